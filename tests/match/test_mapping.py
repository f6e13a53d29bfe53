"""Modules renamed or wrapped between two runs are matched by structure, shown, and can be saved and edited."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import layerdiff  # noqa: E402

from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.torch]


class Block(nn.Module):
    def __init__(self, names, eps=1e-5):
        super().__init__()
        setattr(self, names[0], nn.Linear(8, 16))
        setattr(self, names[1], nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8, eps=eps)
        self.names = names

    def forward(self, x):
        h = torch.relu(getattr(self, self.names[0])(x))
        return self.norm(x + getattr(self, self.names[1])(h))


class Net(nn.Module):
    """Reference naming: blocks.N.linear1/linear2; candidate: layers.N.dense1/dense2 inside a wrapper."""

    def __init__(self, renamed=False, wrapped=False, eps_last=1e-5):
        super().__init__()
        names = ("dense1", "dense2") if renamed else ("linear1", "linear2")
        blocks = nn.ModuleList([Block(names), Block(names, eps=eps_last)])
        if wrapped:
            self.encoder = nn.Module()
            self.encoder.layers = blocks
        else:
            self.blocks = blocks
        self.head = nn.Linear(8, 3)
        self.wrapped = wrapped

    def forward(self, x):
        for block in (self.encoder.layers if self.wrapped else self.blocks):
            x = block(x)
        return self.head(x)


def _trace(path, **kwargs):
    torch.manual_seed(0)
    model = Net(**kwargs)
    x = torch.randn(4, 8)
    with layerdiff.trace(model, path):
        model(x).pow(2).sum().backward()
    return path


def test_renamed_and_wrapped_modules_are_matched_and_the_defect_named(tmp_path, align_paths):
    ref = _trace(tmp_path / "ref.h5")
    clean = _trace(tmp_path / "clean.h5", renamed=True, wrapped=True)
    report = align_paths(ref, clean)
    assert report["verdict"] == "aligned"
    pairs = {m["b"]: m["a"] for m in report["mapping"]}
    assert pairs["encoder.layers.0.dense1"] == "blocks.0.linear1"
    assert pairs["encoder.layers.1.dense2"] == "blocks.1.linear2"
    assert all(0.5 <= m["confidence"] <= 1 for m in report["mapping"])
    assert report["params"]["compared"] == 14 and not report["params"]["differ"]  # parameters follow their modules
    bad = _trace(tmp_path / "bad.h5", renamed=True, wrapped=True, eps_last=1e-1)
    origin = align_paths(ref, bad)["forward"]["first_divergence"]
    assert origin["module"] == "blocks.1.norm"  # named in A's terms
    assert origin["hparam_diff"] == {"eps": [1e-5, 1e-1]}


def test_mapping_is_printed_saved_edited_and_passed_back(tmp_path):
    ref = _trace(tmp_path / "ref.h5")
    cand = _trace(tmp_path / "cand.h5", renamed=True)
    code, out, err = run_cli("align", ref, cand, "--save-map", tmp_path / "map.txt")
    assert code == 0, err
    assert "matched" in out and "blocks.*.dense1 -> blocks.*.linear1 x2" in out  # repeated blocks shown once
    rules = (tmp_path / "map.txt").read_text()
    assert "# blocks.0.dense1 -> blocks.0.linear1" in rules
    # passing the saved file back gives the same alignment without inference
    code, out, err = run_cli("align", ref, cand, "--map", tmp_path / "map.txt", "--no-auto-map", "-q")
    assert code == 0 and out.startswith("aligned"), err
    # an edited (wrong) rule is obeyed: linear1 and linear2 swapped in block 0 -> shapes no longer fit
    edited = rules.replace(r"^blocks\.0\.dense1(\.[^.]+)?$=blocks.0.linear1\1", r"^blocks\.0\.dense1(\.[^.]+)?$=blocks.0.linear2\1")
    (tmp_path / "edited.txt").write_text(edited)
    code, out, _ = run_cli("align", ref, cand, "--map", tmp_path / "edited.txt", "--no-auto-map", "-q")
    assert code == 1
    # without inference, the renamed modules are unmatched and listed, not silently dropped
    code, out, _ = run_cli("align", ref, cand, "--no-auto-map")
    assert "only in A" in out and "blocks.0.linear1" in out


def test_save_map_refuses_to_overwrite(tmp_path):
    ref = _trace(tmp_path / "ref.h5")
    (tmp_path / "map.txt").write_text("keep")
    code, _, err = run_cli("align", ref, ref, "--save-map", tmp_path / "map.txt")
    assert code == 2 and (tmp_path / "map.txt").read_text() == "keep"


class Conv(nn.Module):
    """A conv whose weight a port keeps in another order: ``perm`` of OIHW ([kh, kw, in, out] is TF/JAX's HWIO)."""

    def __init__(self, perm=None):
        super().__init__()
        w = torch.randn(6, 3, 2, 2, generator=torch.Generator().manual_seed(0))
        self.weight = nn.Parameter(w.permute(*perm).contiguous() if perm else w)
        self.back = tuple(int(i) for i in np.argsort(perm)) if perm else None

    def forward(self, x):
        w = self.weight.permute(*self.back) if self.back else self.weight
        return torch.nn.functional.conv2d(x, w)


def _conv_traces(tmp_path):
    for name, perm in (("oihw.h5", None), ("hwio.h5", (2, 3, 1, 0)), ("whio.h5", (3, 2, 1, 0))):
        model = nn.Sequential(Conv(perm))
        with layerdiff.trace(model, tmp_path / name):
            model(torch.ones(1, 3, 4, 4)).sum().backward()


def test_a_permuted_weight_is_inferred_when_same_sized_dimensions_keep_their_order(tmp_path):
    """HWIO against OIHW: kh and kw are both 2, so the shapes allow two orders; the one that keeps them in order
    is taken (and noted). Before, the pair was compared flattened and differed."""
    _conv_traces(tmp_path)
    code, out, err = run_cli("align", tmp_path / "oihw.h5", tmp_path / "hwio.h5", "-q")
    assert code == 0, out + err


def test_declared_layout_rule_compares_permuted_weights(tmp_path):
    _conv_traces(tmp_path)  # [kw, kh, in, out]: the shapes cannot say that kh and kw are swapped
    code, out, _ = run_cli("align", tmp_path / "oihw.h5", tmp_path / "whio.h5", "-q")
    assert code == 1  # same numbers, different layout: weights and their gradients differ as compared
    code, out, err = run_cli("align", tmp_path / "oihw.h5", tmp_path / "whio.h5", "-q",
                             "--layout", r"0\.weight$=permute(3,2,1,0)")
    assert code == 0, out + err
    code, _, err = run_cli("align", tmp_path / "oihw.h5", tmp_path / "whio.h5", "--layout", "x=spin(1)")
    assert code == 2 and err.count("\n") == 1
