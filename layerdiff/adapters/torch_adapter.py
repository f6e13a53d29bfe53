"""PyTorch adapter: module hooks in, numpy views out. Imports torch; nothing else in layerdiff does."""
from __future__ import annotations

import functools
import math
import os
import platform
import sys
import threading
import weakref
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from layerdiff.adapters import megatron_facts, torch_data_parallel, torch_pipelining
from layerdiff.adapters.base import FrameworkAdapter, RankPlace
from layerdiff.adapters.frames import running_frame
from layerdiff.adapters import torch_ops
from layerdiff.adapters.torch_ops import eager
from layerdiff.capture.hooks import ModuleHooks
from layerdiff.capture.parts import ModelParts, each_named, parts_of
from layerdiff.capture.session import DeferredStats
from layerdiff.runs.parallel import ParallelLayout
from layerdiff.tracefile.tensors import READS_SLICES, SHARES_THREADS, stats_at, stats_strided

_DTYPE_NAMES = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
    torch.uint8: "uint8", torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types: no subclass (a DTensor, an async result)


def is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


def _is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t: torch.Tensor):
    """What this process holds of ``t``, as a plain tensor: a DTensor's local shard (with its placement recorded
    separately), an async collective's result (waiting for it), the tensor itself otherwise; None if a tensor
    subclass cannot be read."""
    if type(t) in _PLAIN:
        return t
    if _is_dtensor(t):
        return t.to_local()
    plain = t.detach().clone()  # AsyncCollectiveTensor: any op waits for the collective and unwraps it
    return plain if type(plain) is torch.Tensor else None


def placement(t: torch.Tensor):
    """How a tensor is spread over ranks: DTensor placements (``S(0)``, ``R``, ``P(sum)``) on their device mesh,
    or a Megatron tensor-parallel parameter's partition dimension; None for an ordinary tensor."""
    if type(t) is torch.Tensor:  # neither a DTensor (a subclass) nor a parameter: no attribute lookups that miss
        return None
    if _is_dtensor(t):
        mesh = t.device_mesh
        return {"placements": [str(p) for p in t.placements], "mesh": list(mesh.shape),
                "coord": list(mesh.get_coordinate() or []), "global_shape": list(t.shape)}
    if getattr(t, "tensor_model_parallel", False) and hasattr(t, "partition_dim"):
        state = sys.modules.get("megatron.core.parallel_state")  # set by Megatron itself; never imported here
        size = state.get_tensor_model_parallel_world_size() if state else 1
        if state is not None and size > 1:
            shape = list(t.shape)
            shape[t.partition_dim] *= size
            return {"placements": [f"S({t.partition_dim})"], "mesh": [size],
                    "coord": [state.get_tensor_model_parallel_rank()], "global_shape": shape, "source": "megatron"}
    return None


def dtype_name(t: torch.Tensor) -> str | None:
    """The trace's name of the tensor's dtype ("bfloat16", "float8_e4m3fn", ...), or None if a trace cannot hold it."""
    return _DTYPE_NAMES.get(t.dtype)


