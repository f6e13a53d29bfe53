"""The trace index's JSON lines (no framework): orjson's text reads back as the standard library's would, also
for values orjson cannot write the same way; lines written one pwrite each land where the reader finds them,
across the reserve's growth and interleaved with tensor bytes; a closed trace gives its reserve's unused tail back."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

from layerdiff.tracefile.writer import TraceWriter
from layerdiff.tracefile.index import encode_line
from layerdiff.tracefile.records import decode_line
from layerdiff.tracefile.reader import open_trace


def _json_line(record) -> bytes:
    return (json.dumps(record, separators=(",", ":"), default=lambda o: float(o) if isinstance(o, np.floating)
                       else int(o) if isinstance(o, np.integer) else repr(o)) + "\n").encode()


def _call_record(**extra):
    stats = {"numel": 4096, "min": -0.07368604093790054, "max": 0.06866183876991272,
             "mean": -0.00013604064588434994, "l2": 1.2724981295229012, "nan": 0, "inf": 0}
    record = {"kind": "call", "phase": "forward", "path": "transformer.h.0.attn", "call": 1, "step": 1,
              "type": "GPT2Attention", "begin": 187, "end": 188, "parent": ["transformer.h.0", 1],
              "tensors": [{"dtype": "float32", "shape": [2, 32, 64], "stats": stats, "role": "output", "key": "out"}],
              "hparams": {"p": 0.1, "inplace": False, "padding_idx": None, "sizes": [3, 4.5]}, "scalars": {}}
    record.update(extra)
    return record


def test_an_ordinary_record_is_byte_for_byte_what_json_writes():
    record = _call_record()
    assert encode_line(record) == _json_line(record)
    assert encode_line(record).count(b"\n") == 1 and encode_line(record).endswith(b"\n")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, np.float32("nan"), np.float64("-inf")])
@pytest.mark.parametrize("where", ["hparams", "scalars", "stats", "nested"])
def test_nonfinite_floats_read_back_as_themselves_not_as_null(bad, where):
    """orjson writes NaN and infinities as null; the line must say NaN/Infinity, as json does."""
    record = _call_record()
    if where == "hparams":
        record["hparams"]["clip"] = bad
    elif where == "scalars":
        record["scalars"]["kwargs.mask_value"] = bad
    elif where == "stats":
        record["tensors"][0]["stats"]["l2"] = bad
    else:
        record["hparams"]["sizes"] = [1.0, [2.0, bad]]
    back = json.loads(encode_line(record))
    value = {"hparams": lambda r: r["hparams"].get("clip"), "scalars": lambda r: r["scalars"]["kwargs.mask_value"],
             "stats": lambda r: r["tensors"][0]["stats"]["l2"], "nested": lambda r: r["hparams"]["sizes"][1][1]}[where]
    got = value(back)
    assert isinstance(got, float) and (math.isnan(got) if math.isnan(bad) else got == float(bad))
    assert back["parent"] == ["transformer.h.0", 1] and back["hparams"]["padding_idx"] is None


@pytest.mark.parametrize("extra", [{"big": 2**70}, {"keys": {1: "a", 2.5: "b"}}, {"np": np.float32(0.5)},
                                   {"npi": np.int64(7)}, {"obj": object}, {"tuple": (1, (2, 3))}])
def test_what_orjson_refuses_or_writes_differently_is_written_as_json_writes_it(extra):
    record = _call_record(**extra)
    assert json.loads(encode_line(record)) == json.loads(_json_line(record))


@pytest.mark.parametrize("held", [0, 256])
def test_index_lines_land_where_the_reader_finds_them_across_reserve_growth(tmp_path, held):
    """Lines written straight into the last run of reserved chunks, lines that cross into a new reserve, lines
    longer than a chunk, lines held and written together in pieces (``_WRITE_PIECE``), tensor bytes between them:
    all read back, in order."""
    rng = np.random.default_rng(3)
    writer = TraceWriter(tmp_path / "t.h5", {"case": "index"}, held_records=held)
    expected = []
    for i in range(6000):  # ~2.5 MB of lines: the 256 KB reserve grows several times
        tensors = []
        if i % 97 == 0:
            arr = rng.standard_normal(int(rng.integers(1, 300_000)), dtype=np.float32)
            entry = writer.write_tensor(arr, "float32", store_data=True)
            tensors = [{**entry, "role": "param", "key": "value"}]
        pad = "x" * (70_000 if i % 1500 == 7 else int(rng.integers(0, 600)))  # now and then longer than a chunk
        record = {"kind": "param", "path": f"p{i}", "module": pad, "call": 0, "step": 0, "seq": i, "tensors": tensors}
        writer.write_record(record)
        expected.append(decode_line(encode_line(record)))  # the typed record the reader must find
    writer.close({"kind": "end", "status": "complete"})
    with open_trace(tmp_path / "t.h5") as trace:
        assert trace.records == expected and None not in expected
        assert trace.end.status == "complete"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reserve's tail is given back by Linux's fallocate")
def test_a_closed_trace_keeps_on_disk_only_what_it_holds(tmp_path):
    """The reserves double as they fill (up to 16 MB a growth): a trace holding 6 MB of lines and 20 MB of tensor
    bytes reserved up to 8 MB and 32 MB. Closed, it gives the unused tails back: its disk blocks are what it holds,
    plus HDF5's metadata."""
    rng = np.random.default_rng(5)
    path = tmp_path / "t.h5"
    writer = TraceWriter(path, {"case": "reserve"})
    lines = data = 0
    for i in range(7000):
        tensors = []
        if i % 350 == 0:
            entry = writer.write_tensor(rng.standard_normal(250_000, dtype=np.float32), "float32", store_data=True)
            tensors, data = [{**entry, "role": "param", "key": "value"}], data + entry["nbytes"]
        record = {"kind": "param", "path": f"p{i}", "module": "x" * 800, "call": 0, "step": 0, "seq": i,
                  "tensors": tensors}
        writer.write_record(record)
        lines += len(encode_line(record)) + 20  # the line, its checksum
    writer.close({"kind": "end", "status": "complete"})
    on_disk = os.stat(path).st_blocks * 512
    assert lines + data <= on_disk <= lines + data + (2 << 20), (on_disk, lines, data)
    with open_trace(path) as trace:
        assert len(trace.records) == 7000
