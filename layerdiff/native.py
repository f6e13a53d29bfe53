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

NATIVE = ("capture.session", "capture.ops", "capture.hooks", "capture.structure", "tracefile.index",
          "tracefile.checksums", "tracefile.writer", "tracefile.tensors")  # under ``layerdiff``
SOURCES_FILE = "native.json"  # in the package: {module: sha256 of the source compiled}
PACKAGE = Path(__file__).resolve().parent
ASKED = "LAYERDIFF_NATIVE=0"  # ``why_sources``: the environment asks for the sources
NOT_COMPILED = "not compiled"  # ``why_sources``: nothing was compiled (no mypyc or no compiler at install)


def source(module: str, package: Path = PACKAGE) -> Path:
    """The source file of a ``NATIVE`` module (``capture.session`` -> ``<package>/capture/session.py``)."""
    return package / f"{module.replace('.', '/')}.py"


def source_digests(package: Path = PACKAGE) -> dict[str, str]:
    """The sha256 of each ``NATIVE`` source as it is now (keyed as ``SOURCES_FILE`` keys them)."""
    return {module: hashlib.sha256(source(module, package).read_bytes()).hexdigest() for module in NATIVE}


def compiled(module: str, package: Path = PACKAGE) -> Optional[Path]:
    """The compiled module beside ``module``'s source, if one was built."""
    path = source(module, package)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = path.with_name(path.stem + suffix)
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


def why_sources(package: Path = PACKAGE) -> Optional[str]:
    """Why this process runs the ``NATIVE`` modules from their sources (``ASKED``, ``NOT_COMPILED``, or the
    modules changed since they were compiled); None where it runs them compiled."""
    if os.environ.get("LAYERDIFF_NATIVE") == "0":
        return ASKED
    changed = stale(package)
    if changed:
        return f"{', '.join(changed)} changed since compiled"
    return NOT_COMPILED if all(compiled(m, package) is None for m in NATIVE) else None


class FromSources(importlib.abc.MetaPathFinder):
    """Finds the ``NATIVE`` modules at their sources (and nothing else)."""

    def __init__(self, package: Path):
        self.sources = {f"layerdiff.{m}": source(m, package) for m in NATIVE}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: object = None):
        found = self.sources.get(fullname)
        return importlib.util.spec_from_file_location(fullname, found) if found is not None else None


def use_current_sources() -> bool:
    """Where a compiled module is stale (``stale``), or the environment says ``LAYERDIFF_NATIVE=0`` (to step
    through them in a debugger, or trace their lines), the ``NATIVE`` modules are imported from their sources from
    now on in this process; True if so. Called once, by the package's ``__init__``, before any of them is imported."""
    why = why_sources()
    if why is None or why == NOT_COMPILED:  # the compiled modules, or the sources as Python finds them anyway
        return False
    if not any(isinstance(finder, FromSources) for finder in sys.meta_path):
        sys.meta_path.insert(0, FromSources(PACKAGE))
        if why != ASKED:
            print(f"layerdiff: {why}; running the sources (pip install -e . compiles them again)", file=sys.stderr)
    return True
