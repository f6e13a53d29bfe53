"""Metrics against float64 references, tolerance judgement, dtype decoding."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_kernel
from layerdiff.compare.metrics import DataAccumulator, accumulate, compare_arrays, compare_data, compare_stats
from layerdiff.tracefile import tensors
from layerdiff.tracefile.tensors import as_float, in_memory_order, summarize
from layerdiff.compare.tolerance import DEFAULTS, TolerancePolicy, judge, parse_rule, precision_floor


@pytest.fixture(params=[pytest.param("kernel", marks=needs_kernel), "numpy"])
def statistics_path(request, monkeypatch):
    """Each statistics test runs on both paths: the C kernel (``fastmoments.c``, where it is built) and numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(tensors, "one_pass_moments", None)
    return request.param


def _reference(a, b):
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    d = np.abs(a64 - b64)
    return d.max(), d.mean(), a64 @ b64 / math.sqrt((a64 @ a64) * (b64 @ b64))


@pytest.mark.parametrize("noise", [1e-7, 1e-4, 1e-1])
def test_data_metrics_match_float64_reference(noise):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(300_001).astype(np.float32)  # not a multiple of any block size
    b = (a + rng.standard_normal(a.size) * noise).astype(np.float32)
    m = compare_arrays(a, b, "float32", "float32")
    max_abs, mean_abs, cos = _reference(a, b)
    assert m["max_abs"] == max_abs
    assert m["mean_abs"] == pytest.approx(mean_abs, rel=1e-6)  # float32 sums per block (BLAS), float64 across
    assert 1 - m["cosine"] == pytest.approx(1 - cos, rel=1e-5)  # precise even where cos rounds to 1 in fp32
    assert m["ref_max_abs"] == np.abs(a).max() and not m["identical"]


def test_identical_and_all_zero_tensors():
    a = np.linspace(-1, 1, 1000, dtype=np.float32)
    m = compare_arrays(a, a.copy(), "float32", "float32")
    assert m["identical"] and m["cosine"] == 1.0 and m["max_abs"] == 0.0
    z = np.zeros(10, np.float32)
    assert compare_arrays(z, z, "float32", "float32")["cosine"] == 1.0
    assert compare_arrays(z, np.ones(10, np.float32), "float32", "float32")["cosine"] == 0.0


def test_nonfinite_values_are_matched_not_propagated():
    a = np.array([1, np.nan, np.inf, 2, 0], np.float32)
    same = compare_arrays(a, a.copy(), "float32", "float32")
    assert same["nonfinite_mismatch"] == 0 and same["identical"]
    b = np.array([1, np.nan, 5, 2.5, 0], np.float32)
    m = compare_arrays(a, b, "float32", "float32")
    assert m["nonfinite_mismatch"] == 1 and m["max_abs"] == 0.5
    assert judge(m, DEFAULTS["float32"]) == (False, "1 NaN/Inf values differ")


def test_bfloat16_decoding_and_mixed_dtype_comparison():
    x = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # exact in bf16
    assert np.array_equal(as_float(bits, "bfloat16"), x)
    m = compare_arrays(bits, x, "bfloat16", "float32")
    assert m["identical"]
    assert TolerancePolicy().for_tensor("m", "bfloat16", "float32") == DEFAULTS["bfloat16"]


def test_streams_with_different_chunking_pair_up():
    a = np.arange(100, dtype=np.float32)
    b = a.copy()
    b[77] += 1
    m = compare_data([a[:10], a[10:100]], [b[:33], b[33:66], b[66:]], "float32", "float32")
    assert m["max_abs"] == 1.0 and m["numel"] == 100


