"""The origin rule on synthetic traces (``builders.Recorder``): no framework, no model, no file. Each test builds
the records two runs of a small model would write and checks where judging says they start to differ."""
from __future__ import annotations

import numpy as np
import pytest

from builders import Recorder

import layerdiff
from layerdiff.compare.tolerance import TolerancePolicy
from layerdiff.judge.evaluate import align
from layerdiff.judge.origin import phase_result
from layerdiff.judge.tree import call_tree, judge_rows

X = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
W = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32) / 4


def block_run(defect: str | None = None, scale: float = 1.01) -> Recorder:
    """A model of two blocks; each block runs attn then mlp and adds a residual in its own code. ``defect``
    scales one module's output ("layers.1.mlp"), or the residual of a block's own code ("layers.1:residual")."""
    rec = Recorder()
    with rec.call("", "Model", X) as model_out:
        x = X
        for i in range(2):
            block = f"layers.{i}"
            with rec.call(block, "Block", x) as block_out:
                with rec.call(f"{block}.attn", "Attention", x) as out:
                    h = np.tanh(x @ W)
                    h = h * scale if defect == f"{block}.attn" else h
                    out.append(h)
                mid = x + h * (scale if defect == f"{block}:residual" else 1.0)
                with rec.call(f"{block}.mlp", "MLP", mid) as out:
                    m = np.maximum(mid @ W.T, 0)
                    m = m * scale if defect == f"{block}.mlp" else m
                    out.append(m)
                x = mid + m
                block_out.append(x)
        model_out.append(x)
    return rec


def with_backward(rec: Recorder, defect: str | None = None) -> Recorder:
    """The backward pass of ``block_run``'s model, recorded into the same trace: calls in reverse order, each
    given the gradient of its output and handing back the gradient of its input (``defect`` scales one)."""
    back = Recorder(rec.trace, phase="backward")
    back.clock = rec.clock
    grad = np.ones_like(X)
    roles = ("grad_output", "grad_input")
    with back.call("", "Model", grad, roles=roles) as model_in:
        for i in reversed(range(2)):
            block = f"layers.{i}"
            with back.call(block, "Block", grad, roles=roles) as block_in:
                for child in ("mlp", "attn"):
                    with back.call(f"{block}.{child}", child, grad, roles=roles) as child_in:
                        g = grad @ W * (1.01 if defect == f"{block}.{child}" else 1.0)
                        child_in.append(g)
                    grad = grad + g
                block_in.append(grad)
        model_in.append(grad)
    return rec


def origin(a: Recorder, b: Recorder) -> dict:
    return align(a.trace, b.trace)["forward"]["first_divergence"]


def test_identical_runs_are_aligned():
    report = align(block_run().trace, block_run().trace)
    assert report["forward"]["status"] == "aligned" and report["forward"]["first_divergence"] is None


@pytest.mark.parametrize("defect", ["layers.0.attn", "layers.1.mlp"])
def test_the_origin_is_the_module_whose_inputs_agree_and_outputs_do_not(defect):
    found = origin(block_run(), block_run(defect))
    assert found["module"] == defect and found["where"] == "module", found
    block = defect.rpartition(".")[0]
    assert found["chain"] == ["<root>", block, defect]


def test_a_defect_in_a_blocks_own_code_is_placed_between_the_children_around_it():
    found = origin(block_run(), block_run("layers.1:residual"))
    assert found["module"] == "layers.1" and found["where"] == "own_code", found
    assert found["between"] == ["layers.1.attn", "layers.1.mlp"]
    assert found["description"] == "layers.1, own code between attn and mlp"
    assert (found["tensor"]["role"], found["tensor"]["key"]) == ("output", "out")  # the block's own output


MASK = (np.arange(8) < 6).astype(np.float32)  # the last two features hidden


def masked_run(drop_in: tuple = (), effect: bool = True) -> Recorder:
    """Each block hands its attention the mask it is given; a block in ``drop_in`` calls its attention without it
    (its own code dropped it). ``effect``: whether the attention's result depends on the mask."""
    rec = Recorder()
    with rec.call("", "Model", X, MASK) as model_out:
        x = X
        for i in range(2):
            block = f"layers.{i}"
            with rec.call(block, "Block", x, MASK) as block_out:
                given = (x,) if block in drop_in else (x, MASK)
                with rec.call(f"{block}.attn", "Attention", *given) as out:
                    h = np.tanh(x @ W)
                    out.append(h * MASK if len(given) > 1 and effect else h)
                x = x + out[0]
                block_out.append(x)
        model_out.append(x)
    return rec


