"""Dtype names and summary statistics for tensors handed over as numpy arrays.

Adapters convert framework tensors to numpy *storage* arrays plus a logical dtype name. Dtypes numpy lacks
(bfloat16, float8) travel as unsigned-integer views of their bits and are decoded here, so the core stays
framework-free and a trace made by one framework reads the same in any other environment.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

one_pass_moments: Callable[[np.ndarray], tuple[float, float, float, float] | None] | None
moments_at: Callable[..., tuple[float, float, float, float] | None] | None
moments_strided: Callable[..., tuple[float, float, float, float] | None] | None
threads_shared: Callable[[], int]
try:  # the optional C kernel (fastmoments.c), built at install where a C compiler is present
    from layerdiff.tracefile import fastmoments
    one_pass_moments, moments_at = fastmoments.moments, fastmoments.moments_at
    # a kernel built before it could share threads or read strided tensors (a checkout updated without a rebuild)
    threads_shared = getattr(fastmoments, "threads_shared", lambda: 1)
    moments_strided = getattr(fastmoments, "moments_strided", None)
except ImportError:  # numpy takes every statistic, with the same results to ~1e-7
    one_pass_moments = moments_at = moments_strided = None
    threads_shared = lambda: 1  # noqa: E731

# Logical dtype name -> numpy dtype of the stored bits.
STORAGE_DTYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_, "complex64": np.complex64, "complex128": np.complex128,
}
FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
# Lower rank = less precise; a pair of tensors is judged by its less precise side.
PRECISION_RANK = {"float8_e4m3fn": 0, "float8_e5m2": 0, "bfloat16": 1, "float16": 2, "float32": 3, "float64": 4}


def storage_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(STORAGE_DTYPES[name])
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


def _decode_float8(bits: np.ndarray, exp_bits: int, man_bits: int, bias: int, ieee_inf: bool) -> np.ndarray:
    b = bits.astype(np.int32)
    sign = np.where(b >> 7, -1.0, 1.0).astype(np.float32)
    exp = (b >> man_bits) & ((1 << exp_bits) - 1)
    man = (b & ((1 << man_bits) - 1)).astype(np.float32)
    normal = (1.0 + man / (1 << man_bits)) * np.exp2(exp.astype(np.float32) - bias)
    subnormal = (man / (1 << man_bits)) * np.float32(2.0 ** (1 - bias))
    out = sign * np.where(exp == 0, subnormal, normal)
    max_exp = (1 << exp_bits) - 1
    if ieee_inf:  # e5m2: IEEE-like inf/nan
        out = np.where((exp == max_exp) & (man == 0), sign * np.inf, out)
        out = np.where((exp == max_exp) & (man != 0), np.nan, out)
    else:  # e4m3fn: only S.1111.111 is nan
        out = np.where((exp == max_exp) & (man == (1 << man_bits) - 1), np.nan, out)
    return out.astype(np.float32)


def as_float(stored: np.ndarray, dtype: str) -> np.ndarray:
    """The values of a stored tensor as a numpy float array (float32 or wider); ints and bools as float64."""
    if stored.ndim == 0:  # a scalar tensor: numpy's operators return a scalar for it, whose bits cannot be viewed
        return as_float(stored.reshape(1), dtype).reshape(())
    if dtype == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float8_e4m3fn":
        return _decode_float8(stored, 4, 3, 7, ieee_inf=False)
    if dtype == "float8_e5m2":
        return _decode_float8(stored, 5, 2, 15, ieee_inf=True)
    if dtype in ("float16",):
        return stored.astype(np.float32)
    if dtype in ("float32", "float64"):
        return stored
    if dtype.startswith("complex"):
        return np.abs(stored)
    return stored.astype(np.float64)


def encode_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values as the stored bits of ``dtype`` (``as_float``'s inverse), rounded to the nearest value it holds:
    for values computed from stored tensors, such as partial sums added across ranks."""
    if dtype == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # to nearest, ties to even
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
    if dtype.startswith("float8"):
        codes = np.arange(256, dtype=np.uint8)
        decoded = as_float(codes, dtype).astype(np.float64)
        order = [i for i in np.argsort(decoded, kind="stable") if np.isfinite(decoded[i])]
        grid, grid_codes = decoded[order], codes[order]
        x = values.astype(np.float64)
        clipped = np.clip(np.nan_to_num(x), grid[0], grid[-1])  # beyond the largest finite value: saturated
        upper = np.clip(np.searchsorted(grid, clipped), 1, grid.size - 1)
        nearer_lower = (clipped - grid[upper - 1]) <= (grid[upper] - clipped)
        out = grid_codes[np.where(nearer_lower, upper - 1, upper)]
        for special in (np.inf, -np.inf):  # e5m2 holds infinities; e4m3fn saturates them
            if (decoded == special).any():
                out = np.where(x == special, codes[decoded == special][0], out)
        return np.where(np.isnan(x), codes[np.isnan(decoded)][0], out)
    return values.astype(storage_dtype(dtype))