def test_positions_zero_in_one_run_only_are_counted_and_the_error_elsewhere_measured_apart():
    """A mask that chose otherwise (a ReLU's, dropout's): the positions zero in exactly one run, and the relative
    error over the others, equal to float64's over the same positions, whichever run holds the zero, however the
    tensors are cut into pieces and in how many accumulators (slices compared in separate processes)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(200_000).astype(np.float32)
    b = (a * (1 + 1e-3 * rng.standard_normal(a.size))).astype(np.float32)
    a[rng.choice(a.size, 500, replace=False)] = 0  # zero in A only (where B is not)
    b[rng.choice(a.size, 700, replace=False)] = 0
    one_sided = (a == 0) != (b == 0)
    keep = ~one_sided
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    expected = np.linalg.norm((a64 - b64)[keep]) / np.linalg.norm(a64[keep])
    whole = compare_data([a[:70_001], a[70_001:]], [b[:123_457], b[123_457:]], "float32", "float32")
    assert whole["zero_mismatch"] == int(one_sided.sum()) and 1100 < whole["zero_mismatch"] < 1200
    assert whole["rel_l2_elsewhere"] == pytest.approx(expected, rel=1e-6)
    assert whole["rel_l2"] > 10 * whole["rel_l2_elsewhere"]  # the flips carry most of the error
    merged = DataAccumulator.from_state(accumulate([a[:90_000]], [b[:90_000]], "float32", "float32").state())
    merged.merge(accumulate([a[90_000:]], [b[90_000:]], "float32", "float32"))
    assert merged.result()["zero_mismatch"] == whole["zero_mismatch"]
    assert merged.result()["rel_l2_elsewhere"] == pytest.approx(whole["rel_l2_elsewhere"], rel=1e-6)
    clean = compare_data([a], [np.where(b == 0, a, b)], "float32", "float32")
    assert clean["zero_mismatch"] == int(((a == 0) & (b != 0)).sum()) > 490  # A's zeros only
    assert "zero_mismatch" not in compare_data([np.abs(a) + 1], [np.abs(b) + 1], "float32", "float32")


def test_tolerance_judgement_and_overrides():
    metrics = {"basis": "data", "identical": False, "max_abs": 1e-4, "ref_max_abs": 1.0, "cosine": 0.999999999,
               "nonfinite_mismatch": 0}
    assert judge(metrics, DEFAULTS["float32"])[0] is False  # 1e-4 relative: caught in fp32
    assert judge(metrics, DEFAULTS["bfloat16"])[0] is True
    policy = TolerancePolicy(rtol=1e-3, rules=[parse_rule(r"lm_head:atol=0,rtol=0")])
    assert judge(metrics, policy.for_tensor("model.x", "float32", "float32"))[0] is True
    assert policy.for_tensor("lm_head", "float32", "float32").rtol == 0
    assert policy.for_tensor("model.x", "int64", "int64") == DEFAULTS["exact"]
    with pytest.raises(ValueError):
        parse_rule("no-colon")


def test_cosine_is_no_evidence_between_tensors_within_atol_of_zero():
    """A gradient that is zero in exact arithmetic is rounding noise in each run, at any angle to the other run's:
    judged by its magnitude alone. Above atol, the angle still decides."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(64) * 1e-12, rng.standard_normal(64) * 1e-12
    noise = compare_data([a.astype(np.float32)], [b.astype(np.float32)], "float32", "float32")
    assert noise["cosine"] < 0.9 and judge(noise, DEFAULTS["float32"]) == (True, "within tolerance")
    assert judge(noise, TolerancePolicy(atol=0.0).for_tensor("x", "float32", "float32"))[0] is False
    signal = {**noise, "ref_max_abs": 1e-6, "max_abs": 1e-9}
    assert judge(signal, DEFAULTS["float32"])[0] is False and "cosine" in judge(signal, DEFAULTS["float32"])[1]


def test_runs_holding_parameters_in_other_dtypes_are_judged_by_the_less_precise():
    assert precision_floor(["float32"], ["bfloat16"]) == "bfloat16"
    assert precision_floor(["float32", "bfloat16"], ["float32"]) == "bfloat16"
    assert precision_floor(["float32"], ["float32"]) is None and precision_floor(["bfloat16"], ["bfloat16"]) is None
    assert precision_floor(None, ["float16"]) is None  # a run that does not say: nothing to go by
    policy = TolerancePolicy()
    assert policy.for_tensor("m", "float32", "float32", "bfloat16") == DEFAULTS["bfloat16"]
    assert policy.for_tensor("m", "float16", "float16", "bfloat16") == DEFAULTS["bfloat16"]
    assert policy.for_tensor("m", "float64", "float64", "float16") == DEFAULTS["float16"]
    assert policy.for_tensor("m", "int64", "int64", "bfloat16") == DEFAULTS["exact"]  # integers stay exact
    assert policy.for_tensor("m", "float32", "float32", None) == DEFAULTS["float32"]


@pytest.mark.parametrize("dtype, bits", [("bfloat16", np.uint16(0x3FC0)), ("float8_e4m3fn", np.uint8(0x3C)),
                                         ("float8_e5m2", np.uint8(0x3E)), ("float16", np.float16(1.5)),
                                         ("float32", np.float32(1.5)), ("int64", np.int64(1))])
