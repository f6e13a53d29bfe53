"""Multi-step traces: the step where divergence starts is named, the loss is shown step by step, and module
hyper-parameters are read in every step (a value changed between steps is not recorded stale)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    for name, extra in (("a", []), ("b", ["--arg", "defect=eps", "--arg", "defect_step=2"])):
        code, _, err = run_cli("trace", "torch_llama", "-o", root / f"{name}.h5", "-q", "--steps", "3",
                               "--arg", "lr=0.1", *extra)
        assert code == 0, err
    return root


def test_a_defect_from_step_2_is_named_with_its_step(traces):
    code, out, err = run_cli("align", traces / "a.h5", traces / "b.h5", "--json", traces / "r.json")
    assert code == 1, err
    origin = json.loads((traces / "r.json").read_text())["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.post_attention_layernorm" and origin["step"] == 1  # 0-based
    assert "at step 2 of 3" in out
    assert "steps 3: first diverges at step 2: model.layers.1.post_attention_layernorm" in out
    # the eps set before step 2 was read in step 2, not taken from when tracing started
    assert origin["hparam_diff"] == {"eps": [1e-06, 1e-05]} and "eps: 1e-06 (A) vs 1e-05 (B)" in out
    code, out, _ = run_cli("align", traces / "a.h5", traces / "b.h5", "-q")
    assert out.startswith("divergent: forward model.layers.1.post_attention_layernorm at step 2;")


def test_the_loss_is_shown_step_by_step(traces):
    import layerdiff

    report = layerdiff.align(traces / "a.h5", traces / "b.h5")
    assert report.steps == 3
    from layerdiff.report.terminal import scalar_outputs_by_step

    losses = scalar_outputs_by_step(report.data)
    assert [(step, key) for step, key, *_ in losses] == [(0, "out.loss"), (1, "out.loss"), (2, "out.loss")]
    first_a, first_b = losses[0][2], losses[0][3]
    assert first_a == first_b and losses[2][2] < first_a  # step 1 identical; SGD lowers the loss
    assert losses[2][2] != losses[2][3]  # the defect changes the later losses
    _, out, _ = run_cli("align", traces / "a.h5", traces / "b.h5")
    assert f"{first_a:.7g}" in out
