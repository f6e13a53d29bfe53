"""The CLI end to end: trace a TARGET, align with exit codes and the JSON contract, re-threshold, show."""
import json
import os

import pytest

pytest.importorskip("torch")

from layerdiff.report.jsonio import read_json  # noqa: E402
from layerdiff.recipes.torch_llama import DEFECTS  # noqa: E402

from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch]

USER_FILE = '''
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        self.norm = nn.LayerNorm(4, eps=EPS)

    def forward(self, x):
        return self.norm(self.body(x))

def make(eps=1e-5):
    global EPS
    EPS = eps
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 8)
    def step():
        net.zero_grad()
        net(x).pow(2).sum().backward()
    return net, step
'''


@pytest.fixture(scope="module")
def cli_traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    user = d / "mymodel.py"
    user.write_text(USER_FILE)
    for name, args in {"ref": [], "bad": ["--arg", "eps=0.1"]}.items():
        code, out, err = run_cli("trace", f"{user}:make", "-o", d / f"{name}.h5", *args)
        assert code == 0, err
        assert "records" in out
    code, _, err = run_cli("trace", "torch_llama", "-o", d / "llama_ref.h5", "--mode", "stats")
    assert code == 0, err
    code, _, err = run_cli("trace", "torch_llama", "-o", d / "llama_eps.h5", "--mode", "stats", "--arg", "defect=eps")
    assert code == 0, err
    return d


def test_align_exit_codes_and_json_contract(cli_traces):
    d = cli_traces
    import shutil

    shutil.copy(d / "ref.h5", d / "ref_copy.h5")
    code, out, err = run_cli("align", d / "ref.h5", d / "ref_copy.h5", "--json", d / "same.json")
    assert code == 0, err
    report = json.loads((d / "same.json").read_text())
    assert report["forward"]["first_divergence"] is None and report["backward"]["first_divergence"] is None
    assert report["trust"] == {"ok": True, "problems": []}
    # the same file twice: the runs trivially agree, which proves nothing: exit 3 with a warning
    code, out, err = run_cli("align", d / "ref.h5", d / "ref.h5")
    assert code == 3 and "WARNING: A and B are the same file" in out, out + err
    code, out, err = run_cli("align", d / "ref.h5", d / "bad.h5", "--json", d / "diff.json")
    assert code == 1, err
    report = json.loads((d / "diff.json").read_text())
    assert report["forward"]["first_divergence"]["module"] == "norm"
    assert report["forward"]["first_divergence"]["hparam_diff"] == {"eps": [1e-5, 0.1]}
    assert "origin: norm" in out and "eps: 1e-05 (A) vs 0.1 (B)" in out
    assert report["forward"]["failure"] is None


def test_user_file_target_records_its_modules(cli_traces):
    code, out, _ = run_cli("show", cli_traces / "ref.h5", "--records")
    assert code == 0
    for path in ("body.0", "body.1", "body.2", "norm"):
        assert path in out
    assert "framework: torch" in out and "status: complete" in out


def test_stats_traces_through_the_cli(cli_traces):
    d = cli_traces
    code, out, _ = run_cli("align", d / "llama_ref.h5", d / "llama_eps.h5", "-q")
    assert code == 1
    assert out.strip().startswith(f"divergent: forward {DEFECTS['eps'][1]}")
    code, out, _ = run_cli("align", d / "llama_ref.h5", d / "llama_eps.h5")
    assert "statistics only" in out


def test_report_rethresholds_without_traces(cli_traces, tmp_path):
    d = cli_traces
    code, _, _ = run_cli("align", d / "ref.h5", d / "bad.h5", "--json", tmp_path / "r.json")
    assert code == 1
    # loosen every tolerance: the same measurements now pass
    code, out, err = run_cli("report", tmp_path / "r.json", "--atol", "10", "--cos", "0", "--json", tmp_path / "r2.json")
    assert code == 0, err
    loose = read_json(tmp_path / "r2.json")
    assert loose["verdict"] == "aligned"
    strict = read_json(tmp_path / "r.json")
    assert [t["metrics"] for r in strict["records"] for t in r["tensors"]] == \
           [t["metrics"] for r in loose["records"] for t in r["tensors"]]
    # a per-module rule that only loosens `norm` moves the origin elsewhere or clears it
    code, out, _ = run_cli("report", tmp_path / "r.json", "--tol", "^norm$:atol=10,cos=0", "-q")
    assert "forward norm" not in out


