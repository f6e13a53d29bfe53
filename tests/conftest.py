"""Shared fixtures: real traces of the torch_llama recipe, made once per session and cached by arguments."""
from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:  # in one process mindspore must be imported before paddle (their oneDNN builds clash the other way)
    import mindspore  # noqa: F401
except ImportError:
    pass

import layerdiff

# markers (registered in pyproject.toml) -> the module that must be installed; files that need a framework
# throughout also call pytest.importorskip at module level, this covers single marked tests
FRAMEWORK_MODULES = {"torch": "torch", "paddle": "paddle", "mindspore": "mindspore", "megatron": "megatron.core"}


@functools.lru_cache(maxsize=None)
def _installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


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


def launch(root, name: str, code: str, launcher: list[str]) -> None:
    """Write ``code`` to ``root/NAME.py`` and run it under ``python -m LAUNCHER`` (torchrun, paddle's launch, msrun)
    with ``root`` as its argument; the launch must succeed."""
    import textwrap

    script = root / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run([sys.executable, "-m", *launcher, str(script), str(root)], capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def run_scripts(root, scripts: dict, timeout=300):
    """Run {name: python source} side by side, each in its own interpreter with ``root`` as argv[1]
    (one framework per process: imports are slow, and some frameworks must not share a process)."""
    import textwrap

    procs = []
    for name, code in scripts.items():
        path = root / f"make_{name}.py"
        path.write_text(textwrap.dedent(code))
        procs.append((name, subprocess.Popen([sys.executable, str(path), str(root)], stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)))
    for name, proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name} script failed:\n{stdout}\n{stderr[-4000:]}"


def run_cli(*args, cwd=None, timeout=300):
    """The real CLI in a subprocess: (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "layerdiff", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


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