def bytes_present(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds every element ``t`` addresses. FSDP frees a gathered weight by resizing
    its storage to nothing, leaving views of it with their sizes and an address into freed memory: read there (a
    numpy view through DLPack, the C kernel, a device kernel) the process died of a segmentation fault. Such a
    tensor holds no values any more: nothing reads it, it is not recorded."""
    n = t.numel()
    if n == 0:
        return True
    if t.is_contiguous():  # most tensors, and every one the kernel reads in place: n elements from the offset on
        end = t.storage_offset() + n
    else:
        end = t.storage_offset() + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return t.untyped_storage().nbytes() >= end * t.element_size()


def to_stored(t: torch.Tensor):
    """(numpy array of the tensor's bits, dtype name), or None for dtypes a trace cannot hold and for a tensor whose
    bytes are gone (``bytes_present``)."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None or t.is_meta:
        return None
    if type(t) in _PLAIN and t.is_cpu and t.layout == torch.strided:
        t = t.detach()  # the common case (a plain tensor in memory): no conversions to try one by one
        if not bytes_present(t):
            return None
    else:
        t = local(t)
        if t is None:
            return None
        t = t.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        if not bytes_present(t):
            return None
        if t.device.type != "cpu":
            t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if name == "bfloat16":
        return host_array(t.view(torch.int16)).view(np.uint16), name
    if name.startswith("float8"):
        return host_array(t.view(torch.uint8)), name
    return host_array(t), name


def host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes, through DLPack, not ``Tensor.numpy()``: that marks the tensor's storage
    as never to be resized again, and FSDP frees a gathered weight by resizing its storage to nothing ("Trying to
    resize storage that is not resizable": a trace with operations recorded crashed an FSDP2 model at its first
    reshard). The view lives only while the tensor is summarized and its bytes copied (1.4 us more a tensor)."""
    return np.from_dlpack(t)


def identify(t: torch.Tensor):
    """Equal for two tensors only while they show the same bytes (in-place ops bump ``_version``). One flat tuple
    (sizes, then strides: as many of each): a trace keeps one a tensor for the step, and nested tuples were two more
    objects each for the garbage collector to visit."""
    if t.layout != torch.strided or t.is_meta or type(t) not in _PLAIN:
        return None
    return (t.data_ptr(), t._version, t.dtype, t.device, *t.shape, *t.stride())


def plus_bias(output: torch.Tensor, bias: torch.Tensor) -> torch.Tensor | None:
    """``output + bias`` outside the graph (``FrameworkAdapter.plus_bias``); None for a tensor subclass (a DTensor:
    the sum would be another distributed tensor, not the local part the trace records)."""
    if type(output) not in _PLAIN or type(bias) not in _PLAIN:
        return None
    with torch.no_grad():
        return output.detach() + bias.detach()


def version(t: torch.Tensor) -> int | None:
    """The in-place version counter of a tensor that ``identify`` knows (None for others)."""
    return t._version if type(t) in _PLAIN else None


_MAX_GRAPH_WALK = 512  # autograd nodes visited per call of a module that owns a tied weight
_FLOAT_BASES = (torch.float32, torch.float64)  # reduced as they are; narrower floats are widened to float32
# whether ATen runs its CPU operations on OpenMP's threads: the kernel then reads a large tensor with those threads,
# each the share it wrote (``stats_at``): a traced Llama step with ``--ops`` 2.66x -> 2.45x the untraced step
_OPENMP_ATEN = "parallel backend: OpenMP" in torch.__config__.parallel_info()
# Whether the C kernel takes the statistics of float32 and bfloat16 CPU tensors of any size: where it reads them with
# torch's threads it beats torch's reductions at every size (float32: 69 us against 323 at 1M elements, 1.5 ms
# against 5.0 at 16M; bfloat16: 3.0 ms against 9.8 at 16M; a traced step of a Llama with 16M-element logits: the
# module-level trace's cost 92 -> 64 ms). Alone, one thread against torch's two, it wins below 1M elements only.
KERNEL_READS_ANY_SIZE = _OPENMP_ATEN and SHARES_THREADS
# Elements from which a CPU tensor's statistics are torch's own reductions rather than numpy's or the C kernel's
# (measured in a traced step: float16 and 8-bit floats, which numpy must first widen in whole-array temporaries, are
# 1.1x (128K) to 3x (8M) faster in torch; float32 and bfloat16 from 1M elements, where the kernel does not read them in
# place with torch's threads: ``KERNEL_READS_ANY_SIZE``). Tensors on an accelerator (CUDA, NPU, XPU, MPS) always are:
# their statistics are reduced where they live; four numbers cross to the host.
_CPU_STATS_MIN = {torch.float32: 1 << 20, torch.bfloat16: 1 << 20, torch.float16: 1 << 17}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _CPU_STATS_MIN[getattr(torch, _name)] = 1 << 17
_STATS_CHUNK = 1 << 18  # CPU: 1 MB of fp32 per piece, so the second and third pass read it from the cache
_DEVICE_CHUNK = 1 << 26  # accelerators: bounds the float32/float64 temporaries of a huge tensor
_NORM_ROW = 1024  # elements per partial sum of squares


def _on_accelerator(t: torch.Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


# CPU dtypes the C kernel reads where they lie (``stats_at``), below the sizes torch takes
_READ_IN_PLACE = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel()`` slots from ``data_ptr()`` on, in some order: contiguous, or a
    permutation of a contiguous layout (a transpose), as statistics may read them."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda dim: dim[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def cpu_route(t: torch.Tensor) -> str | None:
    """Which path takes a CPU tensor's statistics, as measured fastest in a traced step: "torch" (its own
    reductions: large floating tensors, ``_CPU_STATS_MIN``), "kernel" (the C kernel reads a dense float32, float64
    or bfloat16 tensor where it lies: ``stats_at``), "strided" (it gathers a smaller one that is not dense, a
    slice, where it lies: ``stats_strided``), or None (numpy, from a view of its bytes: other dtypes, a tensor
    whose elements share memory). A dense float32 or bfloat16 tensor of any size is the kernel's where it reads
    with torch's threads (``KERNEL_READS_ANY_SIZE``)."""
    large = t.numel() >= _CPU_STATS_MIN.get(t.dtype, math.inf)
    if large and not KERNEL_READS_ANY_SIZE:
        return "torch"
    if t.dtype in _READ_IN_PLACE and type(t) in _PLAIN and t.layout == torch.strided and not t.is_neg():
        if _dense(t):
            return "kernel"
        if not large and READS_SLICES and 0 not in t.stride():
            return "strided"
    return "torch" if large else None


def fast_stats(t: torch.Tensor):
    """The tensor's statistics taken where it lies, or None to let numpy take them from a view of its bytes.

    Torch takes them for floating tensors on an accelerator (no copy of the tensor leaves the device) and for large
    enough CPU tensors; the C kernel for the others of the dtypes it reads, dense or smaller slices (``cpu_route``).
    A DTensor's are its local shard's, like the bytes ``to_stored`` keeps.
    """
    if t.is_cpu:
        if type(t) not in _PLAIN and _is_dtensor(t):  # its local shard's, taken as that shard's own would be
            shard = t.to_local()
            return fast_stats(shard) if type(shard) in _PLAIN else None
        route = cpu_route(t)
        if route is None or (route != "torch" and not bytes_present(t)):  # the kernel reads only bytes still there
            return None
        if route == "strided":  # None: a value not finite (numpy counts them)
            return stats_strided(t.data_ptr(), _READ_IN_PLACE[t.dtype], tuple(t.shape), t.stride())
        if route == "kernel":
            stats = stats_at(t.data_ptr(), t.numel(), _READ_IN_PLACE[t.dtype], _OPENMP_ATEN)
            if stats is not None or t.numel() < _CPU_STATS_MIN.get(t.dtype, math.inf):
                return stats  # None: a value not finite (numpy counts them) or no kernel built
            return framework_stats(t)  # a large one holding NaN or Inf: torch counts them, where numpy would copy it
    if not t.is_floating_point() or t.layout != torch.strided or t.is_meta:
        return None
    threshold = 0 if _on_accelerator(t) else _CPU_STATS_MIN.get(t.dtype, math.inf)
    if t.numel() < threshold:  # before ``local``: a shard is never larger, and a subclass's is a copy
        return None
    shard = local(t)
    if shard is None or shard.numel() == 0 or not bytes_present(shard):
        return None
    if not _on_accelerator(shard):
        return framework_stats(shard) if shard.numel() >= threshold else None
    try:
        return framework_stats(shard)
    except (RuntimeError, TypeError, NotImplementedError):  # a backend without a kernel or dtype used here (MPS
        return None  # has no float64): the tensor is summarized on the host; its own error, if any, surfaces there


_DEFERRED_CHUNK = 1 << 26  # accelerators: bounds the float32 temporary of a narrower tensor's reductions


class DeviceStats(DeferredStats):
    """A tensor's statistics queued on its accelerator now and read back later, in a batch with others: its
    minimum and maximum, its sum (accumulated in float64) and its L2 norm (in float32 at least), as 0-dimensional
    device tensors: three kernels, whatever its layout (reduced as it lies, no copy, no reshape; an 8-bit float is
    widened first). NaN or Inf show in them; such a tensor is counted and summarized over its finite values when
    read back if it is still as it was (its version counter), else it keeps a count of one NaN or Inf (a lower
    bound) and no min, max, mean or norm."""

    __slots__ = ("source", "version", "numel", "parts")

    def __init__(self, t: torch.Tensor):
        super().__init__(None)
        values = t.detach()
        n = values.numel()
        # a huge tensor in pieces: bounds the temporaries of its reductions
        pieces = (values,) if n <= _DEFERRED_CHUNK else values.reshape(-1).split(_DEFERRED_CHUNK)
        narrow = values.element_size() == 1  # 8-bit floats: torch reduces none of them as they are
        norm_dtype = None if values.dtype in _FLOAT_BASES or narrow else torch.float32
        self.parts = []
        for part in pieces:
            if narrow:
                part = part.float()
            lo, hi = torch.aminmax(part)
            norm = torch.linalg.vector_norm(part, dtype=norm_dtype)
            self.parts.append((lo, hi, part.sum(dtype=torch.float64), norm))
        self.source, self.version, self.numel = weakref.ref(t), t._version, n


# Accelerators: a tensor of up to ``STAGED_MAX`` elements is copied into its device's staging buffer of
# ``STAGING`` float64 elements (32 MiB, allocated on first use), one kernel, rather than reduced alone, three. A
# segment reduction gives each segment one block of threads: a batch takes as long as its largest tensor alone (on
# an H200, staging tensors of up to 2M elements made an 8-layer model's traced step 2.6x slower, not faster).
STAGING = 1 << 22
STAGED_MAX = 1 << 18


class StagedStats(DeferredStats):
    """A small tensor's statistics on an accelerator: its values copied now (widened to float64) into its device's
    staging buffer, then reduced with the rest of the buffer's batch (``StagingBuffer.reduce``). Why: on a small
    model the three reductions of ``DeviceStats`` cost their launches, not their arithmetic (about 100 us a tensor
    on an H200's host, against a traced step of 15 ms: tools/bench_gpu.py)."""

    __slots__ = ("source", "version", "numel", "batch", "index")

    def __init__(self, t: torch.Tensor):
        super().__init__(None)
        self.source, self.version, self.numel = weakref.ref(t), t._version, t.numel()
        self.batch: torch.Tensor | None = None  # (4, members) float64 on the device: min, max, sum, sum of squares
        self.index = 0


class StagingBuffer:
    """One device's staging buffer and the tensors copied into it since it was last reduced. A copy and the
    reductions after it run in the order they were queued (the calling thread's stream), so the buffer is reused
    at once; results stay on the device until read back. Copies and reductions queued on different streams are
    not ordered between them (as ``DeviceStats``' reductions and their read-back are not): autograd runs each
    backward step on its forward step's stream, one stream for most models. ``segments``: whether the device has
    segment reductions; where a backend has none (found at the first batch, or told), each member is reduced
    alone, as its slice."""

    def __init__(self, device: torch.device, capacity: int = STAGING, segments: bool = True):
        self.buffer = torch.empty(capacity, dtype=torch.float64, device=device)
        self.segments = segments
        self.used = 0
        self.members: list[StagedStats] = []
        self.lengths: list[int] = []

    def stage(self, t: torch.Tensor) -> StagedStats:
        n = t.numel()
        if n > self.buffer.numel():
            raise ValueError(f"{n} elements do not fit a staging buffer of {self.buffer.numel()}")
        if self.used + n > self.buffer.numel():
            self.reduce()
        self.buffer[self.used:self.used + n].view(t.shape).copy_(t.detach())
        stats = StagedStats(t)
        self.members.append(stats)
        self.lengths.append(n)
        self.used += n
        return stats

    def reduce(self) -> None:
        """The batch's reductions queued (five kernels, whatever its size); its members point at them."""
        if not self.members:
            return
        data = self.buffer[:self.used]
        batch = None
        if self.segments:
            try:
                batch = self._segment_reductions(data)
            except (RuntimeError, NotImplementedError):  # a backend without them
                self.segments = False
        if batch is None:
            batch = self._reductions_one_by_one(data)
        for index, member in enumerate(self.members):
            member.batch, member.index = batch, index
        self.members, self.lengths, self.used = [], [], 0

    def _segment_reductions(self, data: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        if data.device.type == "cuda":  # from pinned memory: copied without waiting for the device
            lengths = lengths.pin_memory()
        lengths = lengths.to(data.device, non_blocking=True)
        # ``unsafe``: the lengths are not checked against the data, a check that waits for the device
        return torch.stack([torch.segment_reduce(values, how, lengths=lengths, unsafe=True)
                            for values, how in ((data, "min"), (data, "max"), (data, "sum"), (data * data, "sum"))])

    def _reductions_one_by_one(self, data: torch.Tensor) -> torch.Tensor:
        rows = []
        for part in data.split(self.lengths):
            lo, hi = torch.aminmax(part)
            rows.append(torch.stack([lo, hi, part.sum(), part.dot(part)]))
        return torch.stack(rows, dim=1)


def _read_back(tensors: list) -> list[float]:
    """Device tensors of any float dtypes and shapes, as one flat list of Python floats (each tensor's elements in
    order, one tensor after the other): one concatenation a dtype, one transfer. Why: converting each statistic
    first cost a kernel a statistic (four a tensor: 9,300 launches in five traced steps of the toy on an H200, a
    third of the traced step)."""
    groups: dict[Any, list[int]] = {}
    for i, v in enumerate(tensors):
        groups.setdefault(v.dtype, []).append(i)
    joined = torch.cat([torch.cat([tensors[i].reshape(-1) for i in members]).to(torch.float64)
                        for members in groups.values()]).cpu().tolist()
    by_tensor: list[list[float]] = [[] for _ in tensors]
    at = 0
    for members in groups.values():
        for i in members:
            n = tensors[i].numel()
            by_tensor[i] = joined[at:at + n]
            at += n
    return [v for values in by_tensor for v in values]


class DeviceDeferral:
    """The statistics of a trace's tensors on accelerators, left on the device until read back in batches.

    Why: on a GPU, each statistic reduced where the tensor lives and read back at once costs a dozen small kernels
    launched from Python (~10 us each) and a synchronization: several times the model's own step on a small model
    (measured on an H200, tools/bench_gpu.py). Here a small tensor costs one kernel (a copy into a staging buffer,
    ``StagedStats``) and a larger one three (``DeviceStats``), queued at once (so they see its values as they are
    now, whatever runs after); a batch's results cross to the host together. Autograd calls back from threads of
    its own: staging is locked."""

    def __init__(self) -> None:
        self.staging: dict[torch.device, StagingBuffer | None] = {}  # None: that device stages nothing
        self.lock = threading.Lock()

    def add(self, t: torch.Tensor) -> DeferredStats | None:
        """The tensor's statistics, deferred; None for what is summarized otherwise (the host's tensors)."""
        if t.is_cpu or not _on_accelerator(t) or not t.is_floating_point() or t.layout != torch.strided:
            return None
        shard = local(t)
        if shard is None or shard.numel() == 0 or not bytes_present(shard):
            return None
        if shard.numel() <= STAGED_MAX:
            with self.lock:
                staged = self._staged(shard)
            if staged is not None:
                return staged
        try:
            return DeviceStats(shard)
        except (RuntimeError, TypeError, NotImplementedError):  # no kernel or dtype used here
            return None

    def _staged(self, t: torch.Tensor) -> StagedStats | None:
        """``t`` staged on its device; None where that device stages nothing (no float64, as on MPS, or a copy
        into the buffer failed there once: it is not tried again)."""
        device = t.device
        if device not in self.staging:
            try:
                self.staging[device] = StagingBuffer(device) if device.type != "mps" else None
            except (RuntimeError, TypeError, NotImplementedError):
                self.staging[device] = None
        staging = self.staging[device]
        if staging is None:
            return None
        try:
            return staging.stage(t)
        except (RuntimeError, TypeError, NotImplementedError):
            staging.reduce()  # what it holds is read as usual
            self.staging[device] = None
            return None

    def read(self, pending: list) -> None:
        """Every pending statistic read back: one transfer for the whole batch."""
        with self.lock:
            for staging in self.staging.values():
                if staging is not None:
                    staging.reduce()
        direct = [p for p in pending if isinstance(p, DeviceStats)]
        staged = [p for p in pending if isinstance(p, StagedStats) and p.batch is not None]
        batches = list({id(m.batch): m.batch for m in staged if m.batch is not None}.values())
        if not direct and not batches:
            return
        values = iter(_read_back([v for p in direct for part in p.parts for v in part] + batches))
        for alone in direct:
            parts = [[next(values) for _ in range(4)] for _ in alone.parts]
            alone.parts = []
            lo, hi = min(r[0] for r in parts), max(r[1] for r in parts)
            _settle(alone, lo, hi, sum(r[2] for r in parts), sum(r[3] ** 2 for r in parts))
        rows: dict[int, tuple[list[float], int]] = {}  # id(batch) -> (its values, row by row; its members)
        for batch in batches:
            rows[id(batch)] = ([next(values) for _ in range(batch.numel())], batch.shape[1])
        for member in staged:
            (flat, k), i = rows[id(member.batch)], member.index
            lo, hi, total, square = flat[i], flat[k + i], flat[2 * k + i], flat[3 * k + i]
            member.batch = None
            _settle(member, lo, hi, total, square)


def _settle(p: Any, lo: float, hi: float, total: float, square: float) -> None:
    """A deferred statistic's result from its reductions: summarized over its finite values where they were not all
    finite and the tensor is still as it was (its version counter); else a count of one NaN or Inf (a lower bound)
    and no min, max, mean or norm."""
    if all(math.isfinite(v) for v in (lo, hi, total, square)):
        p.result = {"numel": p.numel, "min": lo, "max": hi, "mean": total / p.numel, "l2": math.sqrt(square),
                    "nan": 0, "inf": 0}
        return
    source = p.source()
    if source is not None and source._version == p.version:  # still as it was: its finite values
        p.result = _stats_skipping_nonfinite(local(source).detach().reshape(-1), _DEVICE_CHUNK)
    else:  # changed or gone since: at least one NaN (or Inf), nothing more is known
        nan = any(math.isnan(v) for v in (lo, hi, total, square))
        p.result = {"numel": p.numel, "min": None, "max": None, "mean": None, "l2": None,
                    "nan": int(nan), "inf": int(not nan)}


# the child of a module that only wraps it to change how it runs (torch's activation checkpointing and CPU offload
# wrappers, as torchtitan and FSDP recipes apply them; FSDP1's ``FullyShardedDataParallel`` units): the wrapper is
# left out, its child named as one process without it names it (``layers.0``, not
# ``layers.0._checkpoint_wrapped_module``), as torch's state dicts do
WRAPPED_CHILDREN = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def wrapped_child(module: Any) -> Any:
    """The module a wrapper (``WRAPPED_CHILDREN``) wraps, or None for any other module."""
    for attribute in WRAPPED_CHILDREN:
        child = getattr(module, attribute, None)
        if isinstance(child, torch.nn.Module):
            return child
    return None


def unwrapped_names(named: Iterable[tuple[str, Any]], skip_wrappers: bool = False) -> Iterator[tuple[str, Any]]:
    """``named``'s (name, object) pairs without the wrappers' child segments in the names; ``skip_wrappers``:
    without the wrapper modules themselves (their child takes their name)."""
    for name, obj in named:
        if skip_wrappers and wrapped_child(obj) is not None:
            continue
        if any(child in name for child in WRAPPED_CHILDREN):
            name = ".".join(part for part in name.split(".") if part not in WRAPPED_CHILDREN)
        yield name, obj


def framework_stats(t: torch.Tensor) -> dict:
    """``summarize``'s statistics by torch's own (multi-threaded, or on-device) reductions, for any floating dtype.

    One read from memory: min/max, sum and sum of squares are taken piece by piece while the piece is in the
    cache, widened to float32 if narrower. The squares are summed as the norms of 1024-element rows (one pass, no
    temporary; float32 over 1024 elements stays within ~1e-7), squared and added in float64. Not ``torch.dot``: a
    single-threaded BLAS dot (``OMP_NUM_THREADS=1``, common in data-parallel jobs) was measured 2.4e-6 off
    numpy's float64 over 256K elements. The results reach the host together, once. NaN/Inf, or squares beyond
    float32's range, cost a second pass in float64 that counts and skips them.
    """
    flat = t.detach().reshape(-1)
    chunk = _DEVICE_CHUNK if _on_accelerator(flat) else _STATS_CHUNK
    lows, highs, sums, norms = [], [], [], []
    for part in flat.split(chunk):
        part = part if part.dtype in _FLOAT_BASES else part.float()  # faster than reducing bf16 as it is (measured)
        lo, hi = torch.aminmax(part)
        lows.append(lo)
        highs.append(hi)
        sums.append(part.sum())
        rows = part.numel() // _NORM_ROW * _NORM_ROW
        norms.append(torch.linalg.vector_norm(part[:rows].view(-1, _NORM_ROW), dim=1))
        if rows < part.numel():
            norms.append(torch.linalg.vector_norm(part[rows:]).reshape(1))
    summary = torch.stack([torch.stack(lows).min().double(), torch.stack(highs).max().double(),
                           torch.stack(sums).double().sum(), torch.cat(norms).double().square().sum()])
    lo, hi, total, square = summary.tolist()
    n = flat.numel()
    if all(math.isfinite(v) for v in (lo, hi, total, square)):
        return {"numel": n, "min": lo, "max": hi, "mean": total / n, "l2": math.sqrt(square), "nan": 0, "inf": 0}
    return _stats_skipping_nonfinite(flat, chunk)


def _stats_skipping_nonfinite(flat: torch.Tensor, chunk: int) -> dict:
    """Counts NaN and Inf and summarizes the finite rest in float64 (no boolean indexing: no sync per piece)."""
    counts, lows, highs, sums, squares = [], [], [], [], []
    for part in flat.split(chunk):
        part = part.double()
        finite = torch.isfinite(part)
        counts.append(torch.stack([torch.isnan(part).sum(), torch.isinf(part).sum()]))
        lows.append(torch.where(finite, part, math.inf).min())
        highs.append(torch.where(finite, part, -math.inf).max())
        kept = torch.where(finite, part, 0.0)
        sums.append(kept.sum())
        squares.append(torch.dot(kept, kept))
    nan, inf = torch.stack(counts).sum(dim=0).tolist()
    lo, hi, total, square = torch.stack([torch.stack(lows).min(), torch.stack(highs).max(), torch.stack(sums).sum(),
                                         torch.stack(squares).sum()]).tolist()
    n, kept = flat.numel(), flat.numel() - nan - inf
    if kept == 0:
        return {"numel": n, "min": None, "max": None, "mean": None, "l2": None, "nan": nan, "inf": inf}
    return {"numel": n, "min": lo, "max": hi, "mean": total / kept, "l2": math.sqrt(square), "nan": nan, "inf": inf}


def describe(t: torch.Tensor):
    """(dtype name, shape) of what ``fast_stats`` summarized: a DTensor's local shard, as ``to_stored`` keeps it."""
    return _DTYPE_NAMES[t.dtype], list(local(t).shape)


def device_fingerprints(ts: list) -> list:
    """Each tensor's sum and L2 norm in float64, reduced where it lives (an accelerator) and read back together:
    no copy to the host, one synchronization for all."""
    shards = [local(t).detach() for t in ts]
    values = torch.stack([torch.stack([s.sum(dtype=torch.float64), torch.linalg.vector_norm(s, dtype=torch.float64)])
                          for s in shards]).cpu().tolist()
    return [tuple(v) for v in values]


# where torch.autocast can be on: the CPU, and each accelerator this torch build knows by a type of its own
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_dtypes() -> list[str]:
    """The dtypes ``torch.autocast`` computes in right now, on any device (empty while it is off)."""
    return [_DTYPE_NAMES[torch.get_autocast_dtype(device)] for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)]


def distributed() -> RankPlace | None:
    """This process's place in a torch.distributed job of several ranks (None when it runs alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": str(dist.get_backend()),
            "local_rank": int(os.environ.get("LOCAL_RANK", dist.get_rank()))}


def assign(param, array: np.ndarray, dtype: str):
    """Copy stored bits into a parameter (cast to the parameter's dtype if they differ)."""
    if dtype == "bfloat16":
        value = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    elif dtype.startswith("float8"):
        value = torch.from_numpy(array.copy()).view(getattr(torch, dtype))
    else:
        value = torch.from_numpy(array.copy())
    with torch.no_grad():
        param.copy_(value)


def to_framework(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor holding ``array``'s values with ``like``'s dtype and device (a reference value for replay)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=like.device, dtype=like.dtype)


class _GradTap(torch.autograd.Function):
    """Identity in forward; in backward, hands the incoming gradients to a callback.

    Unlike ``register_full_backward_hook`` (whose outputs are views that forbid in-place ops on them),
    the tap returns detached aliases, so models that modify activations in place trace unchanged.
    Under replay a ``ForcePlan`` swaps in the reference's values (forward) and gradients (backward); the
    gradient still flows on to the candidate's own graph.
    """

    @staticmethod
    def forward(ctx, callback, plan, *tensors):
        ctx.callback, ctx.plan = callback, plan
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in plan.forward(tensors)) if plan else tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback(grads)
        if ctx.plan:
            grads = ctx.plan.backward(grads)
        return (None, None, *grads)


class _OutputGradient:
    """An autograd node's pre-hook handing one of its outputs' gradient to a tap's ``report``."""

    __slots__ = ("report", "index")

    def __init__(self, report, index: int):
        self.report, self.index = report, index

    def __call__(self, grad_outputs):
        self.report((grad_outputs[self.index],))


def _hook_output(t, report) -> bool:
    """``report`` called in backward with the gradient w.r.t. ``t``, a module call's one differentiable output,
    through a pre-hook on the autograd node that made it (a tapped input handed back: its tap's node); False for a
    leaf or a tensor subclass, for a ``_GradTap`` to take it.

    Why: the gradient w.r.t. the output is the one the node that made it receives, and the tap (a Python
    ``autograd.Function``: one more node, a context and a Python backward) cost the benchmark toy's traced step about
    1.3 ms of its 25 (measured). The caller gets the output itself, not an alias. The hook stays on that node when
    the caller then modifies the output in place (it receives the gradient w.r.t. the value the call returned)."""
    node = t.grad_fn
    if node is None or type(t) not in _PLAIN:
        return False
    node.register_prehook(_OutputGradient(report, t.output_nr))
    return True


def _differentiable(t) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


# torch.distributed's functions that write into a tensor they are given, and which argument that is. Their writes
# leave the tensor's in-place counter (``_version``) as it was (measured: all_reduce, broadcast), so a tensor met
# before one would otherwise be taken for unchanged. isend/irecv are not wrapped (``P2POp`` checks its function by
# identity); ``batch_isend_irecv`` is, for the tensors its receives write.
_COLLECTIVE_WRITES = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "recv": "tensor", "scatter": "tensor",
    "all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor",
    "reduce_scatter": "output", "reduce_scatter_tensor": "output", "_reduce_scatter_base": "output",
    "all_to_all": "output_tensor_list", "all_to_all_single": "output", "gather": "gather_list",
    "batch_isend_irecv": "p2p_op_list"}


