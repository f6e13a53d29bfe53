"""PaddlePaddle's interceptor for operations inside modules (``ops`` tracing).

Paddle has no public hook that sees every call, so the public APIs of ``api_lists.PADDLE`` (``paddle.*``,
``paddle.nn.functional.*``, Tensor methods and operators) are wrapped while the trace is open and restored on exit
(``capture/apis.py``). Backward goes through tensor hooks: on each output, and on an alias of each input made for
the operation alone (a node of its own, so the gradient there is this operation's contribution, however many
other operations read the same tensor: ``_alias``)."""
from __future__ import annotations

import os
from typing import Any, Callable, ContextManager

import paddle

from layerdiff.adapters.api_lists import PADDLE, PADDLE_KINDS
from layerdiff.capture.apis import Api, resolve, wrapped
from layerdiff.capture.ops import OpCapture, OpGradients, OpName


def _layer(args: tuple) -> OpName:
    return OpName(f"{args[0].__qualname__}.apply", args[0].__name__)


def intercepted(capture: OpCapture) -> ContextManager[Any]:
    """Layerdiff's own PyLayers (gradient taps) run inside its hooks, where nothing is an operation."""
    apis = resolve(PADDLE, PADDLE_KINDS, ("paddle.Tensor", paddle.Tensor))
    # a custom autograd layer applied by model code is one operation, its backward that operation's backward
    apis.append(Api(paddle.autograd.PyLayer, "apply", None, _layer, per_class=True, several_steps=True))
    return wrapped(capture, apis)


def _differentiable(t: Any) -> bool:
    return isinstance(t, paddle.Tensor) and not t.stop_gradient and \
        (paddle.is_floating_point(t) or paddle.is_complex(t))


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
        t.register_hook(collector.hook_for(i))


def _alias(t: Any) -> Any:
    """A node of the graph of its own that shows ``t``'s values: ``view`` to the same shape (``reshape`` to the
    same shape hands back ``t`` itself, whose hook sees the gradient summed over all its users); a copy where
    the tensor takes no view."""
    try:
        return t.view(t.shape)
    except (RuntimeError, ValueError):
        return t.clone()


def gradients() -> OpGradients:
    return OpGradients(_differentiable, _alias, _on_gradients, paddle.is_grad_enabled)


def scalar(obj: Any) -> Any:
    """A non-tensor argument Paddle names: a dtype, a place."""
    if isinstance(obj, paddle.dtype):
        return str(obj)
    if isinstance(obj, paddle.CPUPlace):
        return str(obj)
    return None


def framework_dirs() -> list[str]:
    return [os.path.dirname(paddle.__file__)]


def framework_leaf(module: Any) -> bool:
    """Paddle's own layers (``nn.Linear``, ``nn.Embedding``, ``nn.Silu``): their operations are Paddle's."""
    return type(module).__module__.startswith("paddle.")
