"""The origin at the operation and line (``--ops``), on transformers' Llama running the model code of
``recipes/torch_llama_ops.py``: every planted defect is named at its operation and at the line that carries its
``# defect: NAME`` marker (computed from the source, never written here), with eager attention against eager and
SDPA against SDPA; pairs that differ without a bug (eager against SDPA, an inserted cast and ``contiguous``, two
independent operations swapped) align with no false alarm, and still name a defect planted in them."""
from __future__ import annotations

import inspect

import conftest
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import layerdiff  # noqa: E402
from layerdiff.judge.evaluate import align  # noqa: E402
from layerdiff.recipes import torch_llama_ops as recipe  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

pytestmark = [pytest.mark.torch]
RECIPE = inspect.getsourcefile(recipe)


def marked(marker: str) -> str:
    """``FILE:LINE`` of the recipe line ending in ``# <marker>``."""
    return f"{RECIPE}:{conftest.marked_line(RECIPE, marker)}"


class Runs:
    """Traces of the recipe made on demand, once each (in this process: the recipe patches nothing global)."""

    def __init__(self, root):
        self.root = root
        self.paths: dict = {}

    def trace(self, **build):
        key = tuple(sorted(build.items()))
        if key not in self.paths:
            path = self.root / ("_".join(f"{k}-{v}" for k, v in key) or "plain") / "t.h5"
            path.parent.mkdir(parents=True)
            built = recipe.build(**build)
            with layerdiff.trace(built["model"], path, ops=True):
                built["step"]()
            self.paths[key] = path
        return self.paths[key]

    def align(self, a: dict, b: dict) -> dict:
        with open_trace(self.trace(**a)) as ra, open_trace(self.trace(**b)) as rb:
            return align(ra, rb)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("op_origin"))


# defect -> (the marker of its line, where the origin is: "op" or "op_input")
EXPECTED = {"constant": ("defect: constant ({attn})", "op"), "dtype": ("defect: dtype", "op"),
            "helper": ("defect: helper", "op_input"), "norm": ("defect: norm", "op"),
            "residual": ("defect: residual", "op_input"), "function": ("defect: function", "op")}


def check_named(report: dict, defect: str, attn: str):
    marker, where = EXPECTED[defect]
    phase = recipe.DEFECTS[defect]
    origin = report[phase]["first_divergence"]
    assert origin is not None and origin["where"] == where, (defect, origin)
    assert origin["op"]["source_b"] == marked(marker.format(attn=attn)), (defect, origin["op"])
    if phase == "backward":
        assert report["forward"]["status"] == "aligned", report["forward"]["first_divergence"]
    return origin


