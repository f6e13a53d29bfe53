"""The statistics torch computes itself (one pass per cache-sized piece, no host copy; on an accelerator, where the
tensor lives) equal numpy's reference summary: on random data of sizes that do and do not fill the last piece, on
non-contiguous views, for every floating dtype, with NaN/Inf and with squares beyond float32's range; CPU
tensors take the path that is faster for them; the C kernel reading a tensor in place gives what it gives for its
bytes."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import needs_kernel  # noqa: E402
from layerdiff.adapters.torch_adapter import (KERNEL_READS_ANY_SIZE, cpu_route, fast_stats,  # noqa: E402
                                             framework_stats, to_stored)
from layerdiff.tracefile import tensors  # noqa: E402
from layerdiff.tracefile.tensors import summarize  # noqa: E402

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
    _close(framework_stats(t), _reference(t))  # torch's own path, whichever ``cpu_route`` picks
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


def test_nan_and_inf_are_counted_by_both_paths():
    t = torch.randn(1 << 21, generator=torch.Generator().manual_seed(2))
    t[7], t[70_000], t[1_300_001] = float("nan"), float("inf"), float("-inf")
    _close(fast_stats(t), _reference(t))
    stats = summarize(*to_stored(t))
    assert (stats["nan"], stats["inf"]) == (1, 2)
    _close(stats, _reference(t))


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("numel", [1, 1023, 1025, (1 << 18) + 1])
def test_every_float_dtype_as_an_accelerator_would_take_it(dtype, numel):
    """``framework_stats`` is what runs on CUDA/NPU for any size; the CPU runs the same code."""
    t = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 4 - 1).to(dtype)
    rel = 1e-6 if dtype in (torch.float32, torch.float64) else 1e-5
    _close(framework_stats(t), _reference(t), rel=rel)
    _close(summarize(*to_stored(t)), _reference(t), rel=rel)


def test_a_zero_dimensional_tensor_and_a_strided_half_view():
    _close(framework_stats(torch.tensor(-2.5)), _reference(torch.tensor(-2.5)))
    view = torch.randn(700, 300, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)[:, ::7].t()
    assert not view.is_contiguous()
    _close(framework_stats(view), _reference(view), rel=1e-5)


@pytest.mark.parametrize("where", [[0], [300_000], [5, 299_999], list(range(0, 300_001, 1000))])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_in_any_piece(where, bad):
    t = torch.linspace(-3, 2, 300_001)
    t[where] = bad
    got = framework_stats(t)
    assert (got["nan"], got["inf"]) == ((len(where), 0) if math.isnan(bad) else (0, len(where)))
    _close(got, _reference(t))
    _close(summarize(*to_stored(t)), _reference(t))


def test_all_nonfinite_and_squares_beyond_float32():
    nothing = framework_stats(torch.full((5000,), float("nan")))
    assert nothing["nan"] == 5000 and nothing["min"] is nothing["l2"] is None
    huge = torch.full((300_000,), 1e20)  # finite, but its float32 squares are not
    got = framework_stats(huge)
    assert got["min"] == got["max"] == float(torch.tensor(1e20)) and got["nan"] == got["inf"] == 0
    assert got["l2"] == pytest.approx(float(torch.tensor(1e20)) * math.sqrt(300_000), rel=1e-12)


def test_cpu_tensors_take_the_path_measured_faster():
    """The C kernel reads dense float32, float64 and bfloat16 tensors where they lie: at any size where it reads them
    with torch's threads (``KERNEL_READS_ANY_SIZE``, here with a built kernel and torch on OpenMP), else below 1M
    elements, torch's reductions from there. torch for float16 and 8-bit floats from 128K (numpy widens them in
    whole-array temporaries first), and for large views the kernel cannot read in place; numpy takes the rest (other
    dtypes and layouts)."""
    if tensors.moments_at is not None and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert KERNEL_READS_ANY_SIZE
    for dtype in (torch.float32, torch.bfloat16):
        assert cpu_route(torch.randn(1 << 20).to(dtype)) == ("kernel" if KERNEL_READS_ANY_SIZE else "torch")
        assert cpu_route(torch.randn((1 << 20) - 1).to(dtype)) == "kernel"
        assert cpu_route(torch.randn(1 << 12, 1 << 10).to(dtype)[:, ::2]) == "torch"  # 2M elements, strided
        big = torch.randn(1 << 21).to(dtype)
        big[12345] = float("nan")  # the kernel hands a large tensor holding NaN to torch's path, which counts it
        got = fast_stats(big)
        assert got is not None and got["nan"] == 1 and got["numel"] == 1 << 21
    for dtype in (torch.float16, torch.float8_e4m3fn):
        assert cpu_route(torch.randn(1 << 17).to(dtype)) == "torch"
    for dtype in (torch.float16, torch.float8_e4m3fn):
        assert cpu_route(torch.randn((1 << 17) - 1).to(dtype)) is None
    assert cpu_route(torch.randn(1 << 21, dtype=torch.float64)) == "kernel"
    assert cpu_route(torch.ones(1 << 21, dtype=torch.int64)) is None
    assert cpu_route(torch.ones(1 << 21, dtype=torch.bool)) is None
    # not dense: the kernel gathers the slice where it lies, numpy reads a view of it where the kernel is not built
    assert cpu_route(torch.randn(40, 30)[:, ::2]) == ("strided" if tensors.READS_SLICES else None)
    assert cpu_route(torch.randn(2, 3).expand(4, 2, 3)) is None  # elements shared
    assert fast_stats(torch.empty(1 << 21, device="meta")) is None


DENSE = {"contiguous": lambda t: t, "transposed": lambda t: t.reshape(60, 50).t(),
         "permuted": lambda t: t.reshape(5, 20, 30).permute(2, 0, 1), "offset": lambda t: t[17:],
         "one row": lambda t: t.reshape(3000, 1)[:, 0]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(DENSE))
def test_the_kernel_reads_a_dense_tensor_where_it_lies_as_summarize_reads_its_bytes(dtype, layout):
    """Read in place (its address, its count) the statistics are those of the stored bytes: to the bit for float32
    and float64 (the same kernel, the same values); for bfloat16 (widened as it is read, its sums vectorized
    otherwise) within float32's rounding. A NaN or an infinity hands the tensor to numpy's path, which counts them."""
    t = DENSE[layout]((torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 2 - 0.5).to(dtype))
    assert cpu_route(t) == "kernel"
    if dtype == torch.bfloat16:
        _close(fast_stats(t), summarize(*to_stored(t)), rel=1e-6)
    else:
        assert fast_stats(t) == summarize(*to_stored(t))
    _close(fast_stats(t), _reference(t), rel=1e-6 if dtype != torch.bfloat16 else 1e-5)
    bad = t.clone()
    bad[(1,) * bad.ndim] = float("nan")
    assert cpu_route(bad) == "kernel" and fast_stats(bad) is None
    assert summarize(*to_stored(bad))["nan"] == 1


SLICES = {"a head's half": lambda t: t.reshape(2, 8, 12, 16)[..., :8],  # rotate_half's x1
          "every third column": lambda t: t.reshape(48, 64)[:, ::3],
          "rows and columns": lambda t: t.reshape(48, 64)[5:40:2, 1:-1].t(),
          "one column": lambda t: t.reshape(1536, 2)[:, 1],
          "size-1 dims": lambda t: t.reshape(3, 1, 1024)[:, :, 7:900].unsqueeze(0),
          "longer than a block": lambda t: t.reshape(3, 1024)[:, 1:]}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(SLICES))
def test_the_kernel_gathers_a_slice_where_it_lies(dtype, layout):
    """A tensor that is not dense (a slice) is read where it lies, its runs gathered: the statistics of its values,
    as numpy takes them from a copy; one NaN hands it to numpy's path, which counts it."""
    t = SLICES[layout]((torch.randn(3072, generator=torch.Generator().manual_seed(5)) * 2 - 0.5).to(dtype))
    assert not t.is_contiguous() and cpu_route(t) == "strided"
    rel = 1e-6 if dtype != torch.bfloat16 else 1e-5
    _close(fast_stats(t), _reference(t), rel=rel)
    _close(fast_stats(t), summarize(*to_stored(t)), rel=rel)
    t[tuple(min(1, size - 1) for size in t.shape)] = float("nan")  # in the slice itself (a copy would be dense)
    assert cpu_route(t) == "strided" and fast_stats(t) is None and summarize(*to_stored(t))["nan"] == 1
    assert cpu_route(torch.randn(4, 1).expand(4, 6)) is None  # elements shared: numpy reads the view