class _CollectiveWatch:
    """torch.distributed's writing collectives wrapped while the trace is open (public functions, restored by
    ``remove``): after each call, the tensors it wrote are forgotten by the session (``TraceSession.forget``).
    Code that bound a collective to a name of its own before the trace opened calls it unseen."""

    def __init__(self, session):
        import inspect

        import torch.distributed as dist

        self.dist, self.session = dist, session
        self.wrapped: dict[str, tuple[Any, Any]] = {}  # name -> (original, wrapper)
        for name, argument in _COLLECTIVE_WRITES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            try:
                signature = inspect.signature(original)
            except (TypeError, ValueError):
                continue
            wrapper: Any = eager(self._wrap(original, signature, argument))
            wrapper.layerdiff_watch = self  # what ``remove`` of a trace wrapped on top of this one looks for
            self.wrapped[name] = (original, wrapper)
            setattr(dist, name, wrapper)

    def _wrap(self, original, signature, argument: str):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            result = original(*args, **kwargs)
            session = self.session
            if session is None:  # removed, while another trace's wrapper still holds this one
                return result
            try:
                written = signature.bind(*args, **kwargs).arguments.get(argument)
            except TypeError:
                return result
            for t in written if isinstance(written, (list, tuple)) else [written]:
                if isinstance(t, torch.Tensor):
                    session.forget(t)
                elif getattr(getattr(t, "op", None), "__name__", "") in ("irecv", "recv"):  # a P2POp receiving
                    session.forget(t.tensor)
            return result

        return collective

    def remove(self):
        """The originals back, where nothing wrapped them again since; else this wrapper only passes calls on, until
        the trace that wrapped it is closed too (traces closed in another order than opened)."""
        self.session = None
        for name, (original, wrapper) in self.wrapped.items():
            if getattr(self.dist, name, None) is wrapper:
                watch = getattr(original, "layerdiff_watch", None)
                while watch is not None and watch.session is None:  # a closed trace's wrapper: skipped
                    original = watch.wrapped[name][0]
                    watch = getattr(original, "layerdiff_watch", None)
                setattr(self.dist, name, original)


