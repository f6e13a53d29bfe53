"""MindSpore adapter (PyNative mode): Cell hooks in, numpy views out. Imports mindspore; nothing else in layerdiff does.

Forward: ``Cell.register_forward_pre_hook(with_kwargs=True)`` and ``Cell.register_forward_hook(with_kwargs=True,
always_call=True)`` on every cell of ``cells_and_names()``.

Backward (only while PyNative records a graph for ``ms.grad`` / ``ms.value_and_grad``): each differentiable input
and output of a call is routed through one ``_GradTap`` cell (identity forward, custom ``bprop`` that passes the
gradients through unchanged), and ``Tensor.register_hook`` is put on the tap's outputs. A hook on a tap output
receives exactly the gradient w.r.t. that alias (None when it was not used), which is what the torch adapter's
``_GradTap`` reports. The hooks of one call are collected and handed to the session together.

Parameter gradients: ``Parameter.register_hook`` fires once per backward with the parameter's total gradient
(MindSpore returns parameter gradients from ``ms.grad`` instead of accumulating ``.grad``).
"""
from __future__ import annotations

import contextlib
import platform
import sys

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from layerdiff.adapters.base import FrameworkAdapter, RankPlace
from layerdiff.adapters.frames import running_frame
from layerdiff.capture.hooks import ModuleHooks

_DTYPE_NAMES = {
    ms.float64: "float64", ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16",
    ms.int64: "int64", ms.int32: "int32", ms.int16: "int16", ms.int8: "int8", ms.uint8: "uint8",
    ms.bool_: "bool", ms.complex64: "complex64", ms.complex128: "complex128",
}
_FLOATS = {ms.float64, ms.float32, ms.float16, ms.bfloat16}


def is_tensor(obj) -> bool:
    return isinstance(obj, ms.Tensor)


def _dtype_name(t):
    return _DTYPE_NAMES.get(t.dtype)


