"""Error inherited through a change of precision, judged as the pure function it is (``judge.inherited``): what a
mask's flips may explain, and what they may not."""
from __future__ import annotations

from layerdiff.judge.inherited import inherit


def _tensor(role: str, dtype: str, rel_l2: float, passed: bool, **metrics) -> dict:
    return {"role": role, "key": "out" if role == "output" else "args.0", "dtype_a": dtype,
            "dtype_b": dtype if dtype == "int64" else "bfloat16", "passed": passed,
            "reason": "within tolerance" if passed else "max abs diff 2 > 0",
            "metrics": {"basis": "data", "rel_l2": rel_l2, "numel": 64, **metrics}}


def _call(output: dict) -> list:
    """One call whose input carries bfloat16's rounding (0.5% relative) and whose output is ``output``."""
    return [{"kind": "call", "phase": "forward", "path": "gate", "call": 0, "step": 0, "begin": 1, "end": 2,
             "parent": ["", 0], "tensors": [_tensor("input", "float32", 0.005, True), output]},
            {"kind": "call", "phase": "forward", "path": "", "call": 0, "step": 0, "begin": 0, "end": 3,
             "parent": None, "tensors": []}]


def test_floats_zero_in_one_run_at_few_positions_are_a_mask_that_rounding_flipped():
    """A ReLU's gradient: 1 of 64 positions zero in one run only (1.6% against 4 x 0.5% carried), and the error
    elsewhere 1x what it was given: inherited, and the reason says why."""
    out = _tensor("output", "float32", 0.15, False, zero_mismatch=1, rel_l2_elsewhere=0.005)
    judged = inherit(_call(out), "bfloat16")[0]["tensors"][1]
    assert judged["passed"] and judged["inherited"]["growth"] == 1.0 and "holds zero" in judged["reason"], judged
    many = _tensor("output", "float32", 0.4, False, zero_mismatch=6, rel_l2_elsewhere=0.005)  # 9%: dropout's
    assert not inherit(_call(many), "bfloat16")[0]["tensors"][1]["passed"]
    off = _tensor("output", "float32", 0.15, False, zero_mismatch=1, rel_l2_elsewhere=0.05)  # 10x elsewhere
    assert not inherit(_call(off), "bfloat16")[0]["tensors"][1]["passed"]


def test_integers_zero_in_one_run_are_a_choice_not_a_mask():
    """A router's chosen experts (integers): expert 0 in one run, 2 in the other, at 1 of 64 positions. Before, that
    read as a mask's flip and was inherited, and the origin moved on to the experts that followed the choice
    (MiniMax-M3's MoE in bfloat16, found by ``tools/sweep_hf.py``); the choice stays over its tolerance."""
    out = _tensor("output", "int64", 0.15, False, zero_mismatch=1, rel_l2_elsewhere=0.0)
    judged = inherit(_call(out), "bfloat16")[0]["tensors"][1]
    assert not judged["passed"] and "inherited" not in judged, judged


def _mixer(grad_rel_l2: float) -> list:
    """A call ``mixer`` whose backward was computed from gradients carrying 1% error, and the gradient of a weight
    of its child ``mixer.conv1d``, which made no call: the mixer's own code used that weight (transformers' Mamba2
    mixer convolves with its ``conv1d``'s weight itself)."""
    return [{"kind": "call", "phase": "forward", "path": "", "call": 0, "step": 0, "begin": 0, "end": 3,
             "parent": None, "tensors": []},
            {"kind": "call", "phase": "forward", "path": "mixer", "call": 0, "step": 0, "begin": 1, "end": 2,
             "parent": ["", 0], "tensors": [_tensor("input", "float32", 0.005, True),
                                            _tensor("output", "float32", 0.01, True)]},
            {"kind": "call", "phase": "backward", "path": "mixer", "call": 0, "step": 0, "begin": 4, "end": 5,
             "parent": ["", 0], "tensors": [_tensor("grad_output", "float32", 0.01, True),
                                            _tensor("grad_input", "float32", 0.01, True)]},
            {"kind": "param_grad", "path": "mixer.conv1d.bias", "module": "mixer.conv1d", "call": 0, "step": 0,
             "tensors": [_tensor("param_grad", "float32", grad_rel_l2, False)]}]


def test_a_weight_used_by_the_code_around_its_module_inherits_from_that_code():
    """Its gradient carries 2x the error the mixer's backward was computed from: inherited. Before, a weight whose
    own module made no call inherited nothing, and the bias gradient was named (Mamba2 and Gemma 3n in bfloat16,
    found by ``tools/sweep_hf.py``). 20x is not forgiven."""
    judged = inherit(_mixer(0.02), "bfloat16")[-1]["tensors"][0]
    assert judged["passed"] and judged["inherited"]["growth"] == 2.0, judged
    assert not inherit(_mixer(0.2), "bfloat16")[-1]["tensors"][0]["passed"]