def test_scalar_tensors_of_every_dtype_are_read(dtype, bits):
    """A 0-dimensional tensor (a loss, a scale an operation makes) in bfloat16 stopped a trace: numpy's shift of a
    0-d array gives a scalar, whose bits cannot be viewed as float32."""
    stored = np.array(bits)
    assert stored.ndim == 0
    value = as_float(stored, dtype)
    assert value.shape == () and float(value) == (1.0 if dtype == "int64" else 1.5)
    assert summarize(stored, dtype)["mean"] == float(value)


def test_stats_comparison():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(1000).astype(np.float32)
    sa, sb = summarize(a, "float32"), summarize(a * 1.01, "float32")
    m = compare_stats(sa, sb)
    assert m["basis"] == "stats" and m["cosine"] is None and m["max_abs"] > 0
    assert judge(m, DEFAULTS["float32"])[0] is False
    assert compare_stats(sa, dict(sa))["identical"]


@pytest.mark.parametrize("values, numel", [(1e19, 100_000), (3e38, 3), (-7e37, 200_000)])
def test_statistics_of_values_whose_float32_squares_overflow(values, numel, statistics_path):
    """Summed piece by piece in float32, such squares (and sums) overflow: the statistics are then taken in
    float64, and are finite and right."""
    x = np.full(numel, values, np.float32)
    stats = summarize(x, "float32")
    exact = float(np.float32(values))
    assert stats["min"] == stats["max"] == exact and stats["nan"] == stats["inf"] == 0
    assert stats["mean"] == pytest.approx(exact, rel=1e-12)
    assert stats["l2"] == pytest.approx(abs(exact) * math.sqrt(numel), rel=1e-12)


@pytest.mark.parametrize("where", [0, 65_536, 150_000])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_nonfinite_value_in_any_piece_is_counted(where, bad, statistics_path):
    """A NaN in one piece of many was lost: its piece's NaN min lost to the other pieces' finite ones (a defect of
    the piece-by-piece reduction, caught by the torch path's tests)."""
    x = np.linspace(-2, 3, 200_000, dtype=np.float32)
    x[where] = bad
    stats = summarize(x, "float32")
    assert (stats["nan"], stats["inf"]) == ((1, 0) if math.isnan(bad) else (0, 1))
    finite = np.delete(x, where).astype(np.float64)
    assert stats["min"] == finite.min() and stats["max"] == finite.max()
    assert stats["mean"] == pytest.approx(finite.mean(), rel=1e-9)
    assert stats["l2"] == pytest.approx(math.sqrt(float(np.dot(finite, finite))), rel=1e-9)


