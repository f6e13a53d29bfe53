"""MindSpore adapter and recipe, against real MindSpore (PyNative) and against the torch recipe.

Traces are made in subprocesses, one per framework, all at once (imports are slow and MindSpore must not share
a process with torch-before-mindspore import orders); alignment happens here, with numpy and h5py only.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from layerdiff.tracefile.reader import open_trace
from layerdiff.recipes.llama_shared import DEFECTS  # the MindSpore recipe's (no framework imported here)

from conftest import align_files, run_python, run_scripts, skip_unless_installed

# torch: the torch recipe's trace is the reference for the port (made in a subprocess)
skip_unless_installed("mindspore", "torch")

pytestmark = [pytest.mark.slow, pytest.mark.mindspore, pytest.mark.torch]

MS_SCRIPT = """
import json, sys
import numpy as np
import mindspore as ms
import layerdiff
from layerdiff.recipes import mindspore_llama as recipe

out_dir = sys.argv[1]
result = {}
for name, defect in [("clean", None), ("clean2", None)] + [(d, d) for d in recipe.DEFECTS]:
    built = recipe.build(defect)
    with layerdiff.trace(built["model"], f"{out_dir}/ms_{name}.h5"):
        built["step"]()
    if name == "clean":
        result["grads"] = {k: v.asnumpy().tolist() for k, v in built["grads"]["grads"].items()
                           if k in ("lm_head.weight", "model.layers.0.self_attn.k_proj.weight")}

# forward exactness: the same model with and without tracing, with and without gradient recording
built = recipe.build(None)
model = built["model"]
ids = ms.Tensor(recipe.shared.input_ids(recipe.shared.config(), 2, 16, 0))
plain = model(input_ids=ids, labels=ids)
grad_fn = ms.value_and_grad(lambda i: model(input_ids=i, labels=i), None, model.trainable_params(), has_aux=True)
(plain_loss_g, plain_logits_g), plain_grads = grad_fn(ids)
with layerdiff.trace(model, f"{out_dir}/ms_exact.h5"):
    traced = model(input_ids=ids, labels=ids)
    (traced_loss_g, traced_logits_g), traced_grads = grad_fn(ids)
result["forward_identical"] = bool(np.array_equal(plain[1].asnumpy(), traced[1].asnumpy())
                                   and plain[0].asnumpy() == traced[0].asnumpy())
result["grad_forward_identical"] = bool(np.array_equal(plain_logits_g.asnumpy(), traced_logits_g.asnumpy()))
result["grads_max_rel"] = max(float(np.abs(a.asnumpy() - b.asnumpy()).max() / np.abs(a.asnumpy()).max())
                              for a, b in zip(plain_grads, traced_grads))

# Cell.recompute() in PyNative: reentrant (its default), a custom bprop runs each block again in backward; not
# (use_reentrant=False), a saved tensor's unpack does, and stops once it has what backward needs
from mindspore import nn


class Residual(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Dense(16, 32), nn.GELU(), nn.Dense(32, 16)

    def construct(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Blocks(nn.Cell):
    def __init__(self, recompute):
        super().__init__()
        self.blocks, self.head = nn.CellList([Residual() for _ in range(2)]), nn.Dense(16, 4)
        for block in self.blocks if recompute else ():
            block.recompute(use_reentrant=recompute == "recompute")

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32))
for name, ops in (("plain", False), ("recompute", False), ("recompute_nonreentrant", False), ("plain", True),
                  ("recompute_nonreentrant", True)):
    ms.set_seed(0)
    net = Blocks(name if name != "plain" else None)
    with layerdiff.trace(net, f"{out_dir}/ms_blocks_{name}{'_ops' if ops else ''}.h5", ops=ops):
        ms.value_and_grad(net, None, net.trainable_params())(x)

result["torch_imported"] = "torch" in sys.modules or "paddle" in sys.modules
json.dump(result, open(f"{out_dir}/ms_result.json", "w"))
"""

# MindSpore's default asynchronous launch (the suite launches blocking: see MS_DEV_LAUNCH_BLOCKING in conftest.py)
ASYNC_SCRIPT = """
import os, sys
os.environ.pop("MS_DEV_LAUNCH_BLOCKING", None)  # before MindSpore's runtime reads it
import layerdiff
from layerdiff.recipes import mindspore_llama as recipe

built = recipe.build(None)
with layerdiff.trace(built["model"], f"{sys.argv[1]}/ms_async.h5"):
    built["step"]()
"""

TORCH_SCRIPT = """
import sys
import layerdiff
from layerdiff.recipes import torch_llama

