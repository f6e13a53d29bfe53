"""Resolve a ``layerdiff trace`` TARGET and run it under the tracer.

Contract: TARGET names a function (``path/to/file.py:build``, ``package.module:build``, or a recipe name such
as ``torch_llama``) that takes keyword arguments (from ``--arg key=value``) and returns either
``(model, step)`` or a dict ``{"model": model, "step": step, "meta": {...}}``. ``step()`` runs one training or
inference step (forward, and backward if wanted); layerdiff calls it ``--steps`` times inside the trace.
The user's own model file is imported, never edited.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from .errors import LayerdiffError

DEFAULT_FUNCTION = "build"


def _parse_value(text: str):
    if any(c.isdigit() for c in text):  # "nan" and "inf" stay words
        for conv in (int, float):
            try:
                return conv(text)
            except ValueError:
                pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    return text


def parse_args(pairs) -> dict:
    out = {}
    for pair in pairs or ():
        key, eq, value = pair.partition("=")
        if not eq or not key.isidentifier():
            raise LayerdiffError(f"bad --arg {pair!r}: expected NAME=VALUE")
        out[key] = _parse_value(value)
    return out


def _load_file(path: Path):
    name = f"layerdiff_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LayerdiffError(f"{path}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))  # so the file's own sibling imports work
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resolve(target: str):
    """The callable a TARGET names."""
    location, colon, func_name = target.rpartition(":") if ":" in target else (target, "", DEFAULT_FUNCTION)
    func_name = func_name or DEFAULT_FUNCTION
    if location.endswith(".py") or "/" in location or "\\" in location:
        path = Path(location)
        if not path.is_file():
            raise LayerdiffError(f"{location}: no such file")
        module = _load_file(path)
    else:
        module = None
        for candidate in (f"layerdiff.recipes.{location}", location):
            try:
                module = importlib.import_module(candidate)
                break
            except ModuleNotFoundError as exc:
                if exc.name not in (candidate, candidate.rpartition(".")[0]):
                    raise
        if module is None:
            raise LayerdiffError(f"{location!r} is neither a file, a recipe (see recipes/) nor an importable module")
    func = getattr(module, func_name, None)
    if not callable(func):
        raise LayerdiffError(f"{target}: no function {func_name!r} in {getattr(module, '__file__', module)}")
    return func


def build(target: str, kwargs: dict):
    """Call the TARGET function; return (model, step, meta)."""
    func = resolve(target)
    try:
        built = func(**kwargs)
    except Exception as exc:  # the target could not even build its model: report it as bad input
        raise LayerdiffError(f"{target} raised {type(exc).__name__} while building: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if isinstance(built, dict):
        model, step, meta = built.get("model"), built.get("step"), built.get("meta", {})
    elif isinstance(built, (tuple, list)) and len(built) == 2:
        (model, step), meta = built, {}
    else:
        raise LayerdiffError(f"{target} must return (model, step) or {{'model': ..., 'step': ...}}, "
                             f"not {type(built).__name__}")
    if model is None or not callable(step):
        raise LayerdiffError(f"{target} must return a model and a callable step")
    return model, step, meta
