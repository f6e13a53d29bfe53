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

from layerdiff.errors import LayerdiffError

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
    sys.modules[name] = module
    with _on_path(path.parent.resolve()):  # so the file's own sibling imports work
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise LayerdiffError(f"{path}: importing it raised {_where(exc)}") from None
    return module


def _where(exc: BaseException) -> str:
    """``SyntaxError: invalid syntax (line 3)``: the error and, for syntax errors, where."""
    text = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    if isinstance(exc, SyntaxError) and exc.lineno:
        text += f" (line {exc.lineno})"
    return text


class _on_path:
    """Put a directory first on ``sys.path`` while a target is imported, and take it off again."""

    def __init__(self, directory):
        self.directory = str(directory)

    def __enter__(self):
        self.added = self.directory not in sys.path
        if self.added:
            sys.path.insert(0, self.directory)

    def __exit__(self, *exc):
        if self.added and self.directory in sys.path:
            sys.path.remove(self.directory)


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
                with _on_path(Path.cwd()):  # package.module targets next to where the command runs
                    module = importlib.import_module(candidate)
                break
            except ModuleNotFoundError as exc:
                if exc.name not in (candidate, candidate.rpartition(".")[0]):
                    raise LayerdiffError(f"{location}: importing it raised {_where(exc)}") from None
            except Exception as exc:
                raise LayerdiffError(f"{location}: importing it raised {_where(exc)}") from None
        if module is None:
            raise LayerdiffError(f"{location!r} is neither a file, a recipe (see recipes/) nor an importable module")
        if getattr(module, "__file__", None) is None and Path(location).is_dir():  # a folder read as a package
            raise LayerdiffError(f"{location!r} is a directory (a run of traces?), not code to run: give a target as "
                                 "file.py:function, module:function or a recipe")
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
