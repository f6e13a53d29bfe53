"""Several modules traced as one model: ``layerdiff.trace([part0, part1], path)``.

Why: a pipeline schedule that runs several stages on one rank (interleaved 1F1B, looped BFS: torchtitan's
``model_parts``) holds each stage as a module of its own, each keeping the whole model's module names. Their calls
go to one trace per rank; each record says which stage ran it (``stage``, learned from the schedule), and reading
the run splits the rank's trace into its stages (``runs.stages``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


@dataclass(frozen=True)
class ModelParts:
    """The modules of one model that one process traces together, in the order given (``parts``: two or more)."""

    parts: tuple[Any, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError("ModelParts holds two modules or more")


def model_parts(model: Any) -> Any:
    """``model`` as traced: a list or tuple of modules becomes ``ModelParts`` (one module: that module itself)."""
    if isinstance(model, (list, tuple)):
        if not model:
            raise ValueError("no module to trace: the list of model parts is empty")
        return ModelParts(tuple(model)) if len(model) > 1 else model[0]
    return model


def parts_of(model: Any) -> tuple[Any, ...]:
    """The modules of ``model``: its parts, or the model itself."""
    return model.parts if isinstance(model, ModelParts) else (model,)


def each_named(model: Any, named: Callable[[Any], Iterable[tuple[str, Any]]],
               once_per_object: bool = False) -> Iterator[tuple[str, Any]]:
    """``named(part)``'s (name, object) pairs over every part, each pair once: an object that several parts share
    under the same name (a rotary embedding) is listed once. ``once_per_object``: an object is listed once under
    whatever names (a module is hooked once: under the first part's name)."""
    seen: set = set()
    for part in parts_of(model):
        for name, obj in named(part):
            key = id(obj) if once_per_object else (name, id(obj))
            if key not in seen:
                seen.add(key)
                yield name, obj
