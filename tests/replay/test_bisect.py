"""layerdiff bisect on PyTorch: replay confirms each injected defect as the module's OWN error, separates own from
inherited error, localizes a crash; the binary search over 8 decoder layers takes log2(8) splice runs; an
interrupted bisect resumes. (Other frameworks: test_bisect_frameworks.py.)"""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torch")

from conftest import run_cli  # noqa: E402
from layerdiff.replay import driver as bisect  # noqa: E402
from layerdiff.compare.spec import Comparison  # noqa: E402
from layerdiff.recipes.torch_llama import DEFECTS  # noqa: E402

pytestmark = [pytest.mark.torch]


def replay(reference, tmp_path, **kwargs):
    workdir = bisect.Workdir(tmp_path / "work", {"test": kwargs})
    return bisect.replay(reference, "torch_llama", kwargs, workdir, Comparison())


def search(reference, tmp_path, **kwargs):
    workdir = bisect.Workdir(tmp_path / "work", {"test": kwargs})
    return bisect.search(reference, "torch_llama", kwargs, workdir, Comparison())


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_replay_confirms_the_origin_of_every_defect(recipe_trace, tmp_path, defect):
    direction, module = DEFECTS[defect]
    result = replay(recipe_trace(), tmp_path, defect=defect)
    culprit = result[direction]["culprit"]
    assert culprit is not None and culprit["module"] == module, result[direction]["segments"]
    assert result["confirms"][direction] is True
    assert result["verdict"] == "own_error"
    # every own error, forward and backward, lies in the defect's own module: nothing downstream is blamed
    for phase in ("forward", "backward"):
        assert {s["module"] for s in result[phase]["segments"]} <= {module}, result[phase]["segments"]
    if direction == "backward":
        assert result["forward"]["segments"] == []


def test_replay_of_an_honest_reimplementation_finds_no_own_error(recipe_trace, tmp_path):
    result = replay(recipe_trace(), tmp_path, defect="reimpl")
    assert result["verdict"] == "clean"
    assert result["forward"]["segments"] == [] and result["backward"]["segments"] == []
    assert result["forcing"]["forced_tensors"] > 100 and result["forcing"]["not_forced"] == []


def test_inherited_divergence_shows_no_own_error_but_its_amplification(recipe_trace, tmp_path):
    result = replay(recipe_trace(), tmp_path, defect="eps")
    modules = {m["module"]: m for m in result["modules"]}
    origin = modules[DEFECTS["eps"][1]]
    assert origin["own_error"] and origin["own_rel"] > 1e-3
    for path in ("model.layers.1.mlp", "model.layers.1.mlp.down_proj", "model.norm", "lm_head"):
        m = modules[path]
        assert m["out_rel"] > 1e-4, m  # the free run differs here...
        assert not m["own_error"] and m["own_rel"] < 1e-6, m  # ...but only by what it was given
        assert 0.1 < m["amplification"] < 100
    assert math.isinf(origin["amplification"])  # exact inputs, differing outputs


def test_an_own_code_error_is_its_modules_own_in_the_amplification_table(recipe_trace, tmp_path):
    """A defect in self_attn's own code shows on o_proj's input under replay, and self_attn's output (o_proj's,
    forced to the reference's) agrees: the table said 'own (replay) 0' beside '<- own error'. The module's own
    error is its segment's."""
    result = replay(recipe_trace(), tmp_path, defect="owncode")
    segment = result["forward"]["culprit"]
    assert segment["where"] == "own_code" and segment["module"] == DEFECTS["owncode"][1]
    own = {m["module"]: m for m in result["modules"]}[segment["module"]]
    assert own["own_error"] and own["own_rel"] == segment["rel_error"] > 1e-3, own
    assert [m["module"] for m in result["modules"] if m["own_error"]] == [segment["module"]]


def test_crash_is_localized_and_reproduced_on_the_reference_inputs(recipe_trace, tmp_path):
    result = replay(recipe_trace(), tmp_path, defect="crash")
    culprit = result["forward"]["culprit"]
    assert culprit["where"] == "raised" and culprit["module"] == "model.layers.1.mlp.down_proj"
    assert "mat1 and mat2 shapes cannot be multiplied" in culprit["error"]
    assert result["align"]["forward"]["where"] == "raised"  # align on the crashed free run says the same
    assert result["runs"]["free"]["raised"].startswith("RuntimeError")
    assert [s["module"] for s in result["forward"]["segments"]] == ["model.layers.1.mlp.down_proj"]  # not its callers


