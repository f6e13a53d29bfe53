"""A run in bfloat16 against the same model in float32 (the parity workflow's change of precision).

A value computed from bfloat16 data is no more precise than bfloat16, even where it is held in float32: the loss
computed from the logits, an upcast (``logits.float()``, the rotary embedding's ``inv_freq.to(float32)``). Before,
judged at float32's tolerance, every such comparison was "divergent" at the loss (module level) or at the first
upcast (operations recorded). Now every floating tensor of runs that hold their parameters in different dtypes is
judged at the less precise one's tolerance, and a defect of the bfloat16 run is still named where it is.

Real models: the Llama of ``recipes/torch_llama_ops.py`` (transformers' modeling code, spelled out), in float32 and
cast to bfloat16 with ``model.to``, with and without its operations recorded.
"""
from __future__ import annotations

import pytest

from conftest import align_files, marked_line

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.compare.tolerance import DEFAULTS, judge  # noqa: E402
from layerdiff.recipes import torch_llama_ops  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    for name, dtype, defect in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                ("bf16_residual", torch.bfloat16, "residual")):
        built = torch_llama_ops.build(defect, seq=32)
        built["model"].to(dtype)
        for ops in (False, True):
            with layerdiff.trace(built["model"], root / f"{name}{'_ops' if ops else ''}.h5", ops=ops):
                built["step"]()
    return root


@pytest.mark.parametrize("ops", ["", "_ops"])
def test_bfloat16_against_float32_is_aligned(traces, ops):
    report = align_files(traces / f"fp32{ops}.h5", traces / f"bf16{ops}.h5")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    upcast = [t for r in report["records"] for t in r["tensors"]
              if t["dtype_a"] == t["dtype_b"] == "float32" and not judge(t["metrics"], DEFAULTS["float32"])[0]]
    assert all(t["passed"] and t["tolerance"]["rtol"] == 1e-2 for t in upcast)  # float32, from bfloat16 data
    if ops:
        assert upcast, "no float32 tensor over float32's tolerance: the comparison no longer shows the case"


@pytest.mark.parametrize("ops", ["", "_ops"])
def test_a_defect_of_the_bfloat16_run_is_still_named(traces, ops):
    report = align_files(traces / f"fp32{ops}.h5", traces / f"bf16_residual{ops}.h5")
    origin = report["forward"]["first_divergence"]
    assert report["verdict"] == "divergent" and origin["module"] == "model.layers.1", origin
    if ops:
        assert origin["op"]["source"].endswith(f"torch_llama_ops.py:{marked_line(torch_llama_ops.__file__, 'defect: residual')}"), origin["op"]

