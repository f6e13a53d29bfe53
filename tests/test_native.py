"""The recording's compiled modules (``layerdiff/native.py``): built where the statistics kernel is (both need a C
compiler), run only while they are what their sources say, and never in place of an edited source."""
from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerdiff import native
from layerdiff.tracefile import tensors

ROOT = Path(__file__).resolve().parent.parent
NAMES = [f"layerdiff.{m}" for m in native.NATIVE]
SHOW = "import importlib, sys; print(' '.join(importlib.import_module(n).__file__ for n in sys.argv[1:]))"


def _files(env: dict | None = None) -> list[str]:
    """Where each ``NATIVE`` module is imported from, in a fresh interpreter (layerdiff's ``__init__`` first)."""
    done = subprocess.run([sys.executable, "-c", "import layerdiff; " + SHOW, *NAMES], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.skipif(tensors.one_pass_moments is None, reason="no C compiler at install: nothing was compiled")
def test_an_install_with_a_compiler_runs_the_compiled_modules_and_they_are_current():
    assert native.stale() == [], "pip install -e . compiles them again"
    assert all(not f.endswith(".py") for f in _files()), _files()


def test_layerdiff_native_0_runs_every_module_from_its_source():
    files = _files({"LAYERDIFF_NATIVE": "0"})
    assert files == [str(ROOT / "layerdiff" / f"{m.replace('.', '/')}.py") for m in native.NATIVE]


def _package(tmp_path: Path) -> Path:
    """A copy of the compiled modules' sources, each with a compiled module beside it (an empty file: ``stale``
    looks at names and digests only) and the digests a build writes."""
    package = tmp_path / "layerdiff"
    for module in native.NATIVE:
        source = Path(module.replace(".", "/") + ".py")
        (package / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "layerdiff" / source, package / source)
        (package / source).with_suffix(importlib.machinery.EXTENSION_SUFFIXES[0]).write_bytes(b"")
    (package / native.SOURCES_FILE).write_text(json.dumps(native.source_digests(package)))
    return package


def test_a_changed_source_makes_every_compiled_module_stale_and_a_build_without_digests_too(tmp_path):
    package = _package(tmp_path)
    assert native.stale(package) == []
    writer = package / "tracefile" / "writer.py"
    writer.write_text(writer.read_text() + "\n# edited\n")
    assert native.stale(package) == ["tracefile.writer"]
    (package / native.SOURCES_FILE).unlink()  # a build cut short: compiled modules, no digests
    assert native.stale(package) == list(native.NATIVE)
    for built in package.rglob("*.so"):
        built.unlink()
    assert native.stale(package) == []  # nothing compiled: nothing to be stale


def test_the_sources_are_found_by_the_finder_it_installs(tmp_path):
    finder = native.FromSources(_package(tmp_path))
    spec = finder.find_spec("layerdiff.capture.session")
    assert spec is not None and spec.origin == str(tmp_path / "layerdiff" / "capture" / "session.py")
    assert finder.find_spec("layerdiff.capture.filters") is None  # not compiled: found as usual


@pytest.mark.torch
def test_what_an_adapter_overrides_holds_in_the_compiled_hooks(tmp_path):
    """A compiled class calls its own static methods and reads its own class attributes directly unless they are
    declared overridable: torch's ``Hooks`` must still decide what is differentiable (a gradient recorded) and say
    its own consequence of an input modified in place."""
    torch = pytest.importorskip("torch")
    import layerdiff
    from layerdiff.tracefile.reader import open_trace

    class Sneaky(torch.nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x * 3

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Sneaky())
    with layerdiff.trace(model, tmp_path / "t.h5"):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    with open_trace(tmp_path / "t.h5") as trace:
        assert trace.end is not None
        assert ["1 modifies its input in place: input gradients of its first call may be misattributed; its later "
                "calls record no grad_input"] == trace.end.warnings
        assert any(r.phase == "backward" and r.path == "0" for r in trace.records)


@pytest.mark.slow
def test_a_build_whose_compiler_fails_still_succeeds_and_leaves_the_sources_to_run(tmp_path):
    """No C compiler (``CC`` a command that fails): the build goes on, with neither the kernel nor the compiled
    modules nor their digests, so nothing stale can shadow a source."""
    pytest.importorskip("mypyc")
    if not (ROOT / "setup.py").exists():
        pytest.skip("layerdiff is not installed from its sources")
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "temp")], cwd=ROOT,
                           env={**os.environ, "CC": "false", "LAYERDIFF_NATIVE": "1"}, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "the recording's modules were not compiled" in build.stdout
    assert not list((tmp_path / "lib").rglob("*.so")) and not list((tmp_path / "lib").rglob(native.SOURCES_FILE))