def test_statistics_piece_by_piece_equal_float64_over_many_pieces(statistics_path):
    x = (np.random.default_rng(5).standard_normal(1_000_003) * 3 + 0.25).astype(np.float32)
    stats, wide = summarize(x, "float32"), x.astype(np.float64)
    assert stats["min"] == float(x.min()) and stats["max"] == float(x.max())
    assert stats["mean"] == pytest.approx(wide.mean(), rel=1e-6)
    assert stats["l2"] == pytest.approx(math.sqrt((wide ** 2).sum()), rel=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int64"])
@pytest.mark.parametrize("numel", [1, 7, 4096, 65_536])
def test_statistics_of_one_piece_equal_float64_and_warn_nothing(dtype, numel, statistics_path):
    """Tensors of one piece take a shorter path (no ``np.errstate``): it must give the same statistics, raise no
    warning, and hand NaN, Inf and sums that would overflow to the full path."""
    rng = np.random.default_rng(numel)
    wide = rng.standard_normal(numel) * 3 + 0.5
    if dtype == "int64":
        stored = (wide * 1000).astype(np.int64)
    elif dtype == "bfloat16":
        stored = (wide.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        stored = wide.astype(dtype)
    values = as_float(stored, dtype).astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = summarize(stored, dtype)
    assert stats["min"] == values.min() and stats["max"] == values.max() and stats["nan"] == stats["inf"] == 0
    assert stats["mean"] == pytest.approx(values.mean(), rel=1e-6, abs=1e-6)
    assert stats["l2"] == pytest.approx(math.sqrt(float(values @ values)), rel=2e-6)  # a float32 BLAS dot: ~1e-6


def test_transposed_and_strided_tensors_are_summarized_over_their_own_elements(statistics_path):
    """A permutation of a dense layout is read as a view in memory order; a slice with gaps or a broadcast is not
    (its elements are not the memory's): either way the statistics are those of the elements it shows."""
    dense = (np.random.default_rng(3).standard_normal((4, 96, 200)) + 0.5).astype(np.float32)
    broadcast = np.broadcast_to(dense[:1], (3, 96, 200))
    for shown in (dense.transpose(0, 2, 1), dense.transpose(2, 0, 1), dense[:, ::2], dense[..., 3:150], broadcast):
        ordered = in_memory_order(shown)
        permutation = shown is not broadcast and shown.base is dense and shown.size == dense.size
        assert (ordered is not shown and ordered.flags.c_contiguous and np.shares_memory(ordered, dense)) == permutation
        values, stats = shown.astype(np.float64), summarize(shown, "float32")
        assert stats["numel"] == shown.size and stats["min"] == values.min() and stats["max"] == values.max()
        assert stats["mean"] == pytest.approx(values.mean(), rel=1e-6)
        assert stats["l2"] == pytest.approx(math.sqrt((values ** 2).sum()), rel=1e-6)


@pytest.mark.parametrize("values", [[1e20, -1e20, 3.0], [3e38] * 5, [1e34] * 60_000, [np.nan, 1.0], [np.inf, -np.inf, 2.0],
                                    [np.nan, np.inf]])
def test_one_piece_of_nonfinite_or_overflowing_values_is_summarized_by_the_full_path(values, statistics_path):
    x = np.array(values, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = summarize(x, "float32")
    finite = x[np.isfinite(x)].astype(np.float64)
    assert (stats["nan"], stats["inf"]) == (int(np.isnan(x).sum()), int(np.isinf(x).sum()))
    if finite.size == 0:
        assert stats["min"] is stats["mean"] is stats["l2"] is None
        return
    assert stats["min"] == finite.min() and stats["max"] == finite.max()
    assert stats["mean"] == pytest.approx(finite.mean(), rel=1e-9)
    assert stats["l2"] == pytest.approx(math.sqrt(float(finite @ finite)), rel=1e-9)


def _kernel_input(numel: int, dtype) -> np.ndarray:
    return ((np.random.default_rng(numel).standard_normal(numel) - 0.3) * 5).astype(dtype)


def _assert_moments_match_float64(moments, x: np.ndarray, *context) -> None:
    """A kernel's (min, max, sum, sum of squares) of ``x`` against float64's."""
    lo, hi, total, square = moments(x)
    wide = x.astype(np.float64)
    assert (lo, hi) == (wide.min(), wide.max()), context
    assert total == pytest.approx(wide.sum(), rel=1e-7, abs=1e-7 * np.abs(wide).sum()), context
    assert square == pytest.approx(wide @ wide, rel=1e-7), context


def _assert_nonfinite_sums(moments, *context) -> None:
    """A NaN or infinity anywhere makes both sums non-finite (numpy's path then counts it), the kernel being built
    as if every value were finite."""
    cases = [np.array(bad, np.float32) for bad in ([np.nan, 1.0, 2.0], [1.0, np.inf], [2.0] * 3000 + [np.nan])]
    for bad in (np.nan, np.inf, -np.inf):
        x = np.linspace(-2, 3, 3000, dtype=np.float32)
        x[1234] = bad
        cases.append(x)
    for x in cases:
        total, square = moments(x)[2:]
        assert not math.isfinite(total) and not math.isfinite(square), (context, x[~np.isfinite(x)])


def _why_no_kernel_builds(compiler: str) -> str | None:
    """Why ``compiler`` cannot build the kernel here (None: it can)."""
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler}) here"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h) here"
    return None


@needs_kernel
@pytest.mark.parametrize("numel", [1, 2, 255, 256, 257, 1025, 65_535, 65_536, 65_537, 300_001])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_statistics_kernel_agrees_with_numpy_and_float64(numel, dtype, monkeypatch):
    """Every size around the kernel's block (256) and its threshold for releasing the GIL (65536)."""
    x = _kernel_input(numel, dtype)
    _assert_moments_match_float64(tensors.one_pass_moments, x)
    kernel = summarize(x, np.dtype(dtype).name)
    monkeypatch.setattr(tensors, "one_pass_moments", None)
    numpy_path = summarize(x, np.dtype(dtype).name)
    assert kernel.keys() == numpy_path.keys() and (kernel["min"], kernel["max"]) == (numpy_path["min"], numpy_path["max"])
    assert kernel["mean"] == pytest.approx(numpy_path["mean"], rel=1e-6, abs=1e-7)
    assert kernel["l2"] == pytest.approx(numpy_path["l2"], rel=1e-6)


@needs_kernel
def test_the_statistics_kernel_leaves_other_buffers_to_numpy():
    """None for what it does not reduce (integers, half floats, no elements); a strided view is refused, never read
    as if it were dense; a NaN or infinity makes both sums non-finite, which sends ``summarize`` to numpy's path."""
    for other in (np.arange(10), np.ones(4, np.float16), np.zeros(0, np.float32), b"bytes"):
        assert tensors.one_pass_moments(other) is None
    with pytest.raises((ValueError, BufferError)):
        tensors.one_pass_moments(np.ones((8, 8), np.float32)[:, ::2])
    _assert_nonfinite_sums(tensors.one_pass_moments)


def test_the_statistics_kernel_is_built_where_a_compiler_is():
    """The install builds the kernel wherever a C compiler is found (it is optional only where none is): a build
    that fails silently would leave every trace at numpy's slower path."""
    reason = _why_no_kernel_builds((sysconfig.get_config_var("CC") or "cc").split()[0])
    if reason:
        pytest.skip(f"{reason}: the install takes numpy's path")
    assert tensors.one_pass_moments is not None, "pip install -e . did not build layerdiff/tracefile/fastmoments.c"


@pytest.mark.parametrize("compiler", ["gcc", "clang"])
def test_the_kernel_as_each_compiler_here_builds_it_agrees_with_float64(compiler, tmp_path):
    """The kernel built with setup.py's flags by GCC and by Clang (the compiler of macOS): before its flags, Clang's
    build left min and max unvectorized (9x slower than GCC's, 3x slower than numpy's path) and, with blocks of
    1024, its squares 2.7e-7 off."""
    root = Path(tensors.__file__).parents[2]
    reason = _why_no_kernel_builds(compiler)
    if reason or not (root / "setup.py").exists():
        pytest.skip(reason or "layerdiff is not installed from its sources")
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "temp")], cwd=root,
                           env={**os.environ, "CC": compiler, "LAYERDIFF_NATIVE": "0"},  # the kernel alone
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("fastmoments", next((tmp_path / "lib").rglob("fastmoments*")))
    assert spec is not None and spec.loader is not None
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    for numel in (1, 255, 256, 257, 4097, 65_537, 300_001):
        for dtype in (np.float32, np.float64):
            _assert_moments_match_float64(kernel.moments, _kernel_input(numel, dtype), compiler, numel, dtype)
    _assert_nonfinite_sums(kernel.moments, compiler)


