"""Writing a trace: tensor bytes and index lines straight into chunks reserved ahead of them."""
from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import json
import math
import os
import secrets
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from layerdiff.errors import LayerdiffError, TraceFormatError, first_line
from layerdiff.tracefile.checksums import ALGORITHM, CHECK_BLOCK, digest, meta_digest, with_checksum
from layerdiff.tracefile.index import encode_line
from layerdiff.tracefile.layout import (COMPRESSIONS, DATA_CHUNK, FORMAT_NAME, FORMAT_VERSION, INDEX_CHUNK,
                                        SUPERBLOCK_HEAD, end_address_at, load_h5py)
from layerdiff.tracefile.tensors import summarize
from layerdiff.tracefile.writebehind import BLOCK, WriteBehind


class _AppendOnlyBytes:
    """A growable 1-D uint8 dataset that goes through HDF5's filters (a compressed trace), written a whole chunk at
    a time and each chunk once.

    HDF5 writes a chunk it rewrites (a partial chunk filled later) to a new place and frees the old one, so a
    writer killed between that write and HDF5's next flush could lose bytes the index already points at. So bytes
    are gathered in memory and written in whole chunks; at a flush (the index lines that wait for their data) the
    last partial chunk is written padded with zeros, and the bytes after it start a new chunk (their offsets say
    where). The zeros cost next to nothing once compressed.

    The array starts with one chunk of zeros, written before the trace is published: HDF5 creates a dataset's chunk
    index with its first chunk, and wrote the pointer to that index's node before the node itself; a writer killed
    in between (the first data of a run) left a file plain h5py could not read ("wrong B-tree signature")."""

    def __init__(self, h5file, dataset, buffer_limit: int, fd: int):
        self.h5file, self.dataset, self.fd = h5file, dataset, fd
        self.chunk = dataset.chunks[0]
        self.buffer = bytearray(self.chunk)
        self.buffer_limit = max(buffer_limit, self.chunk)
        self.on_disk = 0  # a whole number of chunks
        self._write(padded=False)

    @property
    def size(self) -> int:
        return self.on_disk + len(self.buffer)

    def append(self, buffers) -> int:
        """Append byte buffers one after the other; return the first one's offset."""
        offset = self.size
        for raw in buffers:
            self.buffer += memoryview(raw).cast("B")
        if len(self.buffer) >= self.buffer_limit:
            self._write(padded=False)
        return offset

    def _write(self, padded: bool):
        """Write the gathered whole chunks (``padded``: and the partial last one, filled with zeros)."""
        n = len(self.buffer) if padded else len(self.buffer) // self.chunk * self.chunk
        if n == 0:
            return
        whole = -(-n // self.chunk) * self.chunk
        arr = np.zeros(whole, dtype=np.uint8)
        arr[:n] = np.frombuffer(self.buffer, dtype=np.uint8, count=n)
        del self.buffer[:n]
        start = self.on_disk
        _preallocate(self.fd, whole)  # HDF5 puts the (compressed) chunks in the room claimed here
        self.dataset.resize((start + whole,))
        self.dataset[start:start + whole] = arr
        self.on_disk += whole
        _flush_file(self.h5file, self.fd)  # the chunks HDF5 allocated are in the file it records, now

    def flush(self):
        self._write(padded=True)
        _flush_file(self.h5file, self.fd)


# A reserve doubles while it is smaller than this, then grows by an eighth. Why: each growth is an HDF5 resize and
# flush (1 ms); by an eighth from the start, a stats trace of a small Llama with operations (0.46 MB of index a step)
# grew 16 times in its first 11 steps, 1.5 ms a step. Doubling grows it 5 times. Nothing is lost on disk: the
# unused tail is given back when the trace closes (``finish``).
_DOUBLE_UP_TO = 16 << 20

# Bytes handed to one ``pwrite``. Why: measured on Linux 6.18 (ext4), inside the traced steps of a small Llama
# with operations (stats mode, 460 KB of index lines a step), one pwrite of the 256 lines held together (about
# 220 KB, into the file's fresh end) took 1.25 ms; the same bytes in pieces of 64 KB (or 128 KB) took 0.13 ms in
# all: the writes went from 1.4 to 0.3 ms a step (the same write outside a traced step: 0.03 to 0.3 ms either
# way). A piece costs a system call more than a whole write would, a microsecond, anywhere else. Writes with
# O_DIRECT (write-behind) stay whole: each waits for the device, and in 64 KB pieces a full trace of a 0.5B
# model (``tools/bench_scale.py``) took 4.47x its untraced step, whole 1.86x (one run each).
_WRITE_PIECE = 64 << 10


def _write_fully(fd: int, data, address: int, piece: int = _WRITE_PIECE) -> None:
    """``data`` (a byte buffer) at ``address`` through ``fd``, in pieces of at most ``piece`` bytes (0: whole;
    short writes continued; OSError as raised)."""
    piece = piece or len(data)
    done = os.pwrite(fd, data, address) if len(data) <= piece else 0  # most lines: one call, no view
    if done == len(data):
        return
    view = memoryview(data).cast("B")
    while done < len(view):
        done += os.pwrite(fd, view[done:done + piece], address + done)


class _ReservedBytes:
    """A growable 1-D byte dataset written straight into the file.

    Its chunks are allocated ahead of the data (early allocation, never filled: the reserve is a hole in the file
    and costs no disk blocks), and bytes go to their place with ``pwrite``. Once ``pwrite`` returns they are in
    the operating system's page cache, so a process killed right after keeps them, with no HDF5 flush per record.
    HDF5's own metadata changes only when the reserve grows (rarely: it doubles, then grows by an eighth), and is
    flushed then. A reader sees the reserve's unused tail as zeros.
    """

    def __init__(self, h5file, name: str, fd: int, chunk: int, reserve: int):
        _preallocate(fd, reserve)
        h5py = load_h5py()
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((chunk,))
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # no timestamps to update in the object header
        space = h5py.h5s.create_simple((reserve,), (h5py.h5s.UNLIMITED,))
        self.dataset = h5py.Dataset(h5py.h5d.create(h5file.id, name.encode(), h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl))
        self.h5file, self.fd, self.chunk = h5file, fd, chunk
        self.size = 0
        self.runs: list[list[int]] = []  # [logical start, file address, length] of consecutive chunks
        self._filling = 0  # the run ``_address`` found last
        self._map()

    def _map(self, since: int = 0):
        """File addresses of the chunks from logical offset ``since`` on, added to the runs of consecutive chunks
        (logical start, address, length). Chunks allocated together usually sit back to back: the first and
        last chunk tell, and only when they do not is every chunk asked."""
        runs = [] if since == 0 else self.runs
        self.capacity = self.dataset.shape[0]
        starts = range(since, self.capacity, self.chunk)
        if not starts:
            self.runs = runs
            return
        first = self.dataset.id.get_chunk_info_by_coord((starts[0],)).byte_offset
        last = self.dataset.id.get_chunk_info_by_coord((starts[-1],)).byte_offset
        if last - first == starts[-1] - starts[0]:
            pieces = [(starts[0], first, self.capacity - since)]
        else:
            pieces = [(s, self.dataset.id.get_chunk_info_by_coord((s,)).byte_offset, self.chunk) for s in starts]
        for start, address, length in pieces:
            if runs and runs[-1][0] + runs[-1][2] == start and runs[-1][1] + runs[-1][2] == address:
                runs[-1][2] += length
            else:
                runs.append([start, address, length])
        self.runs = runs

    def _reserve(self, needed: int):
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity += max(min(capacity, _DOUBLE_UP_TO), capacity // 8) // self.chunk * self.chunk or self.chunk
        _preallocate(self.fd, capacity - self.capacity)  # a full disk fails here, before HDF5 writes anything
        old = self.capacity
        self.dataset.resize((capacity,))
        _flush_file(self.h5file, self.fd)  # the grown dataset's metadata is on disk before a byte is written into it
        self._map(old)

    def append(self, buffers) -> int:
        """Write ``buffers`` (contiguous byte buffers) one after the other; return the first one's offset."""
        start = self.size
        line = buffers[0] if len(buffers) == 1 and type(buffers[0]) is bytes else None
        try:
            address, room = self._address(start) if line is not None and start < self.capacity else (0, 0)
            if line is not None and len(line) <= room:  # index lines inside one run: written where they go
                _write_fully(self.fd, line, address)
                self.size = start + len(line)
                return start
            views = [memoryview(b).cast("B") for b in buffers]
            self.write_at(start, views, self.fd)
        except OSError as exc:
            raise _write_error(exc) from None
        self.size = start + sum(len(v) for v in views)
        return start

    def write_at(self, start: int, views, fd: int, piece: int = _WRITE_PIECE):
        """Write byte views back to back from logical offset ``start`` through ``fd``, ``piece`` bytes a write at
        most (0: as much as a run of chunks takes; OSError as raised)."""
        self._reserve(start + sum(len(v) for v in views))
        position = start
        for view in views:
            done = 0
            while done < len(view):
                address, room = self._address(position + done)
                n = min(room, len(view) - done)
                _write_fully(fd, view[done:done + n], address, piece)
                done += n
            position += len(view)

    def aligned(self, block: int) -> bool:
        """Every run of chunks starts at a file address that is a multiple of ``block`` (for O_DIRECT)."""
        return all(address % block == 0 for _, address, _ in self.runs)

    def _address(self, logical: int) -> tuple[int, int]:
        """(file address, bytes left in that run of chunks) of a logical offset. The run found last is tried first:
        writes go forward through it, and the reserve grows ahead of it in runs of its own, so it is seldom the last
        (the index lines' one-pwrite path checked only the last: nearly half of a long trace's lines went the
        general way, a few microseconds each)."""
        runs = self.runs
        if self._filling < len(runs):
            start, address, length = runs[self._filling]
            if start <= logical < start + length:
                return address + logical - start, start + length - logical
        for i, (start, address, length) in enumerate(runs):  # few runs: the file grows at its end
            if start <= logical < start + length:
                self._filling = i
                return address + logical - start, start + length - logical
        raise TraceFormatError("internal: offset outside the reserved chunks")

    def finish(self):
        """Give the disk blocks of the reserve's unused tail back, leaving HDF5's structure as it is: the
        dataset keeps its length (a reader skips the zeros, as in a killed writer's trace). Shrinking the dataset
        instead frees its last chunks, and HDF5 cuts the file to its new end before it writes that end into the
        superblock: a writer killed in between left a file plain h5py refuses ("truncated file")."""
        for start, address, length in self.runs:
            low = max(start, self.size)
            if low < start + length:
                _punch_hole(self.fd, address + low - start, start + length - low)


class TraceWriter:
    """Streams records and tensor bytes into a trace; memory use does not grow with the trace.

    Crash safety: tensor bytes and each record's index line are written straight into chunks reserved ahead of
    them (``_ReservedBytes``), tensors before the line that points at them, so a process killed at any moment
    leaves a file holding every record completed before it; only the record being written is lost. A compressed
    trace cannot be written that way (its chunks go through HDF5's filters): it is buffered and flushed at least
    every ``flush_interval`` seconds instead.

    With ``write_behind`` > 0 (bytes), tensor bytes and index lines are written by a thread of their own
    (``WriteBehind``), in the same order, while the step goes on; a process killed outright then loses the
    records still queued. ``records_written`` counts the records in the file either way (a compressed trace's
    lines wait in memory for the data they point at, until the next flush).

    With ``held_records`` > 0, each record is encoded as it is handed over and its line held, up to that many lines,
    written together (``_write_fully``: a ``pwrite`` a 64 KB piece), none held longer than ``flush_interval``
    seconds (a thread of its own writes lines held that long while the program waits: a hang's last records reach
    the file). Why lines, not records (held and encoded together, before): a record encoded at once is still in
    the caches, and a line is bytes, which the garbage collector never visits (256 records held kept ~4,000 objects
    alive, 0.8 ms of its collections a step); on ``tools/bench_ops.py``'s toy, ``ops=True`` went from 1.73x to
    1.66x the untraced step (medians of five processes each). A line a write (``held_records=0``) costs a
    ``pwrite`` a record. A process killed outright (SIGKILL, a segfault) loses the lines still held, an exception,
    Ctrl-C or a normal exit none.

    The file is created exclusively and locked for the whole run: a second writer on the same path is refused
    before it writes anything. Thread-safe: autograd may call back from its own thread.
    """

    def __init__(self, path, meta: dict, *, overwrite: bool = False, compression: str | None = None,
                 flush_interval: float = 1.0, buffer_bytes: int = 8 << 20, write_behind: int = 0,
                 held_records: int = 0, format_version: int = FORMAT_VERSION):
        if compression not in COMPRESSIONS:
            raise LayerdiffError(f"unknown compression {compression!r}; choose gzip or lzf")
        if not (isinstance(flush_interval, (int, float)) and math.isfinite(flush_interval) and flush_interval >= 0):
            raise LayerdiffError(f"flush interval must be a finite number of seconds >= 0, not {flush_interval!r}")
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            raise LayerdiffError(f"directory {self.path.parent} does not exist")
        replacing = _refuse_taken(self.path, overwrite)
        self._fd, partial = _open_partial(self.path)
        self._released = False  # the descriptor (and with it the lock) given back
        try:
            h5py = load_h5py()
            behind = write_behind > 0 and compression is None
            self._file = _create_h5(h5py, partial, aligned=behind)
            self._file.attrs["format"] = FORMAT_NAME
            self._file.attrs["format_version"] = format_version
            meta_text = json.dumps(meta, default=str)
            self._file.attrs["meta"] = meta_text
            self._file.attrs["checksum"] = ALGORITHM
            self._file.attrs["meta_checksum"] = meta_digest(meta_text)
            self._data: _ReservedBytes | _AppendOnlyBytes
            self._reserved: _ReservedBytes | None = None  # the data of an uncompressed trace, written in place
            if compression is None:
                self._data = self._reserved = _ReservedBytes(self._file, "data", self._fd, DATA_CHUNK, DATA_CHUNK)
            else:
                data = self._file.create_dataset("data", shape=(0,), maxshape=(None,), dtype="u1",
                                                 chunks=(DATA_CHUNK,), compression=compression)
                self._data = _AppendOnlyBytes(self._file, data, buffer_bytes, self._fd)
            self._index = _ReservedBytes(self._file, "index", self._fd, INDEX_CHUNK, INDEX_CHUNK)
            self._file.flush()
            _publish(partial, self.path, replacing)  # the trace's name appears once it names a whole HDF5 file
        except BaseException as exc:
            if getattr(self, "_file", None) is not None:
                self._file.close()
            _remove(partial)
            self._release()
            if isinstance(exc, OSError):
                raise LayerdiffError(f"cannot write {self.path}: {exc.strerror or first_line(exc)}") from None
            raise
        self._lock = threading.RLock()
        self._pending: list[bytes] = []
        self.compressed = compression is not None
        self._direct_fd = None
        self._behind = None
        if behind:
            self._direct_fd = _open_direct(self.path)
            self._behind = WriteBehind(write_behind, self._write_behind_data, self._write_behind_lines)
        self.flush_interval = flush_interval
        self._last_flush = time.perf_counter()
        self.held_records = held_records if flush_interval > 0 else 0
        self._held: list[bytes] = []  # lines of records handed over, encoded, not yet written
        self._held_since = 0.0  # when the oldest line held was handed over
        self._timer = _HeldTimer(self) if self.held_records else None
        self._pid = os.getpid()
        if self.held_records:  # a program that ends without closing the trace still writes what it holds
            atexit.register(self._flush_at_exit)
        self.records_written = 0  # records whose lines are in the file
        self.records_handed = 0  # records handed to ``write_record`` (in the file, or queued for it)
        self.tensor_bytes = 0
        self.closed = False

    def write_tensor(self, stored: np.ndarray, dtype: str, *, store_data: bool,
                     stats: Mapping[str, Any] | None = None) -> dict:
        """Summarize a tensor (and in full mode append its bytes and their checksums); return its entry for a
        record."""
        entry = self.summary_entry(dtype, stored.shape, stats or summarize(stored, dtype))
        if store_data:
            raw = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
            digests = []
            with self._lock:
                entry["offset"] = self._data.size if self._behind is None else self.tensor_bytes  # the data's end
                for start in range(0, max(raw.size, 1), CHECK_BLOCK):
                    block = raw[start:start + CHECK_BLOCK]
                    digests.append(digest(block))  # hashed just before it is written: read from memory once
                    if self._behind is None:
                        self._data.append([block])
                    else:
                        self._behind.put_bytes(block)
                entry["nbytes"], entry["checksums"] = raw.size, digests
                self.tensor_bytes += raw.size
        return entry

    def _write_behind_data(self, start: int, view: memoryview):
        """The writer thread's data: whole blocks, with O_DIRECT while the file and filesystem allow it (a trace
        written behind is uncompressed: its data is reserved in place)."""
        data = self._reserved
        if data is None:
            raise TraceFormatError("internal: write-behind without reserved data")
        if self._direct_fd is not None and data.aligned(BLOCK):
            try:
                data.write_at(start, [view], self._direct_fd, piece=0)  # whole: each write waits for the device
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no direct I/O after all
                    raise _write_error(exc) from None
            self._close_direct()
        try:
            data.write_at(start, [view], self._fd)
        except OSError as exc:
            raise _write_error(exc) from None

    def _write_behind_lines(self, lines: list):
        self._index.append(lines)
        self.records_written += len(lines)

    @staticmethod
    def summary_entry(dtype: str, shape, stats: Mapping[str, Any]) -> dict:
        """A tensor entry without data: what every record keeps, in both modes."""
        return {"dtype": dtype, "shape": list(shape), "stats": stats}

    def write_record(self, record: dict):
        """One record (a dict of the shape ``records`` declares) as the index's next line, with its checksum: encoded
        now (what changes in it later is not written), written now or held (``held_records``)."""
        line = with_checksum(encode_line(record))
        with self._lock:
            self.records_handed += 1
            if not self.held_records:
                self._put_lines([line])
                return
            held = self._held
            if not held:
                self._held_since = time.perf_counter()
            held.append(line)
            if len(held) >= self.held_records or self.due_in() == 0:
                self._write_held()

    def _write_held(self):
        """The lines held, written as one (the lock is held)."""
        held, self._held = self._held, []
        if held:
            try:
                self._put_lines(held)
            except BaseException:
                self._held = held + self._held  # kept: the next record handed over meets the error again
                raise

    def due_in(self) -> float:
        """Seconds until the oldest line held has waited ``flush_interval`` (the interval itself when none is)."""
        if not self._held:
            return self.flush_interval
        return max(0.0, self._held_since + self.flush_interval - time.perf_counter())

    def write_stale(self):
        """Write the lines held longer than ``flush_interval`` (``_HeldTimer``'s call)."""
        with self._lock:
            if self._held and not self.closed and self.due_in() == 0:
                self._write_held()

    def _put_lines(self, lines: list[bytes]):
        """Index lines to the file, in order (the lock is held)."""
        if self.compressed:  # the index may only point at data that is on disk: lines wait for a flush
            self._pending += lines
            if time.perf_counter() - self._last_flush >= self.flush_interval:
                self.flush()
            return
        if self._behind is not None:
            self._behind.put_lines(lines)
            return
        self._index.append([lines[0] if len(lines) == 1 else b"".join(lines)])
        self.records_written += len(lines)  # counted once their lines are in the file

    def flush(self):
        """Make everything written so far durable against a crash of this process (uncompressed traces are
        already: their bytes go straight into the file)."""
        with self._lock:
            if self.closed:
                return
            self._write_held()
            if self._behind is not None:
                self._behind.drain()
            if isinstance(self._data, _AppendOnlyBytes):  # compressed
                self._data.flush()  # data before the index lines that point into it
                pending, self._pending = self._pending, []
                if pending:
                    self._index.append(pending)
                    self.records_written += len(pending)
                self._file.flush()
            self._last_flush = time.perf_counter()

    def _flush_at_exit(self):
        """``flush`` as the interpreter exits, in the process that opened the trace only: a child forked while it was
        open holds a copy of the lines held, and of HDF5's state, that are not its own to write."""
        if os.getpid() == self._pid:
            self.flush()

    def amend_meta(self, change: Callable[[dict], dict]) -> None:
        """The run's metadata replaced by ``change(metadata)``: facts learned while the run goes on."""
        with self._lock:
            if self.closed:
                return
            meta = change(json.loads(self._file.attrs["meta"]))
            meta_text = json.dumps(meta, default=str)
            self._file.attrs["meta"] = meta_text
            self._file.attrs["meta_checksum"] = meta_digest(meta_text)

    def close(self, end_record: dict):
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()  # before the lock: it may be waiting for it
            atexit.unregister(self._flush_at_exit)
        with self._lock:
            if self.closed:
                return
            try:
                self.write_record(end_record)
                self.flush()  # drains the writer thread; it stays idle (the lock is held) until stopped below
                if self._reserved is not None:  # uncompressed
                    self._reserved.size = self.tensor_bytes  # the written stream's end (whole blocks may pass it)
                    self._reserved.finish()
                self._index.finish()
                _flush_file(self._file, self._fd)  # the reserve given back: the file's end moves back with it
                self._file.close()
            except OSError as exc:  # a full disk: what was written before stays readable
                raise LayerdiffError(f"cannot finish {self.path}: {exc.strerror or first_line(exc)}; the "
                                     "records written before are readable") from None
            finally:
                self.closed = True
                self._stop_writer()
                self._release()

    def _stop_writer(self):
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.close()
        self._close_direct()

    def _close_direct(self):
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None

    def _release(self):
        if not self._released:
            os.close(self._fd)  # also drops the lock
            self._released = True


class _HeldTimer:
    """A thread that wakes when the oldest line held has waited ``flush_interval`` seconds (every interval when
    none is held) and has the writer write the lines held that long: a program that stops handing records over
    (a hang in a collective, a long evaluation) keeps none in memory only."""

    def __init__(self, writer: TraceWriter):
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(writer,), name="layerdiff-held-records", daemon=True)
        self.thread.start()

    def _run(self, writer: TraceWriter):
        while not self.stopped.wait(min(writer.due_in(), threading.TIMEOUT_MAX)):
            try:
                writer.write_stale()
            except Exception:  # noqa: BLE001 - the step's next record meets the same error and raises it
                return

    def stop(self):
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


# Entries in one node of a chunk index (HDF5's v1 B-tree, twice its "istore K"). The index changes only when a
# reserve grows, and HDF5 writes a parent node before the node it points at when a node splits: a writer killed in
# between (one flush in the middle of a run) left a file whose data plain h5py could not read ("wrong B-tree
# signature"; found by killing the writer before each of its writes). With 4,096 chunks a node, a node splits once
# the index outgrows 1 GB or the data 4 GB: never, in most traces; the growth before that rewrites one node
# (128 KB) in place.
_INDEX_NODE_K = 2048


def _create_h5(h5py: Any, partial: Path, *, aligned: bool) -> Any:
    """The new trace's HDF5 file, created at ``partial``: the oldest format (superblock version 0 or 1, whose
    end-of-allocation ``_record_end`` moves: plain h5py of any version reads it), no file locking (the writer
    holds its own lock), large chunk-index nodes (``_INDEX_NODE_K``); ``aligned``: big allocations on O_DIRECT's
    block boundaries (write-behind's data)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_file_locking(False, True)
    if aligned:
        fapl.set_alignment(DATA_CHUNK, BLOCK)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    _set_istore_k(h5py, fcpl, _INDEX_NODE_K)
    return h5py.File(h5py.h5f.create(os.fsencode(partial), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


def _set_istore_k(h5py: Any, fcpl: Any, k: int) -> None:
    """HDF5's ``H5Pset_istore_k`` on a file-creation property list: public HDF5 API that h5py does not wrap, found
    through h5py's own extension (which links the HDF5 library h5py uses). Where it cannot be found the default
    (32: 64 chunks a node) stays, and with it the rare window ``_INDEX_NODE_K`` describes."""
    try:
        call = ctypes.CDLL(h5py.h5p.__file__).H5Pset_istore_k
    except (OSError, AttributeError):
        return
    call.argtypes = (ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    call(fcpl.id, k)


_METADATA_ROOM = 1 << 19  # room past the reserved chunks for HDF5's own metadata: chunk-index nodes (128 KB each; a
# root that splits takes two new ones) and the nodes of its heap


def _preallocate(fd: int, nbytes: int):
    """Claim disk space for ``nbytes`` more at the end of the file (and room for HDF5's metadata) before HDF5
    is told about it: a full disk or a file-size limit is then one clear error while the file still describes
    only what it holds, instead of a half-written HDF5 structure. The superblock's end-of-allocation is moved to
    the end of that room (``_record_end``): what HDF5 allocates next lies inside the file it records."""
    end = os.fstat(fd).st_size
    try:
        os.posix_fallocate(fd, end, nbytes + _METADATA_ROOM)
    except OSError as exc:
        raise LayerdiffError(f"cannot grow the trace by {(nbytes + _METADATA_ROOM) / 1e6:.0f} MB: "
                             f"{exc.strerror or exc} (disk full, or a file-size limit)") from None
    _record_end(fd, end + nbytes + _METADATA_ROOM)


def _punch_hole(fd: int, offset: int, length: int):
    """Free the disk blocks of a byte range of the file, keeping its size (Linux's fallocate(PUNCH_HOLE); where it
    is not available, the blocks stay: the reserve, at most 16 MB or an eighth of the trace, whichever is more)."""
    first, end = -(-offset // _PAGE) * _PAGE, (offset + length) // _PAGE * _PAGE
    if end <= first or _FALLOCATE is None:
        return
    _FALLOCATE(fd, 3, first, end - first)  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE; a failure is harmless


def _libc_fallocate():
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    call.restype = ctypes.c_int
    return call


_FALLOCATE = _libc_fallocate()
_PAGE = 4096


def _flush_file(h5file, fd: int):
    """HDF5's flush of the trace, kept openable by plain h5py at every moment of it.

    HDF5 allocates new chunks (and nodes of their index) at its end-of-allocation and writes that address into
    the superblock only when it flushes, after it has written the metadata that points there and cut the file to
    that length. A writer killed in between left a file plain h5py refuses: metadata past the superblock's end
    ("addr overflow"), or a superblock past the file's end ("truncated file"). So the superblock records, ahead
    of HDF5, the end of the room claimed before HDF5 allocates (``_preallocate``), and, once the datasets' own
    buffers are written (compressed chunks are allocated then), the exact end HDF5 will cut the file to."""
    for dataset in h5file.values():
        dataset.flush()
    _record_end(fd, h5file.id.get_filesize())
    h5file.flush()


def _record_end(fd: int, end: int):
    """Record ``end`` as the file's end-of-allocation in its superblock (``end_address_at``), the file at least
    that long; a file whose superblock is not on disk yet (one being created, not published) is left alone."""
    head = os.pread(fd, SUPERBLOCK_HEAD, 0)
    position = end_address_at(head)
    if position is None or struct.unpack_from("<Q", head, position)[0] == end:
        return
    size = os.fstat(fd).st_size
    if size < end:
        os.posix_fallocate(fd, size, end - size)
    os.pwrite(fd, struct.pack("<Q", end), position)


def _refuse_taken(path: Path, overwrite: bool) -> int | None:
    """Refuse, before anything is written, a path that holds a file (unless ``overwrite``), a directory, or a
    trace another process is writing. Returns the inode of the file to replace (None: there is none)."""
    if path.is_dir():
        raise LayerdiffError(f"{path} is a directory; name a trace file")
    if not path.exists():
        return None
    if not overwrite:
        raise LayerdiffError(f"{path} exists; pass overwrite=True (CLI: --force) to replace it")
    fd = _open_existing(path)
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)  # (the lock taken to probe goes with it)


def _open_existing(path: Path) -> int | None:
    """A descriptor of the file at ``path``, locked, or None when there is none; a file another process holds
    locked (a trace being written) is refused."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise _being_written(path) from None
    return fd


def _being_written(path: Path) -> LayerdiffError:
    return LayerdiffError(f"{path} is being written by another process; choose another path")


def _open_partial(path: Path) -> tuple[int, Path]:
    """A new file beside ``path`` that the trace is built in until its HDF5 structure is whole (``_publish``),
    created exclusively and locked for this writer: a process killed before then leaves no half-made file under
    the trace's name, only this hidden one."""
    while True:
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        try:
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    return fd, partial


def _publish(partial: Path, path: Path, replacing: int | None):
    """Give the partial file the trace's name. ``replacing``: the inode of the file that was there when this writer
    started (``_refuse_taken``), or None. A file that appeared at that name since, or replaced that one, is
    another writer's: refused, never replaced (this writer's file is locked already, so a writer that comes
    later is refused on it)."""
    if replacing is None:
        try:
            os.link(partial, path)  # fails if the name exists: no file is replaced by accident
        except FileExistsError:
            raise _being_written(path) from None
        except OSError:  # a filesystem without hard links (FAT, some network mounts): a rename, checked before
            if os.path.lexists(path):
                raise _being_written(path) from None
            os.rename(partial, path)
            return
        os.unlink(partial)
        return
    fd = _open_existing(path)
    if fd is None:
        raise _being_written(path)  # removed meanwhile: by the other writer's cleanup, or a user
    try:
        if os.fstat(fd).st_ino != replacing:
            raise _being_written(path)
        os.replace(partial, path)
    finally:
        os.close(fd)


def _remove(partial: Path):
    try:
        os.unlink(partial)
    except OSError:
        pass


def _write_error(exc: OSError) -> LayerdiffError:
    return LayerdiffError(f"cannot write the trace: {exc.strerror or exc}")


def _open_direct(path: Path) -> int | None:
    """A second descriptor of the trace that bypasses the page cache, or None where the system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:  # tmpfs and some other filesystems refuse O_DIRECT: buffered writes then
        return None
