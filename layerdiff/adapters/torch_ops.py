"""PyTorch's interceptor for operations inside modules (``ops`` tracing): public mechanisms only.

A ``torch.overrides.TorchFunctionMode`` sees every torch function, ``torch.nn.functional`` function, tensor method
and operator; while it handles one, torch disables it, so what that function calls inside is part of it (the
outermost call is the operation). A custom ``torch.autograd.Function`` is applied through ``Function.apply``, which
the mode does not see: that public classmethod is wrapped while the trace is open and restored on exit. What is
recorded, and where, is ``capture.ops``'s business; this file only names torch's calls."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.overrides import TorchFunctionMode

from layerdiff.capture.ops import OpCapture, OpGradients, OpName, kind_of

# calls that read a tensor's facts, never its values: not operations (they return no tensor)
_FACTS = {"size", "dim", "numel", "stride", "data_ptr", "is_contiguous", "element_size", "storage_offset",
          "is_floating_point", "is_complex", "get_device", "has_names", "nelement", "ndimension", "__len__",
          "__bool__", "__index__", "__int__", "__float__", "__hash__", "__repr__", "__format__", "__reduce_ex__",
          "__array__", "__dlpack__", "__dlpack_device__", "item", "tolist", "numpy", "untyped_storage",
          "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "backward", "is_inference",
          "is_shared", "is_pinned", "dim_order", "__contains__", "equal", "allclose", "is_nonzero", "is_same_size",
          "is_set_to", "__iter__", "__reversed__", "__deepcopy__", "__setstate__", "__getstate__", "__dir__",
          "_set_grad_enabled"}  # ``torch.no_grad()`` entered (Megatron's checkpointed forward): a mode, no tensor
_FACT_ATTRIBUTES = {"shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "names", "layout",
                    "is_cuda", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "output_nr",
                    "_version", "_base", "itemsize", "nbytes", "is_cpu", "is_xpu", "is_mps", "_cdata", "__class__",
                    "__dict__", "_backward_hooks", "_post_accumulate_grad_hooks"}
_NOT_AN_OP = OpName("", "")


def op_name(func: Any) -> OpName:
    """What model code called: ``torch.matmul``, ``Tensor.mul``, ``torch.nn.functional.softmax``, ``Tensor.T``;
    ``_NOT_AN_OP`` for calls that read a tensor's facts (its shape, dtype) rather than compute."""
    short = getattr(func, "__name__", None) or type(func).__name__
    owner = getattr(func, "__self__", None)
    if short == "__get__" and owner is not None:  # a tensor property: x.T, x.mT, x.data, x.real
        attribute = getattr(owner, "__name__", "")
        if attribute in _FACT_ATTRIBUTES or attribute.startswith("_"):
            return _NOT_AN_OP
        return OpName(f"Tensor.{attribute}", attribute.lower())
    if short in _FACTS:
        return _NOT_AN_OP
    module = getattr(func, "__module__", None) or ""
    qualname = getattr(func, "__qualname__", short)
    if qualname.startswith("TensorBase.") or qualname.startswith("Tensor.") or module == "torch._tensor":
        name = f"Tensor.{short}"
    elif module in ("torch.nn.functional", "torch._C._nn") or module.startswith("torch.nn.functional"):
        name = f"torch.nn.functional.{short}"
    elif module in ("torch", "torch._C._VariableFunctions") or qualname.startswith("_VariableFunctionsClass."):
        name = f"torch.{short}"
    elif module.startswith("torch"):
        name = f"{module.replace('._C.', '.').rstrip('.')}.{short}"
    else:
        name = f"{module}.{qualname}" if module else qualname
    kind, in_place = kind_of(short)
    return OpName(name, kind, in_place)


class _Names:
    """``op_name`` per function, remembered: the same few hundred functions are called again and again."""

    def __init__(self) -> None:
        self.known: dict[Any, OpName] = {}

    def __call__(self, func: Any) -> OpName:
        try:
            found = self.known.get(func)
        except TypeError:  # an unhashable callable
            return op_name(func)
        if found is None:
            found = self.known[func] = op_name(func)
        return found


_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
"""Whether ``torch.compile`` is tracing this call into a graph: a compiled graph runs its operations as one
program, so they are not recorded one by one (its modules still are: their hooks run eagerly)."""


