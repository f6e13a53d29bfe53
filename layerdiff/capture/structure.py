"""Walk nested inputs/outputs (tuples, lists, dicts, namedtuples, HF ModelOutput) with stable keys.

Keys are dotted paths: ``args.0``, ``kwargs.attention_mask``, ``out.logits``, ``out.1.0``. The same
structure always gives the same keys, which is what lets two runs be matched tensor by tensor.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable

SCALAR_TYPES = (int, float, bool, str, type(None))


def walk(obj: Any, prefix: str, is_tensor: Callable[[Any], bool], on_tensor: Callable[[str, Any], object],
         on_scalar: Callable[[str, Any], object] | None = None) -> None:
    """Call ``on_tensor(key, t)`` for every tensor leaf, ``on_scalar(key, v)`` for simple scalars."""
    if is_tensor(obj):
        on_tensor(prefix, obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            walk(v, f"{prefix}.{k}", is_tensor, on_tensor, on_scalar)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            walk(v, f"{prefix}.{i}", is_tensor, on_tensor, on_scalar)
    elif on_scalar is not None and isinstance(obj, SCALAR_TYPES):
        if not (isinstance(obj, str) and len(obj) > 200):
            on_scalar(prefix, obj)


def replace_tensors(obj: Any, is_tensor: Callable[[Any], bool], replacement: dict[int, Any]) -> Any:
    """A copy of ``obj`` with the tensors whose ``id`` is in ``replacement`` swapped; untouched parts are shared."""
    if not replacement:
        return obj
    if is_tensor(obj):
        return replacement.get(id(obj), obj)
    if isinstance(obj, Mapping):
        items = {k: replace_tensors(v, is_tensor, replacement) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        if type(obj) in (dict,):
            return items
        new: Any = copy.copy(obj)  # ModelOutput, OrderedDict, ...: keep the type and its attributes
        for k, v in items.items():
            new[k] = v
        return new
    if isinstance(obj, (tuple, list)):
        elements = [replace_tensors(v, is_tensor, replacement) for v in obj]
        if all(a is b for a, b in zip(elements, obj)):
            return obj
        if isinstance(obj, list):
            return type(obj)(elements) if type(obj) is not list else elements
        if hasattr(type(obj), "_fields"):  # namedtuple
            return type(obj)(*elements)
        return type(obj)(elements)
    return obj
