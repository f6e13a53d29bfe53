"""PaddlePaddle adapter (dygraph): layer hooks in, numpy views out. Imports paddle; nothing else in layerdiff does.

Paddle APIs used, and why:

* forward: ``Layer.register_forward_pre_hook(hook, with_kwargs=True)`` and
  ``Layer.register_forward_post_hook(hook, with_kwargs=True, always_call=True)`` (Paddle >= 3.0). With
  ``always_call`` Paddle calls the post hook from inside its ``except`` block when ``forward`` raises, with
  ``outputs=None``; ``sys.exc_info()`` then holds the error and the call is recorded with ``fail_call``.
* backward: a ``paddle.autograd.PyLayer`` gradient tap on layer inputs and outputs. Paddle's PyLayer refuses
  outputs that share storage with its inputs (``detach()`` or ``mark_not_inplace``: "Leaf Var ... can't use
  inplace strategy" as soon as the model modifies the output in place), so the tap returns *copies*
  (``Tensor.clone()`` inside the PyLayer, which is outside the graph there). Copies are bit-identical and keep
  in-place ops on layer outputs working; the price is memory. Layers with ``inplace=True`` are never
  input-tapped; a layer caught modifying its (tapped) input in place has the change written back into the
  caller's tensor with ``paddle.assign(copy, output=original)`` (recorded by autograd, so forward values and
  gradients stay those of the untraced model), gets a warning and no further input taps.
* parameter gradients: ``Tensor._register_backward_hook(hook)``, Paddle's "reduce hook" that runs once the
  gradient of a leaf has been accumulated into ``.grad`` (what DataParallel uses); it takes no arguments and
  reads ``param.grad``. ``register_hook`` would give the gradient *before* accumulation. The reduce hook cannot
  be removed, so each hook checks that its ``Hooks`` is still installed.
* parameter values: recorded at the start of each step when they changed. Paddle's optimizers and
  ``set_value`` do not bump ``Tensor.inplace_version``, so a CRC32 of the bytes decides (with the version and
  ``data_ptr()``).
"""
from __future__ import annotations

import array
import math
import os
import platform
import weakref

import numpy as np
import paddle

from layerdiff.adapters.base import FrameworkAdapter, RankPlace
from layerdiff.adapters.frames import running_frame
from layerdiff.capture.hooks import ModuleHooks
from layerdiff.capture.parts import each_named
from layerdiff.tracefile.tensors import FLOAT_DTYPES, stats_at

