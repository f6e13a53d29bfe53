"""Shared fixtures: real traces of the torch_llama recipe, made once per session and cached by arguments."""
from __future__ import annotations

import atexit
import compileall
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# One OpenMP thread per framework process: the suite runs two workers on two cores, and each spawns more processes
# (ranks, CLI runs, other frameworks); with a thread per core each, their OpenMP threads spin against each other
# for the same cores (measured on 2 cores: the whole suite 7m49s with one, 8m50s to 9m49s without). Set before any
# framework loads OpenMP; inherited by the workers and every process they start; a value given outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MindSpore's PyNative ops launched blocking, each run before the next is queued (``mindspore.runtime.
# launch_blocking``, read from this variable by its runtime): on these 2-core machines its default asynchronous launch
# made the mindspore_llama recipe's step 10x slower (0.55 s against 0.045; traced 1.0 s against 0.08), a quarter of
# the suite's CPU time. Every MindSpore process the suite starts inherits it; one run is made asynchronous on
# purpose (``tests/adapters/test_mindspore.py``: it aligns with a blocking one). A value given outside is kept.
os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")

try:  # in one process mindspore must be imported before paddle (their oneDNN builds clash the other way)
    import mindspore  # noqa: F401
except ImportError:
    pass

import layerdiff

# layerdiff's bytecode, compiled once here: the suite starts hundreds of Python processes that import it (CLI runs,
# ranks, other frameworks), and where the environment sets PYTHONDONTWRITEBYTECODE none of them may write it, so each
# compiled its sources anew (0.16 s of a bad-input CLI run's 0.47). Third-party packages got theirs at install.
# Idempotent and safe to race (files are written atomically), so every xdist worker may run it.
compileall.compile_dir(os.path.dirname(layerdiff.__file__), quiet=1)

from layerdiff.tracefile import tensors as _tensors  # noqa: E402

# tests of the C statistics kernel (``fastmoments.c``): skipped, with the reason shown, in an install without it
needs_kernel = pytest.mark.skipif(_tensors.moments_at is None, reason="the C statistics kernel is not built in this "
                                  "install (no C compiler at install time)")

# markers (registered in pyproject.toml) -> the module that must be installed; files that need a framework
# throughout also call pytest.importorskip at module level, this covers single marked tests
FRAMEWORK_MODULES = {"torch": "torch", "paddle": "paddle", "mindspore": "mindspore", "megatron": "megatron.core"}


@functools.lru_cache(maxsize=None)
def _installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def skip_unless_installed(module: str) -> None:
    """At a test file's top: skip the file where ``module`` is not installed, without importing it. For files whose
    tests run that framework only in processes they start: each worker collects every file, and importing
    Megatron-core there cost 3 s of CPU per worker for nothing."""
    if not _installed(module):
        pytest.skip(f"{module} is not installed", allow_module_level=True)


