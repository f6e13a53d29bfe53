"""Tensor comparison metrics, computed in float64 over chunks so memory stays bounded.

Two families, kept apart so a report says what it measured:
- ``compare_data``: from stored tensor values (full-mode traces);
- ``compare_stats``: from summary statistics only (stats-mode traces), a weaker check.
Metrics are plain dicts; judging them against a tolerance is a separate step (``tolerance.judge``), so a
report can be re-thresholded without re-tracing.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from layerdiff.schema import Metrics
from layerdiff.tracefile.tensors import as_float

CHUNK_ELEMS = 1 << 18   # elements read from a trace at a time
BLOCK_ELEMS = 1 << 15   # elements processed at a time: the two inputs and two scratch arrays stay in cache
_ONES = np.ones(BLOCK_ELEMS, dtype=np.float32)  # read-only: sum |a-b| as a dot product (BLAS), ~5x a float64 sum


class DataAccumulator:
    """Running sums for the data metrics, fed chunk by chunk; the sums of separate slices of one tensor merge
    (``merge``), so slices can be compared in separate processes (``core.workers``).

    Per-element work runs in the tensors' own float precision (float32 for fp32/fp16/bf16): ``a - b`` of two
    close floats is exact (Sterbenz), so nothing is lost there, and it is several times faster than widening
    every element. Sums are accumulated in float64 across blocks. Cosine is taken as ``1 - cos`` from ``|a-b|^2``
    and ``(a-b).(a+b) = |a|^2 - |b|^2``, which keeps full relative precision near cos = 1, where the usual
    ``a.b / (|a||b|)`` in float32 would round to exactly 1. Blocks holding NaN/Inf take a float64 path that
    also counts NaN/Inf values that do not match. Each block costs ~12 passes over cache-resident data, each a
    single numpy or BLAS call into reused scratch arrays: ~2.2 GB/s per side on one core (arrays in memory).
    """

    def __init__(self):
        self._lowest = (-math.inf, -math.inf)  # each side's "lowest" values: half its dtype's most negative or less
        self.n = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.max_rel = 0.0
        self.ref_max = 0.0
        self.dd = self.ds = self.aa = self.bb = 0.0
        self.nonfinite_mismatch = 0
        self.nonfinite = 0
        # positions zero in one run only (a mask that chose otherwise: a ReLU's, a threshold's), and the sums of
        # |A - B|^2 and |A|^2 over the other positions (summed apart: the difference of the totals would cancel)
        self.zero_mismatch = 0
        self.dd_rest = self.aa_rest = 0.0
        self._scratch: dict = {}

    _SUMS = ("n", "max_abs", "sum_abs", "max_rel", "ref_max", "dd", "ds", "aa", "bb", "nonfinite_mismatch",
             "nonfinite", "zero_mismatch", "dd_rest", "aa_rest")

    def state(self) -> dict:
        """The running sums as plain numbers (what a worker process sends back)."""
        return {name: getattr(self, name) for name in self._SUMS}

    @classmethod
    def from_state(cls, state: dict) -> DataAccumulator:
        acc = cls()
        for name in cls._SUMS:
            setattr(acc, name, state[name])
        return acc

    def merge(self, other: DataAccumulator):
        """Add the sums of another slice of the same pair of tensors."""
        for name in ("n", "sum_abs", "dd", "ds", "aa", "bb", "nonfinite_mismatch", "nonfinite", "zero_mismatch",
                     "dd_rest", "aa_rest"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("max_abs", "max_rel", "ref_max"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))

    def add(self, a_raw, b_raw, dtype_a, dtype_b):
        """Feed one pair of equally long chunks (stored bits). Call inside ``np.errstate(all="ignore")``:
        overflow and NaN are counted, not warned about (``compare_data`` does)."""
        self._lowest = (_lowest(dtype_a), _lowest(dtype_b))
        a, b = as_float(a_raw, dtype_a).reshape(-1), as_float(b_raw, dtype_b).reshape(-1)
        if a.dtype != b.dtype:
            a, b = a.astype(np.float64), b.astype(np.float64)
        self.n += a.size
        for i in range(0, a.size, BLOCK_ELEMS):
            self._block(a[i:i + BLOCK_ELEMS], b[i:i + BLOCK_ELEMS])

    def _buffers(self, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two scratch arrays of the block's length and dtype, reused from block to block (no allocation)."""
        pair = self._scratch.get(like.dtype)
        if pair is None:
            pair = self._scratch[like.dtype] = (_off_page(like.dtype, 1024), _off_page(like.dtype, 2560))
        return pair[0][:like.size], pair[1][:like.size]

    def _block(self, a, b):
        d, s = self._buffers(a)
        np.subtract(a, b, out=d)
        np.add(a, b, out=s)
        dd, ds = float(np.dot(d, d)), float(np.dot(d, s))  # one rounding in ds: 1 - cos stays precise (see above)
        aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        if not (math.isfinite(dd) and math.isfinite(ds) and math.isfinite(aa) and math.isfinite(bb)):
            self._block_nonfinite(a.astype(np.float64), b.astype(np.float64))
            return
        self.dd += dd
        self.ds += ds
        self.aa += aa
        self.bb += bb
        self.ref_max = max(self.ref_max, float(a.max()), -float(a.min()))
        np.abs(d, out=d)
        block_max = float(d.max())
        if block_max == 0.0:
            self.aa_rest += aa
            return
        self.max_abs = max(self.max_abs, block_max)
        self.sum_abs += _sum(d)
        np.abs(a, out=s)
        np.divide(d, s, out=s)  # |a-b| / |a|: inf where a == 0 != b, nan (ignored) where both are 0
        block_rel = float(np.fmax.reduce(s))
        self.max_rel = max(self.max_rel, block_rel)
        # where one side is zero and the other not, |a-b| / |a| is 1 or inf: only then are they looked for
        if block_rel < 1.0 or not self._zeros_one_sided(a, b, d, s):
            self.dd_rest += dd
            self.aa_rest += aa

    def _zeros_one_sided(self, a, b, d, scratch) -> bool:
        """Counts the positions zero in one run only and sums the others' squares (``d``, ``|a-b|``, and
        ``scratch`` are overwritten); False where there are none."""
        rest = (a == 0) == (b == 0)
        count = rest.size - int(np.count_nonzero(rest))
        if count:
            np.multiply(d, rest, out=d)  # the flips' differences and values zeroed, the others' summed as ever
            np.multiply(a, rest, out=scratch)
            self.zero_mismatch += count
            self.dd_rest += float(np.dot(d, d))
            self.aa_rest += float(np.dot(scratch, scratch))
        return bool(count)

    def _block_nonfinite(self, a, b):
        """A block whose values overflow float32's squares, or are NaN/Inf: in float64, NaN/Inf counted, and a
        dtype's lowest value read as -inf (an additive attention mask's "never": float16's -65504 against float32's
        -3.4e38 is one mask, not a difference of 3.4e38)."""
        low_a, low_b = self._lowest
        a = np.where(a <= low_a, -np.inf, a)
        b = np.where(b <= low_b, -np.inf, b)
        finite = np.isfinite(a) & np.isfinite(b)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        self.nonfinite_mismatch += int(np.count_nonzero(~finite & ~same))
        self.nonfinite += int(np.count_nonzero(~finite))
        if finite.any():
            self._block(a[finite], b[finite])

    def result(self) -> Metrics:
        na, nb = math.sqrt(self.aa), math.sqrt(self.bb)
        if na > 0 and nb > 0:
            norm_gap = self.ds / (na + nb)  # |a| - |b|, computed without cancellation
            one_minus_cos = max(0.0, self.dd - norm_gap * norm_gap) / (2 * na * nb)
            cosine = max(-1.0, 1.0 - one_minus_cos)
        else:
            cosine = 1.0 if na == nb else 0.0  # both all-zero agree; one all-zero does not
        identical = self.max_abs == 0.0 and self.nonfinite_mismatch == 0
        rel_l2 = 0.0 if identical or self.dd == 0 else (math.sqrt(self.dd) / na if na > 0 else math.inf)
        out: Metrics = {"basis": "data", "identical": identical, "max_abs": self.max_abs,
                        "mean_abs": self.sum_abs / max(self.n - self.nonfinite, 1), "max_rel": self.max_rel,
                        "cosine": 1.0 if identical else cosine, "rel_l2": rel_l2, "ref_max_abs": self.ref_max,
                        "nonfinite_mismatch": self.nonfinite_mismatch, "numel": self.n}
        if self.zero_mismatch:
            out["zero_mismatch"] = self.zero_mismatch
            out["rel_l2_elsewhere"] = 0.0 if self.dd_rest == 0 else (
                math.sqrt(self.dd_rest / self.aa_rest) if self.aa_rest > 0 else math.inf)
        return out