_DTYPE_NAMES = {name: name for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")}


def is_tensor(obj) -> bool:
    return isinstance(obj, paddle.Tensor)


def _dtype_name(t):
    return _DTYPE_NAMES.get(str(t.dtype).rpartition(".")[2])


def _is_dist(t) -> bool:
    try:
        return bool(t.is_dist())
    except AttributeError:
        return False


def local(t):
    """What this process holds of a (semi-)auto-parallel distributed tensor: its local part, as an ordinary
    tensor (the placement is recorded separately); other tensors as they are."""
    if not _is_dist(t):
        return t
    from paddle.distributed.auto_parallel.api import dtensor_to_local

    with paddle.no_grad():
        return dtensor_to_local(t, t.process_mesh, t.placements)


def _placement_text(p) -> str:
    text = str(p)
    if text.startswith("Shard"):
        return f"S({p.get_dim()})"
    if text.startswith("Partial"):
        return "P(sum)"
    return "R" if text.startswith("Replicate") else text


def _fleet_placement(t):
    """A ``fleet`` model-parallel parameter (``ColumnParallelLinear``, ``RowParallelLinear``,
    ``VocabParallelEmbedding``): fleet marks it ``is_distributed`` with the ``split_axis`` it was cut along."""
    if not getattr(t, "is_distributed", False) or getattr(t, "split_axis", None) is None:
        return None
    try:
        group = paddle.distributed.fleet.get_hybrid_communicate_group()
        size, rank = group.get_model_parallel_world_size(), group.get_model_parallel_rank()
    except Exception:  # fleet not initialised: no model-parallel group to place it in
        return None
    if size < 2:
        return None
    shape = list(t.shape)
    shape[t.split_axis] *= size
    return {"placements": [f"S({t.split_axis})"], "mesh": [size], "coord": [rank], "global_shape": shape,
            "source": "fleet"}


def placement(t):
    """How a distributed tensor is spread over the ranks of its process mesh (1-D meshes: ``S(d)``, ``R``,
    ``P(sum)``), a fleet model-parallel parameter's split axis, or None."""
    if not _is_dist(t):
        return _fleet_placement(t)
    mesh = t.process_mesh
    ids = list(mesh.process_ids)
    rank = paddle.distributed.get_rank()
    return {"placements": [_placement_text(p) for p in t.placements], "mesh": list(mesh.shape),
            "coord": [ids.index(rank)] if rank in ids and len(mesh.shape) == 1 else [], "global_shape": list(t.shape)}


def to_stored(t):
    """(numpy array of the tensor's bits, dtype name), or None for dtypes a trace cannot hold."""
    name = _dtype_name(t)
    if name is None:
        return None
    t = local(t)
    try:
        if not t._is_initialized():
            return None
    except AttributeError:
        pass
    arr = _host_view(t) if name in _DLPACK_DTYPES else None
    if arr is None:
        arr = np.asarray(t.numpy())  # copies to host; works for any place, layout and dtype
    if name == "bfloat16":
        return arr.view(np.uint16), name
    if name.startswith("float8"):
        return arr.view(np.uint8), name
    return arr, name


_DLPACK_DTYPES = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}
# dtypes the C kernel reads where they lie (``stats_at``), by Paddle's dtype object (naming it costs a string)
_READ_IN_PLACE = {paddle.float32: "float32", paddle.float64: "float64", paddle.bfloat16: "bfloat16"}


def fast_stats(t):
    """Statistics of a contiguous float32, float64 or bfloat16 CPU tensor read where it lies by the C kernel
    (``stats_at``: its ``data_ptr()`` is its first element's, its offset included), or None: numpy takes them
    from a view or a copy of its bytes (``to_stored``): a small tensor's summary took 7.8 us that way (a float32
    one viewed through DLPack; a bfloat16 one copied for numpy to widen), 2.3 us here."""
    kind = _READ_IN_PLACE.get(t.dtype)
    if kind is None or _is_dist(t):
        return None
    try:
        if not (t._is_initialized() and t.is_contiguous() and t.place.is_cpu_place()):
            return None
        address = t.data_ptr()
    except (AttributeError, RuntimeError, ValueError):  # a Paddle without these, a tensor without memory
        return None
    return stats_at(address, math.prod(t.shape), kind)  # None: a value not finite (numpy counts them)


