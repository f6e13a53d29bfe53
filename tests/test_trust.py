"""Trust: one line and exit 2 for every user error, no hang, and never a silent pass (exit 3 when "aligned" is
not to be trusted). Each case runs the real CLI."""
from __future__ import annotations

import resource
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import run_cli  # noqa: E402
from test_bad_input import assert_one_line_error, snapshot  # noqa: E402

pytestmark = [pytest.mark.torch]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    for name, args in {"ref": [], "fwd_only": ["--no-backward"]}.items():
        code, _, err = run_cli("trace", "torch_llama", "-o", d / f"{name}.h5", "-q", *args)
        assert code == 0, err
    return d


def _one_line(args, cwd, watch=()):
    before = snapshot(*watch) if watch else None
    code, out, err = run_cli(*args, cwd=cwd)
    proc = subprocess.CompletedProcess(args, code, out, err)
    assert_one_line_error(proc)
    if watch:
        assert snapshot(*watch) == before
    return err


@pytest.mark.parametrize("source, expected", [
    ("def build(:\n", "SyntaxError"),
    ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
    ("raise RuntimeError('config not found')\n", "RuntimeError: config not found"),
])
def test_a_target_whose_import_fails(tmp_path, source, expected):
    (tmp_path / "target.py").write_text(source)
    err = _one_line(["trace", "target.py:build", "-o", "x.h5"], tmp_path, [tmp_path])
    assert "target.py: importing it raised" in err and expected in err


def test_module_form_targets_are_found_next_to_the_command(tmp_path):
    (tmp_path / "my_target.py").write_text("from layerdiff.recipes.torch_llama import build\n")
    code, out, err = run_cli("trace", "my_target:build", "-o", "x.h5", "-q", cwd=tmp_path)
    assert code == 0, err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_flush_interval_must_be_a_finite_number(tmp_path, value):
    _one_line(["trace", "torch_llama", "-o", "x.h5", "--flush-interval", value], tmp_path, [tmp_path])


@pytest.mark.parametrize("args", [
    ["trace", "torch_llama", "-o", "x.h5", "--include", "(unclosed"],
    ["trace", "torch_llama", "-o", "x.h5", "--exclude", "[z-a]"],
    ["trace", "torch_llama", "-o", "x.h5", "--include", "^no_such_module$"],
    ["trace", "torch_llama", "-o", "x.h5", "--layers", "7:9"],
])
def test_filters_that_are_invalid_or_keep_nothing(tmp_path, args):
    err = _one_line(args, tmp_path, [tmp_path])
    assert "--include" in err or "--exclude" in err or "--layers" in err


@pytest.mark.parametrize("flag", ["--map", "--layout"])
def test_bad_regular_expressions_in_align(traces, flag):
    value = "(unclosed=x" if flag == "--map" else "(unclosed=transpose"
    _one_line(["align", traces / "ref.h5", traces / "ref.h5", flag, value], traces, [traces])


def test_outputs_that_cannot_be_written(traces, tmp_path):
    (tmp_path / "adir").mkdir()
    err = _one_line(["trace", "torch_llama", "-o", "adir"], tmp_path)
    assert "directory" in err
    _one_line(["trace", "torch_llama", "-o", "/proc/layerdiff.h5"], tmp_path)  # not writable, even for root
    _one_line(["align", traces / "ref.h5", traces / "fwd_only.h5", "--save-map", "/proc/map.txt"], tmp_path)
    _one_line(["align", traces / "ref.h5", traces / "fwd_only.h5", "--json", "/proc/r.json"], tmp_path)


def test_a_full_disk_while_tracing_keeps_a_readable_trace(tmp_path):
    def limit():  # a file-size limit: writes past it fail as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6 << 20, 6 << 20))

    proc = subprocess.run([sys.executable, "-m", "layerdiff", "trace", "torch_llama", "-o", "full.h5", "--arg",
                           "hidden=128", "--arg", "layers=4"], capture_output=True, text=True, cwd=tmp_path,
                          preexec_fn=limit, timeout=300)
    assert_one_line_error(proc)
    assert "failed" in proc.stderr and "readable" in proc.stderr
    code, out, err = run_cli("show", tmp_path / "full.h5")
    assert code == 0 and "records" in out, out + err


def test_a_truncated_trace_does_not_hang(traces, tmp_path):
    (tmp_path / "cut.h5").write_bytes((traces / "ref.h5").read_bytes()[:512])
    proc = subprocess.run([sys.executable, "-m", "layerdiff", "show", "cut.h5"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert_one_line_error(proc)
    assert "damaged" in proc.stderr or "truncated" in proc.stderr


def test_a_phase_recorded_on_one_side_only_is_not_a_pass(traces):
    code, out, err = run_cli("align", traces / "ref.h5", traces / "fwd_only.h5", "-q")
    assert code == 3, out + err
    assert out.startswith("aligned") and "backward was recorded in A only" in out


UNRELATED = """
import torch


class Net(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        if kind == "mlp":
            self.body = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
        else:
            self.body = torch.nn.Sequential(torch.nn.Conv1d(16, 16, 3, padding=1), torch.nn.GroupNorm(4, 16),
                                            torch.nn.Conv1d(16, 16, 3, padding=1), torch.nn.GroupNorm(4, 16))
        self.lm_head = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.body(x if self.kind == "mlp" else x.unsqueeze(-1).expand(-1, -1, 4)).reshape(x.shape[0], 16, -1)
        return self.lm_head(h.mean(-1) if h.dim() == 3 else h)


def build(kind="mlp"):
    torch.manual_seed(0)
    model = Net(kind)
    model.kind = kind
    x = torch.randn(2, 16)
    model.lm_head.weight.data.fill_(0.1)
    return model, lambda: model(x).sum().backward()
"""


def test_unrelated_models_sharing_a_module_name_are_refused(tmp_path):
    (tmp_path / "nets.py").write_text(UNRELATED)
    for kind in ("mlp", "conv"):
        code, _, err = run_cli("trace", "nets.py:build", "--arg", f"kind={kind}", "-o", f"{kind}.h5", "-q",
                               cwd=tmp_path)
        assert code == 0, err
    err = _one_line(["align", "mlp.h5", "conv.h5"], tmp_path)
    assert "different models" in err


ACTIVATIONS = """
import torch
from transformers.activations import GELUActivation, NewGELUActivation


def build(new=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), NewGELUActivation() if new else GELUActivation(),
                                torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    return model, lambda: model(x).sum().backward()
"""


def test_a_class_changed_within_its_family_is_shown_at_the_origin(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "acts.py").write_text(ACTIVATIONS)
    for new in ("False", "True"):
        code, _, err = run_cli("trace", "acts.py:build", "--arg", f"new={new}", "-o", f"{new}.h5", "-q",
                               cwd=tmp_path)
        assert code == 0, err
    code, out, err = run_cli("align", "False.h5", "True.h5", cwd=tmp_path)
    assert code == 1 and "origin: 1" in out, out + err
    assert "class: GELUActivation (A) vs NewGELUActivation (B), the same type family" in out
