"""Checksums of a trace, without a framework: lines and tensor blocks verified, slices of a tensor verified by the
blocks they touch (what compare workers read), and an index read to its end past damaged lines, a killed writer's
cut-short last line told apart from damage."""
from __future__ import annotations

import json

import numpy as np
import pytest

from layerdiff.tracefile.checksums import (CHECK_BLOCK, DamagedTensorError, TensorCheck, line_check, split_joined,
                                           tensor_digests, verified_pieces, verify_bytes, with_checksum)
from layerdiff.tracefile.index import encode_line, parse_index
from layerdiff.tracefile.reader import open_trace
from layerdiff.tracefile.writer import TraceWriter

STATS = {"numel": 2, "min": 0.0, "max": 1.0, "mean": 0.5, "l2": 1.0, "nan": 0, "inf": 0}


def _line(i: int, **extra) -> bytes:
    return with_checksum(encode_line({"kind": "param", "path": f"p{i}", "call": 0, "step": 0, "tensors": [],
                                      **extra}))


def test_a_line_carries_its_checksum_as_its_last_key_and_stays_json():
    line = _line(1)
    assert json.loads(line)["path"] == "p1" and line.endswith(b'"}\n')
    assert line_check(line.rstrip(b"\n")) is True
    for at in range(len(line) - 1):  # any byte changed: the check fails, or finds no checksum (in a trace that
        damaged = bytearray(line.rstrip(b"\n"))  # says it has them, damage too)
        damaged[at] ^= 0x20
        assert line_check(bytes(damaged)) is not True, at
        assert parse_index(bytes(damaged) + b"\n", 0, checksummed=True).damage, at
    assert line_check(json.dumps({"kind": "param"}).encode()) is None  # a line written before checksums


def test_two_lines_joined_by_a_damaged_newline_are_cut_back_apart():
    one, two = _line(1).rstrip(b"\n"), _line(2).rstrip(b"\n")
    assert split_joined(one + b"x" + two) == [one, two]
    assert split_joined(b"garbage") == [b"garbage"]


@pytest.mark.parametrize("nbytes", [0, 1, CHECK_BLOCK - 1, CHECK_BLOCK, 3 * CHECK_BLOCK + 17])
def test_tensor_blocks_verify_a_whole_read_and_any_slice(nbytes):
    raw = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    check = TensorCheck(4096, nbytes, tuple(tensor_digests(raw)))
    verify_bytes(check, raw, 4096)

    def read(start, length):
        return raw[start - 4096:start - 4096 + length]

    for first, count in [(0, nbytes), (nbytes // 3, nbytes // 3), (max(nbytes - 5, 0), min(5, nbytes))]:
        pieces = [raw[i:min(i + 1000, first + count)] for i in range(first, first + count, 1000)]
        got = b"".join(p.tobytes() for p in verified_pieces(iter(pieces), check, 4096 + first, count, read))
        assert got == raw[first:first + count].tobytes()
        sub = check.around(4096 + first, count)  # what a worker is sent for its slice
        list(verified_pieces(iter(pieces), sub, 4096 + first, count, read))
    if nbytes:
        damaged = raw.copy()
        damaged[0] ^= 1
        with pytest.raises(DamagedTensorError, match="do not match their checksum"):
            verify_bytes(check, damaged, 4096)
        last = min(nbytes, CHECK_BLOCK) - 1  # a slice of the first block's last byte: the whole block is hashed
        with pytest.raises(DamagedTensorError):
            list(verified_pieces(iter([damaged[last:last + 1]]), check, 4096 + last, 1,
                                 lambda start, length: damaged[start - 4096:start - 4096 + length]))


def test_an_index_is_read_past_a_damaged_line_and_a_cut_short_last_line_is_an_interruption():
    lines = [_line(i) for i in range(5)]
    end = with_checksum(encode_line({"kind": "end", "status": "complete"}))
    whole = b"".join(lines) + end
    damaged = bytearray(whole)
    damaged[len(lines[0]) + 10] ^= 1  # inside the second line
    scan = parse_index(bytes(damaged), 0, checksummed=True)
    assert [r.path for r in scan.records] == ["p0", "p2", "p3", "p4"] and scan.end is not None
    assert len(scan.damage) == 1 and scan.damage[0].where.startswith("index line 2 ") and not scan.torn
    killed = b"".join(lines) + lines[0][:20] + b"\0" * 100  # the writer died in a line; its reserve is zeros
    scan = parse_index(killed, 0, checksummed=True)
    assert len(scan.records) == 5 and scan.torn and not scan.damage and scan.end is None
    cut = b"".join(lines) + lines[0][:20]  # the same, with no reserve after it: the index was cut, not killed
    scan = parse_index(cut, 0, checksummed=True)
    assert len(scan.records) == 5 and not scan.torn and len(scan.damage) == 1
    plain = b"".join(_line(i).replace(b"\n", b"") [:-31] + b"}\n" for i in range(2))  # no checksums
    scan = parse_index(plain, 0, checksummed=True)
    assert not scan.records and [d.why for d in scan.damage] == ["it carries no checksum"] * 2
    scan = parse_index(plain, 0, checksummed=False)
    assert len(scan.records) == 2 and scan.unverified == 2


def test_a_damaged_metadata_attribute_is_reported_and_the_records_still_read(tmp_path):
    import h5py

    writer = TraceWriter(tmp_path / "t.h5", {"framework": "none", "model_class": "M"})
    entry = writer.write_tensor(np.arange(4, dtype=np.float32), "float32", store_data=True, stats=STATS)
    writer.write_record({"kind": "param", "path": "w", "call": 0, "step": 0, "tensors": [{**entry, "role": "param",
                                                                                            "key": "value"}]})
    writer.close({"kind": "end", "status": "complete"})
    assert not list(tmp_path.glob(".*partial"))  # the hidden file the trace was built in is gone
    with h5py.File(tmp_path / "t.h5", "r+") as f:
        f.attrs["meta"] = f.attrs["meta"].replace("M", "N")
    with open_trace(tmp_path / "t.h5") as reader:
        assert [d.describe() for d in reader.damage] == [
            "the run's metadata (attribute meta): its checksum does not match"]
        assert len(reader.records) == 1 and reader.tensor(reader.records[0].tensors[0]).tolist() == [0, 1, 2, 3]