def _fingerprint(array) -> tuple:
    """Wrapping sum and xor of the 64-bit words (plus the tail bytes): detects an update at memory speed;
    two different byte strings agreeing on both is vanishingly unlikely (unlike CRC32, no table walk)."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    whole = raw.size // 8 * 8
    words = raw[:whole].view(np.uint64)
    return int(np.add.reduce(words, dtype=np.uint64)), int(np.bitwise_xor.reduce(words)), raw[whole:].tobytes()


def _host_view(t):
    """A zero-copy numpy view of a CPU tensor through DLPack (the session reads it at once, before the tensor
    can change), or None where DLPack cannot serve it."""
    try:
        if not t.place.is_cpu_place():
            return None
        return np.from_dlpack(t.detach())
    except Exception:
        return None


_ORIGIN = "_layerdiff_origin"  # on a tap's copy: (original's identity, copy's inplace version, weakref to original)


def _own_identity(t):
    try:
        ptr = t.data_ptr()
    except Exception:  # uninitialized or not a dense tensor
        return None
    strides = getattr(t, "strides", None)
    return ptr, tuple(t.shape), tuple(strides) if strides is not None else None, str(t.dtype), \
        t.inplace_version, str(t.place)


def identify(t):
    """Equal for two tensors only while they show the same bytes (in-place ops bump ``inplace_version``); None
    for distributed tensors (their local parts are fresh tensors).

    A gradient tap's copy answers with its original's identity while it is not modified itself and the original
    is alive (so that the original's address cannot have been reused by another tensor): it shows the bytes that
    were recorded for the original.
    """
    if _is_dist(t):
        return None
    origin = getattr(t, _ORIGIN, None)
    if origin is not None and origin[1] == t.inplace_version and origin[2]() is not None:
        return origin[0]
    return _own_identity(t)


def describe(t):
    return _dtype_name(t), list(t.shape)


def autocast_dtypes() -> list[str]:
    """The dtype ``paddle.amp.auto_cast`` computes in right now (empty while it is off: always on the CPU, where
    Paddle's auto_cast casts nothing)."""
    if not paddle.amp.is_autocast_enabled():
        return []
    name = str(paddle.amp.get_autocast_dtype()).removeprefix("paddle.")
    return [name] if name in FLOAT_DTYPES else []


def distributed() -> RankPlace | None:
    """This process's place in a paddle.distributed job of several ranks (None when it runs alone)."""
    import paddle.distributed as dist

    try:
        world = dist.get_world_size()
    except Exception:
        return None
    if world < 2 or not dist.is_initialized():
        return None
    return {"rank": dist.get_rank(), "world_size": world, "backend": "paddle",
            "local_rank": int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", dist.get_rank())))}






def assign(param, array: np.ndarray, dtype: str):
    """Copy stored bits into a parameter (cast to the parameter's dtype if they differ)."""
    if dtype == "bfloat16":
        value = paddle.to_tensor(array.view(np.uint16).copy()).view(paddle.bfloat16)
    else:
        value = paddle.to_tensor(array.copy())
    if value.dtype != param.dtype:
        value = value.astype(param.dtype)
    param.set_value(value)


def to_framework(array: np.ndarray, like):
    """A tensor holding ``array``'s values with ``like``'s dtype and place (a reference value for replay)."""
    value = paddle.to_tensor(np.ascontiguousarray(array), place=like.place)
    return value if value.dtype == like.dtype else value.astype(like.dtype)


class _GradTap(paddle.autograd.PyLayer):
    """Identity in forward (returns copies); in backward, hands the incoming gradients to a callback.
    Under replay a ``ForcePlan`` swaps in the reference's values and gradients.

    Gradients are not materialized, so an output that received none is reported as None (not as zeros), like
    the torch tap; Paddle crashes on a PyLayer backward returning None, so zeros are passed on in its place.
    """

    @staticmethod
    def forward(ctx, callback, plan, *tensors):
        ctx.callback, ctx.plan = callback, plan
        ctx.set_materialize_grads(False)
        ctx.like = [(list(t.shape), t.dtype) for t in tensors]
        copies = tuple(t.clone() for t in (plan.forward(tensors) if plan else tensors))
        return copies if len(copies) > 1 else copies[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback(grads)
        if ctx.plan:
            grads = ctx.plan.backward(grads)
        grads = tuple(paddle.zeros(shape, dtype) if g is None else g for g, (shape, dtype) in zip(grads, ctx.like))
        return grads if len(grads) > 1 else grads[0]


def _differentiable(t) -> bool:
    return not t.stop_gradient and (paddle.is_floating_point(t) or paddle.is_complex(t))


class Hooks(ModuleHooks):
    """Registers forward hooks on every sublayer (plus gradient taps and parameter-gradient hooks)."""

    differentiable = staticmethod(_differentiable)

    def register_forward_hooks(self, layer, pre_hook, post_hook) -> list:
        return [layer.register_forward_pre_hook(pre_hook, with_kwargs=True),
                layer.register_forward_post_hook(post_hook, with_kwargs=True, always_call=True)]

    def register_param_grad_hooks(self):
        """The reduce hooks cannot be removed (``remove`` only clears ``active``), so they hold weak references."""
        me = weakref.ref(self)
        for name, p in self.params:
            if not p.stop_gradient:
                p._register_backward_hook(_param_grad_hook(me, name, weakref.ref(p)))

    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def recomputing(self, frame) -> bool:
        # and Paddle's non-reentrant recompute: its saved tensors' ``unpack`` runs the forward again
        return super().recomputing(frame) or running_frame(
            frame, "paddle.distributed.fleet.recompute.recompute", ("unpack",)) is not None

    def apply_tap(self, tensors, report, frame, outputs, plan=None):
        """Copies (see the module docstring); each answers with its original's identity while unmodified."""
        copies = _GradTap.apply(report, plan, *tensors)
        if is_tensor(copies):
            copies = (copies,)
        for i, (t, copy) in enumerate(zip(tensors, copies)):
            if plan is not None and plan.values[i] is not None:
                continue  # a replay's forced value: its bytes are the reference's, not the original's
            identity = identify(t)
            if identity is not None:
                try:
                    setattr(copy, _ORIGIN, (identity, copy.inplace_version, weakref.ref(t)))
                except Exception:
                    pass
        return copies

    def watch_inputs(self, frame, needs, swap):
        """The layer sees the tap's copies: watch those, and remember the caller's tensor to write back into."""
        frame.versions = [(swap[id(t)], swap[id(t)].inplace_version, t) for _, t in needs]

    def check_in_place(self, frame) -> bool:
        changed = [(alias, original) for alias, v, original in frame.versions if alias.inplace_version != v]
        # the layer changed the tap's copy: write it back into the caller's tensor, with autograd, so
        # the caller sees (and differentiates through) the change as it would without the tap
        for alias, original in changed:
            paddle.assign(alias, output=original)
        return bool(changed)

    def param_version(self, p):
        """Paddle's optimizers (``sgd_``, ``adamw_``, ...) and ``set_value`` update parameters in place without
        bumping ``inplace_version``, so a change is detected from a fingerprint of the bytes (read through a
        zero-copy view), together with the version and the data pointer. Exact, unlike the base class's
        "after a backward" rule, which would rewrite unchanged weights after every backward.
        """
        try:
            stored = to_stored(p)
            checksum = _fingerprint(stored[0]) if stored else None
            return p.inplace_version, p.data_ptr(), checksum
        except Exception:
            return None


    # -- operations inside modules (``ops`` tracing): adapters/paddle_ops.py -------------------------------------
    def intercept_ops(self, capture):
        from layerdiff.adapters import paddle_ops

        return paddle_ops.intercepted(capture)

    def framework_leaf(self, module) -> bool:
        from layerdiff.adapters.paddle_ops import framework_leaf

        return framework_leaf(module)

    def named_buffers(self):
        return each_named(self.model, lambda part: part.named_buffers())

    def op_gradients(self):
        from layerdiff.adapters.paddle_ops import gradients

        return gradients()

    def op_scalar(self, obj):
        from layerdiff.adapters.paddle_ops import scalar

        return scalar(obj)

    def op_framework_dirs(self) -> list[str]:
        from layerdiff.adapters.paddle_ops import framework_dirs

        return framework_dirs()


def _param_grad_hook(hooks_ref, name, param_ref):
    def hook():
        hooks, p = hooks_ref(), param_ref()
        if hooks is None or not hooks.active or p is None:
            return
        hooks.record_param_grad(name, p.grad)

    return hook


_FLAGS = ("FLAGS_cudnn_deterministic", "FLAGS_embedding_deterministic", "FLAGS_cpu_deterministic",
          "FLAGS_cudnn_exhaustive_search", "FLAGS_cudnn_batchnorm_spatial_persistent", "FLAGS_use_mkldnn",
          "FLAGS_paddle_num_threads", "FLAGS_enable_pir_api")


def _flags() -> dict:
    """Determinism-related flags: from paddle.get_flags when this build registers them, else the environment."""
    out = {}
    for flag in _FLAGS:
        try:
            value = paddle.get_flags([flag])[flag]
        except Exception:
            value = os.environ.get(flag)
        if value is not None:
            out[flag] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def rng_state() -> str | None:
    """A fingerprint of Paddle's random generators' state now (each one's pickling state: its seed, offset and
    engine), as torch's adapter takes one: a forward that left it as it was drew no dropout mask. None where this
    Paddle's generators cannot say."""
    import xxhash

    digest = xxhash.xxh3_64()
    try:
        for state in paddle.get_rng_state():
            for part in state.__getstate__():  # a list of ints: packed, 3x faster than its text
                digest.update(array.array("q", part).tobytes() if isinstance(part, list) else repr(part).encode())
    except (AttributeError, TypeError, OverflowError, RuntimeError):
        return None
    return digest.hexdigest()


def metadata(model) -> dict:
    """Framework, devices, dtypes, seeds and determinism flags: what explains most 'same model' mismatches."""
    params = list(model.parameters())
    meta = {
        "framework": PaddleAdapter.name,
        "framework_version": paddle.__version__,
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "num_parameters": int(sum(int(np.prod(p.shape)) for p in params)),
        "devices": sorted({str(p.place) for p in params}) or [str(paddle.get_device())],
        "param_dtypes": sorted({_dtype_name(p) or str(p.dtype) for p in params}),
        "default_dtype": str(paddle.get_default_dtype()),
        "device": str(paddle.get_device()),
        "cuda": paddle.version.cuda() if hasattr(paddle, "version") else None,
        "cpu": platform.processor() or platform.machine(),
        "training": bool(model.training),
    }
    try:
        meta["seed"] = int(paddle.get_rng_state()[0].current_seed())
    except Exception:
        pass
    random = rng_state()
    if random is not None:
        meta["rng_state"] = random
    flags = _flags()
    meta["flags"] = flags
    for flag in ("FLAGS_cudnn_deterministic", "FLAGS_embedding_deterministic"):
        if flag in flags:
            meta[flag[len("FLAGS_"):]] = flags[flag]
    threads = flags.get("FLAGS_paddle_num_threads")
    if threads is not None:
        try:
            meta["num_threads"] = int(threads)
        except (TypeError, ValueError):
            pass
    return meta


class PaddleAdapter(FrameworkAdapter):
    """PaddlePaddle (dygraph): ``paddle.nn.Layer`` models of ``paddle.Tensor`` tensors (auto-parallel placements
    and fleet's tensor-parallel parameters recorded)."""

    name = "paddle"
    is_tensor = staticmethod(is_tensor)
    dtype_name = staticmethod(_dtype_name)
    to_stored = staticmethod(to_stored)
    identify = staticmethod(identify)
    describe = staticmethod(describe)
    fast_stats = staticmethod(fast_stats)
    autocast_dtypes = staticmethod(autocast_dtypes)
    random_state = staticmethod(rng_state)
    placement = staticmethod(placement)
    metadata = staticmethod(metadata)
    distributed = staticmethod(distributed)
    assign = staticmethod(assign)
    to_framework = staticmethod(to_framework)
    hooks_class = Hooks
    records_ops = True
    gradients_keep_identity = False  # its backward kernels reuse gradient buffers in place

    def named_modules(self, model):
        return model.named_sublayers(include_self=True)

    def named_parameters(self, model):
        return model.named_parameters()


ADAPTER = PaddleAdapter()