_PIECE = 1 << 16  # elements: a piece stays in the CPU cache for its four reductions (one read from memory)


_ONES = {np.dtype(t): np.ones(_PIECE, t) for t in (np.float32, np.float64)}
for _ones in _ONES.values():
    _ones.setflags(write=False)


_REDUCED = frozenset(_ONES)  # dtypes reduced as they are (a set of dtypes: comparing a dtype with np.float32 converts)


def _sum(x: np.ndarray) -> float:
    """The sum of a flat float32/float64 array of at most a piece, as its dot product with ones (BLAS's dot, as
    the sum of squares already is).

    Why: numpy's pairwise sum of a 64K-element float32 piece took 9.8 us, ``np.einsum`` 3.6 us plus its Python
    dispatcher, the dot 2.7 us, with the same error (within ~1e-7 of the sum of magnitudes over a piece, measured
    against float64); pieces are added in float64. The ones are made once (read-only constants, never written).
    """
    return float(np.dot(x, _ONES[x.dtype][:x.size]))


def _moments(x: np.ndarray, add: Callable[[np.ndarray], Any] = _sum) -> tuple[float, float, float, float]:
    """min, max, sum and sum of squares of a flat float32/float64 array, piece by piece.

    Each piece is read from memory once and reduced four times from the cache (about twice the speed of four
    whole-array passes). Sums of pieces are added in float64: over one piece, sums stay within ~2e-7
    relative and BLAS dot products within ~1e-6 (bf16-valued data: ~1e-6 low; pairwise squares were 8x
    slower); one float32 dot over millions of elements drifts by ~1e-5.
    """
    lo, hi, total, square = math.inf, -math.inf, 0.0, 0.0
    for start in range(0, x.size, _PIECE):
        piece = x[start:start + _PIECE]
        lo = min(lo, float(np.minimum.reduce(piece)))
        hi = max(hi, float(np.maximum.reduce(piece)))
        total += float(add(piece))
        square += float(np.dot(piece, piece))
    return lo, hi, total, square


def _one_piece(x: np.ndarray) -> tuple[float, float, float, float] | None:
    """``_moments`` of an array of one piece (most activations of small models), with the same results, or None
    when a value is NaN or infinite or the squares overflow.

    Why: at these sizes a summary's cost is per-call overhead, and ``np.errstate`` alone was a fifth of it. No
    warning can arise here: min/max and the dot products (BLAS) raise none, and the sum is taken only once the
    squares are finite, when it cannot overflow (by Cauchy-Schwarz its square is at most n times theirs).
    """
    square = float(np.dot(x, x))
    if not math.isfinite(square):  # NaN or Inf anywhere makes it so
        return None
    return float(np.minimum.reduce(x)), float(np.maximum.reduce(x)), _sum(x), square


def _native(x: np.ndarray) -> tuple[float, float, float, float] | None:
    """``_moments`` of a flat float32/float64 array by the C kernel in one read (``fastmoments.c``: 3x numpy's four
    passes at 64K elements, 25x at 256), or None where it is not built or a value is NaN or infinite (numpy's path
    counts those) or the squares overflow."""
    return _finite(one_pass_moments(x)) if one_pass_moments is not None else None


def _finite(moments: tuple[float, float, float, float] | None) -> tuple[float, float, float, float] | None:
    """The kernel's moments where every value was finite, else None: finite squares say so (and then the sum is
    finite too)."""
    return moments if moments is not None and math.isfinite(moments[3]) else None


_KERNEL_KINDS = {"float32": 0, "float64": 1, "bfloat16": 2}  # what ``moments_at`` reads where it lies
# the kernel is built and takes ``share_threads`` (a framework's threads read a large tensor with it)
SHARES_THREADS = moments_at is not None and hasattr(fastmoments, "threads_shared")
READS_SLICES = moments_strided is not None  # the kernel is built with ``moments_strided`` (``stats_strided``)


