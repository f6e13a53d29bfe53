"""A run that raises and a run that produces NaN: what align and show say about them."""
import json

import pytest

torch = pytest.importorskip("torch")

from layerdiff.runner import parse_args  # noqa: E402

from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.torch]

TARGET = '''
import torch, torch.nn as nn

class Boom(nn.Module):
    def __init__(self, fail):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x):
        y = self.fc(x)
        if self.fail:
            raise ValueError("shape mismatch in my port")
        return y

class NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        out = g * 2
        out[0, 0] = float("nan")
        return out

class Doubler(nn.Module):
    def forward(self, x):
        return NanGrad.apply(x)

def build(fail=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), Boom(fail), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    def step():
        m(x).sum().backward()
    return m, step

def nan_backward():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), Doubler(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    def step():
        m(x).sum().backward()
    return m, step
'''


@pytest.mark.slow
def test_align_reports_the_module_that_raised_and_compares_what_ran(tmp_path):
    (tmp_path / "boom.py").write_text(TARGET)
    assert run_cli("trace", f"{tmp_path / 'boom.py'}:build", "-o", tmp_path / "ok.h5", "-q")[0] == 0
    code, _, err = run_cli("trace", f"{tmp_path / 'boom.py'}:build", "-o", tmp_path / "bad.h5", "-q", "--arg", "fail=true")
    assert code == 1 and "'1'" in err
    code, out, _ = run_cli("align", tmp_path / "ok.h5", tmp_path / "bad.h5", "--json", tmp_path / "r.json")
    assert code == 1 and "FORWARD  failed" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["forward"]["failure"]["module"] == "1"
    assert report["forward"]["failure"]["error"] == "ValueError: shape mismatch in my port"
    assert report["forward"]["first_divergence"]["where"] == "raised"
    assert report["forward"]["first_divergence"]["chain"] == ["<root>", "1"]
    compared = {r["path"] for r in report["records"] if r["phase"] == "forward"}
    assert {"0", "1.fc"} <= compared  # everything that ran before the error is compared
    # a clean pair has no failure
    run_cli("align", tmp_path / "ok.h5", tmp_path / "ok.h5", "--json", tmp_path / "clean.json")
    assert json.loads((tmp_path / "clean.json").read_text())["forward"]["failure"] is None


def test_show_nan_names_where_a_backward_nan_is_born(tmp_path):
    (tmp_path / "boom.py").write_text(TARGET)
    assert run_cli("trace", f"{tmp_path / 'boom.py'}:nan_backward", "-o", tmp_path / "n.h5", "-q")[0] == 0
    code, out, _ = run_cli("show", tmp_path / "n.h5", "--nan")
    assert code == 0
    assert "backward NaN/Inf origin: 1 (call 0) args.0: 1 NaN" in out
    assert "forward NaN/Inf origin" not in out


def test_forward_nan_origin_from_the_recipe(recipe_trace):
    code, out, _ = run_cli("show", recipe_trace("nan"), "--nan")
    assert "forward NaN/Inf origin: model.layers.1.mlp.gate_proj (call 0) out: 1 NaN" in out


def test_argument_values_that_look_like_words_stay_words():
    assert parse_args(["a=nan", "b=1e-5", "c=3", "d=true", "e=inf", "f=none"]) == \
        {"a": "nan", "b": 1e-5, "c": 3, "d": True, "e": "inf", "f": None}