def to_stored(t):
    """(numpy array of the tensor's bits, dtype name), or None for dtypes a trace cannot hold."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        return None
    try:
        if name == "bfloat16":  # numpy has no bfloat16: keep the raw bits
            return np.ascontiguousarray(t.view(ms.int16).asnumpy()).view(np.uint16), name
        return np.asarray(t.asnumpy()), name
    except Exception:  # an uninitialized / lazily-initialized parameter, a tensor on an unreachable device
        return None


def describe(t):
    return _dtype_name(t), list(t.shape)


def identify(t):
    """None: MindSpore 2.10's in-place ops (``Tensor.add_``, optimizer updates) do not bump ``Tensor._version``,
    so no key is reliably 'same bytes'. The session then stores every tensor it is handed (no dedup)."""
    return None


def distributed() -> RankPlace | None:
    """This process's place in a MindSpore job of several ranks, launched by msrun (None when it runs alone).

    Asks the communication module only once it is initialized (``init()`` ran): calling ``get_rank`` earlier
    raises, and a worker that never initialized communication writes an ordinary single trace."""
    import os

    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        return None
    world = get_group_size()
    if world < 2:
        return None
    return {"rank": get_rank(), "world_size": world, "backend": str(GlobalComm.BACKEND),
            "local_rank": int(os.environ.get("MS_LOCAL_RANK_ID", os.environ.get("RANK_ID", get_rank())))}






def assign(param, array: np.ndarray, dtype: str):
    """Copy stored bits into a parameter (cast to the parameter's dtype if they differ)."""
    if dtype == "bfloat16":
        value = ms.Tensor(array.view(np.int16).copy()).view(ms.bfloat16)
    else:
        value = ms.Tensor(array.copy())
    if value.dtype != param.dtype:
        value = value.astype(param.dtype)
    param.set_data(value)


class _GradTap(nn.Cell):
    """Identity in forward; a custom bprop passes the gradients through unchanged.

    Its outputs are fresh graph nodes, so a hook on them sees only the gradient that flows into this alias (the
    call's own inputs/outputs), and MindSpore hands such hooks None when the alias received no gradient.
    """

    def construct(self, *tensors):
        return tuple(ops.identity(t) for t in tensors)

    def bprop(self, *args):
        return args[-1]


_TAP = _GradTap()


def tap(t):
    """An identity alias of ``t`` that is a node of the graph of its own (a hook on it sees only the gradient that
    flows into it)."""
    with _unseen_by_recomputation():
        return _TAP(t)[0]


class _ValueTap(nn.Cell):
    """Replay's tap: takes n tensors and n reference values, returns the values; the gradient goes to the
    tensors (so the candidate's own graph still receives it), none to the values."""

    def construct(self, *args):
        return tuple(ops.identity(v) for v in args[len(args) // 2:])

    def bprop(self, *args):
        dout = args[-1]
        n = (len(args) - 2) // 2
        return (dout if isinstance(dout, tuple) else (dout,)) + tuple(ops.zeros_like(v) for v in args[n:2 * n])


_VALUE_TAP = _ValueTap()


def to_framework(array: np.ndarray, like):
    """A tensor holding ``array``'s values with ``like``'s dtype (a reference value for replay)."""
    value = ms.Tensor(np.ascontiguousarray(array))
    return value if value.dtype == like.dtype else value.astype(like.dtype)


class _Collector:
    """Gathers the per-tensor hook calls of one call's inputs (or outputs) and reports them together."""

    def __init__(self, hooks, frame, size, report):
        self.hooks, self.frame, self.report = hooks, frame, report
        self.size = size
        self.hooked = size  # tensors whose alias took a hook: the ones to wait for
        self.grads: dict = {}
        self.done = False

    def hook_for(self, index, plan=None):
        """The hook reports ``grad``; under replay it returns the reference gradient, which MindSpore then
        propagates instead."""
        def hook(grad):
            if self.done:
                return None
            self.grads[index] = grad
            if len(self.grads) == self.hooked:
                self.flush()
            return plan.grad(index, None) if plan else None

        return hook

    def flush(self):
        if self.done:
            return
        self.done = True
        self.hooks.pending.discard(self)
        grads = [self.grads.get(i) for i in range(self.size)]
        if any(g is not None for g in grads):
            self.report(grads)


RECOMPUTE_CELL = "_recompute_cell"


class Hooks(ModuleHooks):
    """Registers forward hooks on every cell (plus gradient taps and parameter-gradient hooks)."""

    def __init__(self, adapter, model, session, options, path_filter, forcer=None):
        super().__init__(adapter, model, session, options, path_filter, forcer)
        self.out_collectors: dict[int, _Collector] = {}  # id(frame) -> output-side collector
        self.pending: set = set()

    @staticmethod
    def differentiable(t) -> bool:
        return differentiable(t)

    def forward_function(self, module):
        return getattr(module, "construct", None)

    def recomputing(self, frame) -> bool:
        # ``Cell.recompute()`` in PyNative: reentrant (its default), its ``bprop`` runs the cell again; not
        # (``use_reentrant=False``), a saved tensor's ``unpack`` does
        return super().recomputing(frame) or running_frame(
            frame, "mindspore.common.recompute", ("bprop", "backward", "unpack")) is not None

    def register_forward_hooks(self, cell, pre_hook, post_hook) -> list:
        return [cell.register_forward_pre_hook(pre_hook, with_kwargs=True),
                cell.register_forward_hook(post_hook, with_kwargs=True, always_call=True)]

    def register_param_grad_hooks(self):
        for name, p in self.params:
            if p.requires_grad:
                self.handles.append(p.register_hook(self._param_grad_hook(name)))

    def _param_grad_hook(self, name):
        def hook(grad):
            self.record_param_grad(name, grad)
            return None

        return hook

    def remove(self):
        self.flush_pending()
        super().remove()

    def start_step(self):
        """Reports what the previous step left pending, then records parameters: every step, since MindSpore's
        optimizers do not bump ``_version`` (no cheap change test, so ``param_version`` stays None)."""
        self.flush_pending()
        super().start_step()

    def flush_pending(self):
        """Collectors some of whose tensors never received a hook call (not connected to the loss)."""
        for collector in sorted(self.pending, key=lambda c: c.frame.begin, reverse=True):
            collector.flush()
        self.out_collectors.clear()

    # -- operations inside modules (``ops`` tracing): adapters/mindspore_ops.py ----------------------------------
    def intercept_ops(self, capture):
        from layerdiff.adapters import mindspore_ops

        return mindspore_ops.intercepted(capture, {id(cell) for _, cell in self.named_modules()})

    def framework_leaf(self, module) -> bool:
        from layerdiff.adapters.mindspore_ops import framework_leaf

        return framework_leaf(module)

    def op_gradients(self):
        from layerdiff.adapters.mindspore_ops import gradients

        return gradients()

    def op_scalar(self, obj):
        from layerdiff.adapters.mindspore_ops import scalar

        return scalar(obj)

    def op_framework_dirs(self) -> list[str]:
        from layerdiff.adapters.mindspore_ops import framework_dirs

        return framework_dirs()

    def sync(self):
        _sync()

    def grad_enabled(self) -> bool:
        return recording_grad()

    def apply_tap(self, tensors, report, frame, outputs, plan=None):
        """One ``_TAP`` call; ``Tensor.register_hook`` on each alias, gathered by a ``_Collector``."""
        if not outputs:
            # the output side of this call reports first; it must not wait for an unconnected output's hook
            report = self._after_outputs(frame, report)
        collector = _Collector(self, frame, len(tensors), report)
        self.pending.add(collector)
        if outputs:
            self.out_collectors[id(frame)] = collector
        with _unseen_by_recomputation():
            aliases = list(_VALUE_TAP(*tensors, *plan.forward(tensors)) if plan else _TAP(*tensors))
        for i, alias in enumerate(aliases):
            try:
                alias.register_hook(collector.hook_for(i, plan))
            except RuntimeError:  # not part of the recorded graph after all: no gradient will reach it
                collector.hooked -= 1
                aliases[i] = None
        return aliases

    def _after_outputs(self, frame, report):
        def run(grads):
            out = self.out_collectors.pop(id(frame), None)
            if out is not None:
                out.flush()
            report(grads)

        return run


def _unseen_by_recomputation():
    """Inside a region of non-reentrant recomputation (``Cell.recompute(use_reentrant=False)``): the taps' saved
    tensors kept by a saved-tensors hook of their own. MindSpore's recomputation counts the tensors its region saves,
    in the forward pass and again when backward recomputes it, and stops the recomputation once it has them all:
    counted, the taps' could stop it inside a tap (its custom ``bprop`` cell left open: "Stack input_args_info_stack_
    is empty")."""
    if running_frame(sys._getframe(), "mindspore.common.recompute", ("recompute_without_reentrant", "unpack")) is None:
        return contextlib.nullcontext()
    return ms.saved_tensors_hooks(_kept, _kept)


def _kept(t):
    return t


def differentiable(t) -> bool:
    """A float tensor in the recorded graph (not made under ``_no_grad`` / ``stop_gradient``, not frozen)."""
    if t.dtype not in _FLOATS or (isinstance(t, ms.Parameter) and not t.requires_grad):
        return False
    return bool(getattr(t, "_requires_grad", True))


def _sync():
    """Wait for PyNative's queued ops; raises the error of a failed one (the adapter reads every output anyway)."""
    if _executor is not None:
        _executor.sync()


try:
    from mindspore.common.api import _pynative_executor as _executor
except ImportError:  # pragma: no cover - private API moved; errors then surface at the next read
    _executor = None


def recording_grad() -> bool:
    """True while PyNative records the forward for ``ms.grad`` / ``ms.value_and_grad``."""
    try:
        return bool(_executor.requires_grad())
    except Exception:  # pragma: no cover - API moved: tap anyway (identity taps are harmless without grad)
        return True


def metadata(model) -> dict:
    """Framework, device, dtypes, seed and execution mode: what explains most 'same model' mismatches."""
    params = list(model.get_parameters())
    mode = ms.get_context("mode")
    meta = {
        "framework": MindSporeAdapter.name,
        "framework_version": ms.__version__,
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "num_parameters": int(sum(int(np.prod(p.shape)) for p in params)),
        "device_target": ms.get_context("device_target"),
        "param_dtypes": sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params}),
        "seed": ms.get_seed(),
        "execution_mode": {ms.PYNATIVE_MODE: "pynative", ms.GRAPH_MODE: "graph"}.get(mode, str(mode)),
        "cpu": platform.processor() or platform.machine(),
        "training": bool(getattr(model, "training", False)),
    }
    meta["devices"] = [str(meta["device_target"]).lower()]
    for key in ("deterministic", "jit_level"):
        try:
            value = ms.get_context(key)
        except Exception:
            continue
        meta[key] = value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
    return meta


class MindSporeAdapter(FrameworkAdapter):
    """MindSpore (PyNative mode): ``mindspore.nn.Cell`` models of ``mindspore.Tensor`` tensors."""

    name = "mindspore"
    is_tensor = staticmethod(is_tensor)
    dtype_name = staticmethod(_dtype_name)
    to_stored = staticmethod(to_stored)
    identify = staticmethod(identify)
    describe = staticmethod(describe)
    metadata = staticmethod(metadata)
    distributed = staticmethod(distributed)
    assign = staticmethod(assign)
    to_framework = staticmethod(to_framework)
    hooks_class = Hooks
    records_ops = True

    def named_modules(self, model):
        # ``Cell.recompute()`` (PyNative) routes the cell's call through a ``_recompute_cell`` holding a ``wrap_cell``
        # that runs its ``construct``: machinery, not the model's (its children keep their own names)
        return ((name, cell) for name, cell in model.cells_and_names()
                if RECOMPUTE_CELL not in name.split("."))

    def named_parameters(self, model):
        return model.parameters_and_names()


ADAPTER = MindSporeAdapter()
