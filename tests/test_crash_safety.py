"""Crash safety: a trace killed with SIGKILL mid-run stays readable, and a model that raises closes its trace.

The killed runs are real subprocesses tracing the torch_llama recipe in an endless loop; both are started
at once (module fixture) so the slow imports overlap.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import layerdiff
from layerdiff.core.tensors import FLOAT_DTYPES, as_float
from layerdiff.core.traceformat import open_trace

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch]

LOOP_SCRIPT = '''
import sys

import layerdiff
from layerdiff.recipes import torch_llama

path, flush_interval = sys.argv[1], float(sys.argv[2])
built = torch_llama.build()
with layerdiff.trace(built["model"], path, flush_interval=flush_interval):
    print("started", flush=True)
    n = 0
    while True:
        built["step"]()
        n += 1
        print(f"step {n}", flush=True)
'''

RAISING_TARGET = '''
import torch


class Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom: forward refused")


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), Boom(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    return {"model": model, "step": lambda: model(x).sum().backward()}
'''


def _env():
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "layerdiff", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=_env())


def _describe(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def _wait_for_line(proc, prefix: bytes, deadline: float) -> bytes:
    """Read the child's stdout until a line starting with prefix (the child flushes whole lines)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {prefix!r} from the tracing subprocess")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read().decode(errors="replace")
            raise AssertionError(f"tracing subprocess exited ({proc.wait()}) before {prefix!r}:\n{err}")
        if line.startswith(prefix):
            return line


class _Run:
    def __init__(self, tmp: Path, name: str, flush_interval: float):
        self.path = tmp / f"{name}.h5"
        self.proc = subprocess.Popen([sys.executable, str(tmp / "loop.py"), str(self.path), str(flush_interval)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), bufsize=0)
        self.steps_done = 0

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def killed_traces(tmp_path_factory):
    """Two endless traced loops, SIGKILLed mid-run: one flushing after every record, one with the default."""
    tmp = tmp_path_factory.mktemp("crash")
    (tmp / "loop.py").write_text(LOOP_SCRIPT)
    every = _Run(tmp, "flush_every_record", 0)
    default = _Run(tmp, "flush_default", 1.0)
    runs = (every, default)
    try:
        deadline = time.monotonic() + 120
        for run in runs:
            _wait_for_line(run.proc, b"started", deadline)
        # flush_interval=0: wait until three whole steps are done (so they must all be on disk), then kill
        # a moment later, somewhere inside a later step
        line = _wait_for_line(every.proc, b"step 3", deadline)
        every.steps_done = int(line.split()[1])
        time.sleep(0.37)
        every.kill()
        # default flush interval: a few seconds of running, then kill at an arbitrary point
        _wait_for_line(default.proc, b"step 1", deadline)
        time.sleep(2.3)
        default.kill()
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
    return {"every": every, "default": default}


def _check_tensors(reader) -> int:
    """Every tensor of every record reads back with its recorded shape, and its values match its statistics."""
    n = 0
    for rec in reader.records:
        for entry in rec.get("tensors", ()):
            arr = reader.tensor(entry)
            assert list(arr.shape) == list(entry["shape"]), (rec["path"], entry["key"])
            stats = entry["stats"]
            if entry["dtype"] in FLOAT_DTYPES and arr.size and not (stats["nan"] or stats["inf"]):
                values = as_float(arr, entry["dtype"])
                assert float(values.min()) == stats["min"], (rec["path"], entry["key"], "min")
                assert float(values.max()) == stats["max"], (rec["path"], entry["key"], "max")
            n += 1
    return n


def _assert_cli_ok(proc):
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, _describe(proc)
    assert proc.returncode == 0, _describe(proc)


# ---------------------------------------------------------------------------------------------------------
# SIGKILL
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_with_flush_every_record_keeps_completed_steps(killed_traces):
    run = killed_traces["every"]
    assert run.path.is_file()
    with open_trace(run.path) as reader:
        assert reader.crashed, "a SIGKILLed trace must be reported as crashed/incomplete"
        assert reader.end is None
        assert len(reader.records) > 0
        # every step that finished before the kill was flushed record by record: its root forward call and
        # the parameter gradients it produced are all there
        root_forward = [r for r in reader.records if r["kind"] == "call" and r["phase"] == "forward"
                        and r["path"] == ""]
        assert len(root_forward) >= run.steps_done, (len(root_forward), run.steps_done)
        assert {r["step"] for r in root_forward} >= set(range(run.steps_done))
        steps_with_grads = {r["step"] for r in reader.records if r["kind"] == "param_grad"}
        assert steps_with_grads >= set(range(run.steps_done)), steps_with_grads
        assert _check_tensors(reader) > 0
    size, mtime = run.path.stat().st_size, run.path.stat().st_mtime_ns

    proc = run_cli("show", run.path)
    _assert_cli_ok(proc)
    assert "interrupted" in proc.stdout, proc.stdout
    proc = run_cli("align", run.path, run.path, "-q")
    _assert_cli_ok(proc)
    assert proc.stdout.startswith("aligned"), proc.stdout
    assert (run.path.stat().st_size, run.path.stat().st_mtime_ns) == (size, mtime), "readers modified the trace"