_LOWEST = {"float16": -65504.0 / 2, "bfloat16": -3.3895e38 / 2, "float32": -3.4028e38 / 2, "float64": -1.7976e308 / 2}


def _lowest(dtype: str) -> float:
    """At or below this a value of ``dtype`` stands for minus infinity: half its most negative number (where masks
    put ``torch.finfo(dtype).min``); -inf for dtypes that hold no masks (float8's range is all in use)."""
    return _LOWEST.get(dtype, -math.inf)


def _off_page(dtype, page_offset: int) -> np.ndarray:
    """A block-long array that starts ``page_offset`` bytes into a 4 KB page. The blocks compared usually start
    on a page (file chunks are page-aligned), and arrays at the same offset in their pages evict each other from
    the CPU's L1 cache (4K aliasing): scratch arrays at the input's offset made the comparison 30% slower."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(BLOCK_ELEMS * itemsize + 8192, dtype=np.uint8)
    start = (page_offset - raw.ctypes.data) % 4096
    return raw[start:start + BLOCK_ELEMS * itemsize].view(dtype)


def _sum(values: np.ndarray) -> float:
    """The sum of a block's non-negative values: a BLAS dot with ones for float32 (multi-lane float32 sums, ~1e-7
    relative over a block, then added in float64), numpy's float64 sum otherwise."""
    if values.dtype == np.float32:
        return float(np.dot(values, _ONES[:values.size]))
    return float(np.add.reduce(values, dtype=np.float64))


