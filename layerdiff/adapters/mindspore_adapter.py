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

import platform
import sys

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from ..core.session import TensorAdapter
from ..core.structure import replace_tensors, walk
from .common import hyper_parameters

FRAMEWORK = "mindspore"

_DTYPE_NAMES = {
    ms.float64: "float64", ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16",
    ms.int64: "int64", ms.int32: "int32", ms.int16: "int16", ms.int8: "int8", ms.uint8: "uint8",
    ms.bool_: "bool", ms.complex64: "complex64", ms.complex128: "complex128",
}
_FLOATS = {ms.float64, ms.float32, ms.float16, ms.bfloat16}


def is_tensor(obj) -> bool:
    return isinstance(obj, ms.Tensor)


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


def identify(t):
    """None: MindSpore 2.10's in-place ops (``Tensor.add_``, optimizer updates) do not bump ``Tensor._version``,
    so no key is reliably 'same bytes'. The session then stores every tensor it is handed (no dedup)."""
    return None


TENSORS = TensorAdapter(to_stored, identify, None)


def parameters(model):
    """(name, parameter, type name of its cell) for weight transfer."""
    types = {name: type(cell).__name__ for name, cell in model.cells_and_names()}
    return [(name, p, types.get(name.rpartition(".")[0])) for name, p in model.parameters_and_names()]


def shape(t) -> list:
    return list(t.shape)


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


class _Collector:
    """Gathers the per-tensor hook calls of one call's inputs (or outputs) and reports them together."""

    def __init__(self, hooks, frame, keys, sink):
        self.hooks, self.frame, self.keys, self.sink = hooks, frame, keys, sink
        self.grads: dict = {}
        self.done = False

    def hook_for(self, key):
        def hook(grad):
            if self.done:
                return None
            self.grads[key] = grad
            if len(self.grads) == len(self.keys):
                self.flush()
            return None

        return hook

    def flush(self):
        if self.done:
            return
        self.done = True
        self.hooks.pending.discard(self)
        grads = [(k, self.grads[k]) for k in self.keys if self.grads.get(k) is not None]
        if grads:
            self.sink(self.frame, grads)