MASKED = {"dense": lambda t: t, "a slice": lambda t: t[..., 1:],
          "large, shared threads": lambda t: t.repeat(2, 2, 1, 1)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(MASKED))
def test_attention_scores_masked_with_the_lowest_value_are_summarized_by_the_kernel(dtype, layout):
    """Eager attention adds the dtype's lowest finite value (-3.4e38 in float32) where a position is masked: the
    float32 sums of such a tensor overflow though every value is finite. The kernel reads it again summed in double
    (numpy's path took 20x as long): the statistics of its values, none counted as NaN or Inf. A real infinity
    among them still goes to numpy's path, which counts it; so does numpy's own array of such values."""
    scores = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    mask = torch.full((64, 64), torch.finfo(dtype).min, dtype=dtype).triu(1)
    t = MASKED[layout](scores + mask)
    assert float(t.min()) == torch.finfo(dtype).min and bool(torch.isfinite(t).all())
    got = fast_stats(t)
    assert got is not None and got["nan"] == got["inf"] == 0
    _close(got, _reference(t), rel=1e-12)
    _close(summarize(*to_stored(t)), _reference(t), rel=1e-12)
    t[(0,) * (t.ndim - 1) + (5,)] = float("-inf")
    assert fast_stats(t) is None
    stats = summarize(*to_stored(t))
    assert stats["inf"] == 1
    _close(stats, _reference(t), rel=1e-12)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_a_large_tensor_read_by_torchs_threads_has_the_statistics_one_thread_gives(dtype):
    """From 32K elements on the kernel reads a tensor with the threads of the OpenMP runtime torch runs on (each
    its share, still in its core's cache). Its statistics are the same to the bit with all of torch's threads or
    one, shared or not, and (float32, float64) as ``summarize`` gives its bytes; sizes around the threshold, chunks
    cut short, a transpose."""
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert tensors.threads_shared() == min(torch.get_num_threads(), 8)
    threads = torch.get_num_threads()
    for numel, layout in ((32_767, None), (32_768, None), (65_537, None), (300_001, None), (640 * 512, "t")):
        t = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3 - 1).to(dtype)
        if layout == "t":
            t = t.reshape(640, 512).t()
        shared = fast_stats(t)
        alone = tensors.stats_at(t.data_ptr(), numel, str(dtype).split(".")[1], share_threads=False)
        try:
            torch.set_num_threads(1)
            one_thread = fast_stats(t)
        finally:
            torch.set_num_threads(threads)
        assert shared == alone == one_thread, (numel, layout)
        if dtype != torch.bfloat16:
            assert shared == summarize(*to_stored(t)), (numel, layout)
        _close(shared, _reference(t), rel=1e-6 if dtype != torch.bfloat16 else 1e-5)


