"""A few training steps (the parity workflow's third level): where the first step that differs begins with
parameters that differ while every earlier step agrees end to end, the origin is the update between the steps
(``where: "update"``), not the first module that holds a weight. A defect of the model's code in a later step is
still named at its module.

Real models: transformers' Llama of ``recipes/torch_llama.py``, trained with SGD for two steps.
"""
from __future__ import annotations

import pytest

from conftest import align_files

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    for name, kwargs in {"ref": dict(lr=0.1), "lr": dict(lr=0.11),
                         "eps_step2": dict(lr=0.1, defect="eps", defect_step=2)}.items():
        built = torch_llama.build(**kwargs)
        with layerdiff.trace(built["model"], root / f"{name}.h5"):
            for _ in range(2):
                built["step"]()
    return root


def test_another_learning_rate_is_named_as_the_update_between_steps(traces):
    report = align_files(traces / "ref.h5", traces / "lr.h5")
    origin = report["forward"]["first_divergence"]
    assert report["verdict"] == "divergent" and origin["where"] == "update" and origin["step"] == 1, origin
    assert "the update before step 2" in origin["description"] and "learning rate" in origin["description"]
    assert origin["param_diffs"] and all(p["step"] == 1 for p in origin["param_diffs"])
    assert report["backward"]["first_divergence"]["where"] == "forward"  # inherited from it


def test_a_defect_of_the_models_code_in_a_later_step_is_named_at_its_module(traces):
    report = align_files(traces / "ref.h5", traces / "eps_step2.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["where"] != "update" and origin["step"] == 1, origin
    assert origin["module"] == "model.layers.1.post_attention_layernorm", origin["description"]


@pytest.fixture(scope="module")
def through_data(tmp_path_factory):
    """SGD written by hand through ``.data`` (as tutorials and older training loops do, and as Megatron's
    mixed-precision optimizers copy into the model's weights): it leaves torch's in-place counter as it was.
    Before, the parameters were recorded at the first step only, and another learning rate was named at
    "model.embed_tokens" with "parameters: 0 of N differ"."""
    root = tmp_path_factory.mktemp("through_data")
    for name, lr in (("ref", 0.1), ("lr", 0.11), ("still", 0.0)):
        built = torch_llama.build()
        with layerdiff.trace(built["model"], root / f"{name}.h5"):
            for _ in range(3):  # the third step's check reads a fingerprint, the second's the statistics
                built["step"]()
                for p in built["model"].parameters():
                    if lr:
                        p.data -= lr * p.grad
    return root


def test_an_update_written_through_data_is_seen(through_data):
    report = align_files(through_data / "ref.h5", through_data / "lr.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["where"] == "update" and origin["step"] == 1, origin["description"]
    assert report["params"]["differ"]
    assert _param_steps(through_data / "ref.h5") == {0, 1, 2}  # recorded again after each update


def test_parameters_a_backward_pass_left_unchanged_are_not_recorded_again(through_data):
    assert _param_steps(through_data / "still.h5") == {0}


def _param_steps(path) -> set[int]:
    from layerdiff.tracefile.reader import open_trace

    with open_trace(path) as trace:
        return {r.step for r in trace.records if r.kind == "param"}


def test_weights_swapped_in_through_data_between_inference_steps_are_recorded(tmp_path):
    built = torch_llama.build(backward=False)
    model = built["model"]
    with layerdiff.trace(model, tmp_path / "swapped.h5", backward=False):
        built["step"]()
        model.lm_head.weight.data = model.lm_head.weight.data * 2  # no backward pass, no counter moved
        built["step"]()
    from layerdiff.tracefile.reader import open_trace

    with open_trace(tmp_path / "swapped.h5") as trace:
        again = {r.path for r in trace.records if r.kind == "param" and r.step == 1}
    assert again == {"lm_head.weight"}
