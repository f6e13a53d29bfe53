"""An operation computed again in float64 from each run's own recorded input: how far each run's output is from what
the operation makes of what it was given (``own_error`` of its output's metrics).

Some operations amplify their input's error: a softmax turns an absolute difference d of its input into a relative
difference of up to e^(2d) - 1 of its output, whatever the input's size. Against a run in a lower precision, large
scores that agree within the relative tolerance make probabilities that do not, with no fault of the softmax, and a
defect in it (a temperature, another dimension) looks the same to a comparison of the two runs. Each run's output
against the operation replayed from that run's own input tells them apart: a softmax computes its output to within
its dtype's rounding, a defect does not. The table is data: an operation family -> how it is replayed
(``Replayed``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np


def _softmax(x: np.ndarray, dim: Optional[int]) -> np.ndarray:
    shifted = x - np.max(x, axis=dim, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=dim, keepdims=True)


def _exp(x: np.ndarray, dim: Optional[int]) -> np.ndarray:
    return np.exp(x)


def _sigmoid(x: np.ndarray, dim: Optional[int]) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


@dataclass(frozen=True)
class Replayed:
    """An operation as replayed: its float64 ``function`` of (input, dim), whether it ``needs_dim``, and how it
    ``amplifies`` an absolute change d of its input: into a relative change of its output of at most
    e^(amplifies x d) - 1, whatever the input's size (log softmax(x)_i = x_i - logsumexp(x) moves by at most twice
    the largest change of x; log exp(x) and log sigmoid(x) by at most the change itself)."""

    function: Callable[[np.ndarray, Optional[int]], np.ndarray]
    needs_dim: bool
    amplifies: float


REPLAYED = {"softmax": Replayed(_softmax, True, 2.0), "exp": Replayed(_exp, False, 1.0),
            "sigmoid": Replayed(_sigmoid, False, 1.0)}
MAX_ELEMENTS = 1 << 22  # a side: a larger operation is not replayed (read whole, it takes ~5 float64 copies of it)


def dimension(hparams: Optional[Mapping[str, Any]], args: Optional[Mapping[str, Any]]) -> Optional[int]:
    """The dimension an operation works along, as a module's hyper-parameters (``dim``, Paddle's ``axis``) or an
    operation's arguments (``dim=-1``, or the second positional argument) record it; None where neither says."""
    for source, keys in ((hparams, ("dim", "axis")), (args, ("kwargs.dim", "kwargs.axis", "args.1"))):
        for key in keys:
            value = (source or {}).get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def own_error(family: str, x: np.ndarray, y: np.ndarray, dim: Optional[int]) -> Optional[float]:
    """|y - f(x)| / |f(x)| (L2 norms over the positions where both are finite) with f the operation of ``family``
    replayed in float64 from ``x``; None where it cannot be replayed (no such family, no dimension where it needs
    one, shapes that differ, nothing finite)."""
    replay = REPLAYED.get(family)
    if replay is None or x.shape != y.shape or (replay.needs_dim and (dim is None or not -x.ndim <= dim < x.ndim)):
        return None
    with np.errstate(all="ignore"):
        expected = replay.function(x.astype(np.float64), dim)
        finite = np.isfinite(expected) & np.isfinite(y)
        if not finite.any():
            return None
        diff, ref = (y.astype(np.float64) - expected)[finite], expected[finite]
        norm = float(np.linalg.norm(ref))
        error = float(np.linalg.norm(diff))
    if norm == 0:
        return 0.0 if error == 0 else math.inf
    return error / norm
