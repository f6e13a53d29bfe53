"""A module that runs another module's work inside itself, known by a parameter the rule set places in that other
module (``moved_params``): Transformer Engine's linear applies the norm before its own matmul (its
``layer_norm_weight``), where the reference calls a norm module first. Its inputs differ by design and are not
compared; its result is; the norm's weight is compared where it belongs. (After its own work: Megatron's
``shared_experts`` applying Qwen2-MoE's gate, ``test_megatron_models.py``.)"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.api import align  # noqa: E402

pytestmark = pytest.mark.torch
F = torch.nn.functional


class Block(torch.nn.Module):
    """The reference: a norm module, then a linear."""

    def __init__(self):
        super().__init__()
        self.attn_norm = torch.nn.LayerNorm(16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.proj(self.attn_norm(x))


class NormLinear(torch.nn.Module):
    """A linear that applies the norm before its own work, keeping the norm's weight (Transformer Engine's
    ``LayerNormLinear``)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(16, 16))
        self.bias = torch.nn.Parameter(torch.empty(16))
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(16))
        self.layer_norm_bias = torch.nn.Parameter(torch.empty(16))

    def forward(self, x):
        return F.linear(F.layer_norm(x, (16,), self.layer_norm_weight, self.layer_norm_bias), self.weight, self.bias)


class FusedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = NormLinear()

    def forward(self, x):
        return x + self.proj(x)


class Model(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.layers = torch.nn.ModuleList([block(), block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moved")
    rules = root / "te.toml"
    rules.write_text('[moved_params]\n"proj.layer_norm_" = "attn_norm."\n')
    torch.manual_seed(0)
    reference = Model(Block)
    with torch.no_grad():
        for layer in reference.layers:  # a norm that is not the identity
            layer.attn_norm.weight.uniform_(0.5, 1.5)
            layer.attn_norm.bias.uniform_(-0.1, 0.1)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    paths = {}
    for name in ("reference", "fused", "defect"):
        model = reference if name == "reference" else Model(FusedBlock)
        if name != "reference":
            with torch.no_grad():
                for ours, theirs in zip(model.layers, reference.layers):
                    ours.proj.weight.copy_(theirs.proj.weight)
                    ours.proj.bias.copy_(theirs.proj.bias)
                    ours.proj.layer_norm_weight.copy_(theirs.attn_norm.weight)
                    ours.proj.layer_norm_bias.copy_(theirs.attn_norm.bias)
                if name == "defect":
                    model.layers[1].proj.weight.mul_(1 + 1e-3)
        paths[name] = root / f"{name}.h5"
        with layerdiff.trace(model, paths[name]):
            model(x).pow(2).mean().backward()
    return paths, rules


def test_a_linear_that_applies_the_norm_before_its_own_work_aligns(runs):
    paths, rules = runs
    report = align(paths["reference"], paths["fused"], rules=[rules]).data
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    proj = next(r for r in report["records"] if r["path"] == "layers.0.proj" and r["phase"] == "forward")
    assert [t["role"] for t in proj["tensors"]] == ["output"] and proj["tensors"][0]["passed"]
    assert any(s.startswith("input:") and "before its own work" in s for s in proj["skipped"]), proj
    norm = next(r for r in report["records"] if r["kind"] == "param" and r["path"] == "layers.0.attn_norm.weight")
    assert norm["path_b"] == "layers.0.proj.layer_norm_weight" and all(t["passed"] for t in norm["tensors"])


def test_a_defect_in_that_linear_is_named_there(runs):
    paths, rules = runs
    report = align(paths["reference"], paths["defect"], rules=[rules]).data
    assert report["forward"]["first_divergence"]["module"] == "layers.1.proj", report["forward"]