built = torch_llama.build(None)
with layerdiff.trace(built["model"], f"{sys.argv[1]}/torch_clean.h5"):
    built["step"]()
"""


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_traces")
    run_scripts(root, {"ms": MS_SCRIPT, "ms_async": ASYNC_SCRIPT, "torch": TORCH_SCRIPT})
    result = json.loads((root / "ms_result.json").read_text())
    return root, result


_align = align_files


@pytest.mark.parametrize("other", ["ms_clean2", "ms_async"])
def test_two_mindspore_runs_align(traces, other):
    """Two runs of the same model, in one process and in two, one of them launching its operations
    asynchronously (MindSpore's default): the same records, the same values."""
    root, _ = traces
    report = _align(root / "ms_clean.h5", root / f"{other}.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    assert report["forward"]["first_divergence"] is None and report["backward"]["first_divergence"] is None
    compared = [t for r in report["records"] for t in r["tensors"]]
    assert len(compared) > 100 and all(t["passed"] for t in compared)
    assert max(t["metrics"]["max_abs"] for t in compared if t.get("metrics")) == 0.0


def test_mindspore_port_aligns_with_torch(traces):
    root, _ = traces
    report = _align(root / "torch_clean.h5", root / "ms_clean.h5")
    assert report["forward"]["status"] == "aligned", report["forward"]["first_divergence"]
    assert report["backward"]["status"] == "aligned", report["backward"]["first_divergence"]
    assert report["verdict"] == "aligned"


@pytest.mark.parametrize("reference", ["ms_clean", "torch_clean"])
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_mindspore_defect_is_named_at_its_origin(traces, reference, defect):
    root, _ = traces
    direction, module = DEFECTS[defect]
    report = _align(root / f"{reference}.h5", root / f"ms_{defect}.h5")
    assert report["verdict"] == "divergent"
    assert report[direction]["first_divergence"]["module"] == module, report[direction]["first_divergence"]
    if direction == "backward":
        assert report["forward"]["status"] == "aligned", report["forward"]["first_divergence"]
    else:
        assert report["backward"]["first_divergence"]["module"] == module


def test_trace_records_the_structure_of_a_training_step(traces):
    root, result = traces
    with open_trace(root / "ms_clean.h5") as r:
        assert r.meta["framework"] == "mindspore" and r.meta["execution_mode"] == "pynative"
        records = r.records
        forward = {(x.path, x.type) for x in records if x.kind == "call" and x.phase == "forward"}
        assert ("model.layers.1.self_attn.k_proj", "Dense") in forward and ("", "LlamaForCausalLM") in forward
        backward = {x.path: x for x in records if x.kind == "call" and x.phase == "backward"}
        roles = {(t.role, t.key) for t in backward["model.layers.0.mlp.down_proj"].tensors}
        assert roles == {("grad_output", "out"), ("grad_input", "args.0")}
        # the root's logits output carries no gradient (only the loss does), as in torch
        assert [t.key for t in backward[""].tensors] == ["out.0"]
        # parameter gradients are the ones ms.value_and_grad returned
        grads = {x.path: x for x in records if x.kind == "param_grad"}
        assert len(grads) == len([x for x in records if x.kind == "param"]) == 21
        for name, expected in result["grads"].items():
            stored = r.tensor(grads[name].tensors[0])
            np.testing.assert_array_equal(stored, np.asarray(expected, dtype=np.float32))


def test_tracing_leaves_forward_bit_identical_and_gradients_equal(traces):
    """Forward results are bit-identical; gradients equal to fp32 rounding (the identity taps add nodes to the
    backward graph, which can change the order in which MindSpore sums a tensor's incoming gradients)."""
    _, result = traces
    assert result["forward_identical"] and result["grad_forward_identical"]
    assert result["grads_max_rel"] < 1e-6


def test_trace_works_without_torch_in_the_process(traces):
    _, result = traces
    assert result["torch_imported"] is False


def test_nan_defect_first_nonfinite(traces):
    root, _ = traces
    report = _align(root / "ms_clean.h5", root / "ms_nan.h5")
    nan = report["first_nonfinite"]["b"]
    assert (nan["module"], nan["phase"]) == ("model.layers.1.mlp.gate_proj", "forward")


SGD_SCRIPT = r"""
import sys
import mindspore as ms
import mindspore.nn as msnn
import layerdiff
from layerdiff.recipes import llama_shared as shared, mindspore_llama as recipe

built = recipe.build()
model = built["model"]
weights = model.trainable_params()
optimizer = msnn.SGD(weights, learning_rate=0.1)
grad_fn = ms.value_and_grad(lambda ids: model(input_ids=ids, labels=ids)[0], None, weights)
ids = ms.Tensor(shared.input_ids(shared.config(), 2, 16, 0))
with layerdiff.trace(model, sys.argv[1]):
    for _ in range(2):
        loss, grads = grad_fn(ids)
        optimizer(grads)
"""


def test_training_steps_with_an_optimizer(tmp_path):
    """Two value_and_grad + nn.SGD steps: per-step parameter values, gradients, and w1 = w0 - lr * g0."""
    path = tmp_path / "sgd.h5"
    proc = run_python(SGD_SCRIPT, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open_trace(path) as r:
        assert r.end.steps == 2
        values = [p for p in r.records if p.kind == "param" and p.path == "lm_head.weight"]
        grads = [p for p in r.records if p.kind == "param_grad" and p.path == "lm_head.weight"]
        assert [v.step for v in values] == [0, 1] and [g.step for g in grads] == [0, 1]
        w0, w1 = (r.tensor(v.tensors[0]) for v in values)
        g0 = r.tensor(grads[0].tensors[0])
        assert not np.array_equal(w0, w1)
        np.testing.assert_allclose(w1, w0 - np.float32(0.1) * g0, rtol=1e-6, atol=1e-9)
        backward = [c for c in r.records if c.kind == "call" and c.phase == "backward" and c.path == "lm_head"]
        assert [c.step for c in backward] == [0, 1]


def test_mindspore_recompute_aligns_with_the_plain_net_and_replays_its_forward(traces):
    """``Cell.recompute()`` in PyNative runs each block again in backward (its custom bprop), through a
    ``_recompute_cell`` it adds: left out of the names, its calls replay the forward's, so the run aligns with the
    plain one record for record (before: ``steps: 3`` and the blocks' calls unmatched)."""
    root = traces[0]
    plain, recomputed = root / "ms_blocks_plain.h5", root / "ms_blocks_recompute.h5"
    with open_trace(plain) as a, open_trace(recomputed) as b:
        assert a.end.steps == b.end.steps == 1
        assert sorted((r.kind, r.phase, r.path, r.call) for r in a.records) == \
            sorted((r.kind, r.phase, r.path, r.call) for r in b.records)
        assert {r.path for r in b.recomputed} == {f"blocks.{i}.{child}" for i in range(2)
                                                  for child in ("fc1", "act", "fc2")}
    report = align_files(plain, recomputed)
    assert report["verdict"] == "aligned" and not report["only_a"] and not report["only_b"]
    assert report["recompute"]["b"] == {"calls": 6, "compared": 6, "differ": []}


def test_mindspore_non_reentrant_recompute_traces_and_aligns_with_the_plain_net(traces):
    """``Cell.recompute(use_reentrant=False)``: a saved tensor's ``unpack`` recomputes each block in backward and
    stops once it has every tensor backward needs, by raising through the calls it is in. Before, a traced run
    raised in MindSpore's executor ("Stack input_args_info_stack_ is empty": the taps' saved tensors were counted
    and the stop came inside a tap), and with the stop moved, the recomputed calls opened steps of their own."""
    root = traces[0]
    plain, recomputed = root / "ms_blocks_plain.h5", root / "ms_blocks_recompute_nonreentrant.h5"
    with open_trace(recomputed) as b:
        assert b.end.steps == 1 and b.end.status == "complete"
        calls = [r for r in b.recomputed if r.kind == "call"]
        assert {r.path for r in calls} == {f"blocks.{i}.{child}" for i in range(2) for child in ("fc1", "act", "fc2")}
        assert not any(r.error for r in calls)  # a recomputation stopped early is no failure
    report = align_files(plain, recomputed)
    assert report["verdict"] == "aligned" and not report["only_a"] and not report["only_b"]
    assert report["recompute"]["b"] == {"calls": 6, "compared": 6, "differ": []}
    # with every operation recorded (each op's inputs tapped for their gradients: unseen by the recomputation too)
    plain, recomputed = root / "ms_blocks_plain_ops.h5", root / "ms_blocks_recompute_nonreentrant_ops.h5"
    with open_trace(plain) as a, open_trace(recomputed) as b:
        keys = [sorted((o.phase, o.path, o.call, o.index, o.name) for o in t.ops) for t in (a, b)]
        assert keys[0] == keys[1] and ("backward", "blocks.1", 0, 0, "Tensor.__add__") in keys[0], keys[0]
    report = align_files(plain, recomputed)
    assert report["verdict"] == "aligned" and not report["only_a"] and not report["only_b"]
