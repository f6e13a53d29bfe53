"""A run under automatic mixed precision (``torch.autocast``) against float32, and two such runs against each other
(the parity workflow's change of precision, as most training code makes it).

Autocast keeps the parameters in float32 and computes matmuls in bfloat16; the residual stream, norms and losses stay
float32 tensors that add up bfloat16 results. Before, those were judged at float32's tolerance: float32 against
autocast was "divergent" at the first decoder layer's residual add (max abs 8e-4 against an allowance of 3e-6),
and so was autocast eager against autocast SDPA. Now a trace records what autocast computed in, every floating
tensor of a pair where either run autocasts is judged at that dtype's tolerance, the difference is shown among the
run settings, and a defect is still named where it is.

Real models: the Llama of ``recipes/torch_llama_ops.py`` (transformers' modeling code, spelled out), with and
without its operations recorded.
"""
from __future__ import annotations

import pytest

from conftest import align_files, marked_line

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama_ops  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced

RUNS = {"fp32": (False, "eager", None), "amp": (True, "eager", None), "amp_sdpa": (True, "sdpa", None),
        "amp_residual": (True, "eager", "residual")}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("autocast")
    for name, (autocast, attn, defect) in RUNS.items():
        built = torch_llama_ops.build(defect, attn=attn, seq=32)
        for ops in (False, True):
            with layerdiff.trace(built["model"], root / f"{name}{'_ops' if ops else ''}.h5", ops=ops):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    built["step"]()  # forward and backward
    return root


def _first(report):
    return report["forward"]["first_divergence"], report["backward"]["first_divergence"]


def test_the_trace_says_what_autocast_computed_in(traces):
    with open_trace(traces / "amp.h5") as trace:
        assert list(trace.end.autocast_dtypes) == ["bfloat16"]
    with open_trace(traces / "fp32.h5") as trace:
        assert list(trace.end.autocast_dtypes) == []


@pytest.mark.parametrize("ops", ["", "_ops"])
@pytest.mark.parametrize("pair", [("fp32", "amp"), ("amp", "amp_sdpa")])
def test_clean_pairs_under_autocast_are_aligned(traces, pair, ops):
    report = align_files(traces / f"{pair[0]}{ops}.h5", traces / f"{pair[1]}{ops}.h5")
    assert report["verdict"] == "aligned", _first(report)
    widened = [t for r in report["records"] for t in r["tensors"]
               if t["dtype_a"] == t["dtype_b"] == "float32" and t["metrics"].get("max_abs", 0) > 1e-4]
    assert widened and all(t["passed"] and t["tolerance"]["rtol"] == 1e-2 for t in widened)  # bfloat16's
    differ = {d["key"]: d for d in report["settings"]["differ"]}
    if pair[0] == "fp32":
        assert differ["autocast_dtypes"]["b"] == ["bfloat16"] and report["b"]["autocast_dtypes"] == ["bfloat16"]
    else:
        assert "autocast_dtypes" not in differ


@pytest.mark.parametrize("ops", ["", "_ops"])
def test_a_defect_under_autocast_is_still_named(traces, ops):
    report = align_files(traces / f"amp{ops}.h5", traces / f"amp_residual{ops}.h5")
    origin = report["forward"]["first_divergence"]
    assert report["verdict"] == "divergent" and origin["module"] == "model.layers.1", origin
    if ops:
        assert origin["op"]["source"].endswith(f"torch_llama_ops.py:{marked_line(torch_llama_ops.__file__, 'defect: residual')}"), origin["op"]

