"""The write-behind path of a full trace (no framework): the same file as inline writes, whatever the ring's size,
the arrays' sizes and layouts; errors of the writer thread reach the caller as one line."""
from __future__ import annotations

import mmap
import os
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from layerdiff.tracefile.writer import TraceWriter
from layerdiff.tracefile.reader import open_trace
from layerdiff.tracefile import writebehind
from layerdiff.tracefile.writebehind import BATCH, FIRST_RING, WriteBehind


def _arrays():
    """Sizes around the ring's (2 MB + 2 blocks at the smallest): tiny, block-odd, larger than the ring, empty,
    non-contiguous, bfloat16 bits as uint16."""
    rng = np.random.default_rng(0)
    out = []
    for n in (1, 3, 1023, 4097, 300_001, 700_000, 5, 1_200_000, 0, 17):
        out.append(("float32", rng.standard_normal(n, dtype=np.float32)))
    out.append(("float32", rng.standard_normal((512, 300), dtype=np.float32)[:, ::3]))  # strided
    out.append(("float32", np.asfortranarray(rng.standard_normal((300, 301), dtype=np.float32))))
    out.append(("bfloat16", rng.integers(0, 2**16, 77_777, dtype=np.uint16)))
    out.append(("int64", np.arange(123_457, dtype=np.int64)))
    return out * 3


def _write(path: Path, write_behind: int) -> TraceWriter:
    writer = TraceWriter(path, {"case": "writebehind"}, write_behind=write_behind)
    for i, (dtype, arr) in enumerate(_arrays()):
        entry = writer.write_tensor(arr, dtype, store_data=True, stats={"min": 0.0})
        writer.write_record({"kind": "param", "path": f"p{i}", "module": "", "call": 0, "step": 0, "seq": i,
                             "tensors": [{**entry, "role": "param", "key": "value"}]})
    writer.close({"kind": "end", "status": "complete"})
    return writer


@pytest.mark.parametrize("ring", [1, 3 << 20, 64 << 20])
def test_write_behind_writes_what_inline_writes(tmp_path, ring):
    inline = _write(tmp_path / "inline.h5", 0)
    behind = _write(tmp_path / "behind.h5", ring)
    assert behind.records_written == inline.records_written == len(_arrays()) + 1
    with open_trace(tmp_path / "inline.h5") as a, open_trace(tmp_path / "behind.h5") as b:
        assert a.records == b.records  # the same index lines: offsets, sizes, order
        arrays = _arrays()
        for rec in b.records:
            if rec.kind == "param":
                expected = arrays[int(rec.path[1:])][1]
                got = b.tensor(rec.tensors[0])
                assert got.shape == expected.shape and np.array_equal(got, expected)
        assert b.size_bytes() - a.size_bytes() < 1 << 20  # alignment pads a little, no more


def test_pieces_read_through_the_mapping_or_preadv_equal_the_written_arrays(tmp_path):
    """Pieces come from the mapped file where chunks sit back to back, through preadv where they do not (or no
    mapping could be made); both give the bytes written, in order."""
    _write(tmp_path / "t.h5", 0)
    arrays = _arrays()
    with open_trace(tmp_path / "t.h5") as reader:
        assert reader._raw is not None and reader._raw.mapped is not None
        original = reader._raw.mapped
        for mapping in (original, None):
            reader._raw.mapped = mapping
            for rec in reader.records:
                if rec.kind != "param":
                    continue
                entry, expected = rec.tensors[0], arrays[int(rec.path[1:])][1]
                got = [piece.copy() for piece in reader.tensor_chunks(entry, 1000)]
                got = np.concatenate(got) if got else np.empty(0, expected.dtype)
                assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(expected).reshape(-1).view(np.uint8))
        reader._raw.mapped = original


