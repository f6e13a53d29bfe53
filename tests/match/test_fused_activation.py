"""A port whose Linear applies its activation as a child (MindSpore Transformers' ``w1``), with a user's own
activation class under a neutral name no rule set mentions: recognized from structure and values (a child called
inside the Linear, after its matmul; the Linear's output is what A's next call gives), not from the class name.

Before: the aligner compared HF ``gate_proj``'s pre-activation output with ``w1``'s post-activation output, a false
forward alarm at ``gate_proj`` (max diff 0.3), and named the backward wrongly.

Two real ports of the shared Llama: a torch port whose gate Linear runs ``self.post = Squash()`` (both names
neutral), traced in this process; and the MindSpore Transformers port whose ``w1.activation`` is a user's Cell
with a backward of its own (MindSpore records such a cell in backward only), traced in a subprocess.
"""
from __future__ import annotations

import pytest

from conftest import align_files, run_scripts

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402


class Squash(torch.nn.Module):
    """x * sigmoid(k x): SiLU when k = 1, under a name no rule set knows."""

    def __init__(self, k: float = 1.0):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * torch.sigmoid(self.k * x)


class GateLinear(torch.nn.Linear):
    """A Linear that applies its activation inside itself, after its matmul, as a child."""

    def __init__(self, linear: torch.nn.Linear, activation: torch.nn.Module):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight = linear.weight
        self.post = activation

    def forward(self, x):
        return self.post(super().forward(x))


class PortMLP(torch.nn.Module):
    """A port's MLP in MindSpore Transformers' shape: w1 (with the activation inside), w3 (up), w2 (down)."""

    def __init__(self, mlp, activation):
        super().__init__()
        self.w1, self.w3, self.w2 = GateLinear(mlp.gate_proj, activation), mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.w2(self.w1(x) * self.w3(x))


def _port(defect: str | None):
    built = torch_llama.build()
    for i, layer in enumerate(built["model"].model.layers):
        layer.mlp = PortMLP(layer.mlp, Squash(1.25 if defect == "act" and i == 0 else 1.0))
        if defect == "weight" and i == 1:
            with torch.no_grad():
                layer.mlp.w1.weight.mul_(1.001)
    return built


@pytest.fixture(scope="module")
def torch_port(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_act")
    built = torch_llama.build()
    with layerdiff.trace(built["model"], root / "hf.h5"):
        built["step"]()
    for defect in (None, "act", "weight"):
        built = _port(defect)
        with layerdiff.trace(built["model"], root / f"port_{defect}.h5"):
            built["step"]()
    return root


def _origins(report) -> tuple:
    return tuple((report[p]["first_divergence"] or {}).get("module") for p in ("forward", "backward"))


@pytest.mark.slow
def test_a_linear_applying_a_neutral_activation_inside_aligns(torch_port):
    report = align_files(torch_port / "hf.h5", torch_port / "port_None.h5")
    assert report["verdict"] == "aligned", _origins(report)
    inside = {m["b"]: m for m in report["mapping"] if m.get("inside")}
    match = inside["model.layers.0.mlp.w1.post"]
    assert match["a"] == "model.layers.0.mlp.act_fn" and match["inside"] == "model.layers.0.mlp.w1"
    assert "runs inside w1, as act_fn runs after gate_proj" in match["reason"] and "w1's output is act_fn's" in \
        match["reason"]
    gate = next(r for r in report["records"] if r["path"] == "model.layers.0.mlp.gate_proj" and r["phase"] == "forward")
    assert {t["role"] for t in gate["tensors"]} == {"input", "output"}  # its output against w1.post's input


@pytest.mark.slow
@pytest.mark.parametrize("defect, origin", [("act", "model.layers.0.mlp.act_fn"),
                                            ("weight", "model.layers.1.mlp.gate_proj")])
def test_a_defect_is_named_at_the_activation_or_at_the_linear(torch_port, defect, origin):
    report = align_files(torch_port / "hf.h5", torch_port / f"port_{defect}.h5")
    assert _origins(report)[0] == origin


MINDSPORE_SCRIPT = """
import sys
import mindspore as ms
from mindspore import nn, ops
import layerdiff
from layerdiff.recipes import mindformers_llama as mf, torch_llama

class Squash(nn.Cell):  # a user's own SiLU with a backward of its own: MindSpore records it in backward only
    def __init__(self, k=1.0, g=1.0):
        super().__init__()
        self.k, self.g = k, g

    def construct(self, x):
        return x * ops.sigmoid(self.k * x)

    def bprop(self, x, out, dout):
        s = ops.sigmoid(self.k * x)
        return (dout * (s + self.k * x * s * (1 - s)) * self.g,)

for name, layer_defect in [("clean", {}), ("act", {0: "act"}), ("grad", {0: "grad"}), ("weight", {1: "weight"})]:
    built = mf.build(None, impl="port")
    for i, layer in enumerate(built["model"].model.layers):
        w1, defect = layer.feed_forward.w1, layer_defect.get(i)
        w1.activation = Squash(1.25 if defect == "act" else 1.0, 1.01 if defect == "grad" else 1.0)
        if defect == "weight":
            w1.weight.set_data(w1.weight * 1.001)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/mf_{name}.h5"):
        built["step"]()
"""


@pytest.fixture(scope="module")
def mindspore_port(tmp_path_factory, torch_port):
    pytest.importorskip("mindspore")
    root = tmp_path_factory.mktemp("fused_act_ms")
    run_scripts(root, {"mindspore": MINDSPORE_SCRIPT})
    return root


@pytest.mark.slow
@pytest.mark.mindspore
def test_mindformers_w1_with_a_users_activation_cell_aligns_and_names_each_defect(torch_port, mindspore_port):
    """The issue's port: ``w1.activation`` is a user's Cell with its own bprop (no forward record at all)."""
    reference = torch_port / "hf.h5"
    clean = align_files(reference, mindspore_port / "mf_clean.h5")
    assert clean["verdict"] == "aligned", _origins(clean)
    match = next(m for m in clean["mapping"] if m["b"] == "model.layers.0.feed_forward.w1.activation")
    assert match["a"] == "model.layers.0.mlp.act_fn" and match["inside"] == "model.layers.0.feed_forward.w1"
    act_fn = next(r for r in clean["records"] if r["path"] == "model.layers.0.mlp.act_fn" and r["phase"] == "forward")
    assert [t["role"] for t in act_fn["tensors"]] == ["output"] and act_fn["inputs_inside"] == \
        "model.layers.0.feed_forward.w1"
    assert any("computed inside B's model.layers.0.feed_forward.w1" in s for s in act_fn["skipped"])
    assert _origins(align_files(reference, mindspore_port / "mf_act.h5"))[0] == "model.layers.0.mlp.act_fn"
    assert _origins(align_files(reference, mindspore_port / "mf_grad.h5")) == (None, "model.layers.0.mlp.act_fn")
    assert _origins(align_files(reference, mindspore_port / "mf_weight.h5"))[0] == "model.layers.1.mlp.gate_proj"
