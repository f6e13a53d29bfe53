"""Crash safety: a trace killed with SIGKILL mid-run stays readable, and a model that raises closes its trace.

The killed runs are real subprocesses tracing a two-layer ``torch.nn.TransformerEncoder`` (attention, norms, MLPs)
in an endless loop, two at a time (module fixture). Not the transformers Llama of the recipes: importing
transformers cost each of the eight processes of this file 5 s of CPU, and what is tested here is the writer.
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
from layerdiff.tracefile.tensors import FLOAT_DTYPES, as_float
from layerdiff.tracefile.reader import open_trace

import conftest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch]

# One interpreter imports torch and layerdiff once, then forks each traced loop it is asked for (a line on its stdin:
# path, counter file, write-behind MB); it reports each child's end when asked ("reap PID"). Six interpreters each
# importing torch cost this file 25 s more of the suite's CPU.
LOOP_SCRIPT = '''
import mmap
import os
import struct
import sys
import threading
import time

import layerdiff
import torch


def loop(path, counter, write_behind):
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    built = {"model": model, "step": lambda: model(x).square().mean().backward()}
    tracer = layerdiff.trace(built["model"], path, write_behind=write_behind)
    with tracer, open(counter, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 8)
        writer = tracer.session.writer

        def publish():  # how many records the writer has put in the file, for the parent to read before killing
            while True:
                shared[:8] = struct.pack("q", writer.records_written)
                time.sleep(0.0002)

        threading.Thread(target=publish, daemon=True).start()
        print("started", os.getpid(), path, flush=True)
        while True:
            built["step"]()


print("ready", flush=True)
for line in sys.stdin:
    words = line.split()
    if words[0] == "reap":
        _, status = os.waitpid(int(words[1]), 0)
        print("ended", words[1], os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
        continue
    pid = os.fork()
    if pid == 0:  # the traced loop: never returns here
        try:
            loop(words[0], words[1], float(words[2]))
        finally:
            os._exit(1)
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
    code, out, err = conftest.run_cli(*args, cwd=cwd, env={"PYTHONDONTWRITEBYTECODE": "1"})
    return subprocess.CompletedProcess(["layerdiff", *map(str, args)], code, out, err)


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


def _check_tensors(reader) -> int:
    """Every tensor of every record reads back with its recorded shape, and its values match its statistics."""
    n = 0
    for rec in reader.records:
        for entry in rec.tensors:
            arr = reader.tensor(entry)
            assert list(arr.shape) == list(entry.shape), (rec.path, entry.key)
            stats = entry.stats
            if entry.dtype in FLOAT_DTYPES and arr.size and not (stats["nan"] or stats["inf"]):
                values = as_float(arr, entry.dtype)
                assert float(values.min()) == stats["min"], (rec.path, entry.key, "min")
                assert float(values.max()) == stats["max"], (rec.path, entry.key, "max")
            n += 1
    return n


def _assert_cli_ok(proc):
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, _describe(proc)
    assert proc.returncode == 0, _describe(proc)


KILLS = 6


class _Run:
    """A traced endless loop forked by ``zygote`` that publishes how many records it has written (an 8-byte counter
    in a shared file); ``kill`` reads the counter, then SIGKILLs: every record counted must be in the file."""

    def __init__(self, tmp: Path, name: str, write_behind: float, zygote):
        self.path = tmp / f"{name}.h5"
        self.counter = tmp / f"{name}.count"
        self.counter.write_bytes(b"\0" * 8)
        self.write_behind = write_behind
        self.zygote = zygote
        zygote.stdin.write(f"{self.path} {self.counter} {write_behind}\n".encode())
        zygote.stdin.flush()
        self.pid = None
        self.written_at_kill = None

    def kill(self):
        written = int.from_bytes(self.counter.read_bytes()[:8], "little", signed=True)
        os.kill(self.pid, signal.SIGKILL)
        self.zygote.stdin.write(f"reap {self.pid}\n".encode())
        self.zygote.stdin.flush()
        line = _wait_for_line(self.zygote, f"ended {self.pid} ".encode(), time.monotonic() + 30)
        assert int(line.split()[2]) == signal.SIGKILL, line
        self.written_at_kill = written


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Endless traced loops SIGKILLed at spread-out moments (two at a time: 2 cores); in each pair one writes
    behind the step (a 1 MB ring, so records are queued at the kill) and one writes inline."""
    tmp = tmp_path_factory.mktemp("crash")
    (tmp / "loop.py").write_text(LOOP_SCRIPT)
    delays = [0.05, 0.4, 0.9, 1.3, 1.8, 2.6][:KILLS]
    runs = []
    zygote = subprocess.Popen([sys.executable, str(tmp / "loop.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=_env(), bufsize=0)
    try:
        _wait_for_line(zygote, b"ready", time.monotonic() + 120)
        for first in range(0, KILLS, 2):
            batch = [_Run(tmp, f"run{i}", 1.0 if i % 2 == 0 else 0, zygote) for i in range(first, min(first + 2, KILLS))]
            runs += batch
            deadline = time.monotonic() + 120
            for _ in batch:  # in the order they started, not necessarily forked
                _, pid, path = _wait_for_line(zygote, b"started", deadline).split()
                next(r for r in batch if str(r.path) == path.decode()).pid = int(pid)
            started = time.monotonic()
            for run, delay in sorted(zip(batch, delays[first:first + 2]), key=lambda rd: rd[1]):
                time.sleep(max(0.0, started + delay - time.monotonic()))
                run.kill()
    finally:
        for run in runs:
            if run.pid is not None and run.written_at_kill is None:
                os.kill(run.pid, signal.SIGKILL)
        zygote.kill()
        zygote.wait()
        zygote.stdout.close()
        zygote.stderr.close()
        zygote.stdin.close()
    return runs


@pytest.mark.slow
def test_sigkill_loses_no_record_that_was_written(killed_runs):
    lost = []
    for run in killed_runs:
        with open_trace(run.path) as reader:
            assert reader.crashed and reader.end is None, run.path
            assert len(reader.records) >= run.written_at_kill, (run.path, len(reader.records), run.written_at_kill)
            lost.append(run.written_at_kill - len(reader.records))
            assert _check_tensors(reader) >= 0
            steps = {r.step for r in reader.records if r.kind == "call" and r.path == ""}
            assert steps == set(range(len(steps))), "whole steps, in order, up to the kill"
    print(f"records lost per kill (counted before the kill - in the file; write-behind ring MB): "
          f"{list(zip(lost, [run.write_behind for run in killed_runs]))}")
    assert all(n <= 0 for n in lost)
    assert sum(run.written_at_kill for run in killed_runs) > 0


@pytest.mark.slow
def test_a_killed_trace_shows_and_aligns_with_a_warning(killed_runs):
    # the shortest run that wrote records: the longest (thousands of records, 70 MB) took 13 s to align with itself
    run = min((r for r in killed_runs if r.written_at_kill > 0), key=lambda r: r.written_at_kill)
    size, mtime = run.path.stat().st_size, run.path.stat().st_mtime_ns
    proc = run_cli("show", run.path)
    _assert_cli_ok(proc)
    assert "interrupted" in proc.stdout, proc.stdout
    proc = run_cli("align", run.path, run.path, "-q")
    assert "Traceback" not in proc.stderr, _describe(proc)
    assert proc.returncode == 3 and proc.stdout.startswith("aligned"), _describe(proc)
    assert "is incomplete" in proc.stdout and "the same file" in proc.stdout, _describe(proc)
    assert (run.path.stat().st_size, run.path.stat().st_mtime_ns) == (size, mtime), "readers modified the trace"


RACE_SCRIPT = """
import os, sys, time
from pathlib import Path
import layerdiff
from layerdiff.errors import LayerdiffError
import torch

torch.manual_seed(0)
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
built = {"model": model, "step": lambda: model(x).square().mean().backward()}
barrier = Path(sys.argv[2])  # both start writing at the same moment, however long each took to get here
(barrier / str(os.getpid())).touch()
while len(list(barrier.iterdir())) < 2:
    time.sleep(0.001)
tried = Path(sys.argv[3])  # each says there that it has tried to open the trace; the one that got it holds it
# open until both have: on a loaded machine one writer had finished before the other tried, and both wrote


def wait_for_both():
    deadline = time.monotonic() + 120
    while len(list(tried.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)


try:
    with layerdiff.trace(built["model"], sys.argv[1], overwrite=True):
        (tried / str(os.getpid())).touch()
        wait_for_both()
        for _ in range(3):
            built["step"]()
except LayerdiffError as exc:
    (tried / str(os.getpid())).touch()
    print("refused:", exc)
    sys.exit(2)
print("wrote")
"""


@pytest.mark.slow
def test_two_writers_on_one_path_one_is_refused(tmp_path):
    (tmp_path / "race.py").write_text(RACE_SCRIPT)
    path = tmp_path / "shared.h5"
    (tmp_path / "ready").mkdir()  # the barrier: each writer says it is ready there, and waits for the other
    (tmp_path / "tried").mkdir()
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "race.py"), str(path), str(tmp_path / "ready"),
                               str(tmp_path / "tried")],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outputs
    refused = next(out for (out, _), p in zip(outputs, procs) if p.returncode == 2)
    assert "is being written by another process" in refused
    with open_trace(path) as reader:  # the winner's trace, whole
        assert reader.end.status == "complete" and reader.end.steps == 3


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
        assert reader.end.status == "error"
        failure = reader.end.failure
        assert failure["module"] == "2", failure
        assert "ValueError" in failure["error"] and "boom" in failure["error"]
        forward = {r.path: r for r in reader.records if r.kind == "call" and r.phase == "forward"}
        # the modules that ran before the failure are recorded, complete, with their real values
        for path_ in ("0", "1"):
            assert path_ in forward and not forward[path_].incomplete, sorted(forward)
        assert "3" not in forward, "a module after the failing one never ran"
        assert forward["2"].incomplete and "boom" in (forward["2"].error or "")
        out0 = [t for t in forward["0"].tensors if t.role == "output"]
        assert len(out0) == 1
        with torch.no_grad():
            expected = model[0](x).numpy()
        np.testing.assert_array_equal(reader.tensor(out0[0]), expected)
        out1 = [t for t in forward["1"].tensors if t.role == "output"]
        np.testing.assert_array_equal(reader.tensor(out1[0]), np.maximum(expected, 0))
        in2 = [t for t in forward["2"].tensors if t.role == "input"]
        assert in2, "the failing module's inputs are kept"
        np.testing.assert_array_equal(reader.tensor(in2[0]), np.maximum(expected, 0))
        assert not any(r.kind == "call" and r.phase == "backward" for r in reader.records)


def test_cli_trace_of_raising_model_exits_1_naming_the_module(tmp_path):
    (tmp_path / "raising.py").write_text(RAISING_TARGET)
    proc = run_cli("trace", "raising.py", "-o", "out.h5", cwd=tmp_path)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, _describe(proc)
    assert proc.returncode == 1, _describe(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerdiff"), _describe(proc)
    assert "ValueError" in lines[0] and "'2'" in lines[0], _describe(proc)
    with open_trace(tmp_path / "out.h5") as reader:
        assert reader.end.status == "error"
        assert reader.end.failure["module"] == "2"
        assert {"0", "1"} <= {r.path for r in reader.records if r.kind == "call"}
    proc = run_cli("show", "out.h5", cwd=tmp_path)
    _assert_cli_ok(proc)
    assert "failed in 2" in proc.stdout, proc.stdout
