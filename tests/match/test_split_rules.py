"""Tensor-parallel split rules without a framework: per-rank traces written through the real session and writer
from numpy arrays, shaped as PaddlePaddle ``fleet`` model parallelism shapes them (ColumnParallelLinear: weight
[in, out] cut along out, split_axis 1, output a shard; RowParallelLinear: weight cut along in, split_axis 0,
input a shard, output all-reduced), aligned with a single-process PyTorch-layout trace of the same numbers.
(fleet's mp layers do not run on CPU: ``c_identity`` has no CPU kernel; these are the rules it would need.)"""
from __future__ import annotations

import numpy as np
import pytest

from layerdiff.judge.evaluate import align
from layerdiff.runs.ranks import open_run
from layerdiff.capture.session import TraceSession
from layerdiff.tracefile.writer import TraceWriter
from layerdiff.tracefile.reader import open_trace

from conftest import NumpyTensors

HIDDEN, INTER, WORLD = 4, 8, 2


def _model(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    up = rng.standard_normal((INTER, HIDDEN)).astype(np.float32)  # PyTorch layout [out, in]
    down = rng.standard_normal((HIDDEN, INTER)).astype(np.float32)
    return x, up, down


def _write(path, *, framework, rank=None, weights, calls, placements=None):
    """One trace: ``weights`` [(name, module, type, array)], ``calls`` [(path, type, inputs, outputs)] (the root
    first, its children after it: each closes in order)."""
    placements = placements or {}
    meta = {"framework": framework, "model_class": "toy.MLP", "mode": "full",
            "distributed": {"rank": rank, "world_size": WORLD} if rank is not None else None}
    writer = TraceWriter(path, meta)
    session = TraceSession(writer, NumpyTensors(placements))
    for name, module, module_type, array in weights:
        session.param("param", name, module, array, module_type)
    root_path, root_type, root_in, root_out = calls[0]
    root = session.begin_call(root_path, root_type, {}, root_in, {})
    for path_, type_, inputs, outputs in calls[1:]:
        frame = session.begin_call(path_, type_, {}, inputs, {})
        session.end_call(frame, outputs, {})
    session.end_call(root, root_out, {})
    session.close()


def _reference(path, x, up, down):
    y1 = x @ up.T
    y2 = y1 @ down.T
    _write(path, framework="torch", weights=[("up.weight", "up", "Linear", up), ("down.weight", "down", "Linear", down)],
           calls=[("", "MLP", [("args.0", x)], [("out", y2)]), ("up", "Linear", [("args.0", x)], [("out", y1)]),
                  ("down", "Linear", [("args.0", y1)], [("out", y2)])])


def _fleet_run(run, x, up, down, scale_rank=None):
    run.mkdir()
    up_pd, down_pd = up.T.copy(), down.T.copy()  # Paddle Linear layout [in, out]
    cols = INTER // WORLD
    locals_ = []
    for rank in range(WORLD):
        up_r = np.ascontiguousarray(up_pd[:, rank * cols:(rank + 1) * cols])
        if rank == scale_rank:
            up_r = up_r * np.float32(1 + 1e-3)
        down_r = np.ascontiguousarray(down_pd[rank * cols:(rank + 1) * cols])
        locals_.append((up_r, down_r, x @ up_r))
    y2 = sum(y1_r @ down_r for _, down_r, y1_r in locals_)  # RowParallelLinear's all-reduce
    for rank, (up_r, down_r, y1_r) in enumerate(locals_):
        placements = {id(up_r): {"placements": ["S(1)"], "mesh": [WORLD], "coord": [rank], "source": "fleet"},
                      id(down_r): {"placements": ["S(0)"], "mesh": [WORLD], "coord": [rank], "source": "fleet"}}
        _write(run / f"rank{rank}.h5", framework="paddle", rank=rank, placements=placements,
               weights=[("up.weight", "up", "ColumnParallelLinear", up_r),
                        ("down.weight", "down", "RowParallelLinear", down_r)],
               calls=[("", "MLP", [("args.0", x)], [("out", y2)]),
                      ("up", "ColumnParallelLinear", [("args.0", x)], [("out", y1_r)]),
                      ("down", "RowParallelLinear", [("args.0", y1_r)], [("out", y2)])])


def _align(a, b):
    with open_trace(a) as ra, open_run(b) as rb:
        return align(ra, rb)


@pytest.fixture()
def traces(tmp_path):
    x, up, down = _model()
    _reference(tmp_path / "ref.h5", x, up, down)
    return tmp_path, (x, up, down)


def test_fleet_column_and_row_parallel_shards_are_joined(traces):
    root, (x, up, down) = traces
    _fleet_run(root / "run", x, up, down)
    report = _align(root / "ref.h5", root / "run")
    assert report["verdict"] == "aligned", (report["forward"], report["params"])
    rows = {(r["kind"], r["path"]): r for r in report["records"]}
    weight = rows[("param", "up.weight")]["tensors"][0]
    assert weight["shape_b"] == [INTER, HIDDEN] and "transposed" in weight["metrics"]["note"]  # as [out, in]
    out = next(t for t in rows[("call", "up")]["tensors"] if t["role"] == "output")
    assert out["shape_b"] == [2, INTER] and "shards joined on axis 1" in out["metrics"]["note"]  # by its weight
    down_in = next(t for t in rows[("call", "down")]["tensors"] if t["role"] == "input")
    assert "shards joined on axis 1" in down_in["metrics"]["note"]


def test_a_shard_perturbed_on_one_rank_is_named_with_the_rank(traces):
    root, (x, up, down) = traces
    _fleet_run(root / "run", x, up, down, scale_rank=1)
    origin = _align(root / "ref.h5", root / "run")["forward"]["first_divergence"]
    assert origin["module"] == "up" and origin["ranks"] == [1]
    assert origin["description"] == "rank 1's shard of up"
