"""The statistics torch computes itself (one pass per cache-sized piece, no host copy) equal numpy's reference
summary: on random data of sizes that do and do not fill the last piece, on non-contiguous views, and where the
fast path must step aside (NaN/Inf, half precision, small tensors)."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from layerdiff.adapters.torch_adapter import fast_stats, to_stored  # noqa: E402
from layerdiff.core.tensors import summarize  # noqa: E402

pytestmark = pytest.mark.torch


def _reference(t: torch.Tensor) -> dict:
    x = t.detach().double().reshape(-1).numpy()
    finite = x[np.isfinite(x)]
    return {"numel": x.size, "min": finite.min(), "max": finite.max(), "mean": finite.mean(),
            "l2": math.sqrt(float(np.dot(finite, finite))), "nan": int(np.isnan(x).sum()),
            "inf": int(np.isinf(x).sum())}


def _close(got: dict, want: dict, rel: float = 1e-6):
    assert got["numel"] == want["numel"] and got["nan"] == want["nan"] and got["inf"] == want["inf"]
    assert got["min"] == want["min"] and got["max"] == want["max"]  # exact: no rounding in min/max
    assert got["l2"] == pytest.approx(want["l2"], rel=rel)
    assert got["mean"] == pytest.approx(want["mean"], rel=rel, abs=rel * want["l2"] / math.sqrt(want["numel"]))


@pytest.mark.parametrize("numel", [1 << 20, (1 << 18) * 5 + 12345, 5_000_003])
def test_fast_statistics_equal_numpy(numel):
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3 + 0.5
    got = fast_stats(t)
    assert got is not None
    _close(got, _reference(t))
    _close(summarize(*to_stored(t)), _reference(t))


@pytest.mark.parametrize("threads", [1, 2])
def test_non_contiguous_views(threads):
    """Also single-threaded (OMP_NUM_THREADS=1): a one-thread BLAS dot was 2.4e-6 off on ``base[:, ::3]``."""
    base = torch.randn(2400, 1800, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for view in (base.t(), base[:, ::3], base[200:2200].transpose(0, 1)):
            assert not view.is_contiguous()
            _close(fast_stats(view), _reference(view))
            _close(summarize(*to_stored(view)), _reference(view))
    finally:
        torch.set_num_threads(before)


def test_nan_and_inf_leave_the_fast_path_and_are_counted():
    t = torch.randn(1 << 21, generator=torch.Generator().manual_seed(2))
    t[7], t[70_000], t[1_300_001] = float("nan"), float("inf"), float("-inf")
    assert fast_stats(t) is None  # the numpy path counts them
    stats = summarize(*to_stored(t))
    assert (stats["nan"], stats["inf"]) == (1, 2)
    _close(stats, _reference(t))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_goes_through_numpy(dtype):
    t = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    assert fast_stats(t) is None
    stored, name = to_stored(t)
    _close(summarize(stored, name), _reference(t), rel=1e-5)


def test_small_tensors_use_numpy():
    assert fast_stats(torch.randn(1000)) is None