def test_trace_target_failure_modes_exit_2(tmp_path):
    code, _, err = run_cli("trace", "no_such_recipe", "-o", tmp_path / "x.h5")
    assert code == 2 and err.count("\n") == 1 and "no_such_recipe" in err
    code, _, err = run_cli("trace", "torch_llama", "-o", tmp_path / "x.h5", "--arg", "defect=bogus")
    assert code == 2 and err.count("\n") == 1 and "ValueError" in err and "bogus" in err
    assert not (tmp_path / "x.h5").exists()


def test_demo_runs_and_names_the_defect():
    """The module first (its own code), bisect's confirmation, then the step the report proposes, taken: both runs
    traced again with that module's operations, and the operation and line where they part (the attention's
    scale, passed to sdpa at the line computed here from transformers' source)."""
    import inspect

    from transformers.integrations import sdpa_attention

    code, out, err = run_cli("demo", "--defect", "owncode")
    assert code == 0, err
    assert "own code between v_proj and o_proj" in out and "correct" in out
    assert "layerdiff bisect re-ran the candidate" in out and "confirmed, not inherited" in out
    lines = inspect.getsource(sdpa_attention).splitlines()
    call = next(number for number, line in enumerate(lines, start=1)
                if "torch.nn.functional.scaled_dot_product_attention(" in line)
    stepped = out[out.index("inside model.layers.1.self_attn, operation by operation"):]
    assert f"scaled_dot_product_attention at sdpa_attention.py:{call}" in " ".join(stepped.split())
    assert "argument kwargs.scale: 0.25 (A) vs 0.3125 (B)" in stepped


def test_align_works_without_any_framework_importable(cli_traces):
    """The aligner never imports a framework, nor Dask unless a scheduler is given: block them and align two torch
    traces; asked for a scheduler, it says in one line what to install."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('torch', 'paddle', 'mindspore', 'dask', 'distributed'):\n"
            "    sys.modules[name] = None\n"
            "from layerdiff.cli import main\n"
            f"traces = [r'{cli_traces / 'ref.h5'}', r'{cli_traces / 'bad.h5'}']\n"
            "assert main(['align', *traces, '-q', '--workers', '2']) == 1\n"
            "assert main(['align', *traces, '-q', '--scheduler', 'local']) == 2\n"
            "sys.exit(main(['align', *traces, '-q']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "LAYERDIFF_SCHEDULER": ""})
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("divergent: forward norm")
    assert proc.stderr == "layerdiff: error: --scheduler needs Dask: pip install 'layerdiff[dask]'\n"


def test_recipes_are_listed_with_their_defects():
    code, out, err = run_cli("recipes")
    assert code == 0, err
    for name in ("torch_llama ", "megatron_llama ", "mindformers_llama ", "torch_llama_tp ", "paddle_llama_tp "):
        assert name in out, out
    assert "--arg defect= eps, act, weight" in out


def test_show_lists_modules_in_the_order_they_ran(recipe_trace):
    code, out, err = run_cli("show", recipe_trace())
    assert code == 0, err
    tree = out[out.index("<root>"):]
    assert tree.index("model ") < tree.index("lm_head"), tree  # not alphabetical: model runs first


def test_a_second_candidate_gets_its_own_bisect_directory(tmp_path, monkeypatch):
    import json

    from layerdiff.replay.driver import default_workdir

    monkeypatch.chdir(tmp_path)
    first = {"target": "a", "args": {}}
    assert default_workdir(tmp_path / "ref.h5", first) == "ref.h5.bisect"
    (tmp_path / "ref.h5.bisect").mkdir()
    (tmp_path / "ref.h5.bisect" / "state.json").write_text(json.dumps({"command": first}))
    assert default_workdir(tmp_path / "ref.h5", first) == "ref.h5.bisect"  # the same command resumes
    other = default_workdir(tmp_path / "ref.h5", {"target": "b", "args": {}})
    assert other.startswith("ref.h5.bisect-") and other != default_workdir(tmp_path / "ref.h5", {"target": "c"})