class Hooks:
    """Registers forward hooks on every cell (plus gradient taps and parameter-gradient hooks)."""

    def __init__(self, model, session, *, backward: bool, path_filter, params: bool):
        self.model = model
        self.session = session
        self.backward = backward
        self.path_filter = path_filter
        self.record_params = params
        self.handles = []
        self.open_frames: dict[int, list] = {}
        self.out_collectors: dict[int, _Collector] = {}  # id(frame) -> output-side collector
        self.pending: set = set()
        self.params = [(name, p) for name, p in model.parameters_and_names()
                       if path_filter(name.rpartition(".")[0])]

    # -- installation --------------------------------------------------------------------------------------
    def install(self):
        for path, cell in self.model.cells_and_names():
            if cell is not self.model and not self.path_filter(path):
                continue
            hparams = hyper_parameters(cell, _safe_extra_repr(cell))
            self.handles.append(cell.register_forward_pre_hook(
                self._pre_hook(path, type(cell).__name__, hparams), with_kwargs=True))
            self.handles.append(cell.register_forward_hook(
                self._post_hook(path), with_kwargs=True, always_call=True))
        if self.backward and self.record_params:
            for name, p in self.params:
                if p.requires_grad:
                    self.handles.append(p.register_hook(self._param_grad_hook(name)))

    def remove(self):
        self.flush_pending()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def flush_pending(self):
        """Collectors some of whose tensors never received a hook call (not connected to the loss)."""
        for collector in sorted(self.pending, key=lambda c: c.frame.begin, reverse=True):
            collector.flush()
        self.out_collectors.clear()

    # -- hooks ---------------------------------------------------------------------------------------------
    def _pre_hook(self, path, type_name, hparams):
        session = self.session

        def hook(cell, args, kwargs):
            _sync()  # a failure of an op queued before this call surfaces here, in the caller's frame
            if not session.stack:
                self.flush_pending()
                if self.record_params:
                    self._record_params()
            tensors, scalars = [], {}
            walk(args, "args", is_tensor, lambda k, t: tensors.append((k, t)), scalars.__setitem__)
            walk(kwargs, "kwargs", is_tensor, lambda k, t: tensors.append((k, t)), scalars.__setitem__)
            frame = session.begin_call(path, type_name, hparams, tensors, scalars)
            self.open_frames.setdefault(id(cell), []).append(frame)
            if not self._taps_enabled() or getattr(cell, "inplace", False) is True:
                return None
            needs = [(k, t) for k, t in tensors if _differentiable(t)]
            if not needs:
                return None
            frame.tapped_inputs = True
            swap = self._tap(needs, self._inputs_sink, frame)
            return replace_tensors(args, is_tensor, swap), replace_tensors(kwargs, is_tensor, swap)

        return hook

    def _post_hook(self, path):
        session = self.session

        def hook(cell, args, kwargs, output):
            stack = self.open_frames.get(id(cell))
            if not stack:
                return None
            frame = stack.pop()
            error = sys.exc_info()[1]
            if output is None and error is not None:
                session.fail_call(frame, error)
                return None
            try:
                _sync()  # PyNative runs ops asynchronously: make this cell's own errors surface in its frame
            except Exception as exc:
                session.fail_call(frame, exc)
                raise
            tensors, scalars = [], {}
            walk(output, "out", is_tensor, lambda k, t: tensors.append((k, t)), scalars.__setitem__)
            session.end_call(frame, tensors, scalars)
            if not self._taps_enabled():
                return None
            needs = [(k, t) for k, t in tensors if _differentiable(t)]
            if not needs:
                return None
            return replace_tensors(output, is_tensor, self._tap(needs, self._outputs_sink, frame, outputs=True))

        return hook

    def _outputs_sink(self, frame, grads):
        self.session.grad_outputs(frame, grads)

    def _inputs_sink(self, frame, grads):
        self.session.grad_inputs(frame, grads)

    def _taps_enabled(self) -> bool:
        return self.backward and _recording_grad()

    def _tap(self, needs, sink, frame, outputs=False) -> dict:
        """Route ``needs`` [(key, tensor)] through one gradient tap; {id(original): alias} to swap them in."""
        keys = [k for k, _ in needs]
        if not outputs:
            # the output side of this call reports first; it must not wait for an unconnected output's hook
            sink = self._after_outputs(sink)
        collector = _Collector(self, frame, keys, sink)
        self.pending.add(collector)
        if outputs:
            self.out_collectors[id(frame)] = collector
        aliases = _TAP(*[t for _, t in needs])
        swap = {}
        collector.keys = list(keys)
        for (key, t), alias in zip(needs, aliases):
            try:
                alias.register_hook(collector.hook_for(key))
            except RuntimeError:  # not part of the recorded graph after all: no gradient will reach it
                collector.keys.remove(key)
                continue
            self.session.remember_alias(t, alias)
            swap[id(t)] = alias
        return swap

    def _after_outputs(self, sink):
        def run(frame, grads):
            out = self.out_collectors.pop(id(frame), None)
            if out is not None:
                out.flush()
            sink(frame, grads)

        return run

    def _param_grad_hook(self, name):
        def hook(grad):
            if grad is not None:
                self.session.param("param_grad", name, name.rpartition(".")[0], grad)
            return None

        return hook

    def _record_params(self):
        """Parameter values at the start of each step. MindSpore's optimizers update parameters without bumping
        ``_version``, so there is no cheap change test: every step records them."""
        for name, p in self.params:
            self.session.param("param", name, name.rpartition(".")[0], p)


def _differentiable(t) -> bool:
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


def _recording_grad() -> bool:
    """True while PyNative records the forward for ``ms.grad`` / ``ms.value_and_grad``."""
    try:
        return bool(_executor.requires_grad())
    except Exception:  # pragma: no cover - API moved: tap anyway (identity taps are harmless without grad)
        return True


def _safe_extra_repr(cell) -> str:
    try:
        return cell.extra_repr()
    except Exception:  # a user's extra_repr must never break tracing
        return ""


def metadata(model) -> dict:
    """Framework, device, dtypes, seed and execution mode: what explains most 'same model' mismatches."""
    params = list(model.get_parameters())
    mode = ms.get_context("mode")
    meta = {
        "framework": FRAMEWORK,
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
