"""Operations in frameworks that have no public hook for every call (PaddlePaddle, MindSpore): their public API
functions, Tensor methods and operators, named in one list per framework (``adapters/api_lists.py``), are wrapped
while a trace is open and restored on exit, exceptions included. Their private internals are never touched.

A wrapped function asks ``OpCapture.recording()`` first (one attribute check when no module records its
operations), then hands the call to ``OpCapture.run``, which records it; what a recorded call runs inside is part of
it (``run`` suppresses nested calls), so a framework function built of others is one operation."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from layerdiff.capture.ops import OpCapture, OpName, kind_of


@dataclass(frozen=True)
class Api:
    """One public callable to wrap: ``owner.attribute`` (a module's function or a class's method), recorded as
    ``name`` or, where the operation depends on the instance or class (a MindSpore Primitive's ``__call__``, a
    custom autograd layer's ``apply``), as ``named(args)``. ``per_class``: a class method that subclasses inherit
    (``PyLayer.apply``): the wrapper receives the class first. ``several_steps``: one call is several steps of
    the autograd graph (a custom autograd layer), so its inputs are tapped for their gradients. ``applies``: which
    calls are operations at all (a MindSpore ``Cell.__call__`` only for cells with a hand-written ``bprop``)."""

    owner: Any
    attribute: str
    name: OpName | None
    named: Callable[[tuple], OpName] | None = None
    per_class: bool = False
    several_steps: bool = False
    applies: Callable[[tuple], bool] | None = None  # None: every call; else the calls it says are operations


def op_from(prefix: str, attribute: str, kind: str | None = None) -> OpName:
    """``paddle.matmul`` / ``Tensor.__mul__`` with its framework-neutral kind (``kind`` overrides where the
    framework's word means another operation: Paddle's ``transpose`` takes a permutation)."""
    derived, in_place = kind_of(attribute)
    return OpName(f"{prefix}.{attribute}", kind or derived, in_place)


def resolve(lists: Mapping[str, Sequence[str]], kinds: Mapping[str, str],
            tensor_class: tuple[str, Any] | None = None) -> list[Api]:
    """The Apis of a framework's list: ``{"paddle": ["matmul", ...], "paddle.nn.functional": [...]}`` (modules,
    imported here: the framework's own adapter calls this), ``tensor_class``: (the list's key for Tensor methods,
    the class). ``kinds``: "module.attribute" -> kind where the name misleads. Names missing from the installed
    version are skipped; a callable reached under two names is wrapped under each (nested calls are not
    recorded twice)."""
    apis: list[Api] = []
    for where, names in lists.items():
        if tensor_class is not None and where == tensor_class[0]:
            owner, prefix = tensor_class[1], "Tensor"
        else:
            owner, prefix = importlib.import_module(where), where
        for attribute in names:
            if not callable(getattr(owner, attribute, None)):
                continue
            apis.append(Api(owner, attribute, op_from(prefix, attribute, kinds.get(f"{where}.{attribute}"))))
    return apis


def _wrapper(original: Any, api: Api, capture: OpCapture) -> Callable[..., Any]:
    several, applies = api.several_steps, api.applies
    fixed = api.name
    if api.named is not None:
        name_of: Callable[[tuple], OpName] = api.named
    elif fixed is not None:
        name_of = lambda args: fixed  # noqa: E731
    else:
        raise ValueError(f"{api.attribute}: an Api needs a name or a way to name its calls")
    if api.per_class:
        def method(cls: Any, *args: Any, **kwargs: Any) -> Any:
            bound = original.__get__(None, cls)
            if not capture.recording():
                return bound(*args, **kwargs)
            return capture.run(bound, name_of((cls, *args)), args, kwargs, sys._getframe(1),
                               several_steps=several)

        return method

    def call(*args: Any, **kwargs: Any) -> Any:
        if not capture.recording() or (applies is not None and not applies(args)):
            return original(*args, **kwargs)
        return capture.run(original, name_of(args), args, kwargs, sys._getframe(1), several_steps=several)

    call.__name__ = getattr(original, "__name__", api.attribute)
    call.__qualname__ = getattr(original, "__qualname__", api.attribute)
    call.__doc__ = getattr(original, "__doc__", None)
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def wrapped(capture: OpCapture, apis: Sequence[Api]) -> Iterator[None]:
    """Every Api wrapped while open; on exit (an exception included) each attribute is what it was: the same
    object where the owner held it, or removed where the owner inherited it."""
    undo: list[tuple[Any, str, Any]] = []
    try:
        for api in apis:
            own = vars(api.owner).get(api.attribute, _INHERITED)
            if api.per_class:  # the descriptor itself, bound to each caller's class at the call
                descriptor = inspect.getattr_static(api.owner, api.attribute)
                setattr(api.owner, api.attribute, classmethod(_wrapper(descriptor, api, capture)))
            else:
                call = _wrapper(getattr(api.owner, api.attribute), api, capture)
                setattr(api.owner, api.attribute, staticmethod(call) if isinstance(own, staticmethod) else call)
            undo.append((api.owner, api.attribute, own))
        yield
    finally:
        for owner, attribute, own in reversed(undo):
            if own is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)


_INHERITED = object()  # the owner had no attribute of its own: restoring removes the wrapper
