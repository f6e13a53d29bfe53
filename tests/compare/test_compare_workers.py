"""Stored tensors compared by worker processes (no framework): the same metrics as in-process, whatever the
slicing, dtypes, NaN/Inf or empty tensors; a slice that fails in every worker is compared in this process; a
worker killed mid-run changes nothing; align's report is the same with and without workers."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from layerdiff import api
from layerdiff.compare import tasks as compare_tasks
from layerdiff.compare.tasks import LocalPool
from layerdiff.compare.workers import StoredPair, compare_pairs
from layerdiff.compare.metrics import CHUNK_ELEMS, compare_data
from layerdiff.tracefile.chunks import DataLocation
from layerdiff.tracefile.writer import TraceWriter
from layerdiff.tracefile.reader import open_trace


def _tensors(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(1_500_001, dtype=np.float32)
    nonfinite = rng.standard_normal(300_000, dtype=np.float32)
    nonfinite[[5, 70_000, 299_999]] = [np.nan, np.inf, -np.inf]
    bf16 = (rng.standard_normal(200_003, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return [("float32", x), ("float32", nonfinite), ("bfloat16", bf16), ("float32", np.zeros(0, np.float32)),
            ("float64", rng.standard_normal(70_001)), ("float32", rng.standard_normal(3, dtype=np.float32))]


def _write(path, seed: int, noise: float):
    writer = TraceWriter(path, {"case": "workers"})
    for i, (dtype, arr) in enumerate(_tensors(0)):
        if noise and dtype in ("float32", "float64") and arr.size:
            arr = arr + np.asarray(np.random.default_rng(seed).standard_normal(arr.size) * noise, dtype=arr.dtype)
        entry = writer.write_tensor(arr, dtype, store_data=True, stats={"min": 0.0})
        writer.write_record({"kind": "param", "path": f"p{i}", "module": "", "call": 0, "step": 0, "seq": i,
                             "tensors": [{**entry, "role": "param", "key": "value"}]})
    writer.close({"kind": "end", "status": "complete"})


def _same(x: dict, y: dict):
    assert x.keys() == y.keys()
    for key in x:
        if isinstance(x[key], float) and math.isfinite(x[key]):
            assert y[key] == pytest.approx(x[key], rel=1e-12, abs=1e-300), key
        else:
            assert x[key] == y[key], key


def _stored_pairs(ra, rb) -> tuple[list, list[StoredPair]]:
    """The param tensors of two traces written by ``_write``: (entry pairs, ``StoredPair``s)."""
    entries = [(x.tensors[0], y.tensors[0]) for x, y in zip(ra.records, rb.records) if x.kind == "param"]
    return entries, [StoredPair(ra.data_location(a), a.offset, a.dtype, rb.data_location(b), b.offset, b.dtype,
                                math.prod(a.shape)) for a, b in entries]


@pytest.mark.parametrize("slice_bytes", [1, 5 << 20, 32 << 20])  # 1: one read chunk per slice
def test_workers_give_the_metrics_of_an_in_process_comparison(tmp_path, slice_bytes):
    _write(tmp_path / "a.h5", 1, 0.0)
    _write(tmp_path / "b.h5", 2, 1e-3)
    with open_trace(tmp_path / "a.h5") as ra, open_trace(tmp_path / "b.h5") as rb:
        entries, pairs = _stored_pairs(ra, rb)
        assert all(isinstance(p.location_a, DataLocation) for p in pairs)
        seen = []
        got = compare_pairs(pairs, LocalPool(2), progress=type("P", (), {"advance": lambda self, n: seen.append(n)})(),
                            slice_bytes=slice_bytes).metrics
        expected = [compare_data(ra.tensor_chunks(a, CHUNK_ELEMS), rb.tensor_chunks(b, CHUNK_ELEMS), a.dtype,
                                 b.dtype) for a, b in entries]
    assert got is not None and len(got) == len(expected)
    for x, y in zip(expected, got):
        _same(x, y)
    assert not got[0]["identical"] and got[1]["nonfinite_mismatch"] == 0 and got[2]["identical"]
    assert got[3]["numel"] == 0 and got[3]["identical"]
    assert sum(seen) == sum(p.nbytes() for p in pairs)  # progress counts every byte once


def test_a_slice_that_fails_in_every_worker_is_compared_in_this_process_as_without_workers(tmp_path):
    """Retried on the pool, then run here: it raises here as it would without workers, nothing goes missing."""
    _write(tmp_path / "a.h5", 1, 0.0)
    with open_trace(tmp_path / "a.h5") as reader:
        entry = reader.records[0].tensors[0]
        good = reader.data_location(entry)
    missing = DataLocation(str(tmp_path / "gone.h5"), good.chunk, good.addresses)
    pair = StoredPair(good, entry.offset, "float32", missing, entry.offset, "float32", 1_500_001)
    with pytest.raises(FileNotFoundError):
        compare_pairs([pair, pair], LocalPool(2), slice_bytes=1 << 20)


@pytest.mark.slow
def test_a_worker_killed_mid_run_leaves_complete_and_identical_metrics(tmp_path):
    """A worker process killed for real while it holds slices: they go to the others (a new process takes its
    place), and the merged sums are those of an undisturbed run in this process, bit for bit (the slices' sums
    are merged in slice order, wherever they ran)."""
    psutil = pytest.importorskip("psutil")
    _write(tmp_path / "a.h5", 1, 0.0)
    _write(tmp_path / "b.h5", 2, 1e-3)
    with open_trace(tmp_path / "a.h5") as ra, open_trace(tmp_path / "b.h5") as rb:
        _, pairs = _stored_pairs(ra, rb)
        undisturbed = compare_pairs(pairs, LocalPool(1), slice_bytes=1).metrics * 100
        pairs = pairs * 100  # ~1 s of work: the workers are up before this process could do it all
        killed = []

        def kill_one_worker():  # the first worker seen reading a trace: it holds slices
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed:
                for worker in psutil.Process().children():
                    try:
                        reading = any(f.path.endswith(".h5") for f in worker.open_files())
                    except psutil.Error:
                        continue
                    if reading and "layerdiff.compare.tasks" in " ".join(worker.cmdline()):
                        worker.kill()
                        killed.append(worker.pid)
                        return
                time.sleep(0.002)

        killer = threading.Thread(target=kill_one_worker)
        killer.start()
        got = compare_pairs(pairs, LocalPool(2), slice_bytes=1).metrics
        killer.join()
    assert killed
    assert got == undisturbed


@pytest.mark.torch
def test_align_reports_the_same_with_and_without_workers(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import layerdiff
    from layerdiff.recipes import torch_llama

    for name, variant in (("a.h5", None), ("b.h5", "eps")):
        built = torch_llama.build(variant) if variant else torch_llama.build()
        with layerdiff.trace(built["model"], tmp_path / name):
            built["step"]()
    serial = api.align(tmp_path / "a.h5", tmp_path / "b.h5", workers=1).data
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # these traces hold 200 MB: use workers all the same
    started = []
    real_map = LocalPool.map
    monkeypatch.setattr(LocalPool, "map",
                        lambda self, *args, **kw: started.append(self.size) or real_map(self, *args, **kw))
    parallel = api.align(tmp_path / "a.h5", tmp_path / "b.h5", workers=2).data
    assert started == [2]
    assert len(serial["records"]) == len(parallel["records"]) > 100
    for x, y in zip(serial["records"], parallel["records"]):
        for tx, ty in zip(x["tensors"], y["tensors"]):
            _same(tx["metrics"], ty["metrics"])
            assert tx["passed"] == ty["passed"]
    assert serial["verdict"] == parallel["verdict"] == "divergent"
    assert serial["forward"]["first_divergence"]["module"] == parallel["forward"]["first_divergence"]["module"]