@needs_kernel
def test_the_kernel_shares_only_a_runtime_the_process_already_loaded():
    """Without torch, asking to share threads loads no OpenMP runtime and starts no thread: the kernel reads alone.
    Imported before torch, it finds torch's runtime once torch is loaded."""
    script = (
        "import os, numpy as np\n"
        "from layerdiff.tracefile import tensors\n"
        "def runtimes():\n"
        "    return sum(('gomp' in line or 'iomp5' in line) for line in open('/proc/self/maps'))\n"
        "def threads():\n"
        "    return len(os.listdir('/proc/self/task'))\n"
        "x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)\n"
        "before = (runtimes(), threads())\n"
        "got = tensors.stats_at(x.ctypes.data, x.size, 'float32', share_threads=True)\n"
        "assert got == tensors.stats_at(x.ctypes.data, x.size, 'float32'), got\n"
        "assert (runtimes(), threads()) == before and tensors.threads_shared() == 1, (before, runtimes(), threads())\n"
        "import torch\n"
        "if 'parallel backend: OpenMP' in torch.__config__.parallel_info():\n"
        "    assert tensors.threads_shared() == min(torch.get_num_threads(), 8), tensors.threads_shared()\n"
        "print('ok')\n")
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are shared on Linux only")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@needs_kernel
def test_a_child_forked_after_torch_ran_reads_alone_and_does_not_hang():
    """GNU's OpenMP runtime is not fork-safe: in a child forked after the parent's threads ran, a parallel region waits
    forever for them. The kernel reads alone there (the same statistics), where sharing threads hung the child."""
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are shared on Linux only")
    script = (
        "import os, torch\n"
        "from layerdiff.tracefile import tensors\n"
        "t = torch.randn(1 << 20)\n"
        "(t * 2).sum()\n"
        "want = tensors.stats_at(t.data_ptr(), t.numel(), 'float32', share_threads=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    got = tensors.stats_at(t.data_ptr(), t.numel(), 'float32', share_threads=True)\n"
        "    os._exit(0 if got == want and tensors.threads_shared() == 1 else 3)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "0", (run.stdout, run.stderr[-2000:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recorded_statistics_equal_the_stored_bytes_over_a_whole_model(tmp_path, dtype):
    """A full trace of a transformers Llama whose logits and embedding (and their gradients) are large (1M elements
    and more: torch's path, or the kernel's with torch's threads), the rest small: every tensor's recorded statistics
    are those of its stored bytes."""
    transformers = pytest.importorskip("transformers")
    import layerdiff
    from layerdiff.tracefile.reader import open_trace

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=1024, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with layerdiff.trace(model, tmp_path / "t.h5", mode="full"):
        model(input_ids=ids, labels=ids).loss.backward()
    large = 0
    with open_trace(tmp_path / "t.h5") as trace:
        for record in trace.records:
            for entry in record.tensors:
                if entry.dtype not in ("float32", "bfloat16"):
                    continue
                want = summarize(trace.tensor(entry), entry.dtype)
                _close(entry.stats, want, rel=1e-5)
                large += entry.stats["numel"] >= 1 << 20
    assert large >= 4  # logits and their gradient, the embedding's and the LM head's gradients at least


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_statistics_left_on_a_device_and_read_back_together_equal_numpys(dtype):
    """What an accelerator's tensors get (``DeviceDeferral``: reductions queued at once, read back in one batch),
    run here on CPU tensors: the same torch code."""
    from layerdiff.adapters import torch_adapter

    tensors = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 2).to(dtype)
               for n in (1, 7, 1000, 70_000, 300_000)]
    pending = [torch_adapter.DeviceStats(t) for t in tensors]
    expected = [_reference(t) for t in tensors]
    for t in tensors:
        t.mul_(3)  # after the statistics were queued: they are of the values as they were
    torch_adapter.DeviceDeferral().read(pending)
    for p, want in zip(pending, expected):
        _close(p.result, want, rel=1e-5 if dtype == torch.float32 else 1e-2)


