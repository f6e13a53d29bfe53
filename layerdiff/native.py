"""The recording's compiled modules: which they are, and the check that runs their sources instead where those
changed since they were compiled.

Why compiled: with ``ops=True`` most of a trace's cost is layerdiff's own Python per record (hundreds of records a
step, a few microseconds each). Where mypyc and a C compiler are present at install, ``setup.py`` compiles
``NATIVE`` from their unchanged sources, and their calls and attribute reads become C's (``docs/limits.md`` gives
the figures). Nothing else changes: the sources are the code, and they run as they are where nothing was compiled.

Why the check: an install from a clone (``pip install -e .``) builds the compiled modules beside their sources, and
Python imports a compiled module before its source. Edited afterwards, a source would be shadowed by the stale
build. So the package's first import compares the sources with the digests the build wrote (``SOURCES_FILE``); where
one differs (or the build left no digests), every module of ``NATIVE`` is imported from its source (their compiled
code calls one another's directly: all or none), and one line on stderr says how to compile them again.

Standard library only: ``setup.py`` reads this file before anything is installed.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

NATIVE = ("capture.session", "capture.ops", "capture.hooks", "capture.structure", "tracefile.index", "tracefile.checksums",
          "tracefile.writer", "tracefile.tensors")  # under ``layerdiff``
SOURCES_FILE = "native.json"  # in the package: {module: sha256 of the source compiled}
PACKAGE = Path(__file__).resolve().parent


def source_digests(package: Path = PACKAGE) -> dict[str, str]:
    """The sha256 of each ``NATIVE`` source as it is now (keyed as ``SOURCES_FILE`` keys them)."""
    return {module: hashlib.sha256((package / f"{module.replace('.', '/')}.py").read_bytes()).hexdigest()
            for module in NATIVE}


def compiled(module: str, package: Path = PACKAGE) -> Optional[Path]:
    """The compiled module beside ``module``'s source, if one was built."""
    source = package / f"{module.replace('.', '/')}.py"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = source.with_name(source.stem + suffix)
        if built.exists():
            return built
    return None


def stale(package: Path = PACKAGE) -> list[str]:
    """The ``NATIVE`` modules whose compiled build must not run: a source changed since it was compiled, or a
    build without its digests (interrupted). Empty where none was compiled, or every one is current."""
    built = [module for module in NATIVE if compiled(module, package) is not None]
    if not built:
        return []
    try:
        recorded = json.loads((package / SOURCES_FILE).read_text())
        current = source_digests(package)
    except (OSError, ValueError):
        return built
    return [module for module in NATIVE if recorded.get(module) != current[module]]


class FromSources(importlib.abc.MetaPathFinder):
    """Finds the ``NATIVE`` modules at their sources (and nothing else)."""

    def __init__(self, package: Path):
        self.sources = {f"layerdiff.{m}": package / f"{m.replace('.', '/')}.py" for m in NATIVE}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: object = None):
        source = self.sources.get(fullname)
        return importlib.util.spec_from_file_location(fullname, source) if source is not None else None


def use_current_sources() -> bool:
    """Where a compiled module is stale (``stale``), or the environment says ``LAYERDIFF_NATIVE=0`` (to step
    through them in a debugger, or trace their lines), the ``NATIVE`` modules are imported from their sources from
    now on in this process; True if so. Called once, by the package's ``__init__``, before any of them is imported."""
    asked = os.environ.get("LAYERDIFF_NATIVE") == "0"
    changed = [] if asked else stale()
    if not asked and not changed:
        return False
    if not any(isinstance(finder, FromSources) for finder in sys.meta_path):
        sys.meta_path.insert(0, FromSources(PACKAGE))
        if changed:
            print(f"layerdiff: {', '.join(changed)} changed since compiled; running the sources "
                  f"(pip install -e . compiles them again)", file=sys.stderr)
    return True