def test_a_tensor_the_blocks_own_code_drops_is_a_difference_of_its_childs_inputs():
    """Before, the attention that got no mask was named (its paired input agrees), with a note."""
    found = origin(masked_run(), masked_run(drop_in=("layers.1",)))
    assert found["module"] == "layers.1" and found["where"] == "own_code", found
    assert found["description"] == "layers.1, own code before attn: it gives attn args.1 in run A only"
    assert found["tensor"]["key"] == "args.1" and found["tensor"]["reason"] == "given to run A only"


def test_a_tensor_given_to_one_run_only_counts_for_nothing_where_the_results_agree():
    report = align(masked_run(effect=False).trace, masked_run(drop_in=("layers.0", "layers.1"), effect=False).trace)
    assert report["forward"]["status"] == "aligned", report["forward"]["first_divergence"]
    attention = next(r for r in report["records"] if r["path"] == "layers.1.attn")
    assert attention["only_a"] == ["input:args.1"]


def test_the_same_measurements_judged_again_under_looser_tolerances():
    report = layerdiff.Report(align(block_run().trace, block_run("layers.0.attn", scale=1 + 1e-3).trace))
    assert report.data["forward"]["status"] == "divergent"
    loose = report.rethreshold(atol=1.0, rtol=1.0, cos=0.9)
    assert loose.data["forward"]["status"] == "aligned"
    assert report.data["forward"]["status"] == "divergent"  # the first judgement is left as it was


def test_an_operation_inside_a_module_becomes_a_node_of_the_tree():
    """A row of kind "op" (an operation a module's own code ran) hangs under its module call, between the calls
    it ran between, and is the origin when its inputs agree and its output does not."""
    measured = align(block_run().trace, block_run("layers.1:residual").trace)
    rows = judge_rows(measured, TolerancePolicy())
    mlp = next(r for r in rows if r["path"] == "layers.1.mlp" and r["phase"] == "forward")
    attn = next(r for r in rows if r["path"] == "layers.1.attn" and r["phase"] == "forward")
    add = {**mlp, "kind": "op", "path": "layers.1", "call": 0, "parent": ["layers.1", 0],
           "ancestors": [["layers.1", 0], ["", 0]], "begin": attn["end"] + 0.5, "end": attn["end"] + 0.6,
           "op": {"index": 0, "name": "Tensor.add", "kind": "add", "source": "model.py:12", "function": "forward",
                  "args": {"args.1": 1.0}},
           "op_b": {"index": 0, "name": "Tensor.add", "kind": "add", "source": "port.py:40", "function": "forward",
                    "args": {"args.1": 1.01}},
           "tensors": [{**t, "role": "input"} for t in attn["tensors"] if t["role"] == "output"]
           + [{**t, "role": "output"} for t in mlp["tensors"] if t["role"] == "input"]}
    roots = call_tree(rows + [add], "forward")
    block = next(n for n in roots[0].children if n.row["path"] == "layers.1" and n.kind == "module")
    assert [(n.row["path"], n.kind) for n in block.children] == [
        ("layers.1.attn", "module"), ("layers.1", "op"), ("layers.1.mlp", "module")]
    found = phase_result(rows + [add], "forward", roots, {}, None)["first_divergence"]
    assert (found["module"], found["where"]) == ("layers.1", "op"), found
    assert found["op"]["name"] == "Tensor.add" and found["op"]["source_b"] == "port.py:40"
    assert found["op"]["args_diff"] == {"args.1": [1.0, 1.01]}
    assert found["description"] == "layers.1: Tensor.add at model.py:12 (forward); in B at port.py:40 (forward)"


def test_a_gradient_defect_is_found_in_backward_where_forward_agrees():
    report = align(with_backward(block_run()).trace, with_backward(block_run(), "layers.0.mlp").trace)
    assert report["forward"]["status"] == "aligned"
    found = report["backward"]["first_divergence"]
    assert found["module"] == "layers.0.mlp" and found["phase"] == "backward", found
