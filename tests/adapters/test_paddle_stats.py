"""Paddle tensors' statistics read where they lie by the C kernel (``paddle_adapter.fast_stats``) equal those of
their bytes as ``to_stored`` hands them to numpy, for every layout the kernel takes (a contiguous tensor, rows cut
from one: ``data_ptr()`` includes the offset) and none it must not (a transpose, a column slice, integers, a NaN).

Paddle runs in a process of its own (one framework per process); the checks run there and report here."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import run_scripts

pytestmark = [pytest.mark.paddle,
              pytest.mark.skipif(importlib.util.find_spec("paddle") is None, reason="paddle not installed")]

SCRIPT = r'''
import json, sys
from pathlib import Path

import paddle

from layerdiff.adapters import paddle_adapter
from layerdiff.tracefile.tensors import summarize

paddle.seed(0)
x = paddle.randn([40, 30]) * 2 - 0.5
cases = {"contiguous": x, "rows": x[5:], "bfloat16": x.astype("bfloat16"), "float64": x[3:].astype("float64"),
         "transpose": x.t(), "columns": x[:, 3:7], "integers": paddle.arange(10),
         "nan": paddle.to_tensor([1.0, float("nan"), 2.0])}
out = {}
for name, t in cases.items():
    stored = paddle_adapter.to_stored(t)
    out[name] = {"kernel": paddle_adapter.fast_stats(t), "bytes": summarize(*stored)}
Path(sys.argv[1], "stats.json").write_text(json.dumps(out))
'''


def test_the_kernel_reads_paddle_tensors_where_they_lie(tmp_path):
    run_scripts(tmp_path, {"paddle": SCRIPT})
    got = json.loads((tmp_path / "stats.json").read_text())
    for name in ("contiguous", "rows", "bfloat16", "float64"):
        kernel, stored = got[name]["kernel"], got[name]["bytes"]
        assert kernel is not None, name
        assert kernel["numel"] == stored["numel"] and kernel["min"] == stored["min"] and kernel["max"] == stored["max"]
        for key in ("mean", "l2"):
            assert kernel[key] == pytest.approx(stored[key], rel=1e-6), (name, key)
    for name in ("transpose", "columns", "integers", "nan"):  # numpy's path: a view, a copy, or NaN counted
        assert got[name]["kernel"] is None, name
    assert got["nan"]["bytes"]["nan"] == 1