def test_a_run_under_autocast_is_judged_at_the_dtype_it_computes_in():
    assert precision_floor(["float32"], ["float32"], (), ["bfloat16"]) == "bfloat16"  # fp32 against torch.autocast
    assert precision_floor(["float32"], ["float32"], ["float16"], ["float16"]) == "float16"  # both under it
    assert precision_floor(["float32"], ["float32"], ["float16"], ["bfloat16"]) == "bfloat16"
    assert precision_floor(["float32"], ["float32"], (), ()) is None


def test_an_additive_masks_lowest_value_is_one_never_in_every_dtype():
    """A causal mask filled with ``torch.finfo(dtype).min``: -65504 in float16, -3.4e38 in float32. Before, float16
    against float32 differed by 3.4e38 at every masked position (every Hugging Face model with eager attention,
    'divergent' at its first decoder layer's inputs). Each side's lowest values now read as -inf, and agree; a
    mask that hides other positions still differs."""
    causal = np.triu(np.ones((8, 8), dtype=bool), k=1)
    a = np.where(causal, np.float32(-3.4028235e38), np.float32(0.0))
    b = np.where(causal, np.float16(-65504.0), np.float16(0.0))
    m = compare_arrays(a, b, "float32", "float16")
    assert m["max_abs"] == 0.0 and m["nonfinite_mismatch"] == 0 and m["cosine"] == 1.0, m
    assert judge(m, DEFAULTS["float16"])[0]
    shifted = np.where(np.triu(np.ones((8, 8), dtype=bool), k=2), np.float16(-65504.0), np.float16(0.0))
    m = compare_arrays(a, shifted, "float32", "float16")
    assert m["nonfinite_mismatch"] == 7 and not judge(m, DEFAULTS["float16"])[0], m
    big = np.array([-3.0e4, 1.0], dtype=np.float32)  # a large value that is no mask's: compared as it is
    m = compare_arrays(big, np.array([-2.9e4, 1.0], dtype=np.float16), "float32", "float16")
    assert m["max_abs"] > 900, m