def test_statistics_of_several_dtypes_read_back_in_one_batch_keep_their_order():
    """One batch holds tensors of every float dtype (their statistics stacked a dtype at a time, read back in one
    transfer): each gets its own, in order, a strided one (a transpose) too."""
    from layerdiff.adapters import torch_adapter

    tensors = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * (i + 1)).to(dtype)
               for i, (n, dtype) in enumerate([(500, torch.float32), (900, torch.bfloat16), (300, torch.float64),
                                               (700, torch.float16), (64, torch.float32)])]
    tensors.append(torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).t())
    if hasattr(torch, "float8_e4m3fn"):  # reduced by no torch kernel as it is: widened first
        tensors.append(torch.randn(40, generator=torch.Generator().manual_seed(4)).to(torch.float8_e4m3fn))
    pending = [torch_adapter.DeviceStats(t) for t in tensors]
    torch_adapter.DeviceDeferral().read(pending)
    for t, p in zip(tensors, pending):
        _close(p.result, _reference(t.float()), rel=1e-5 if t.dtype in (torch.float32, torch.float64) else 1e-2)


def test_a_tensor_with_nan_read_back_later():
    from layerdiff.adapters.torch_adapter import DeviceDeferral, DeviceStats

    kept, changed, gone = (torch.arange(10.0) for _ in range(3))
    for t in (kept, changed, gone):
        t[3], t[5] = float("nan"), float("inf")
    pending = [DeviceStats(t) for t in (kept, changed, gone)]
    changed.add_(1)
    del gone, t
    DeviceDeferral().read(pending)
    _close(pending[0].result, _reference(kept))  # still as it was: counted and summarized over its finite values
    for p in pending[1:]:  # changed or gone: a NaN is known to be there, nothing else
        assert p.result == {"numel": 10, "min": None, "max": None, "mean": None, "l2": None, "nan": 1, "inf": 0}


def test_records_wait_in_order_for_statistics_left_on_the_device(tmp_path):
    """The session holds records while statistics are on the device, then writes them in their order with the
    statistics read back (one batch), before the next step and at the end."""
    from conftest import NumpyTensors
    from layerdiff.adapters.torch_adapter import DeviceDeferral, DeviceStats
    from layerdiff.capture.session import TraceSession
    from layerdiff.tracefile.reader import open_trace
    from layerdiff.tracefile.writer import TraceWriter

    class Staging(DeviceDeferral):
        def add(self, a):  # the host's tensors, deferred as a device's are
            return DeviceStats(torch.from_numpy(a))

    class OnDevice(NumpyTensors):
        def deferral(self):
            return Staging()

    writer = TraceWriter(tmp_path / "t.h5", {"framework": "torch", "model_class": "toy", "mode": "stats"})
    session = TraceSession(writer, OnDevice(), "stats")
    for step in range(2):
        x = np.full((2, 3), step + 1.0, dtype=np.float32)
        frame = session.begin_call("", "M", {}, [("args.0", x)], {})
        session.end_call(frame, [("out", x * 2)], {})
        assert writer.records_written == step  # this step's record waits; the last step's was written
    session.close()
    with open_trace(tmp_path / "t.h5") as trace:
        assert [r.tensors[1].stats["max"] for r in trace.records] == [2.0, 4.0]
        assert [r.step for r in trace.records] == [0, 1]