@pytest.mark.parametrize("defect", ["constant", "dtype", "helper", "norm", "residual", "function"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_defect_is_named_at_its_operation_and_line(runs, attn, defect):
    report = runs.align({"attn": attn}, {"attn": attn, "defect": defect})
    origin = check_named(report, defect, attn)
    op = origin["op"]
    if defect == "constant":  # the wrong constant is the operation's argument: shown, A's and B's
        key = "args.1" if attn == "eager" else "kwargs.scale"
        a, b = op["args_diff"][key]
        assert b == pytest.approx(a * 1.01)
        assert op["name"] == ("Tensor.mul" if attn == "eager" else "torch.nn.functional.scaled_dot_product_attention")
    if defect == "dtype":
        assert op["name"] == "Tensor.to" and op["args_diff"] == {"args.1": ["torch.float32", "torch.bfloat16"]}
        assert op["dtype_diff"] == ["float32", "bfloat16"]
    if defect == "norm":
        assert op["kind"] == "mean" and origin["module"] == "model.layers.1.input_layernorm"
    if defect == "helper":  # a helper function, not a module: the line in rotate_half, in the attention's call
        assert op["function_b"] == "rotate_half" and origin["module"] == "model.layers.1.self_attn"
    if defect == "residual":
        assert origin["module"] == "model.layers.1" and op["kind"] == "add"
    if defect == "function":  # a custom autograd Function with a wrong backward: its backward is the operation's
        assert op["name"] == "SiLUFunction.apply" and origin["phase"] == "backward"


@pytest.mark.parametrize("defect, phase", [("nan", "forward"), ("nan_backward", "backward")])
def test_a_nan_is_named_at_the_operation_where_it_is_born(runs, defect, phase):
    report = runs.align({"attn": "eager"}, {"attn": "eager", "defect": defect})
    born = report["first_nonfinite"]["b"]
    assert born is not None and born["phase"] == phase, born
    assert born["op"]["source"] == marked(f"defect: {defect}"), born["op"]
    assert born["op"]["name"] == ("torch.rsqrt" if defect == "nan" else "Tensor.pow")
    assert report["first_nonfinite"]["a"] is None


@pytest.mark.parametrize("variant, attn, defect", [
    ({"attn": "sdpa"}, "sdpa", "residual"),          # eager against SDPA: a fused operation against its steps
    ({"variant": "casts"}, "eager", "helper"),       # one side inserts a cast and a contiguous
    ({"variant": "swapped"}, "eager", "constant"),   # two independent computations in the other order
])
def test_pairs_that_differ_without_a_bug_align_and_still_name_a_planted_one(runs, variant, attn, defect):
    clean = runs.align({"attn": "eager"}, {**variant})
    assert clean["verdict"] == "aligned", (clean["forward"]["first_divergence"], clean["backward"]["first_divergence"])
    ops = [r for r in clean["records"] if r["kind"] == "op"]
    assert len(ops) > 200 and all(t["passed"] for r in ops for t in r["tensors"])
    if variant == {"variant": "casts"}:
        inserted = {o[1] for r in clean["records"] if r.get("ops") for o in r["ops"]["only_b"]}
        assert inserted == {"Tensor.contiguous", "Tensor.to"}
    if variant == {"variant": "swapped"}:
        assert any("found out of order" in (t["metrics"].get("note") or "") for r in ops for t in r["tensors"])
    check_named(runs.align({"attn": "eager"}, {**variant, "defect": defect}), defect, attn)


def test_sdpa_is_paired_with_the_eager_operations_it_stands_for(runs):
    report = runs.align({"attn": "eager"}, {"attn": "sdpa"})
    fused = [r for r in report["records"] if r["kind"] == "op" and r["phase"] == "forward"
             and r["op_b"]["kind"] == "scaled_dot_product_attention"]
    assert len(fused) == 2 and all(r["op"]["kind"] == "matmul" for r in fused)
    assert all(t["passed"] and "operations ending in" in t["metrics"]["note"] for r in fused for t in r["tensors"])


def test_the_terminal_shows_both_lines_and_the_modules_operations(runs):
    from rich.console import Console

    from layerdiff.report.terminal import render

    report = runs.align({"attn": "eager"}, {"attn": "eager", "defect": "helper"})
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    line_b = marked("defect: helper").rpartition("/")[2]
    assert f"B {line_b}  return torch.cat((x2, -x1), dim=-1)  # defect: helper" in text, text
    assert "operations of model.layers.1.self_attn (forward), A | B" in text and "<- origin" in text


def test_a_module_level_origin_prints_the_command_that_records_its_operations(tmp_path):
    from layerdiff.cli import main

    for name, args in (("ref", []), ("bad", ["--arg", "defect=helper"])):
        assert main(["trace", "torch_llama_ops", "-o", str(tmp_path / f"{name}.h5"), "-q", *args]) == 0
    from rich.console import Console

    from layerdiff.report.terminal import render

    with open_trace(tmp_path / "ref.h5") as a, open_trace(tmp_path / "bad.h5") as b:
        report = align(a, b)
    console = Console(record=True, width=250)
    render(report, console)
    text = " ".join(console.export_text().split())
    pattern = r"'^model\.layers\.1\.self_attn$'"
    assert f"layerdiff trace torch_llama_ops --ops-in {pattern} -o {tmp_path / 'ref_ops.h5'}" in text, text
    assert f"layerdiff trace torch_llama_ops --arg defect=helper --ops-in {pattern}" in text
