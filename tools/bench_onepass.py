"""What the statistics kernel (layerdiff/tracefile/fastmoments.c: min, max, sum and sum of squares in one read)
saves, tensor size by tensor size: ``summarize`` with the kernel, the same without it (numpy's four passes, the path
of an install built without a C compiler), the kernel reading a torch tensor where it lies with torch's OpenMP
threads (``stats_at(..., share_threads=True)``: what a torch trace takes for dense CPU tensors), and torch's own
reductions (``torch_adapter.framework_stats``: what it takes for large views, and from 1M float32 elements where the
kernel cannot share torch's threads). Data already in the cache, as a microbenchmark; what it saves in a traced
step is in tools/bench_ops.py.

    python tools/bench_onepass.py            # 256 to 16M elements, best of 5
    python tools/bench_onepass.py --quick    # three sizes, best of 3 (checks the tool)
    python tools/bench_onepass.py --json docs/benchmarks/data/bench_onepass.json  # also save the figures
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from layerdiff.adapters.torch_adapter import framework_stats
from layerdiff.tracefile import tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

TITLE = "The one-pass statistics kernel"
METHOD = """The statistics every trace keeps of every tensor (min, max, mean, L2 norm), of one float32 array of each
size: layerdiff's `summarize` with its C kernel (layerdiff/tracefile/fastmoments.c: one read, SIMD, built at install
where a C compiler is present), the same without it (numpy's four passes: what an install without a compiler
takes), the kernel reading the torch tensor where it lies with torch's OpenMP threads (`stats_at` sharing them: what
a torch trace takes for dense CPU tensors of any size), and torch's own multi-threaded reductions (`framework_stats`:
what it takes for large strided views). Each figure is the best of N timed loops of repeated calls on the same array
(data in the cache where it fits); the four results are checked to agree."""
SIZES = (256, 4096, 65_536, 262_144, 1 << 20, 1 << 24)
QUICK_SIZES = (256, 65_536, 1 << 20)
REPEATS = 5
LOOP_SECONDS = 0.02  # each timed loop runs about this long


@contextlib.contextmanager
def numpy_only() -> Iterator[None]:
    """``summarize`` without the kernel while open (as an install without a C compiler runs it)."""
    kernel = tensors.one_pass_moments
    tensors.one_pass_moments = None
    try:
        yield
    finally:
        tensors.one_pass_moments = kernel


def best_call(call: Callable[[], object], repeats: int) -> float:
    """Seconds per call: the best of ``repeats`` loops of about ``LOOP_SECONDS`` each."""
    start = time.perf_counter()
    call()
    calls = max(1, int(LOOP_SECONDS / max(time.perf_counter() - start, 1e-7)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def shown(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help=f"best of N loops (default {REPEATS}; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="three sizes, best of 3: checks the tool")
    parser.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    args = parser.parse_args()
    run = benchlib.BenchRun("bench_onepass", TITLE, METHOD)
    repeats = args.repeats or (3 if args.quick else REPEATS)
    sizes = QUICK_SIZES if args.quick else SIZES
    if tensors.one_pass_moments is None:
        raise SystemExit("the statistics kernel is not built in this install (pip install -e . with a C compiler)")
    rng = np.random.default_rng(0)
    rows, results = [], []
    for size in sizes:
        array = (rng.standard_normal(size, dtype=np.float32) * 2 + 0.1).astype(np.float32)
        tensor = torch.from_numpy(array)
        kernel = best_call(lambda: tensors.summarize(array, "float32"), repeats)
        with numpy_only():
            numpy_path = best_call(lambda: tensors.summarize(array, "float32"), repeats)
            expected = tensors.summarize(array, "float32")
        shared = best_call(lambda: tensors.stats_at(tensor.data_ptr(), size, "float32", share_threads=True), repeats)
        by_torch = best_call(lambda: framework_stats(tensor), repeats)
        got, torch_stats = tensors.summarize(array, "float32"), framework_stats(tensor)
        in_place = tensors.stats_at(tensor.data_ptr(), size, "float32", share_threads=True)
        agree = in_place == got and all(
            got[k] == expected[k] == torch_stats[k] for k in ("min", "max", "numel")) and all(
            math.isclose(got[k], expected[k], rel_tol=1e-6, abs_tol=1e-7) and
            math.isclose(got[k], torch_stats[k], rel_tol=1e-6, abs_tol=1e-7) for k in ("mean", "l2"))
        line = {"elements": size, "kernel_s": kernel, "numpy_s": numpy_path, "shared_s": shared, "torch_s": by_torch,
                "numpy_over_kernel": numpy_path / kernel, "agree": agree}
        results.append(line)
        rows.append([f"{size:,}", shown(kernel), shown(numpy_path), shown(shared), shown(by_torch),
                     f"{numpy_path / kernel:.1f}x", "yes" if agree else "NO"])
        print(f"{size:>11,} float32: kernel {shown(kernel):>9}  numpy {shown(numpy_path):>9}  kernel with torch's "
              f"threads {shown(shared):>9}  torch {shown(by_torch):>9}  numpy/kernel {numpy_path / kernel:5.1f}x  "
              f"agree {agree}", flush=True)
    middle = next(r for r in results if r["elements"] == 65_536)
    largest = results[-1]
    headline = (f"64K float32 elements: kernel {shown(middle['kernel_s'])}, numpy {shown(middle['numpy_s'])} "
                f"({middle['numpy_over_kernel']:.1f}x); {largest['elements']:,}: the kernel with torch's threads "
                f"{shown(largest['shared_s'])}, torch's reductions {shown(largest['torch_s'])}")
    if args.json:
        note = (f"best of {repeats} loops; torch ran {torch.get_num_threads()} threads. 'agree': the four give the "
                "same min and max, and mean and L2 norm within 1e-6 (the kernel's two paths: the same to the bit).")
        run.write(args.json, quick=args.quick or repeats < REPEATS, headline=headline,
                  tables=[benchlib.table("summarize, per float32 array", ["elements", "kernel (one read)",
                                                                            "numpy (four passes)",
                                                                            "kernel, torch's threads",
                                                                            "torch statistics", "numpy / kernel",
                                                                            "agree"], rows, note)],
                  results={"repeats": repeats, "torch_threads": torch.get_num_threads(), "sizes": results})
    if not all(r["agree"] for r in results):
        raise SystemExit("the kernel's statistics disagree with numpy's or torch's (see above)")


if __name__ == "__main__":
    main()