def test_a_tensor_whose_storage_was_freed_is_never_read(tmp_path):
    """FSDP frees a gathered weight by resizing its storage to nothing; a view of it keeps its sizes and an address
    into freed memory. Reading it (numpy's DLPack view, the C kernel) killed the process with a segmentation
    fault; now it is not read and not recorded, and the rest of the call is."""
    import layerdiff
    from layerdiff.tracefile.reader import open_trace

    base = torch.randn(1000)
    freed = base[10:]
    base.untyped_storage().resize_(0)
    assert fast_stats(freed) is None and to_stored(freed) is None

    class KeepsFirst(torch.nn.Module):
        def forward(self, x, gone):
            return x * 2

    x = torch.randn(8)
    with layerdiff.trace(KeepsFirst(), tmp_path / "t.h5", mode="stats", ops=True) as traced:
        traced.model(x, freed)
    with open_trace(tmp_path / "t.h5") as trace:
        call = next(r for r in trace.records if r.kind == "call" and r.phase == "forward")
        keys = {t.key for t in call.tensors}
    assert keys == {"args.0", "out"}  # the freed tensor (args.1) left out


@pytest.mark.parametrize("segments", [True, False], ids=["segment reductions", "one by one"])
def test_small_tensors_staged_in_one_buffer_and_reduced_in_batches_equal_numpys(segments):
    """An accelerator's small tensors (``StagingBuffer``: each copied into a float64 buffer at once, the buffer
    reduced a batch at a time: by segment reductions, or member by member where a backend has none), run here on
    CPU tensors: the same torch code. The buffer fills up three times (a batch is reduced and the buffer reused);
    values changed after staging do not count; every dtype, a transpose, a 0-d tensor, and tensors read back
    together with a large one's (``DeviceStats``) keep their order."""
    from layerdiff.adapters import torch_adapter

    staging = torch_adapter.StagingBuffer(torch.device("cpu"), capacity=2000, segments=segments)
    tensors = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * (i + 1)).to(dtype)
               for i, (n, dtype) in enumerate([(500, torch.float32), (900, torch.bfloat16), (300, torch.float64),
                                               (700, torch.float16), (64, torch.float32), (1999, torch.float32)])]
    tensors += [torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).t(), torch.tensor(2.5)]
    if hasattr(torch, "float8_e4m3fn"):
        tensors.append(torch.randn(40, generator=torch.Generator().manual_seed(4)).to(torch.float8_e4m3fn))
    pending: list = []
    expected: list = []
    for t in tensors:
        pending.append(staging.stage(t))
        expected.append(_reference(t.float()))
        if len(pending) == 3:  # a large tensor's, reduced alone
            pending.append(torch_adapter.DeviceStats(torch.arange(10.0)))
            expected.append(_reference(torch.arange(10.0)))
    batches = {id(p.batch) for p in pending if isinstance(p, torch_adapter.StagedStats) and p.batch is not None}
    assert len(batches) == 3  # three full buffers reduced so far; the rest is reduced when read
    for t in tensors:
        if t.element_size() > 1:  # no in-place arithmetic on 8-bit floats
            t.mul_(3)
    deferral = torch_adapter.DeviceDeferral()
    deferral.staging[torch.device("cpu")] = staging
    deferral.read(pending)
    for p, want in zip(pending, expected):
        _close(p.result, want, rel=1e-5)


def test_a_staged_tensor_with_nan_read_back_later():
    from layerdiff.adapters import torch_adapter

    staging = torch_adapter.StagingBuffer(torch.device("cpu"))
    kept, changed = torch.arange(10.0), torch.arange(10.0)
    for t in (kept, changed):
        t[3], t[5] = float("nan"), float("inf")
    fine = torch.ones(4)
    pending = [staging.stage(t) for t in (kept, changed, fine)]
    changed.add_(1)
    deferral = torch_adapter.DeviceDeferral()
    deferral.staging[torch.device("cpu")] = staging
    deferral.read(pending)
    _close(pending[0].result, _reference(kept))
    assert pending[1].result == {"numel": 10, "min": None, "max": None, "mean": None, "l2": None, "nan": 1, "inf": 0}
    _close(pending[2].result, _reference(fine))