@pytest.mark.slow
def test_sigkill_with_default_flush_interval_opens(killed_traces):
    run = killed_traces["default"]
    assert run.path.is_file()
    with open_trace(run.path) as reader:  # possibly fewer records: only what the last flush made durable
        assert reader.crashed
        assert reader.end is None
        n_records = len(reader.records)
        _check_tensors(reader)
        assert reader.meta.get("framework") == "torch"
    proc = run_cli("show", run.path)
    _assert_cli_ok(proc)
    assert "interrupted" in proc.stdout, proc.stdout
    proc = run_cli("align", run.path, run.path, "-q")
    assert "Traceback" not in proc.stderr, _describe(proc)
    if n_records:
        assert proc.returncode == 0 and proc.stdout.startswith("aligned"), _describe(proc)
    else:  # nothing flushed yet: nothing to compare is bad input, not a crash
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, _describe(proc)


# ---------------------------------------------------------------------------------------------------------
# a model whose forward raises
# ---------------------------------------------------------------------------------------------------------
class Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom: forward refused")


def test_forward_raising_closes_the_trace_cleanly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), Boom(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    path = tmp_path / "raised.h5"
    with pytest.raises(ValueError, match="boom: forward refused"):
        with layerdiff.trace(model, path, flush_interval=60):
            model(x).sum().backward()

    # hooks are gone: the model runs untraced afterwards and the file is not touched
    mtime = path.stat().st_mtime_ns
    model[0](x)
    assert path.stat().st_mtime_ns == mtime

    with open_trace(path) as reader:
        assert not reader.crashed, "a run that raised is closed properly, not a crash"
        assert reader.end is not None
        assert reader.end["status"] == "error"
        failure = reader.end["failure"]
        assert failure["module"] == "2", failure
        assert "ValueError" in failure["error"] and "boom" in failure["error"]
        forward = {r["path"]: r for r in reader.records if r["kind"] == "call" and r["phase"] == "forward"}
        # the modules that ran before the failure are recorded, complete, with their real values
        for path_ in ("0", "1"):
            assert path_ in forward and not forward[path_].get("incomplete"), sorted(forward)
        assert "3" not in forward, "a module after the failing one never ran"
        assert forward["2"].get("incomplete") and "boom" in forward["2"].get("error", "")
        out0 = [t for t in forward["0"]["tensors"] if t["role"] == "output"]
        assert len(out0) == 1
        with torch.no_grad():
            expected = model[0](x).numpy()
        np.testing.assert_array_equal(reader.tensor(out0[0]), expected)
        out1 = [t for t in forward["1"]["tensors"] if t["role"] == "output"]
        np.testing.assert_array_equal(reader.tensor(out1[0]), np.maximum(expected, 0))
        in2 = [t for t in forward["2"]["tensors"] if t["role"] == "input"]
        assert in2, "the failing module's inputs are kept"
        np.testing.assert_array_equal(reader.tensor(in2[0]), np.maximum(expected, 0))
        assert not any(r["kind"] == "call" and r["phase"] == "backward" for r in reader.records)


def test_cli_trace_of_raising_model_exits_1_naming_the_module(tmp_path):
    (tmp_path / "raising.py").write_text(RAISING_TARGET)
    proc = run_cli("trace", "raising.py", "-o", "out.h5", cwd=tmp_path)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, _describe(proc)
    assert proc.returncode == 1, _describe(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerdiff"), _describe(proc)
    assert "ValueError" in lines[0] and "'2'" in lines[0], _describe(proc)
    with open_trace(tmp_path / "out.h5") as reader:
        assert reader.end["status"] == "error"
        assert reader.end["failure"]["module"] == "2"
        assert {"0", "1"} <= {r["path"] for r in reader.records if r["kind"] == "call"}
    proc = run_cli("show", "out.h5", cwd=tmp_path)
    _assert_cli_ok(proc)
    assert "failed in 2" in proc.stdout, proc.stdout
