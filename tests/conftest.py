"""Shared fixtures: real traces of the torch_llama recipe, made once per session and cached by arguments."""
from __future__ import annotations

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


def skip_unless_installed(*modules: str) -> None:
    """At a test file's top: skip the file where one of ``modules`` is not installed, without importing it. For
    files whose tests run those frameworks only in processes they start: each worker collects every file, and
    importing Megatron-core there cost 3 s of CPU per worker for nothing."""
    for module in modules:
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
                 "tests/tracefile/test_kill_points.py", "tests/tracefile/test_kill_before_writes.py",
                 "tests/checkpoints/test_dist_checkpoint.py",
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
    a rank, a fifth of the suite's). ``warm=False``: through torchrun itself (``tests/runs/test_distributed.py``
    keeps one such launch)."""
    import textwrap

    script = root / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    ranks = _standalone_ranks(launcher)
    if warm and ranks and _framework_of_code(code) == "torch" and _WARM["torch"].usable():
        port = free_port()
        procs = [{"script": str(script), "args": [str(root)], "cwd": str(root),
                  "env": {**os.environ, **_torchrun_environment(rank, ranks, port)}} for rank in range(ranks)]
        failures = _WARM["torch"].ask_procs(procs, timeout=600)()
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a launch's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_scripts(root, scripts: dict, timeout=300):
    """Run {name: python source} side by side, each in its own interpreter with ``root`` as argv[1]
    (one framework per process: imports are slow, and some frameworks must not share a process). Each is forked
    from the warm interpreter of the framework it names (see ``launch``; ``_framework_of_code`` says which start
    bare)."""
    import textwrap

    fresh, warm = [], {}
    for name, code in scripts.items():
        path = root / f"make_{name}.py"
        path.write_text(textwrap.dedent(code))
        kind = _framework_of_code(code)
        if kind is not None and _WARM[kind].usable():
            warm.setdefault(kind, []).append((name, {"script": str(path), "args": [str(root)], "cwd": str(Path.cwd()),
                                                    "env": dict(os.environ)}))
            continue
        fresh.append((name, _start_script(path, root)))
    asked = [(entries, _WARM[kind].ask_procs([entry for _, entry in entries], timeout))
             for kind, entries in warm.items()]  # all asked at once: the frameworks' scripts run side by side
    for entries, pending in asked:
        failures = pending()
        if failures is None:  # the warm interpreter is gone: these start bare
            fresh += [(name, _start_script(Path(entry["script"]), root)) for name, entry in entries]
        else:
            assert not failures, "script failed:\n" + "\n".join(failures)
    for name, proc in fresh:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name} script failed:\n{stdout}\n{stderr[-4000:]}"


def _start_script(path: Path, root) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(path), str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def run_cli(*args, cwd=None, timeout=300, env: dict[str, str] | None = None):
    """The real CLI in a process of its own: (returncode, stdout, stderr). The run is forked from the warm
    interpreter of the framework it names (``_framework_of_run``: torch where it names none, and for
    ``FRAMEWORK_FREE`` commands); one that names two runs in a fresh ``python -m layerdiff``. ``env``: the variables
    that run is given besides the test's own (of those Python reads at start, only ``PYTHONDONTWRITEBYTECODE`` can be
    given to a forked run)."""
    argv = [str(a) for a in args]
    kind = "torch" if argv[:1] in FRAMEWORK_FREE else _framework_of_run(argv, cwd)
    return _forked_or_fresh(kind, {"argv": argv}, [sys.executable, "-m", "layerdiff", *argv], cwd, timeout, env)


def run_python(code: str, *args, cwd=None, timeout=300, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` in a process of its own, forked from the warm interpreter of the framework the code
    and its arguments name (``_framework_of_code``, as ``run_scripts``). ``env`` as ``run_cli``'s."""
    argv = [str(a) for a in args]
    command = [sys.executable, "-c", code, *argv]
    done = _forked_or_fresh(_framework_of_code(code, argv), {"code": code, "args": argv}, command, cwd, timeout, env)
    return subprocess.CompletedProcess(command, *done)


