"""MindSpore's interceptor for operations inside modules (``ops`` tracing), PyNative mode.

MindSpore has no public hook that sees every call, so the public APIs of ``api_lists.MINDSPORE`` (``ops.*``,
``mint.*``, ``mint.nn.functional.*``, Tensor methods and operators) are wrapped while the trace is open and restored
on exit (``capture/apis.py``), together with ``Primitive.__call__`` (a Primitive instance called by model code,
``P.BatchMatMul()(x, y)``: its attributes, such as ``transpose_b``, are its arguments) and ``Cell.__call__`` for
cells with a hand-written ``bprop`` that are not part of the model (a custom autograd step, MindSpore's
``autograd.Function``). Backward goes through ``Tensor.register_hook`` on each output and on an identity alias of
each input (the adapter's gradient tap: a node of its own, so the gradient there is this operation's
contribution), under ``ms.grad`` / ``value_and_grad``."""
from __future__ import annotations

import os
from typing import Any, Callable, ContextManager

import mindspore as ms
from mindspore import nn
from mindspore.ops import Primitive

from layerdiff.adapters.api_lists import MINDSPORE, MINDSPORE_KINDS, PRIMITIVE_KINDS
from layerdiff.capture.apis import Api, resolve, wrapped
from layerdiff.capture.ops import OpCapture, OpGradients, OpName


def _primitive(args: tuple) -> OpName:
    name = type(args[0]).__name__
    return OpName(f"ops.{name}", PRIMITIVE_KINDS.get(name, name.lower()))


def _custom_cell(args: tuple) -> OpName:
    name = type(args[0]).__name__
    return OpName(f"{type(args[0]).__qualname__}.__call__", name)


def intercepted(capture: OpCapture, model_cells: set[int]) -> ContextManager[Any]:
    """``model_cells``: id() of the model's own cells, which are modules (recorded as such), never operations."""
    apis = resolve(MINDSPORE, MINDSPORE_KINDS, ("mindspore.Tensor", ms.Tensor))
    apis += [Api(cls, "__call__", None, _primitive) for cls in (Primitive, *_own_calls(Primitive))]

    def custom(args: tuple) -> bool:
        cell = args[0]
        return id(cell) not in model_cells and "bprop" in vars(type(cell))

    apis.append(Api(nn.Cell, "__call__", None, _custom_cell, several_steps=True, applies=custom))
    return wrapped(capture, apis)


def _own_calls(root: type) -> list[type]:
    """The Primitive classes loaded that define ``__call__`` themselves: MindSpore's generated ones
    (``BatchMatMul``, ``Softmax``, ``Reshape``) and hand-written ones (``Tile``) do, so wrapping
    ``Primitive.__call__`` alone saw none of ``P.BatchMatMul()(x, y)`` (MindSpore Transformers' matmuls, softmax
    and tiling went unrecorded)."""
    seen: set[type] = set()
    out: list[type] = []
    stack = [root]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                if "__call__" in vars(sub):
                    out.append(sub)
    return out


def _differentiable(t: Any) -> bool:
    from layerdiff.adapters.mindspore_adapter import differentiable

    return isinstance(t, ms.Tensor) and differentiable(t)


class _Collector:
    """Calls back once with the gradients of all its tensors, when the last one's hook has run."""

    def __init__(self, size: int, callback: Callable[[list], None]):
        self.grads: list = [None] * size
        self.waiting = size
        self.callback = callback

    def hook_for(self, index: int) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            self.grads[index] = grad
            self.waiting -= 1
            if self.waiting == 0:
                self.callback(self.grads)

        return hook


def _on_gradients(tensors: list, callback: Callable[[list], None]) -> None:
    collector = _Collector(len(tensors), callback)
    for i, t in enumerate(tensors):
        try:
            t.register_hook(collector.hook_for(i))
        except RuntimeError:  # not part of the recorded graph after all: no gradient will reach it
            collector.waiting -= 1


def _alias(t: Any) -> Any:
    from layerdiff.adapters.mindspore_adapter import tap

    return tap(t)


def gradients() -> OpGradients:
    from layerdiff.adapters.mindspore_adapter import recording_grad

    return OpGradients(_differentiable, _alias, _on_gradients, recording_grad)


def scalar(obj: Any) -> Any:
    """A non-tensor argument MindSpore names: a dtype; a Primitive called directly: its attributes."""
    if isinstance(obj, ms.dtype.Type):
        return str(obj)
    if isinstance(obj, Primitive):
        return {k: v for k, v in obj.attrs.items() if isinstance(v, (bool, int, float, str)) and k not in
                ("input_names", "output_names")} or None
    return None


def framework_dirs() -> list[str]:
    return [os.path.dirname(ms.__file__)]


def framework_leaf(module: Any) -> bool:
    """MindSpore's own cells (``nn.Dense``, ``nn.Embedding``, ``nn.SiLU``): their operations are MindSpore's."""
    return type(module).__module__.startswith("mindspore.")