# The files that take longest (their fixtures build real models and launch ranks), longest first, as measured: the
# two test workers take whole files (``--dist loadfile``) in collection order (``--no-loadscope-reorder``: not by
# their number of tests), so these start first and the last files to run are short ones, not a minute-long one on
# one worker while the other waits. Other files keep their order after these.
LONGEST_FIRST = ("tests/runs/test_megatron_parallel.py", "tests/runs/test_ranks_other_stacks.py",
                 "tests/runs/test_distributed.py", "tests/runs/test_torch_parallel.py", "tests/test_layers.py",
                 "tests/match/test_ports.py", "tests/replay/test_bisect_frameworks.py",
                 "tests/adapters/test_mindspore.py", "tests/tracefile/test_crash_safety.py",
                 "tests/match/test_crossframework.py", "tests/judge/test_cross_framework_ops.py",
                 "tests/tracefile/test_kill_points.py", "tests/checkpoints/test_dist_checkpoint.py",
                 "tests/capture/test_compiled.py", "tests/match/test_megatron_models.py",
                 "tests/checkpoints/test_paddleformers_moe_weights.py", "tests/replay/test_bisect.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: the rest in order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark, module in FRAMEWORK_MODULES.items():
        if item.get_closest_marker(mark) is not None and not _installed(module):
            pytest.skip(f"{mark} is not installed ({module} not importable)")


@pytest.fixture(scope="session")
def recipe_trace(tmp_path_factory):
    """recipe_trace(defect=None, mode="full", steps=1, **build_kwargs) -> path of a trace of the recipe."""
    from layerdiff.recipes import torch_llama

    cache = {}
    root = tmp_path_factory.mktemp("recipe_traces")

    def make(defect=None, mode="full", steps=1, **kwargs):
        key = (defect, mode, steps, tuple(sorted(kwargs.items())))
        if key not in cache:
            path = root / f"trace{len(cache)}_{defect}_{mode}.h5"
            built = torch_llama.build(defect, **kwargs)
            with layerdiff.trace(built["model"], path, mode=mode):
                for _ in range(steps):
                    built["step"]()
            cache[key] = path
        return cache[key]

    return make


def marked_line(path, marker: str) -> int:
    """The number of the one line of ``path`` that ends in ``# <marker>``: tests compute a planted defect's line from
    the source, never write it as a literal."""
    lines = [i + 1 for i, text in enumerate(Path(path).read_text().splitlines())
             if re.search(rf"# {re.escape(marker)}\s*$", text)]
    assert len(lines) == 1, (path, marker, lines)
    return lines[0]


def align_files(a, b, how=None, **kwargs):
    """``layerdiff.judge.evaluate.align`` on two trace paths (``how``: a ``Comparison``, its ``workers`` too)."""
    from layerdiff.judge.evaluate import align
    from layerdiff.runs.ranks import open_run

    with open_run(a) as ra, open_run(b) as rb:
        return align(ra, rb, how, **kwargs)


@pytest.fixture(scope="session")
def align_paths():
    return align_files


def launch(root, name: str, code: str, launcher: list[str], warm: bool = True) -> None:
    """Write ``code`` to ``root/NAME.py`` and run it under ``python -m LAUNCHER`` (torchrun, paddle's launch, msrun)
    with ``root`` as its argument; the launch must succeed.

    A torchrun launch of torch-only code (``--standalone --nproc-per-node N``) runs its N ranks as children forked
    from a warm interpreter, each given the environment torchrun gives a rank (``_torchrun_environment``): real
    processes on real gloo ranks, without importing torch, transformers and Megatron-core again in each (7 s of CPU
    a rank, a fifth of the suite's). ``warm=False``: through torchrun itself."""
    import textwrap

    script = root / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    ranks = _standalone_ranks(launcher)
    if warm and ranks and _torch_only_code(code) and _WARM_SCRIPTS.usable():
        port = _free_port()
        procs = [{"script": str(script), "args": [str(root)], "cwd": str(root),
                  "env": {**os.environ, **_torchrun_environment(rank, ranks, port)}} for rank in range(ranks)]
        failures = _WARM_SCRIPTS.run_procs(procs, timeout=600)
        if failures is not None:
            assert not failures, f"{name}:\n" + "\n".join(failures)
            return
    proc = subprocess.run([sys.executable, "-m", *launcher, str(script), str(root)], capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _standalone_ranks(launcher: list[str]) -> int | None:
    """N of a ``torch.distributed.run --standalone --nproc-per-node N`` launcher (None for any other)."""
    if len(launcher) == 4 and launcher[:3] == ["torch.distributed.run", "--standalone", "--nproc-per-node"] and \
            launcher[3].isdigit():
        return int(launcher[3])
    return None


def _torchrun_environment(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun (``--standalone``, one node) sets in the environment of each rank it starts."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(ranks),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": f"layerdiff-tests-{port}", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torch_only_code(code: str) -> bool:
    """Whether a script names no framework other than torch (those start bare: see ``_OTHER_FRAMEWORKS``)."""
    return not any(name in code.lower() for name in _OTHER_FRAMEWORKS)


def run_scripts(root, scripts: dict, timeout=300):
    """Run {name: python source} side by side, each in its own interpreter with ``root`` as argv[1]
    (one framework per process: imports are slow, and some frameworks must not share a process). Torch-only
    scripts are forked from a warm interpreter (see ``launch``); the others start bare, first."""
    import textwrap

    procs, warm = [], []
    for name, code in scripts.items():
        path = root / f"make_{name}.py"
        path.write_text(textwrap.dedent(code))
        if _torch_only_code(code) and _WARM_SCRIPTS.usable():
            warm.append((name, {"script": str(path), "args": [str(root)], "cwd": str(Path.cwd()),
                                "env": dict(os.environ)}))
            continue
        procs.append((name, _start_script(path, root)))
    if warm:
        failures = _WARM_SCRIPTS.run_procs([entry for _, entry in warm], timeout=timeout)
        if failures is None:  # the warm interpreter is gone: these start bare
            procs += [(name, _start_script(Path(entry["script"]), root)) for name, entry in warm]
        else:
            assert not failures, "script failed:\n" + "\n".join(failures)
    for name, proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name} script failed:\n{stdout}\n{stderr[-4000:]}"


def _start_script(path: Path, root) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(path), str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def run_cli(*args, cwd=None, timeout=300, env: dict[str, str] | None = None):
    """The real CLI in a process of its own: (returncode, stdout, stderr). A run that imports no framework but
    torch (or none: ``FRAMEWORK_FREE``) is forked from a warm interpreter (``cli_zygote.py``: torch and
    transformers imported once per test worker); any other runs in a fresh ``python -m layerdiff``. ``env``: the
    variables that run is given besides the test's own (of those Python reads at start, only
    ``PYTHONDONTWRITEBYTECODE`` can be given to a forked run)."""
    argv = [str(a) for a in args]
    extra = env or {}
    forkable = all(k == "PYTHONDONTWRITEBYTECODE" or not k.startswith("PYTHON") for k in extra)
    if forkable and (argv[:1] in FRAMEWORK_FREE or _torch_only(argv, cwd)) and _WARM.usable():
        done = _WARM.run(argv, cwd, timeout, extra)
        if done is not None:
            return done
    proc = subprocess.run([sys.executable, "-m", "layerdiff", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, **extra})
    return proc.returncode, proc.stdout, proc.stderr


# commands that import no framework whatever their arguments name (a trace of a Paddle run, a folder called mindspore)
FRAMEWORK_FREE = (["align"], ["show"], ["report"])


# several CLI runs in one fresh interpreter, one after the other: ``main`` once per run, each run's exit code and
# output written as JSON to the file named second; the first that fails stops the rest where asked (third)
_CLI_RUNS = """
import contextlib
import io
import json
import sys

from layerdiff.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    results.append((code or 0, out.getvalue(), err.getvalue()))
    if code and sys.argv[3] == "stop":
        break
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def run_cli_each(*runs: list, timeout=600) -> list[tuple[int, str, str]]:
    """The real CLI's runs (each a list of arguments) in one fresh interpreter, in order: (returncode, stdout,
    stderr) of each. For runs of one framework other than torch, whose import alone is seconds (MindSpore's ~5 s):
    it is imported once for them all."""
    return _cli_runs(runs, stop=False, timeout=timeout)[0]


def run_cli_runs(*runs: list, timeout=600) -> tuple[int, str, str]:
    """``run_cli_each``, stopping at the first run that fails: (returncode, stdout, stderr) of them together."""
    results, proc = _cli_runs(runs, stop=True, timeout=timeout)
    failed = next((r for r in results if r[0]), None)
    return (failed[0] if failed else 0, "".join(r[1] for r in results),
            "".join(r[2] for r in results) + proc.stderr)


def _cli_runs(runs: tuple, stop: bool, timeout: float) -> tuple[list, subprocess.CompletedProcess]:
    """[(returncode, stdout, stderr)] of each run made, and the interpreter's own process."""
    argvs = [[str(a) for a in run] for run in runs]
    with tempfile.TemporaryDirectory() as scratch:
        results = Path(scratch) / "results.json"
        proc = subprocess.run([sys.executable, "-c", _CLI_RUNS, json.dumps(argvs), str(results),
                               "stop" if stop else "all"], capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and results.exists(), f"the CLI runs' interpreter died:\n{proc.stderr[-4000:]}"
        return [tuple(r) for r in json.loads(results.read_text())], proc


# the other frameworks, as their recipes, flags and scripts name them: such runs must start bare (mindspore before
# paddle in one process; neither after a torch-only warm start is known to be safe)
_OTHER_FRAMEWORKS = ("paddle", "mindspore", "mindformers", "msrun")


def _torch_only(argv: list[str], cwd) -> bool:
    """Whether a CLI run names no framework other than torch: in its arguments, or in a script it is given."""
    for arg in argv:
        if any(name in arg.lower() for name in _OTHER_FRAMEWORKS):
            return False
        script = arg.split(":", 1)[0]
        if script.endswith(".py"):
            path = Path(cwd or ".") / script
            try:
                text = path.read_text(errors="replace").lower()
            except OSError:
                continue
            if any(name in text for name in _OTHER_FRAMEWORKS):
                return False
    return True


def _startup_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}


class _WarmInterpreter:
    """One ``cli_zygote.py`` per test process, started at its first use and stopped at exit. ``preload``: the
    modules it imports besides torch and transformers' Llama, those that are installed."""

    def __init__(self, preload: tuple[str, ...] = ()):
        self.proc: subprocess.Popen | None = None
        self.failed = not _installed("torch") or not _installed("transformers")
        self.startup = _startup_environment()
        self.preload = preload

    def usable(self) -> bool:
        """Started, or startable; not where a variable the interpreter reads at start (``PYTHONPATH``,
        ``PYTHONDONTWRITEBYTECODE``, ...) changed since: a forked child would not see the change."""
        if _startup_environment() != self.startup:
            return False
        if self.proc is None and not self.failed:
            preload = [m for m in self.preload if _installed(m.partition(".")[0])]  # no parent imported here
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py")),
                                          *(["--preload", *preload] if preload else [])],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
            if self.proc.stdout.readline().strip() != "ready":
                self.proc.kill()
                self.proc, self.failed = None, True
            else:
                atexit.register(self.proc.kill)
        return self.proc is not None

    def run(self, argv: list[str], cwd, timeout: float, env: dict[str, str] | None = None
            ) -> tuple[int, str, str] | None:
        with tempfile.TemporaryDirectory(prefix="layerdiff-cli-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            request = {"argv": argv, "cwd": str(Path(cwd or ".").resolve()), "env": {**os.environ, **(env or {})},
                       "stdout": str(out), "stderr": str(err)}
            codes = self._ask({"procs": [request], "timeout": timeout}, ["layerdiff", *argv])
            if codes is None:
                return None
            return codes[0], out.read_text(errors="replace"), err.read_text(errors="replace")

    def run_procs(self, procs: list[dict], timeout: float) -> list[str] | None:
        """Scripts forked at once ({script, args, cwd, env} each) and waited for together: for each that failed, a
        line and its output's tail ([]: none failed); None when the warm interpreter is gone (start them bare)."""
        with tempfile.TemporaryDirectory(prefix="layerdiff-scripts-") as d:
            entries = [{**p, "stdout": str(Path(d) / f"{i}.out"), "stderr": str(Path(d) / f"{i}.err")}
                       for i, p in enumerate(procs)]
            codes = self._ask({"procs": entries, "timeout": timeout}, [p["script"] for p in procs])
            if codes is None:
                return None
            return [f"{Path(e['script']).name} (child {i}) exit {code}:\n{Path(e['stdout']).read_text()[-2000:]}\n"
                    f"{Path(e['stderr']).read_text(errors='replace')[-3000:]}"
                    for i, (e, code) in enumerate(zip(entries, codes)) if code != 0]

    def _ask(self, request: dict, command: list[str]) -> list[int] | None:
        """One request to the warm interpreter: its children's exit codes; None when it is gone (what was asked,
        and what is asked next, starts fresh)."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:  # a broken pipe
            line = ""
        if not line:
            self.proc, self.failed = None, True
            return None
        reply = json.loads(line)
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(command, request["timeout"])
        return reply["codes"]


_WARM = _WarmInterpreter()
# scripts and ranks (``launch``, ``run_scripts``): Megatron-core imported too, once
_WARM_SCRIPTS = _WarmInterpreter(preload=("torch.distributed", "transformers.models.mixtral.modeling_mixtral",
                                          "transformers.models.qwen2.modeling_qwen2", "megatron.core",
                                          "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
                                          "megatron.core.pipeline_parallel", "megatron.core.distributed"))


class NumpyTensors:
    """The session's view of tensors (``capture.session.TensorAccess``) for numpy float32 arrays: what a
    framework-free test hands a ``TraceSession`` in place of a framework adapter. ``placements``: id -> placement."""

    gradients_keep_identity = True

    def __init__(self, placements=None):
        self.placements = placements or {}

    def to_stored(self, a):
        return a, "float32"

    def identify(self, a):
        return None

    def fast_stats(self, a):
        return None

    def deferral(self):
        return None

    def describe(self, a):
        return "float32", list(a.shape)

    def placement(self, a):
        return self.placements.get(id(a))
