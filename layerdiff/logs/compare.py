"""Two parsed training logs compared metric by metric, aligned by iteration.

Default tolerances, chosen for "the first training steps of the same model give the same numbers" across frameworks
(|a - b| > atol + rtol * |a| is over; A is the reference):

* loss: rtol 1e-3 (MindSpore prints 3 decimals; bf16 runs of the same model on the same data agree to ~1e-4),
* lr: rtol 1e-5 (a schedule is deterministic; Megatron prints 7 significant digits, MindSpore a float32),
* grad_norm: rtol 5e-2 (reductions in a different order; the most sensitive of the three).

All atol default to 0. Override per metric: ``--tol loss:rtol=1e-3,atol=0`` (repeatable).
"""
from __future__ import annotations

import math

import numpy as np

from layerdiff.errors import LayerdiffError
from layerdiff.logs.parse import METRICS, alias

DEFAULT_TOLERANCES = {"loss": {"atol": 0.0, "rtol": 1e-3},
                      "lr": {"atol": 0.0, "rtol": 1e-5},
                      "grad_norm": {"atol": 0.0, "rtol": 5e-2}}


def parse_tolerance(text: str, into: dict | None = None) -> dict:
    """``METRIC:atol=..,rtol=..`` -> updated copy of the tolerance table."""
    table = {k: dict(v) for k, v in (into or DEFAULT_TOLERANCES).items()}
    metric, sep, spec = text.partition(":")
    metric = alias(metric) or metric.strip()
    if not sep or metric not in METRICS:
        raise LayerdiffError(f"bad tolerance {text!r}: expected METRIC:atol=..,rtol=.. with METRIC one of "
                             f"{', '.join(METRICS)}")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("atol", "rtol"):
            raise LayerdiffError(f"bad tolerance {text!r}: {item!r} is not atol=.. or rtol=..")
        try:
            v = float(value)
        except ValueError:
            raise LayerdiffError(f"bad tolerance {text!r}: {value.strip()!r} is not a number") from None
        if not math.isfinite(v) or v < 0:
            raise LayerdiffError(f"bad tolerance {text!r}: {key} must be a finite number >= 0")
        table[metric][key] = v
    return table


def ranges(its) -> list[list[int]]:
    out: list[list[int]] = []
    for i in its:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def ranges_text(rs, limit=4) -> str:
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in rs[:limit]]
    return ", ".join(parts) + (f", ... ({len(rs) - limit} more ranges)" if len(rs) > limit else "")


def _compare_metric(its, a, b, tol) -> dict:
    """Statistics over pairs where both values are finite; a NaN/inf on one side only (or different infs) is a
    "nonfinite mismatch" and always over tolerance. Two NaNs (both runs skipped the iteration) are equal."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    finite = np.isfinite(a) & np.isfinite(b)
    same_nonfinite = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
    mismatch = ~finite & ~same_nonfinite
    with np.errstate(invalid="ignore", divide="ignore"):
        absdiff = np.where(finite, np.abs(a - b), 0.0)
        rel = np.where(absdiff == 0, 0.0, absdiff / np.abs(np.where(finite, a, 1.0)))
        over = mismatch | (finite & (absdiff > tol["atol"] + tol["rtol"] * np.abs(np.where(finite, a, 0.0))))
    idx = np.flatnonzero(over)
    first = int(its[idx[0]]) if idx.size else None
    k = int(np.argmax(absdiff))
    identical = not absdiff.any() and not mismatch.any()
    return {
        "compared": int(a.size),
        "max_abs": float(absdiff.max()), "max_abs_at": int(its[k]),
        "max_rel": float(rel.max()),
        "mean_abs": float(absdiff[finite].mean()) if finite.any() else 0.0,
        "nonfinite_mismatch": int(mismatch.sum()),
        "first_over": first,
        "first_over_values": [float(a[idx[0]]), float(b[idx[0]])] if idx.size else None,
        "over": int(idx.size),
        "identical": bool(identical),
        "atol": tol["atol"], "rtol": tol["rtol"],
        "verdict": "identical" if identical else ("within tolerance" if not idx.size else "different"),
    }


def diff(a: dict, b: dict, tolerances: dict | None = None) -> dict:
    """Compare two parsed logs ({iteration: {metric: value}}) aligned by iteration."""
    tol = {k: dict(v) for k, v in DEFAULT_TOLERANCES.items()}
    for k, v in (tolerances or {}).items():
        tol.setdefault(k, {}).update(v)
    ia, ib = set(a), set(b)
    common = sorted(ia & ib)
    only_a, only_b = sorted(ia - ib), sorted(ib - ia)
    metrics, series = {}, {}
    for m in METRICS:
        its = [i for i in common if a[i].get(m) is not None and b[i].get(m) is not None]
        in_a = any(r.get(m) is not None for r in a.values())
        in_b = any(r.get(m) is not None for r in b.values())
        if not its:
            if in_a or in_b:
                metrics[m] = {"compared": 0, "verdict": "not compared",
                              "note": f"only in {'A' if in_a else 'B'}" if in_a != in_b else "no common iteration"}
            continue
        va = [a[i][m] for i in its]
        vb = [b[i][m] for i in its]
        metrics[m] = _compare_metric(its, va, vb, tol[m])
        series[m] = {"iterations": its, "a": va, "b": vb}
    judged = [r["verdict"] for r in metrics.values() if r["compared"]]
    if not common or not judged:
        verdict = "nothing compared"
    elif "different" in judged:
        verdict = "different"
    elif all(v == "identical" for v in judged):
        verdict = "identical"
    else:
        verdict = "within tolerance"
    return {
        "report_kind": "logs_diff",
        "verdict": verdict,
        "compared": len(common),
        "common_range": [common[0], common[-1]] if common else None,
        "only_a": {"count": len(only_a), "ranges": ranges(only_a)},
        "only_b": {"count": len(only_b), "ranges": ranges(only_b)},
        "tolerances": {m: tol[m] for m in METRICS},
        "metrics": metrics,
        "series": series,
    }


def tolerances(texts=()) -> dict:
    """The default tolerances with ``--tol`` overrides applied in order."""
    tol = {k: dict(v) for k, v in DEFAULT_TOLERANCES.items()}
    for text in texts or ():
        tol = parse_tolerance(text, tol)
    return tol