@pytest.mark.parametrize("defect, layer", [("eps", 5), ("act", 0), ("owncode", 7), ("residual", 2)])
def test_binary_search_finds_the_block_in_log2_n_runs(recipe_trace, tmp_path, defect, layer):
    result = search(recipe_trace(layers=8), tmp_path, layers=8, defect=defect, defect_layer=layer)
    assert result["block"] == f"model.layers.{layer}"
    assert len(result["blocks"]) == 8
    assert result["splice_runs"] == 3 == result["expected_runs"]
    assert len(result["runs"]) == 4  # the baseline plus log2(8)
    assert result["runs"][0]["spliced"] is None and not result["runs"][0]["last_output_ok"]


def test_binary_search_of_a_clean_candidate_stops_after_the_baseline(recipe_trace, tmp_path):
    result = search(recipe_trace(layers=8), tmp_path, layers=8)
    assert result["answer"]["where"] == "none" and result["splice_runs"] == 0 and result["verdict"] == "aligned"


@pytest.mark.slow
def test_cli_bisect_resumes_an_interrupted_run_and_refuses_another_command(recipe_trace, tmp_path):
    ref, work = recipe_trace(), tmp_path / "w"
    args = ["bisect", ref, "torch_llama", "--arg", "defect=owncode", "--workdir", work]
    code, out, err = run_cli(*args, "--json", tmp_path / "r1.json")
    assert code == 1, err
    assert "own code between v_proj and o_proj" in out and "confirms align's origin" in out
    assert "run 1: free run" in err and "run 2: replay" in err
    # interrupted after the free run: the state file lists only it
    state = json.loads((work / "state.json").read_text())
    del state["runs"]["replay"]
    (work / "state.json").write_text(json.dumps(state))
    code, out, err = run_cli(*args, "--json", tmp_path / "r2.json")
    assert code == 1, err
    assert "free run of torch_llama: reused" in err and "run 1: replay" in err
    first, second = (json.loads((tmp_path / f"r{i}.json").read_text()) for i in (1, 2))
    assert first["forward"]["segments"] == second["forward"]["segments"]
    # the same work directory for another command is refused, and nothing in it is touched
    before = (work / "state.json").read_text()
    code, _, err = run_cli("bisect", ref, "torch_llama", "--arg", "defect=eps", "--workdir", work)
    assert code == 2 and "holds a bisect of another command" in err and "Traceback" not in err
    assert (work / "state.json").read_text() == before


@pytest.mark.slow
def test_cli_search_quiet_line_and_resume(recipe_trace, tmp_path):
    ref = recipe_trace(layers=8)
    args = ["bisect", ref, "torch_llama", "--search", "--arg", "layers=8", "--arg", "defect=eps",
            "--arg", "defect_layer=3", "--workdir", tmp_path / "w", "-q"]
    code, out, _ = run_cli(*args)
    assert code == 1 and out.startswith("divergent: model.layers.3:") and "(3 splice runs)" in out
    code, out2, err = run_cli(*args[:-1])  # not quiet: progress lines on stderr say every run was reused
    assert code == 1 and err.count("reused") == 4 and "A's input spliced into model.layers.3" in out2


@pytest.mark.slow
def test_bad_bisect_input_is_one_line_and_creates_nothing(recipe_trace, tmp_path):
    cases = [
        ([tmp_path / "missing.h5", "torch_llama"], "no such file"),
        ([recipe_trace(mode="stats"), "torch_llama"], "traced in stats mode"),
        ([recipe_trace(), "no_such_recipe"], "neither a file"),
        ([recipe_trace(), "torch_llama", "--blocks", "model.layers"], "--blocks goes with --search"),
        ([recipe_trace(), "torch_llama", "--arg", "bad"], "bad --arg"),
        ([recipe_trace(), "torch_llama", "--json", tmp_path / "nodir" / "r.json"], "does not exist"),
    ]
    for args, message in cases:
        code, out, err = run_cli("bisect", *args, "--workdir", tmp_path / "w")
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / "w").exists()
    (tmp_path / "afile").write_text("keep me")
    code, _, err = run_cli("bisect", recipe_trace(), "torch_llama", "--workdir", tmp_path / "afile")
    assert code == 2 and "cannot use" in err and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "keep me"


def _run(spliced, last_ok, first_ok=True, final_ok=None):
    return {"spliced": spliced, "first_input_ok": first_ok, "last_output_ok": last_ok,
            "final_ok": last_ok if final_ok is None else final_ok}