def _forked_or_fresh(kind: str | None, entry: dict, command: list[str], cwd, timeout: float,
                     env: dict[str, str] | None) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of one process: forked from ``kind``'s warm interpreter as ``entry`` asks
    (``_WarmInterpreter.run``), or ``command`` run fresh where it cannot be (no kind, a variable Python reads at
    start given in ``env``, the interpreter gone)."""
    extra = env or {}
    forkable = all(k == "PYTHONDONTWRITEBYTECODE" or not k.startswith("PYTHON") for k in extra)
    if forkable and kind is not None and _WARM[kind].usable():
        done = _WARM[kind].run({**entry, "cwd": str(Path(cwd or ".").resolve()), "env": {**os.environ, **extra}},
                               timeout, command)
        if done is not None:
            return done
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, **extra})
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
    """The real CLI's runs (each a list of arguments) in one interpreter of their own, in order: (returncode,
    stdout, stderr) of each (``run_python``: forked from the warm interpreter of the framework they name)."""
    return _cli_runs(runs, stop=False, timeout=timeout)[0]


def run_cli_runs(*runs: list, timeout=600) -> tuple[int, str, str]:
    """``run_cli_each``, stopping at the first run that fails: (returncode, stdout, stderr) of them together."""
    results, stderr = _cli_runs(runs, stop=True, timeout=timeout)
    failed = next((r for r in results if r[0]), None)
    return (failed[0] if failed else 0, "".join(r[1] for r in results), "".join(r[2] for r in results) + stderr)


def _cli_runs(runs: tuple, stop: bool, timeout: float) -> tuple[list, str]:
    """[(returncode, stdout, stderr)] of each run made, and what the interpreter itself wrote on stderr."""
    argvs = [[str(a) for a in run] for run in runs]
    with tempfile.TemporaryDirectory() as scratch:
        results = Path(scratch) / "results.json"
        args = [json.dumps(argvs), str(results), "stop" if stop else "all"]
        proc = run_python(_CLI_RUNS, *args, timeout=timeout)
        assert proc.returncode == 0 and results.exists(), f"the CLI runs' interpreter died:\n{proc.stderr[-4000:]}"
        return [tuple(r) for r in json.loads(results.read_text())], proc.stderr


# the frameworks other than torch, by the words their recipes, flags and scripts use; a run naming two starts bare
# (mindspore must be imported before paddle in one process), and so does one naming a launcher
_FRAMEWORK_WORDS = {"paddle": ("paddle",), "mindspore": ("mindspore", "mindformers")}
_LAUNCHER_WORDS = ("msrun",)


def _framework_of(texts: list[str]) -> str | None:
    """The warm interpreter a process whose arguments or code are ``texts`` can be forked from: the one framework
    other than torch they name, else torch; None (start it bare) where they name two, or a launcher."""
    lowered = "\n".join(texts).lower()
    if any(word in lowered for word in _LAUNCHER_WORDS):
        return None
    named = [kind for kind, words in _FRAMEWORK_WORDS.items() if any(word in lowered for word in words)]
    return None if len(named) > 1 else (named[0] if named else "torch")


def _framework_of_code(code: str, args: list[str] = ()) -> str | None:
    """``_framework_of`` code to run (and its arguments), but None (start it bare) for code that blocks imports
    (``sys.modules[name] = None``: it must run where nothing was imported yet), and for Paddle or MindSpore code that
    touches ``os.environ`` (they read variables as they are imported)."""
    kind = _framework_of([code, *args])
    if "sys.modules[" in code or kind != "torch" and "os.environ" in code:
        return None
    return kind


def _framework_of_run(argv: list[str], cwd) -> str | None:
    """``_framework_of`` a CLI run: its arguments, and the scripts (``FILE.py`` or ``FILE.py:NAME``) they name."""
    texts = list(argv)
    for arg in argv:
        script = arg.split(":", 1)[0]
        if script.endswith(".py"):
            try:
                texts.append((Path(cwd or ".") / script).read_text(errors="replace"))
            except OSError:
                continue
    return _framework_of(texts)


def _startup_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}


class _WarmInterpreter:
    """A ``cli_zygote.py`` importing ``modules`` (those installed), shared by the session's test workers: the first
    to need it starts it, under a lock, and each connects to its socket. It exits with the session."""

    def __init__(self, kind: str, modules: tuple[str, ...]):
        self.kind, self.modules = kind, modules
        self.stream = None
        self.failed = not _installed(kind)
        self.startup = _startup_environment()

    def usable(self) -> bool:
        """Connected, or connectable; not where a variable the interpreter reads at start (``PYTHONPATH``,
        ``PYTHONDONTWRITEBYTECODE``, ...) changed since: a forked child would not see the change."""
        if _startup_environment() != self.startup:
            return False
        if self.stream is None and not self.failed:
            self._connect()
        return self.stream is not None

    def _connect(self) -> None:
        import fcntl
        import socket

        run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
        owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()  # xdist's controller
        folder = Path(tempfile.gettempdir()) / f"layerdiff-warm-{run}"
        folder.mkdir(exist_ok=True)
        path, failed = folder / f"{self.kind}.sock", folder / f"{self.kind}.failed"
        with open(folder / f"{self.kind}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists() and not failed.exists():
                modules = [m for m in self.modules if _installed(m.partition(".")[0])]  # no parent imported here
                proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py")), str(path),
                                         str(owner), *modules], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
                if proc.stdout.readline().strip() != "ready":
                    proc.kill()
                    failed.touch()
                proc.stdout.close()
            if failed.exists():
                self.failed = True
                return
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(path))
            self.stream = conn.makefile("rw")

    def run(self, entry: dict, timeout: float, command: list[str]) -> tuple[int, str, str] | None:
        """One process: a CLI run ({argv}) or ``python -c`` ({code, args}), with its cwd and env: (returncode,
        stdout, stderr); None when the interpreter is gone (start it bare). ``command``: what it stands for."""
        with tempfile.TemporaryDirectory(prefix="layerdiff-run-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            codes = self._ask([{**entry, "stdout": str(out), "stderr": str(err)}], timeout, command)()
            if codes is None:
                return None
            return codes[0], out.read_text(errors="replace"), err.read_text(errors="replace")

    def ask_procs(self, procs: list[dict], timeout: float):
        """Scripts forked at once ({script, args, cwd, env} each); returns the wait for them: for each that failed,
        a line and its output's tail ([]: none failed), or None when the interpreter is gone (start them bare)."""
        folder = tempfile.TemporaryDirectory(prefix="layerdiff-scripts-")
        entries = [{**p, "stdout": f"{folder.name}/{i}.out", "stderr": f"{folder.name}/{i}.err"}
                   for i, p in enumerate(procs)]
        pending = self._ask(entries, timeout, [p["script"] for p in procs])

        def wait() -> list[str] | None:
            with folder:
                codes = pending()
                if codes is None:
                    return None
                return [f"{Path(e['script']).name} (child {i}) exit {code}:\n{Path(e['stdout']).read_text()[-2000:]}"
                        f"\n{Path(e['stderr']).read_text(errors='replace')[-3000:]}"
                        for i, (e, code) in enumerate(zip(entries, codes)) if code != 0]
        return wait

    def _ask(self, procs: list[dict], timeout: float, command: list[str]):
        """Send one request; returns the wait for its reply: the children's exit codes, or None when the
        interpreter is gone (what was asked, and what is asked next, starts bare)."""
        try:
            self.stream.write(json.dumps({"procs": procs, "timeout": timeout}) + "\n")
            self.stream.flush()
        except OSError:  # a broken pipe
            self.stream, self.failed = None, True

        def reply() -> list[int] | None:
            try:
                line = self.stream.readline() if self.stream is not None else ""
            except OSError:
                line = ""
            if not line:
                self.stream, self.failed = None, True
                return None
            answer = json.loads(line)
            if answer.get("timeout"):
                raise subprocess.TimeoutExpired(command, timeout)
            return answer["codes"]
        return reply


# the warm interpreters, one per framework: what each imports (never computes with) before it forks
_WARM = {
    "torch": _WarmInterpreter("torch", (
        "torch", "torch.distributed", "transformers.models.llama.modeling_llama",
        "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2.modeling_qwen2", "megatron.core",
        "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.pipeline_parallel",
        "megatron.core.distributed", "layerdiff.adapters.torch_adapter", "layerdiff.adapters.torch_ops",
        "layerdiff.recipes.torch_llama")),
    "paddle": _WarmInterpreter("paddle", ("paddle", "layerdiff.adapters.paddle_adapter",
                                          "layerdiff.adapters.paddle_ops", "layerdiff.recipes.paddle_llama")),
    "mindspore": _WarmInterpreter("mindspore", ("mindspore", "layerdiff.adapters.mindspore_adapter",
                                                "layerdiff.adapters.mindspore_ops",
                                                "layerdiff.recipes.mindspore_llama")),
}


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