def stats_at(address: int, count: int, dtype: str, share_threads: bool = False) -> dict[str, Any] | None:
    """``summarize``'s statistics of ``count`` elements of ``dtype`` lying back to back from ``address`` (a
    framework's dense CPU tensor), read where they lie by the C kernel; None where the kernel is not built, the
    dtype is not one it reads, or a value is not finite (``summarize`` then counts NaN/Inf).

    Why: a numpy view of a tensor (DLPack) cost 2.7 us and the rest of ``summarize``'s path 2 us more, most of a
    small tensor's summary; a traced step of a small Llama with ``--ops`` summarizes ~450 of them. The caller
    vouches for the memory: a plain dense tensor's own, alive during the call.

    ``share_threads``: a large tensor is read by the threads of the OpenMP runtime the process has loaded, each
    reading the share that is still in its core's cache (``fastmoments.c``). The framework adapter says so where
    its framework runs its operations on that runtime (torch's ATen): the threads are then its own, idle between
    operations, and no thread is started for layerdiff alone. Same results with any number of threads.
    """
    kind = _KERNEL_KINDS.get(dtype)
    if kind is None or moments_at is None or count <= 0:
        return None
    return _stats(moments_at(address, count, kind, True) if share_threads and SHARES_THREADS else
                  moments_at(address, count, kind), count)


def stats_strided(address: int, dtype: str, sizes: tuple[int, ...], strides: tuple[int, ...]) -> dict[str, Any] | None:
    """``stats_at`` for a tensor that is not dense (a slice: ``x[..., :half]``, every other column), laid out from
    ``address`` with ``sizes`` and ``strides`` (in elements, none 0): the kernel gathers its runs where they lie.
    None where the kernel cannot (not built, another dtype, a value not finite). Why: numpy copied such a slice to
    make it contiguous, then took four passes: 70 us for a 32K-element float32 slice, 28 with the kernel alone."""
    kind = _KERNEL_KINDS.get(dtype)
    if kind is None or moments_strided is None:
        return None
    count = math.prod(sizes)
    if count <= 0:
        return None
    return _stats(moments_strided(address, kind, sizes, strides), count)


def _stats(moments: tuple[float, float, float, float] | None, count: int) -> dict[str, Any] | None:
    """A record's statistics from the kernel's moments of ``count`` finite values (None where one was not)."""
    moments = _finite(moments)
    if moments is None:
        return None
    lo, hi, total, square = moments
    return {"numel": count, "min": lo, "max": hi, "mean": total / count, "l2": math.sqrt(square), "nan": 0, "inf": 0}


def in_memory_order(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as a view in the order memory holds them, where its layout is a permutation of a dense one
    (a transpose, a permute); otherwise ``a`` itself.

    Why: statistics do not depend on the order of the elements, and flattening such a view in its own order copies
    it. A fifth of the tensors a step of a Llama with ``--ops`` summarizes are not contiguous (5 M elements); read
    in memory order, their statistics took 4.3 ms a step instead of 5.3 (measured).
    """
    if a.ndim < 2 or a.flags.c_contiguous:
        return a
    strides = a.strides
    permuted = a.transpose(sorted(range(a.ndim), key=lambda i: -strides[i]))
    return permuted if permuted.flags.c_contiguous else a


def summarize(stored: np.ndarray, dtype: str) -> dict[str, Any]:
    """min, max, mean, l2 norm and NaN/Inf counts: kept for every tensor in every mode.

    NaN/Inf are counted only when a statistic came out non-finite, which keeps the common all-finite case at one
    read of the data (the C kernel, ``_native``; without it, ``_moments``). Not "when min or max is": a piece's NaN
    min does not survive ``min()`` with the finite min of another piece, but every sum it enters is NaN.
    """
    n = int(stored.size)
    stats: dict[str, Any] = {"numel": n, "min": None, "max": None, "mean": None, "l2": None, "nan": 0, "inf": 0}
    if n == 0:
        return stats
    x = np.ascontiguousarray(as_float(in_memory_order(stored), dtype).reshape(-1))
    if x.dtype not in _REDUCED:
        x = x.astype(np.float64)
    moments = _native(x)  # None: not built, or not all finite
    if moments is None and n <= _PIECE and one_pass_moments is None:
        moments = _one_piece(x)  # None: not all finite (the kernel, where built, has already said so)
    if moments is None:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught below, and taken wide
            moments = _moments(x)
        if not all(math.isfinite(v) for v in moments):
            nan, inf = np.isnan(x), np.isinf(x)  # NaN/Inf: counted, then left out of the statistics
            stats["nan"], stats["inf"] = int(nan.sum()), int(inf.sum())
            if stats["nan"] or stats["inf"]:
                x = x[~(nan | inf)]
                if x.size == 0:
                    return stats
            # float32 sums could overflow: wide, and pairwise (values this large may cancel each other)
            moments = _moments(x.astype(np.float64, copy=False), np.add.reduce)
    lo, hi, total, sq = moments
    stats.update(min=lo, max=hi, mean=total / x.size, l2=math.sqrt(sq))
    return stats