def test_the_chunk_walk_finds_every_chunk_that_lookups_find(tmp_path):
    """The reader maps every /data chunk to its file address in one walk of HDF5's chunk index; the addresses are
    those that a lookup per chunk gives, across the reserve's growths, and tensors read back the same either way."""
    writer = TraceWriter(tmp_path / "t.h5", {"case": "walk"})
    arrays = _arrays()
    for i, (dtype, arr) in enumerate(arrays):
        entry = writer.write_tensor(arr, dtype, store_data=True, stats={"min": 0.0})
        for seq in range(300):  # the index grows too, between the data's growths: the data's chunks are not one run
            writer.write_record({"kind": "param", "path": f"p{i}", "module": "", "call": 0, "step": 0, "seq": seq,
                                 "tensors": [{**entry, "role": "param", "key": "value"}]})
    writer.close({"kind": "end", "status": "complete"})
    with open_trace(tmp_path / "t.h5") as reader:
        raw = reader._raw
        walked = dict(raw.addresses)
        chunks = -(-raw.dataset.shape[0] // raw.chunk)
        assert sorted(walked) == list(range(chunks)) and chunks > 10
        raw.addresses = {}  # as without a walk (older HDF5): chunks are looked up as they are read
        assert {i: raw._address(i) for i in range(chunks)} == walked
        assert len({address - i * raw.chunk for i, address in walked.items()}) > 1  # not one run: growths moved it
        raw.addresses = {}
        for rec in reader.records:
            if rec.kind == "param":
                expected = arrays[int(rec.path[1:])][1]
                assert np.array_equal(reader.tensor(rec.tensors[0]), expected)


def test_a_trace_whose_file_outgrew_its_recorded_end_is_read_whole(tmp_path):
    """A writer killed while HDF5 grew the file (between a resize and the flush that records the new end of file
    in the superblock) leaves chunks and chunk-index nodes past the recorded end that HDF5 will not read ("addr
    overflow", seen in the SIGKILL test). The reader sees the file with its real length, without changing it: no
    record or tensor that reached the file is lost."""
    path = tmp_path / "t.h5"
    writer = TraceWriter(path, {"case": "eoa"})
    entry = writer.write_tensor(np.arange(1000, dtype=np.float32), "float32", store_data=True)
    for seq in range(3000):  # ~600 KB of lines: the index grows past its first reserve
        writer.write_record({"kind": "param", "path": f"p{seq}", "module": "", "call": 0, "step": 0, "seq": seq,
                             "tensors": [{**entry, "role": "param", "key": "value"}]})
    last = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)  # the data grows after it
    writer.write_record({"kind": "param", "path": "last", "module": "", "call": 0, "step": 0, "seq": 3000,
                         "tensors": [{**writer.write_tensor(last, "float32", store_data=True), "role": "param",
                                      "key": "value"}]})
    writer.close({"kind": "end", "status": "complete"})
    with h5py.File(path, "r", locking=False) as f:
        index, data = f["index"], f["data"]
        end = max(index.id.get_chunk_info(i).byte_offset for i in range(index.id.get_num_chunks()))
        assert max(data.id.get_chunk_info(i).byte_offset for i in range(data.id.get_num_chunks())) > end
    with open(path, "r+b") as f:  # superblock version 0 or 1 ("earliest"; 1 for the chunk-index nodes' size)
        version = f.read(9)[8]
        assert version in (0, 1)
        f.seek(40 if version == 0 else 44)  # its end-of-file address
        f.write(struct.pack("<Q", end))  # as if the flush after the last growths never ran
    before = path.read_bytes()
    with h5py.File(path, "r", locking=False) as f, pytest.raises(Exception, match="addr overflow"):
        f["index"][:]
    with open_trace(path) as reader:
        assert [r.seq for r in reader.records] == list(range(3001)) and reader.end.status == "complete"
        assert reader.crashed  # shown as a trace that was not closed cleanly
        assert np.array_equal(reader.tensor(reader.records[0].tensors[0]), np.arange(1000, dtype=np.float32))
        assert np.array_equal(reader.tensor(reader.records[-1].tensors[0]), last)
        chunks = [piece.copy() for piece in reader.tensor_chunks(reader.records[-1].tensors[0], 100_000)]
        assert np.array_equal(np.concatenate(chunks), last)
    assert path.read_bytes() == before  # read, never repaired in place


class _Sink:
    """A writer's file, in memory: the blocks written (whole blocks, at block offsets) and the lines, each of which
    names how many stream bytes were put before it and must come after them. ``delay``: seconds a write takes (a
    disk slower than the step)."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.written, self.lines, self.data_end = delay, [], [], 0

    def write_data(self, start, view):
        assert start % 4096 == 0 and len(view) % 4096 == 0
        if self.delay:
            time.sleep(self.delay)
        self.written.append((start, bytes(view)))
        self.data_end = max(self.data_end, start + len(view))

    def write_lines(self, lines):
        for line in lines:
            assert self.data_end >= int(line), "a line was written before its bytes"
        self.lines.extend(lines)

    def assert_holds(self, stream: np.ndarray):
        """The file holds the stream: later writes of a block replace the partial earlier ones."""
        image = bytearray(-(-stream.size // 4096) * 4096)
        for start, raw in self.written:
            image[start:start + len(raw)] = raw
        assert bytes(image[:stream.size]) == stream.tobytes()


def test_lines_wait_for_their_bytes_and_the_ring_bounds_memory():
    """The writer hands lines over only after every byte put before them, and the step never gets more than the
    ring's size ahead of the disk (a slow sink makes the step wait)."""
    sink = _Sink()
    behind = WriteBehind(0, sink.write_data, sink.write_lines)  # the smallest ring
    stream = np.random.default_rng(1).integers(0, 256, 5 * behind.capacity + 123, dtype=np.uint8)
    put = 0
    for piece in np.array_split(stream, 37):
        behind.put_bytes(piece)
        put += piece.size
        assert put - behind.done <= behind.capacity + 4096
        behind.put_line(str(put).encode())
    behind.drain()  # raises an assertion the writer thread met
    behind.close()
    assert len(sink.lines) == 37
    sink.assert_holds(stream)