def eager(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as dynamo leaves it (``torch.compiler.disable``): run by Python, never traced into a compiled
    graph, nor compiled when a compiled program calls back into Python (0.5 us a call)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(function) if disable is not None else function


@eager
def _record(capture: OpCapture, call: Callable[..., Any], name: OpName, args: tuple, kwargs: dict, caller: Any,
            several_steps: bool = False) -> Any:
    """``capture.run``, out of dynamo's reach: a compiled model's own code calls back into Python at run time
    (``torch._as_tensor_fullprec`` for a float that became an input of its graph), and dynamo then compiled the
    recording's frames, which failed on their first read of a tensor's bytes ("Cannot access data pointer of
    Tensor (e.g. FakeTensor)")."""
    return capture.run(call, name, args, kwargs, caller, several_steps=several_steps)


class _OpMode(TorchFunctionMode):
    """Hands every torch call made while a module's operations are recorded to ``capture.run``."""

    def __init__(self, capture: OpCapture):
        super().__init__()
        self.capture = capture
        self.names = _Names()
        self.off = 0  # > 0 while a function runs from this handler: torch turns the mode off around it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        capture = self.capture
        self.off += 1
        try:
            if _compiling() or not capture.recording():
                return func(*args, **kwargs)
            name = self.names(func)
            if name is _NOT_AN_OP or not name.kind:
                return func(*args, **kwargs)
            return _record(capture, func, name, args, kwargs, sys._getframe(1))
        finally:
            self.off -= 1

    @contextlib.contextmanager
    def resumed(self) -> Iterator[None]:
        """The mode on again where a function run from its handler runs model code: a backward
        (``loss.backward()`` goes through the handler) in which activation checkpointing recomputes."""
        if not self.off:
            yield
            return
        off, self.off = self.off, 0
        try:
            with self:
                yield
        finally:
            self.off = off


# autograd functions that run model code rather than compute (reentrant activation checkpointing: torch's,
# Megatron's and DeepSpeed's): not operations; the module calls and operations they run are the model's own
RECOMPUTING_FUNCTIONS = frozenset({"CheckpointFunction"})


def _forward_of(function: Any) -> torch.nn.Module | None:
    """The module whose ``forward`` a checkpointed function is, where checkpointing was given that rather than
    the module (whose call runs its hooks): a bound ``forward`` or transformers' ``partial(forward, module)``."""
    if isinstance(function, functools.partial):
        owner, function = (function.args[0] if function.args else None), function.func
    else:
        owner, function = getattr(function, "__self__", None), getattr(function, "__func__", None)
    if isinstance(owner, torch.nn.Module) and getattr(function, "__name__", None) == "forward":
        return owner
    return None


@contextlib.contextmanager
def intercepted(capture: OpCapture, own_functions: tuple[type, ...]) -> Iterator[None]:
    """Operations go to ``capture`` while open: the mode is pushed, ``Function.apply`` wrapped; both undone on
    exit. ``own_functions``: layerdiff's own autograd functions (gradient taps), never operations."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]  # a classmethod
    apply: Callable[..., Any] = original.__func__

    def wrapped(cls, *args, **kwargs):
        if cls.__name__ in RECOMPUTING_FUNCTIONS:
            module = _forward_of(args[0]) if args else None
            if module is not None:
                args = (capture.hooks.checkpointed_forward(args[0], module), *args[1:])
            return apply(cls, *args, **kwargs)
        if cls in own_functions or _compiling() or not capture.recording():
            return apply(cls, *args, **kwargs)
        name = OpName(f"{cls.__qualname__}.apply", cls.__name__)
        return _record(capture, lambda *a, **k: apply(cls, *a, **k), name, args, kwargs, sys._getframe(1),
                       several_steps=True)

    function.apply = classmethod(wrapped)  # public API, wrapped only while the trace is open
    mode = _OpMode(capture)
    capture.resumed = mode.resumed
    try:
        with mode:
            yield
    finally:
        function.apply = original


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())


def _one_step(inputs: list, outputs: list, callback: Callable[[list, list], None]) -> bool:
    """An operation that is one node of the autograd graph (most are): that node's hook
    (``torch.autograd.graph.Node.register_hook``) reports the gradients w.r.t. its inputs and its outputs at
    once. Its edges are matched to the operation's inputs by identity (a leaf through its ``AccumulateGrad``);
    an edge to anything else means several nodes (a composite operation): False, nothing registered."""
    made = [(key, t) for key, t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not made:
        return True  # nothing to differentiate
    node = made[0][1].grad_fn
    if any(t.grad_fn is not node for _, t in made):
        return False
    # keyed by the inputs' node objects themselves, which the keys hold: ``next_functions`` hands back the same Python
    # object for a node only while that object is alive (torch 2.11 let it go with its last reference; 2.13 keeps
    # it). Keyed by ``id`` alone and dropped, its address went to the next object made: on an H200's torch 2.11 nine
    # kinds of the toy's operations (mul, add, cat, ...) were taken for composite ones and tapped, at several times
    # the cost. Nodes hash and compare by identity.
    by_edge: dict[tuple, list[str]] = {}
    for key, t in inputs:
        if _differentiable(t):
            edge = ("leaf", id(t)) if t.grad_fn is None else (t.grad_fn, t.output_nr)
            by_edge.setdefault(edge, []).append(key)
    slots: list[str | None] = []
    for child, nr in node.next_functions:
        if child is None:
            slots.append(None)
            continue
        variable = getattr(child, "variable", None)
        keys = by_edge.get(("leaf", id(variable)) if variable is not None else (child, nr))
        if not keys:
            return False
        slots.append(keys.pop(0) if len(keys) > 1 else keys[0])
    node.register_hook(_NodeHook(slots, {t.output_nr: key for key, t in made}, callback))
    return True


class _NodeHook:
    """An autograd node's hook: its gradients handed to ``callback`` under the operation's keys. One object (not a
    closure and its cells): a step holds one per operation until its backward, and fewer objects held means fewer
    garbage-collector passes over them."""

    __slots__ = ("slots", "out_keys", "callback")

    def __init__(self, slots: list, out_keys: dict, callback: Callable[[list, list], None]) -> None:
        self.slots, self.out_keys, self.callback = slots, out_keys, callback

    def __call__(self, grad_inputs, grad_outputs) -> None:
        out_keys = self.out_keys
        self.callback([(k, g) for k, g in zip(self.slots, grad_inputs) if k is not None and g is not None],
                      [(out_keys[i], g) for i, g in enumerate(grad_outputs) if i in out_keys and g is not None])


# what the engine says of the backward running: its id, and whether it runs a node (torch's own multi-gradient hook
# asks the same); a build without them takes that hook
_graph_task: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
_will_run: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)
_ENGINE_KNOWS = _graph_task is not None and _will_run is not None


def _node_of(t: torch.Tensor) -> Any:
    """The autograd node a tensor's gradient arrives at: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]


def _all_gradients(tensors: list, callback: Callable[[list], None]) -> None:
    """``callback`` once per backward with the gradients w.r.t. all of ``tensors`` that it reaches (None for the
    others), as ``register_multi_grad_hook(mode="all")`` calls back, without its reference cycle: torch's hook holds
    the tensors' autograd nodes for as long as they hold it, which kept each step's graph, and the frames and
    records around it, until the garbage collector's full pass (the benchmark toy's process grew from 500 to 900 MB
    over 35 steps). Here the nodes are let go once a backward has counted those it runs; a later backward through
    the same graph (``retain_graph``) expects the same count."""
    state: dict[str, Any] = {"nodes": [_node_of(t) for t in tensors], "expected": None}
    arrived: dict[int, list] = {}
    lock = threading.Lock()

    def hook_of(i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            assert _graph_task is not None and _will_run is not None
            task = _graph_task()
            with lock:
                if state["expected"] is None:
                    state["expected"] = sum(bool(_will_run(node)) for node in state["nodes"])
                    state["nodes"] = None  # the cycle ends here
                got = arrived.setdefault(task, [None] * len(tensors))
                got[i] = grad
                done = sum(g is not None for g in got) >= state["expected"]
                if done:
                    del arrived[task]
            if done:
                callback(got)

        return hook

    for i, t in enumerate(tensors):
        t.register_hook(hook_of(i))


def gradients() -> OpGradients:
    """An operation's gradients in torch: one autograd node's hook where the operation is one node
    (``_one_step``); otherwise inputs through ``view_as`` (an identity node of their own, so the gradient there
    is this operation's contribution), their gradients taken by a tensor hook (one tensor) or ``_all_gradients``
    (several)."""
    def on_gradients(tensors: list, callback: Callable[[list], None]) -> None:
        if len(tensors) == 1:  # most: a tensor hook, which holds nothing of the graph
            def single(grad: torch.Tensor) -> None:
                callback([grad])  # returns None: the gradient flows on unchanged

            tensors[0].register_hook(single)
        elif _ENGINE_KNOWS:
            _all_gradients(tensors, callback)
        else:
            register_multi_grad_hook(tuple(tensors), lambda grads: callback(list(grads)), mode="all")

    return OpGradients(_differentiable, lambda t: t.view_as(t), on_gradients, torch.is_grad_enabled, _one_step)


def scalar(obj: Any) -> Any:
    """A non-tensor argument torch names: a dtype, a device, a memory format, a size."""
    if isinstance(obj, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(obj)
    if isinstance(obj, torch.Size):
        return list(obj)
    return None


def framework_dirs() -> list[str]:
    return [os.path.dirname(torch.__file__)]


# torch's machinery around a model: FSDP (its weights' all-gather before each layer), DDP, tensor parallelism's
# input and output hooks (redistributing DTensors), their communication hooks
_MACHINERY = ("distributed/fsdp", "distributed/_composable", "nn/parallel", "distributed/tensor/parallel",
              "distributed/algorithms")


def machinery_dirs() -> list[str]:
    return [os.path.join(os.path.dirname(torch.__file__), *sub.split("/")) for sub in _MACHINERY]


def framework_leaf(module: Any) -> bool:
    """torch's own modules (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``): their operations are torch's."""
    return type(module).__module__.startswith("torch.")
