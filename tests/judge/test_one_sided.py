"""A tensor a matched call gets in one run only is judged: the candidate's own code drops a mask before calling a
child, or hands it one the reference does not. Before: not judged, and the origin named one level too deep (the
child that got no mask), with a note. Now: a difference of the child's inputs, so the origin is the caller's own
code, and the report names the tensor. Where the child's results agree anyway (eager attention given a causal mask,
SDPA building its own), a one-sided mask is a difference of representation and counts for nothing.

Real models: the shared Llama of transformers (eager attention: the decoder layers hand a causal mask to their
attention), with its decoder layer 1's own code changed in the candidate.
"""
from __future__ import annotations

import pytest

from conftest import align_files

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced (their synthetic twins: test_call_tree)


def _layer_code(layer, change: str):
    """Layer 1's own code, changed: it calls its attention without the mask it was given ("drop"), or with one the
    reference never hands it ("add": the first key hidden from every query but the first)."""
    forward = layer.forward

    def changed(hidden_states, *args, attention_mask=None, **kwargs):
        if change == "drop":
            attention_mask = None
        else:
            size = hidden_states.shape[1]
            attention_mask = torch.zeros(1, 1, size, size)
            attention_mask[..., 1:, 0] = torch.finfo(torch.float32).min
        return forward(hidden_states, *args, attention_mask=attention_mask, **kwargs)

    layer.forward = changed


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_sided")
    for name, attn, change in (("eager", "eager", None), ("eager_drop", "eager", "drop"), ("sdpa", "sdpa", None),
                               ("sdpa_add", "sdpa", "add"), ("port_drop", "eager", "drop")):
        built = torch_llama.build(attn=attn)
        if change:
            _layer_code(built["model"].model.layers[1], change)
        if name.startswith("port"):  # another model class: a port, whose calls may take other tensors by design
            model = built["model"]
            model.__class__ = type("PortedLlamaForCausalLM", (type(model),), {})
        with layerdiff.trace(built["model"], root / f"{name}.h5"):
            built["step"]()
    return root


def test_a_mask_the_candidates_own_code_drops_is_named_at_that_code(traces):
    report = align_files(traces / "eager.h5", traces / "eager_drop.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1" and origin["where"] == "own_code", origin["description"]
    assert origin["description"] == ("model.layers.1, own code between input_layernorm and self_attn: it gives "
                                      "self_attn attention_mask in run A only")
    assert origin["tensor"]["key"] == "kwargs.attention_mask" and origin["tensor"]["role"] == "input"
    assert origin["tensor"]["reason"] == "given to run A only"


def test_a_tensor_the_candidates_own_code_adds_is_named_at_that_code(traces):
    report = align_files(traces / "sdpa.h5", traces / "sdpa_add.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1" and origin["where"] == "own_code", origin["description"]
    assert origin["description"].endswith("it gives self_attn attention_mask in run B only")
    assert origin["tensor"]["reason"] == "given to run B only"


def test_in_a_port_a_mask_the_caller_got_in_both_runs_and_handed_on_in_one_is_named(traces):
    """Between a model and its port, a tensor a port's code makes where the other's never does is a difference of
    design; one the caller got in both runs and handed on in one only was dropped by its code."""
    report = align_files(traces / "eager.h5", traces / "port_drop.h5")
    assert report["structure"] == "ported"
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1" and origin["description"].endswith(
        "it gives self_attn attention_mask in run A only")
    attention = next(r for r in report["records"] if r["path"] == "model.layers.1.self_attn"
                     and r["phase"] == "forward")
    assert attention["dropped"] == ["input:kwargs.attention_mask"]


def test_a_mask_one_run_takes_and_the_other_builds_itself_is_no_difference(traces):
    """Eager attention is handed a causal mask, SDPA makes its own: the results agree, nothing is divergent."""
    report = align_files(traces / "eager.h5", traces / "sdpa.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    attention = next(r for r in report["records"] if r["path"] == "model.layers.1.self_attn"
                     and r["phase"] == "forward")
    assert "input:kwargs.attention_mask" in attention["only_a"]
