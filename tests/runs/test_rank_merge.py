"""Reading a run of several ranks as one trace, without a framework: per-rank traces written by the real writer from
numpy arrays with the placements a DTensor run records. Shards joined on the first axis stream from the rank files
(memory stays flat however large the tensor), other joins are made in memory, and partial sums are added as
values in every stored dtype, bfloat16 and float8 included (their stored bits are integers). Worker processes compare a merged tensor from
the rank files' segments, as in-process."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from layerdiff.compare.tasks import LocalPool
from layerdiff.compare.workers import StoredPair, aligned_pairs, compare_pairs
from layerdiff.compare.metrics import CHUNK_ELEMS, compare_data
from layerdiff.runs.ranks import open_run
from layerdiff.tracefile.tensors import as_float, encode_float
from layerdiff.tracefile.writer import TraceWriter
from layerdiff.tracefile.reader import open_trace

WORLD = 2


def _placement(text: str, rank: int) -> dict:
    return {"placements": [text], "mesh": [WORLD], "coord": [rank]}


def _write_run(run, params):
    """``params``: [(name, placement text, [rank 0's stored array, rank 1's], dtype)] as parameter records."""
    run.mkdir()
    for rank in range(WORLD):
        writer = TraceWriter(run / f"rank{rank}.h5", {"framework": "torch", "model_class": "toy", "mode": "full",
                                                      "distributed": {"rank": rank, "world_size": WORLD}})
        for seq, (name, placement, arrays, dtype) in enumerate(params):
            entry = writer.write_tensor(arrays[rank], dtype, store_data=True)
            writer.write_record({"kind": "param", "path": name, "module": name.rpartition(".")[0], "call": 0,
                                 "step": 0, "seq": seq, "tensors": [{**entry, "role": "param", "key": "value",
                                                                     "placement": _placement(placement, rank)}]})
        writer.close({"kind": "end", "status": "complete"})


def _entry(run, name):
    return next(r for r in run.records if r.path == name).tensors[0]


def test_shards_and_copies_stream_from_the_rank_files(tmp_path):
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((1024, 4096), dtype=np.float32) for _ in range(WORLD)]  # 16 MB a rank
    cols = [rng.standard_normal((64, 32), dtype=np.float32) for _ in range(WORLD)]
    copy = rng.standard_normal((1000, 1000), dtype=np.float32)
    _write_run(tmp_path / "run", [("rows.weight", "S(0)", rows, "float32"), ("cols.weight", "S(1)", cols, "float32"),
                                  ("norm.weight", "R", [copy, copy], "float32")])
    expected = {"rows.weight": np.concatenate(rows), "cols.weight": np.concatenate(cols, axis=1), "norm.weight": copy}
    with open_run(tmp_path / "run") as run:
        for name, full in expected.items():
            entry = _entry(run, name)
            assert np.array_equal(run.tensor(entry), full)
            pieces = [piece.copy() for piece in run.tensor_chunks(entry, 100_000)]
            assert max(p.size for p in pieces) <= 100_000 and np.array_equal(np.concatenate(pieces), full.reshape(-1))
        entry = _entry(run, "rows.weight")
        tracemalloc.start()
        try:
            total = sum(float(piece.sum(dtype=np.float64)) for piece in run.tensor_chunks(entry, 1 << 18))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert total == pytest.approx(float(expected["rows.weight"].sum(dtype=np.float64)), rel=1e-9)
        assert peak < 4 << 20, f"{peak / 2**20:.1f} MB held to read a 32 MB merged tensor"  # joined in memory: 32 MB


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_partial_sums_are_added_as_values(tmp_path, dtype):
    rng = np.random.default_rng(1)
    values = [rng.uniform(-4, 4, (3, 50)) for _ in range(WORLD)]
    stored = [encode_float(v, dtype) for v in values]
    _write_run(tmp_path / "run", [("proj.weight", "P(sum)", stored, dtype)])
    with open_run(tmp_path / "run") as run:
        entry = _entry(run, "proj.weight")
        assert entry.merge.how == "sum" and entry.dtype == dtype
        merged = as_float(run.tensor(entry), dtype)
        exact = sum(as_float(s, dtype).astype(np.float64) for s in stored)
        assert np.array_equal(merged, as_float(encode_float(exact, dtype), dtype))  # the sum, rounded once
        step = np.abs(exact) * {"bfloat16": 2**-8, "float16": 2**-11, "float32": 2**-24,
                                "float8_e4m3fn": 2**-4, "float8_e5m2": 2**-3}[dtype]
        assert np.all(np.abs(merged - exact) <= step + 2**-14)


def test_encoding_inverts_decoding_for_every_code():
    for dtype, bits in (("bfloat16", np.arange(1 << 16, dtype=np.uint16)), ("float8_e4m3fn", np.arange(256, dtype=np.uint8)),
                        ("float8_e5m2", np.arange(256, dtype=np.uint8))):
        values = as_float(bits, dtype)
        kept = ~np.isnan(values) & (values != 0)  # NaN has many codes, zero two
        assert np.array_equal(encode_float(values, dtype)[kept], bits[kept]), dtype
        assert np.isnan(as_float(encode_float(np.array([np.nan]), dtype), dtype)).all()
    halfway = np.float32(1 + 2**-8)  # between bfloat16's 1 and 1 + 2**-7: to even, 1
    assert as_float(encode_float(np.array([halfway]), "bfloat16"), "bfloat16")[0] == 1.0
    assert as_float(encode_float(np.array([1e6]), "float8_e4m3fn"), "float8_e4m3fn")[0] == 448.0  # saturated


def test_workers_compare_a_merged_tensor_from_the_rank_files_as_in_process(tmp_path):
    rng = np.random.default_rng(2)
    rows = [rng.standard_normal((700, 1001), dtype=np.float32) for _ in range(WORLD)]  # shard ends mid-block
    copy = rng.standard_normal(300_007).astype(np.float32)
    cols = [rng.standard_normal((64, 32), dtype=np.float32) for _ in range(WORLD)]
    _write_run(tmp_path / "run", [("rows.weight", "S(0)", rows, "float32"), ("norm.weight", "R", [copy, copy], "float32"),
                                  ("cols.weight", "S(1)", cols, "float32")])
    single = tmp_path / "single.h5"
    writer = TraceWriter(single, {"framework": "torch", "model_class": "toy", "mode": "full"})
    for seq, (name, full) in enumerate((("rows.weight", np.concatenate(rows)), ("norm.weight", copy))):
        full = (full + rng.standard_normal(full.shape).astype(np.float32) * 1e-3).astype(np.float64)  # wider
        writer.write_record({"kind": "param", "path": name, "module": name.rpartition(".")[0], "call": 0, "step": 0,
                             "seq": seq, "tensors": [{**writer.write_tensor(full, "float64", store_data=True),
                                                      "role": "param", "key": "value"}]})
    writer.close({"kind": "end", "status": "complete"})
    with open_run(tmp_path / "run") as run, open_trace(single) as other:
        assert run.data_segments(_entry(run, "cols.weight")) is None  # joined in memory: compared in-process
        assert len(run.data_segments(_entry(run, "rows.weight"))) == WORLD
        for name in ("rows.weight", "norm.weight"):
            a, b = _entry(run, name), _entry(other, name)
            pieces = aligned_pairs(run.data_segments(a), "float32", other.data_segments(b), "float64")
            assert sum(p.numel for p in pieces) == math.prod(a.shape) and len(pieces) >= len(run.data_segments(a))
            got = compare_pairs(pieces, LocalPool(2), groups=[0] * len(pieces), slice_bytes=1 << 20).metrics
            want = compare_data(run.tensor_chunks(a, CHUNK_ELEMS), other.tensor_chunks(b, CHUNK_ELEMS),
                                "float32", "float64")
            assert got is not None and got[0].keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, float):
                    assert got[0][key] == pytest.approx(value, rel=1e-9, abs=1e-15), (name, key)
                else:
                    assert got[0][key] == value, (name, key)


def test_segments_are_cut_where_either_side_ends():
    a, b, c = (object() for _ in range(3))
    pieces = aligned_pairs([(a, 0, 5), (b, 100, 7)], "float32", [(c, 8, 12)], "float64")
    assert pieces == [StoredPair(a, 0, "float32", c, 8, "float64", 5), StoredPair(b, 100, "float32", c, 48, "float64", 7)]
    assert aligned_pairs([(a, 0, 5)], "float32", [(c, 0, 6)], "float32") == []  # different sizes: not element-wise
