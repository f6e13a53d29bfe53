"""Shared fixtures: real traces of the torch_llama recipe, made once per session and cached by arguments."""
from __future__ import annotations

import subprocess
import sys

import pytest

try:  # in one process mindspore must be imported before paddle (their oneDNN builds clash the other way)
    import mindspore  # noqa: F401
except ImportError:
    pass

import layerdiff
from layerdiff.core.traceformat import open_trace


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


@pytest.fixture(scope="session")
def align_paths():
    from layerdiff.core.align import align

    def run(a, b, **kwargs):
        with open_trace(a) as ra, open_trace(b) as rb:
            return align(ra, rb, **kwargs)

    return run


def run_cli(*args, cwd=None, timeout=300):
    """The real CLI in a subprocess: (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "layerdiff", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr
