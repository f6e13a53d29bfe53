"""Tensor comparison metrics, computed in float64 over chunks so memory stays bounded.

Two families, kept apart so a report says what it measured:
- ``compare_data``: from stored tensor values (full-mode traces);
- ``compare_stats``: from summary statistics only (stats-mode traces), a weaker check.
Metrics are plain dicts; judging them against a tolerance is a separate step (``tolerance.judge``), so a
report can be re-thresholded without re-tracing.
"""
from __future__ import annotations

import math

import numpy as np

from .tensors import as_float

CHUNK_ELEMS = 1 << 16


class _Accumulator:
    """Running sums for the data metrics, fed chunk by chunk."""

    def __init__(self):
        self.n = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.max_rel = 0.0
        self.ref_max = 0.0
        self.dot_ab = self.dot_aa = self.dot_bb = 0.0
        self.nonfinite_mismatch = 0
        self.identical = True

    def add(self, a_raw, b_raw, dtype_a, dtype_b):
        self.n += a_raw.size
        if dtype_a == dtype_b and np.array_equal(a_raw.view(np.uint8), b_raw.view(np.uint8)):
            self._add_identical(a_raw, dtype_a)  # the common case for a clean pair: no subtraction needed
            return
        self.identical = False
        a = as_float(a_raw, dtype_a).astype(np.float64)
        b = as_float(b_raw, dtype_b).astype(np.float64)
        finite = np.isfinite(a) & np.isfinite(b)
        if not finite.all():
            same = (a == b) | (np.isnan(a) & np.isnan(b))
            self.nonfinite_mismatch += int(np.count_nonzero(~finite & ~same))
            a, b = a[finite], b[finite]
        if a.size == 0:
            return
        diff = np.abs(a - b)
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        mag = np.abs(a)
        self.ref_max = max(self.ref_max, float(mag.max()))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff > 0, diff / mag, 0.0)
        self.max_rel = max(self.max_rel, float(rel.max()))
        self.dot_ab += float(np.dot(a, b))
        self.dot_aa += float(np.dot(a, a))
        self.dot_bb += float(np.dot(b, b))

    def _add_identical(self, raw, dtype):
        x = as_float(raw, dtype)
        x = x[np.isfinite(x)] if not np.isfinite(x).all() else x
        if x.size:
            x64 = x.astype(np.float64, copy=False).reshape(-1)
            self.ref_max = max(self.ref_max, float(np.abs(x64).max()))
            sq = float(np.dot(x64, x64))
            self.dot_ab += sq
            self.dot_aa += sq
            self.dot_bb += sq

    def result(self) -> dict:
        if self.dot_aa > 0 and self.dot_bb > 0:
            cosine = self.dot_ab / math.sqrt(self.dot_aa * self.dot_bb)
            cosine = min(1.0, max(-1.0, cosine))
        else:
            cosine = 1.0 if self.dot_aa == self.dot_bb else 0.0  # both all-zero agree; one all-zero does not
        return {"basis": "data", "identical": self.identical, "max_abs": self.max_abs,
                "mean_abs": self.sum_abs / self.n if self.n else 0.0, "max_rel": self.max_rel,
                "cosine": cosine, "ref_max_abs": self.ref_max,
                "nonfinite_mismatch": self.nonfinite_mismatch, "numel": self.n}


def compare_data(chunks_a, chunks_b, dtype_a: str, dtype_b: str) -> dict:
    """Metrics over two equally long streams of flat chunks (numpy arrays of stored bits)."""
    acc = _Accumulator()
    for a_raw, b_raw in _rechunk(chunks_a, chunks_b):
        acc.add(a_raw, b_raw, dtype_a, dtype_b)
    return acc.result()


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


def compare_arrays(a: np.ndarray, b: np.ndarray, dtype_a: str, dtype_b: str) -> dict:
    """``compare_data`` for in-memory arrays (used by tests and by small tensors)."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    return compare_data((fa[i:i + CHUNK_ELEMS] for i in range(0, fa.size, CHUNK_ELEMS)),
                        (fb[i:i + CHUNK_ELEMS] for i in range(0, fb.size, CHUNK_ELEMS)), dtype_a, dtype_b)


def compare_stats(sa: dict, sb: dict) -> dict:
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