def accumulate(chunks_a, chunks_b, dtype_a: str, dtype_b: str) -> DataAccumulator:
    """The running sums over two equally long streams of flat chunks (numpy arrays of stored bits)."""
    acc = DataAccumulator()
    with np.errstate(all="ignore"):  # overflow/NaN are counted, not warned about
        for a_raw, b_raw in _rechunk(chunks_a, chunks_b):
            acc.add(a_raw, b_raw, dtype_a, dtype_b)
    return acc


def compare_data(chunks_a, chunks_b, dtype_a: str, dtype_b: str) -> Metrics:
    """Metrics over two equally long streams of flat chunks (numpy arrays of stored bits)."""
    return accumulate(chunks_a, chunks_b, dtype_a, dtype_b).result()


def _rechunk(chunks_a, chunks_b):
    """Pair up two chunk streams whose chunk sizes may differ (different dtypes, different element sizes)."""
    it_a, it_b = iter(chunks_a), iter(chunks_b)
    a = b = None
    while True:
        if a is None or a.size == 0:
            a = next(it_a, None)
        if b is None or b.size == 0:
            b = next(it_b, None)
        if a is None or b is None:
            return
        n = min(a.size, b.size)
        yield a[:n], b[:n]
        a, b = a[n:], b[n:]


def compare_arrays(a: np.ndarray, b: np.ndarray, dtype_a: str, dtype_b: str) -> Metrics:
    """``compare_data`` for in-memory arrays (used by tests and by small tensors)."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    return compare_data((fa[i:i + CHUNK_ELEMS] for i in range(0, fa.size, CHUNK_ELEMS)),
                        (fb[i:i + CHUNK_ELEMS] for i in range(0, fb.size, CHUNK_ELEMS)), dtype_a, dtype_b)


def compare_stats(sa: Mapping[str, Any], sb: Mapping[str, Any]) -> Metrics:
    """Metrics from summary statistics: the largest difference among min, max, mean and RMS."""
    if sa.get("numel", 0) == 0 or sa.get("min") is None or sb.get("min") is None:
        same = sa.get("numel") == sb.get("numel") and sa.get("nan") == sb.get("nan")
        return {"basis": "stats", "identical": same, "max_abs": 0.0 if same else math.inf, "ref_max_abs": 0.0,
                "cosine": None, "nonfinite_mismatch": 0 if same else 1, "numel": sa.get("numel", 0)}
    na, nb = max(sa["numel"], 1), max(sb["numel"], 1)
    rms_a, rms_b = sa["l2"] / math.sqrt(na), sb["l2"] / math.sqrt(nb)
    diffs = [abs(sa["min"] - sb["min"]), abs(sa["max"] - sb["max"]), abs(sa["mean"] - sb["mean"]),
             abs(rms_a - rms_b)]
    ref = max(abs(sa["min"]), abs(sa["max"]))
    nonfinite = abs(sa.get("nan", 0) - sb.get("nan", 0)) + abs(sa.get("inf", 0) - sb.get("inf", 0))
    return {"basis": "stats", "identical": all(d == 0 for d in diffs) and nonfinite == 0,
            "max_abs": max(diffs), "mean_abs": abs(sa["mean"] - sb["mean"]),
            "l2_rel": abs(sa["l2"] - sb["l2"]) / sa["l2"] if sa["l2"] else abs(sb["l2"]),
            "ref_max_abs": ref, "cosine": None, "nonfinite_mismatch": nonfinite, "numel": sa["numel"]}


def relative_error(m: Mapping[str, Any]) -> float:
    """Worst absolute difference over the reference's largest magnitude (inf for a mismatch): how errors are
    ranked along the model."""
    if m.get("mismatch") or m.get("nonfinite_mismatch"):
        return math.inf
    ref = m.get("ref_max_abs") or 0.0
    mx = m.get("max_abs") or 0.0
    return mx / ref if ref else (0.0 if mx == 0 else math.inf)