def test_the_ring_grows_while_the_disk_falls_behind_and_keeps_every_byte():
    """A sink slower than the step: the ring, small at first (its pages are touched only as the stream passes
    over them), doubles while the step waits for room, never past the capacity asked for, and the bytes not yet
    written when it grows (a partial block among them) land where the stream puts them; lines still follow their
    bytes."""
    sink = _Sink(delay=0.005)
    behind = WriteBehind(4 * FIRST_RING, sink.write_data, sink.write_lines)
    assert behind.capacity == FIRST_RING < behind.max_capacity
    stream = np.random.default_rng(2).integers(0, 256, 6 * FIRST_RING + 4321, dtype=np.uint8)
    put, sizes = 0, set()
    for piece in np.array_split(stream, 61):  # pieces that end mid-block
        behind.put_bytes(piece)
        put += piece.size
        behind.put_line(str(put).encode())
        sizes.add(behind.capacity)
    behind.drain()
    behind.close()
    assert len(sizes) > 1 and max(sizes) <= 4 * FIRST_RING  # it grew, within the capacity asked for
    assert len(sink.lines) == 61
    sink.assert_holds(stream)


def test_no_memory_for_a_larger_ring_leaves_the_step_waiting_for_the_disk(monkeypatch):
    """A larger ring that cannot be mapped: the ring keeps its size, the step waits for the disk instead, and the
    stream is whole (the writer thread does not die with the step waiting on it)."""
    real_mmap = mmap.mmap

    def small_maps_only(fileno, length, *args, **kwargs):
        if length > FIRST_RING:
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(fileno, length, *args, **kwargs)

    monkeypatch.setattr(writebehind.mmap, "mmap", small_maps_only)
    sink = _Sink(delay=0.005)
    behind = WriteBehind(4 * FIRST_RING, sink.write_data, sink.write_lines)
    stream = np.random.default_rng(3).integers(0, 256, 3 * FIRST_RING + 99, dtype=np.uint8)

    def step():
        for piece in np.array_split(stream, 23):
            behind.put_bytes(piece)
        behind.drain()

    stepping = threading.Thread(target=step, daemon=True)
    stepping.start()
    stepping.join(60)
    assert not stepping.is_alive(), "the step waits for a writer thread that died"
    behind.close()
    assert behind.capacity == behind.max_capacity == FIRST_RING
    sink.assert_holds(stream)


def test_an_error_in_the_writer_thread_reaches_the_step():
    def failing(start, view):
        raise OSError(28, "No space left on device")

    behind = WriteBehind(0, failing, lambda lines: None)
    with pytest.raises(OSError, match="No space"):
        for _ in range(64):
            behind.put_bytes(np.zeros(BATCH, dtype=np.uint8))
            behind.put_line(b"x")
        behind.drain()
    behind.close()


def test_a_full_disk_behind_the_step_is_one_line_and_the_trace_stays_readable(tmp_path):
    script = (
        "import numpy as np, sys\n"
        "from layerdiff.tracefile.writer import TraceWriter\n"
        "from layerdiff.errors import LayerdiffError\n"
        "w = TraceWriter(sys.argv[1], {}, write_behind=4 << 20)\n"
        "try:\n"
        "    for i in range(200):\n"
        "        e = w.write_tensor(np.full(100_000, i, np.float32), 'float32', store_data=True, stats={})\n"
        "        w.write_record({'kind': 'param', 'path': f'p{i}', 'module': '', 'call': 0, 'step': 0, 'seq': i,\n"
        "                        'tensors': [{**e, 'role': 'param', 'key': 'value'}]})\n"
        "    w.close({'kind': 'end', 'status': 'complete'})\n"
        "except LayerdiffError as exc:\n"
        "    print('ERROR', exc)\n"
        "    try:\n"
        "        w.close({'kind': 'end', 'status': 'error'})\n"
        "    except LayerdiffError:\n"
        "        pass\n"
    )

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 20, 12 << 20))

    path = tmp_path / "t.h5"
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                          preexec_fn=limit, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("ERROR ") and len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    with open_trace(path) as reader:  # what was written before the error reads back, each with its own values
        params = [r for r in reader.records if r.kind == "param"]
        assert 0 < len(params) < 200
        for rec in params:
            assert np.all(reader.tensor(rec.tensors[0]) == int(rec.path[1:]))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_a_filesystem_without_direct_io_gets_buffered_writes(tmp_path):
    shm = Path("/dev/shm") / f"layerdiff-{os.getpid()}.h5"
    try:
        writer = _write(shm, 3 << 20)
        assert writer.records_written == len(_arrays()) + 1
        with open_trace(shm) as b:
            arrays = _arrays()
            for rec in b.records:
                if rec.kind == "param":
                    assert np.array_equal(b.tensor(rec.tensors[0]), arrays[int(rec.path[1:])][1])
    finally:
        shm.unlink(missing_ok=True)
