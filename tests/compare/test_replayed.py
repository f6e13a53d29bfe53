"""An operation replayed in float64 from a run's own recorded input (``compare.replayed``): how far the run's output
is from what the operation makes of what it was given."""
from __future__ import annotations

import math

import numpy as np

from layerdiff.compare.replayed import dimension, own_error


def _softmax32(x: np.ndarray, axis: int) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # a line of -inf only (masked keys along another axis): NaN, as torch's
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def test_a_softmax_computed_in_float32_is_within_its_rounding_and_one_computed_otherwise_is_not():
    rng = np.random.default_rng(0)
    scores = (25 * rng.standard_normal((2, 4, 16, 16))).astype(np.float32)
    scores[..., 10:] = -np.inf  # masked keys: zero probability in both
    right = _softmax32(scores, -1)
    assert own_error("softmax", scores, right, -1) < 4 * 2.0 ** -24
    assert own_error("softmax", scores, _softmax32(scores * 1.01, -1), -1) > 1e-4  # a temperature: 1000 roundings
    assert own_error("softmax", scores, _softmax32(scores, -2), -1) > 0.5  # another dimension
    assert own_error("softmax", scores, right, None) is None  # no dimension: not replayed
    assert own_error("softmax", scores, right[..., :8], -1) is None  # shapes differ
    assert own_error("matmul", scores, right, -1) is None  # not in the table


def test_elementwise_operations_need_no_dimension():
    x = np.linspace(-40, 40, 101, dtype=np.float32)
    assert own_error("sigmoid", x, (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32), None) < 1e-7
    assert own_error("exp", x, np.exp(x), None) < 1e-6
    assert math.isinf(own_error("exp", np.full(3, -np.inf, np.float32), np.ones(3, np.float32), None))  # 0 expected


def test_the_dimension_from_hyper_parameters_or_arguments():
    assert dimension({"dim": -1}, None) == -1 and dimension({"axis": 1}, None) == 1
    assert dimension(None, {"kwargs.dim": 2}) == 2 and dimension(None, {"args.1": -1, "kwargs.dtype": "x"}) == -1
    assert dimension({"dim": None}, {"args.1": True}) is None  # a flag is no dimension
