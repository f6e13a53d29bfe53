"""Dtype-aware tolerances and the judgement of metrics against them.

A pair passes when ``max_abs <= atol + rtol * max|reference|`` and ``cosine >= cos`` (when cosine is known, and the
reference is not entirely within ``atol`` of zero: the angle between two tensors of rounding noise is no evidence).
Defaults per dtype follow common parity practice: bf16 max diff ~1e-2 and cosine > 0.9999, fp16 ~1e-3 and
> 0.99999; fp32 is tight enough to flag a 1e-4 relative defect while staying quiet on honest fp32
reimplementations (different op order: ~1e-6 relative). The less precise side of a pair decides, and where the two runs
hold their parameters in different dtypes, the less precise of those decides for every floating tensor
(``precision_floor``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from layerdiff import schema
from layerdiff.tracefile.tensors import FLOAT_DTYPES, PRECISION_RANK


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    cos: float | None

    def as_dict(self) -> schema.Tolerance:
        return {"atol": self.atol, "rtol": self.rtol, "cos": self.cos}


DEFAULTS = {
    "float64": Tolerance(atol=1e-12, rtol=1e-9, cos=1 - 1e-9),
    "float32": Tolerance(atol=1e-8, rtol=2e-5, cos=0.99999),
    "float16": Tolerance(atol=1e-3, rtol=1e-3, cos=0.99999),
    "bfloat16": Tolerance(atol=1e-2, rtol=1e-2, cos=0.9999),
    "float8": Tolerance(atol=1e-1, rtol=1.25e-1, cos=0.999),
    "exact": Tolerance(atol=0.0, rtol=0.0, cos=None),  # integers and booleans
}


def dtype_class(dtype_a: str | None, dtype_b: str | None, floor: str | None = None) -> str:
    """The tolerance class of a pair: its less precise floating dtype, or ``floor`` where that is less precise
    still (``precision_floor``); "exact" for integers and booleans."""
    floats = [d for d in (dtype_a, dtype_b) if d in FLOAT_DTYPES]
    if not floats:
        return "exact"
    if floor in FLOAT_DTYPES:
        floats.append(floor)
    worst = min(floats, key=lambda d: PRECISION_RANK[d])
    return "float8" if worst.startswith("float8") else worst


def precision_floor(dtypes_a: Iterable[str] | None, dtypes_b: Iterable[str] | None,
                    autocast_a: Iterable[str] = (), autocast_b: Iterable[str] = ()) -> str | None:
    """The least precise floating dtype the two runs hold their parameters in, where they hold them in different
    ones (float32 against bfloat16: "bfloat16"), or compute in under automatic mixed precision (``autocast_*``:
    ``torch.autocast`` in either run); None where both hold the same and neither autocasts. Every floating tensor
    of such a comparison is judged by that dtype's tolerance at best.

    Why: a value computed from less precise data is no more precise than that data. A run that holds its weights
    in bfloat16 computes its float32 tensors (a loss from its logits, an upcast buffer, a norm's statistics) from
    bfloat16 values: against a float32 run they differ by bfloat16's rounding (the loss of a small Llama: 2.6e-5
    relative, over float32's 2e-5), and every float32 against bfloat16 comparison was "divergent" at the loss, or
    at the first upcast with operations recorded. Runs that hold the same dtypes keep float32's tolerance where
    they compute in float32: a norm one of them takes in bfloat16 by mistake is still found."""
    floats_a = {d for d in dtypes_a or () if d in FLOAT_DTYPES}
    floats_b = {d for d in dtypes_b or () if d in FLOAT_DTYPES}
    autocast = {d for d in (*autocast_a, *autocast_b) if d in FLOAT_DTYPES}
    if autocast:  # float32 tensors under autocast (the residual stream) add up its dtype's results: both runs'
        return min(autocast | floats_a | floats_b, key=lambda d: PRECISION_RANK[d])
    if not floats_a or not floats_b or floats_a == floats_b:
        return None
    return min(floats_a | floats_b, key=lambda d: PRECISION_RANK[d])


class TolerancePolicy:
    """Defaults per dtype, overridden globally and then by the first matching module-path rule."""

    def __init__(self, atol: float | None = None, rtol: float | None = None, cos: float | None = None,
                 rules: Iterable[tuple[str, Mapping[str, float]]] = ()) -> None:
        self.global_override = {k: v for k, v in (("atol", atol), ("rtol", rtol), ("cos", cos)) if v is not None}
        self.rules = [(re.compile(pattern), dict(values)) for pattern, values in rules]

    def for_tensor(self, path: str, dtype_a: str | None, dtype_b: str | None, floor: str | None = None) -> Tolerance:
        """``floor``: the least precise dtype either run holds its parameters in, where they differ
        (``precision_floor``)."""
        cls = dtype_class(dtype_a, dtype_b, floor)
        tol = DEFAULTS[cls]
        if cls != "exact":
            tol = replace(tol, **self.global_override)
        for pattern, values in self.rules:
            if pattern.search(path):
                tol = replace(tol, **values)
                break
        return tol

    def describe(self) -> dict[str, Any]:
        return {"defaults": {k: v.as_dict() for k, v in DEFAULTS.items()}, "override": self.global_override,
                "rules": [[p.pattern, v] for p, v in self.rules]}

    @classmethod
    def from_description(cls, desc: Mapping[str, Any]) -> TolerancePolicy:
        o = desc.get("override", {})
        return cls(o.get("atol"), o.get("rtol"), o.get("cos"), rules=desc.get("rules", ()))


def parse_rule(text: str) -> tuple[str, dict[str, float]]:
    """``REGEX:atol=1e-3,rtol=0,cos=0.999`` -> (regex, {...}); raises ValueError with a readable message."""
    pattern, sep, body = text.rpartition(":")
    if not sep or not pattern:
        raise ValueError(f"tolerance rule {text!r} should look like 'REGEX:atol=1e-3,cos=0.999'")
    values = {}
    for item in body.split(","):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in ("atol", "rtol", "cos"):
            raise ValueError(f"tolerance rule {text!r}: expected atol=, rtol= or cos=, got {item!r}")
        values[key] = check_value(key, float(val))
    re.compile(pattern)
    return pattern, values


def check_value(name: str, value: float) -> float:
    """Tolerances must be real numbers in range: a NaN would silently pass everything."""
    if math.isnan(value) or (name != "cos" and (value < 0 or math.isinf(value))) or \
            (name == "cos" and not -1 <= value <= 1):
        raise ValueError(f"{name} must be {'between -1 and 1' if name == 'cos' else 'a finite number >= 0'}, "
                         f"not {value}")
    return value


def judge(metrics: Mapping[str, Any], tol: Tolerance) -> tuple[bool, str]:
    """(passed, reason). The reason names the first check that failed, for the report."""
    if metrics.get("mismatch"):
        return False, metrics["mismatch"]
    if metrics.get("nonfinite_mismatch"):
        return False, f"{metrics['nonfinite_mismatch']} NaN/Inf values differ"
    if metrics.get("identical"):
        return True, "identical"
    limit = tol.atol + tol.rtol * metrics.get("ref_max_abs", 0.0)
    if metrics["max_abs"] > limit:
        return False, f"max abs diff {metrics['max_abs']:.3g} > {limit:.3g}"
    cosine = metrics.get("cosine")
    if tol.cos is not None and cosine is not None and cosine < tol.cos and not _within_zero(metrics, tol):
        return False, f"cosine {cosine:.8f} < {tol.cos}"
    return True, "within tolerance"


def _within_zero(metrics: Mapping[str, Any], tol: Tolerance) -> bool:
    """Both tensors lie within the absolute tolerance of zero: the reference's largest magnitude is at most
    ``atol`` (and, the difference being within its limit, the candidate's at most about twice that). The angle
    between two such tensors is rounding noise, not evidence: a gradient that is zero in exact arithmetic (a
    key projection's bias: softmax ignores a shift shared by every key) comes out as ~1e-12 of noise in each
    run, at any angle to the other run's (cosine 0.3 between BERT's eager and SDPA attention)."""
    return tol.atol > 0 and metrics.get("ref_max_abs", math.inf) <= tol.atol