def test_search_decisions_before_inside_and_after_the_blocks():
    from layerdiff.replay.search import next_splice

    assert next_splice(8, [_run(None, True)])[1]["where"] == "none"
    assert next_splice(8, [_run(None, True, final_ok=False)])[1]["where"] == "after"  # the head, not a block
    base = _run(None, False)
    assert next_splice(8, [base]) == (4, None)
    assert next_splice(8, [base, _run(4, True)]) == (2, None)
    assert next_splice(8, [base, _run(4, True), _run(2, False)]) == (3, None)
    assert next_splice(8, [base, _run(4, True), _run(2, False), _run(3, True)])[1] == \
        {"where": "block", "block": 2, "description": "block 2 is the first whose output does not recover"}
    # the candidate's input to the first block already differs: block 0 is tested on A's input first
    early = _run(None, False, first_ok=False)
    assert next_splice(8, [early]) == (0, None)
    assert next_splice(8, [early, _run(0, True)])[1]["where"] == "before"
    assert next_splice(8, [early, _run(0, False)]) == (4, None)


SLOW_SECOND_BUILD = '''
import os, time
from pathlib import Path
import torch

def build():
    counter = Path(os.environ["BUILD_COUNTER"])
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n == 2:
        time.sleep(120)  # the replay run's build: the test kills bisect here
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)

    def step():
        net.zero_grad()
        net(x).pow(2).sum().backward()
    return net, step
'''


@pytest.mark.slow
def test_bisect_killed_mid_run_resumes_from_its_state_file(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    target = tmp_path / "model.py"
    target.write_text(SLOW_SECOND_BUILD)
    env = {**os.environ, "BUILD_COUNTER": str(tmp_path / "ref_counter")}
    cli = [sys.executable, "-m", "layerdiff"]
    subprocess.run([*cli, "trace", f"{target}:build", "-o", tmp_path / "ref.h5", "-q"], env=env, check=True)
    env["BUILD_COUNTER"] = str(tmp_path / "counter")
    args = [*cli, "bisect", tmp_path / "ref.h5", f"{target}:build", "--workdir", tmp_path / "w", "-q"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    counter = tmp_path / "counter"
    while not (counter.exists() and counter.read_text() == "2"):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # killed while building the candidate for the replay run
    proc.communicate()
    state = json.loads((tmp_path / "w" / "state.json").read_text())
    assert list(state["runs"]) == ["free"]
    done = subprocess.run(args[:-1], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # the same model: no own error
    assert "free run of" in done.stderr and "reused" in done.stderr and "run 1: replay" in done.stderr
    assert counter.read_text() == "3"  # one new build: the replay run only
    assert "no own error" in done.stdout


RENAMED_PORT = '''
import torch
from torch import nn

class Ref(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.head = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.fc2(self.act(self.fc1(x))))

class Port(nn.Module):  # every module renamed; the bug is in the model's own code, between two of them
    def __init__(self, bug):
        super().__init__()
        self.dense_in, self.gelu = nn.Linear(16, 32), nn.GELU()
        self.dense_mid, self.out = nn.Linear(32, 32), nn.Linear(32, 4)
        self.bug = bug

    def forward(self, x):
        h = self.dense_mid(self.gelu(self.dense_in(x)))
        return self.out(h * 1.001 if self.bug else h)

def _run(net):
    torch.manual_seed(1)
    x = torch.randn(8, 16)

    def step():
        net.zero_grad()
        net(x).pow(2).sum().backward()
    return net, step

def ref():
    torch.manual_seed(0)
    return _run(Ref())

def port(bug=False):
    torch.manual_seed(0)
    return _run(Port(bug))
'''


@pytest.mark.slow
def test_replay_follows_the_inferred_mapping_of_renamed_modules(tmp_path):
    (tmp_path / "m.py").write_text(RENAMED_PORT)
    assert run_cli("trace", f"{tmp_path / 'm.py'}:ref", "-o", tmp_path / "a.h5", "-q")[0] == 0
    for bug, code_expected in ((True, 1), (False, 0)):
        code, _, err = run_cli("bisect", tmp_path / "a.h5", f"{tmp_path / 'm.py'}:port", "--arg", f"bug={bug}",
                               "--workdir", tmp_path / f"w{bug}", "--json", tmp_path / f"{bug}.json", "-q")
        assert code == code_expected, err
        result = json.loads((tmp_path / f"{bug}.json").read_text())
        assert result["forcing"]["forced_tensors"] >= 16  # every renamed module was fed A's values
        if bug:
            culprit = result["forward"]["culprit"]
            assert culprit["description"] == "<root>, own code between fc2 and head"  # in A's names
            assert result["confirms"]["forward"] is True