class Hooks(ModuleHooks):
    """Registers forward hooks on every module (plus gradient taps and parameter-gradient hooks)."""

    in_place_consequence = ("input gradients of its first call may be misattributed; its later calls record no "
                            "grad_input")
    differentiable = staticmethod(_differentiable)
    held_dtypes: set[str] | None = None  # set at install for a model FSDP shards: the dtypes it holds weights in
    pipeline_read = False  # whether a pipeline schedule running the model was read (``scheduled_step``)
    data_parallel: ParallelLayout | None = None  # the model's data-parallel layout, read at install
    grad_handles: list | tuple = ()  # the hooks that record the parameters' gradients
    fsdp1_root: Any = None  # an FSDP1 root traced whole: its parameters and gradients are read gathered
    # the modules whose outputs keep their gradient taps (set at install): those inside one that owns a tied weight
    # (the taps are the walls at which ``watch_param_uses`` stops its walk through that module's graph)
    output_taps: frozenset[str] = frozenset()

    def named_parameters(self):
        return each_named(self.model, lambda part: unwrapped_names(part.named_parameters(remove_duplicate=False)))
        # a tied weight under each owner

    def compute_dtypes(self, module) -> set[str]:
        """Only for a model FSDP shards (``held_dtypes``, set at install): it may cast each layer's gathered weights
        for computing (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) while holding them in float32."""
        held = self.held_dtypes
        if held is None:
            return set()
        return {name for p in module.parameters(recurse=False)
                if (name := _DTYPE_NAMES.get(p.dtype)) is not None and name not in held}

    def first_call(self, frame) -> None:
        """A model traced inside the ``DistributedDataParallel`` that runs it: the wrapper's layout is learned from it
        as if the wrapper were traced (its gradients, as their hooks see them, are each rank's own, before DDP
        averages them: placed by the wrapper)."""
        if isinstance(self.model, ModelParts):
            return  # a wrapper runs one module
        wrapper = torch_data_parallel.wrapping_ddp(frame, self.model)
        if wrapper is not None:
            layout = torch_data_parallel.parallel_layout(wrapper)
            if layout is not None:
                layout.pop("wrapped", None)  # the model traced is the one it wraps
                self.runner = wrapper
                self.session.learn_layout(layout)

    def scheduled_step(self, scope) -> None:
        """A ``torch.distributed.pipelining`` schedule says which stage the model is, once, at its first step."""
        if self.pipeline_read or not torch_pipelining.is_schedule(scope):
            return
        self.pipeline_read = True
        parts = parts_of(self.model)
        found = torch_pipelining.stage_layout(parts, scope, self.data_parallel)
        if found is None:
            self.session.warn("run by a pipeline schedule whose stages on this rank are not the modules traced: its "
                              "ranks are not joined as one model (trace each rank's PipelineStage.submod, or the list "
                              "of them where the schedule runs several stages on a rank)")
            return
        layout, stages = found
        if len(parts) > 1:
            self.learn_stages(stages)
        self.session.learn_layout(layout)
        if self.backward and self.record_params and torch_pipelining.splits_weight_gradients(scope):
            self.record_weight_gradients_apart()

    def machinery_call(self, frame) -> bool:
        return torch_pipelining.inferring(frame)

    def recomputing(self, frame) -> bool:
        # and torch's non-reentrant checkpoint: its ``recompute_fn``, run from a saved tensor's unpack hook
        return super().recomputing(frame) or running_frame(frame, "torch.utils.checkpoint", ("recompute_fn",)) \
            is not None

    def install(self):
        # read now, while FSDP holds its weights sharded (a step's first call may already have gathered them)
        self.data_parallel = torch_data_parallel.parallel_layout(parts_of(self.model)[0])
        if self.record_params and any(torch_data_parallel.fsdp1_model(part) for part in parts_of(self.model)):
            if torch_data_parallel.fsdp1_gathers(self.model):
                self.fsdp1_root = self.model
            else:
                self.record_params = False
                self.session.warn("FSDP1 (FullyShardedDataParallel) holds each rank's flat shard of its parameters "
                                  "and their gradients: neither is recorded here (they are when the model traced is "
                                  "the FSDP1 root, with use_orig_params=True; FSDP2's fully_shard records both)")
        if any(torch_data_parallel.fsdp_model(part) for part in parts_of(self.model)):
            self.held_dtypes = {name for _, p in self.params if (name := _DTYPE_NAMES.get(p.dtype)) is not None}
        owners = tuple(f"{path}." if path else "" for path in self.tied_in_module)
        self.output_taps = frozenset(path for path, _ in self.named_modules() if path.startswith(owners))
        super().install()

    def register_forward_hooks(self, module, pre_hook, post_hook) -> list:
        """The hooks run as Python even inside a ``torch.compile``d model (``torch.compiler.disable``): compiled
        code breaks its graph at every traced module's boundary, and each module's own code is still compiled.
        Without it, dynamo traced into the hooks (and failed in them: "NameError: ___tuple_iterator_getitem")."""
        return [module.register_forward_pre_hook(eager(pre_hook), with_kwargs=True),
                module.register_forward_hook(eager(post_hook), with_kwargs=True, always_call=True)]

    def watch_hidden_writes(self) -> list:
        import torch.distributed as dist

        return [_CollectiveWatch(self.session)] if dist.is_available() else []

    def register_param_grad_hooks(self):
        if self.fsdp1_root is not None:  # FSDP1 sets its gradients itself: read gathered when an optimizer steps
            self._watch_fsdp1()
            return
        self.grad_handles = [p.register_post_accumulate_grad_hook(self._param_grad_hook(name))
                             for name, p in self.params if p.requires_grad]
        self.handles.extend(self.grad_handles)

    # -- FSDP1: a rank's parameters are flat pieces of its shard between its units' calls, its gradients flat pieces
    # of the reduced shard; both are read gathered whole (``summon_full_params``, collective: every rank runs the
    # same steps) before the root's forward and before an optimizer steps
    def start_step(self):
        if self.fsdp1_root is None:
            super().start_step()

    def _watch_fsdp1(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.handles.append(self.fsdp1_root.register_forward_pre_hook(lambda module, args: self._fsdp1_values(),
                                                                      prepend=True))
        if self.backward:
            self.handles.append(register_optimizer_step_pre_hook(self._fsdp1_gradients))

    def _fsdp1_values(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not self.active:
            return
        with FullyShardedDataParallel.summon_full_params(self.fsdp1_root, writeback=False):
            self._record_changed_params()

    def _fsdp1_gradients(self, optimizer, args, kwargs) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not self.active or not any(id(p) in stepped for _, p in self.params):
            return  # another model's optimizer
        with FullyShardedDataParallel.summon_full_params(self.fsdp1_root, writeback=False, with_grads=True):
            for name, p in self.params:
                self.record_param_grad(name, p.grad, p)

    def _param_grad_hook(self, name):
        return lambda p: self.record_param_grad(name, p.grad, p)

    def record_weight_gradients_apart(self) -> None:
        """A zero-bubble pipeline schedule computes each weight's gradient apart from the input's
        (``torch.autograd.grad`` into the weight's accumulator, then ``weight.grad = dw`` or ``+=``): no accumulation
        hook sees it. Each contribution is recorded instead as it reaches the weight (its tensor hook, which also
        runs where a stage's backward is whole), as an increment: a step's contributions add up."""
        for handle in self.grad_handles:
            handle.remove()
        self.grad_handles = [p.register_hook(self._weight_increment_hook(name, p))
                             for name, p in self.params if p.requires_grad]
        self.handles.extend(self.grad_handles)

    def _weight_increment_hook(self, name, p):
        def hook(grad):
            self.record_param_grad(name, grad, p, increment=True)

        return hook

    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def apply_tap(self, tensors, report, frame, outputs, plan=None):
        """A call's one differentiable output is hooked on the autograd node that made it (``_hook_output``) rather
        than routed through a tap, where that node is the call's own: not where its inputs reached it as they came
        (``frame.inputs_as_given``: it may hand one back, whose node is its caller's). Anything else goes through
        ``_GradTap``."""
        if outputs and plan is None and len(tensors) == 1 and not frame.inputs_as_given and \
                frame.path not in self.output_taps and _hook_output(tensors[0], report):
            return [None]
        return _GradTap.apply(report, plan, *tensors)

    def watch_inputs(self, frame, needs, swap):
        """In-place ops bump ``_version`` (shared with the tap's detached alias)."""
        frame.versions = [(t, t._version) for _, t in needs]

    def check_in_place(self, frame) -> bool:
        return any(t._version != v for t, v in frame.versions)

    def param_version(self, p):
        """``_version``, with the address of the bytes: ``p.data = other`` (weights swapped in between steps, without
        a backward pass) points the parameter at other bytes and moves no counter."""
        try:
            return p._version, p.data_ptr()
        except RuntimeError:  # a tensor subclass without storage of its own
            return p._version

    def watch_param_uses(self, frame, module, outputs):
        """The autograd node that hands this call's contribution to a tied parameter (the edge into its
        ``AccumulateGrad``) gets a hook: its gradient there is this use's own, before the users' sum. The walk
        stays inside the call: it stops at gradient taps (the call's inputs, other modules' outputs)."""
        own = self.tied_in_module.get(frame.path)
        if not own:
            return
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen: set[Any] = set()  # the node objects (they hash by identity): held, so no dropped one's id names another
        while stack and len(seen) < _MAX_GRAPH_WALK:
            node = stack.pop()
            if node in seen or type(node).__name__ == "_GradTapBackward":
                continue
            seen.add(node)
            for index, (child, _) in enumerate(node.next_functions):
                variable = getattr(child, "variable", None) if child is not None else None
                if variable is not None and id(variable) in own:
                    node.register_hook(self._use_hook(frame, own[id(variable)], index))
                elif child is not None:
                    stack.append(child)

    def _use_hook(self, frame, name, index):
        def hook(grad_inputs, grad_outputs):
            if grad_inputs[index] is not None:
                self.session.param_use(name, frame, grad_inputs[index], self.tied[name])

        return hook

    # -- operations inside modules (``ops`` tracing): adapters/torch_ops.py --------------------------------------
    def intercept_ops(self, capture):
        return torch_ops.intercepted(capture, (_GradTap,))

    def unseen(self):
        return torch._C.DisableTorchFunction()  # what torch's own Tensor.__torch_function__ runs its work under

    def framework_leaf(self, module) -> bool:
        return torch_ops.framework_leaf(module)

    def named_buffers(self):
        return each_named(self.model, lambda part: unwrapped_names(part.named_buffers()))

    def op_gradients(self):
        return torch_ops.gradients()

    def op_scalar(self, obj):
        return torch_ops.scalar(obj)

    def op_framework_dirs(self) -> list[str]:
        return torch_ops.framework_dirs()

    def module_parameters(self, module):
        return module.named_parameters(recurse=False)

    def op_machinery_dirs(self) -> list[str]:
        return torch_ops.machinery_dirs()


def rng_state() -> str:
    """A fingerprint of torch's random generators' state now (the CPU's, and each GPU's where CUDA is already
    initialized: never initialized for this): two runs with the same seed that consumed it differently (another
    order of initialization) draw other dropout masks."""
    import xxhash

    digest = xxhash.xxh3_64(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for state in torch.cuda.get_rng_state_all():
            digest.update(state.numpy().tobytes())
    return digest.hexdigest()


def metadata(model) -> dict:
    """Framework, devices, dtypes, seeds and determinism flags: what explains most 'same model' mismatches."""
    params = list(model.parameters())
    inner = model
    while (child := wrapped_child(inner)) is not None:  # the model an FSDP1 or checkpointing wrapper holds
        inner = child
    meta = {
        "framework": TorchAdapter.name,
        "framework_version": torch.__version__,
        "model_class": f"{type(inner).__module__}.{type(inner).__name__}",
        "num_parameters": int(sum(p.numel() for p in params)),
        "devices": sorted({str(p.device) for p in params}) or ["cpu"],
        "param_dtypes": sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params}),
        "seed": torch.initial_seed(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "num_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "training": bool(model.training),
        "rng_state": rng_state(),
    }
    if torch.cuda.is_available():
        meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return meta


class TorchAdapter(FrameworkAdapter):
    """PyTorch: ``torch.nn.Module`` models of ``torch.Tensor`` tensors (DTensors and Megatron's tensor-parallel
    parameters with their placement)."""

    name = "torch"
    is_tensor = staticmethod(is_tensor)
    dtype_name = staticmethod(dtype_name)
    to_stored = staticmethod(to_stored)
    identify = staticmethod(identify)
    version = staticmethod(version)
    fast_stats = staticmethod(fast_stats)
    describe = staticmethod(describe)
    plus_bias = staticmethod(plus_bias)
    autocast_dtypes = staticmethod(autocast_dtypes)
    random_state = staticmethod(rng_state)
    placement = staticmethod(placement)
    metadata = staticmethod(metadata)
    distributed = staticmethod(distributed)
    assign = staticmethod(assign)
    to_framework = staticmethod(to_framework)
    hooks_class = Hooks
    records_ops = True

    def fingerprints(self, ts: list) -> list:
        """On the host, a hash of the bytes (the base class's); on an accelerator, ``device_fingerprints``."""
        on_device = {i for i, t in enumerate(ts) if _on_accelerator(t) and local(t) is not None}
        host = iter(super().fingerprints([t for i, t in enumerate(ts) if i not in on_device]))
        device = iter(device_fingerprints([t for i, t in enumerate(ts) if i in on_device]) if on_device else [])
        return [next(device) if i in on_device else next(host) for i in range(len(ts))]

    def named_modules(self, model):
        return unwrapped_names(model.named_modules(), skip_wrappers=True)

    def named_parameters(self, model):
        return unwrapped_names(model.named_parameters())

    def deferral(self):
        return DeviceDeferral()

    # a Megatron-core model's facts (``megatron_facts``: read from what Megatron has loaded, never imported), or
    # those of torch's own data parallelism (DDP, FSDP2: ``torch_data_parallel``)
    def parallel_layout(self, model):
        return megatron_facts.parallel_layout(model) or torch_data_parallel.parallel_layout(model)

    def parts_layout(self, parts):
        return megatron_facts.parts_layout(parts)

    def step_scope(self, frame):
        return megatron_facts.schedule_frame(frame) or torch_pipelining.schedule_frame(frame)

    def grad_placement(self, model, param):
        return megatron_facts.grad_placement(getattr(model, "config", None), param) or \
            torch_data_parallel.grad_placement(model, param)

    def grad_increments(self, param):
        return megatron_facts.grad_increments(param)


ADAPTER = TorchAdapter()
