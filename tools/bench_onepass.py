"""How much a hand-written one-pass reduction would save on the statistics of large gradients (issue 13's 0.5B
`stats` step spends 0.31-0.52 s on 732M gradient elements): min, max, sum and sum of squares of float32 in one
read, AVX vectors, compiled with gcc into a temporary library, against the torch statistics layerdiff uses.
Nothing here ships: the numbers decide whether a compiled extension would be worth making layerdiff a
compiled package.

    python tools/bench_onepass.py [--elements 136000000] [--repeats 5]
    python tools/bench_onepass.py --quick   # 16M elements, best of 3 (checks the tool)
    python tools/bench_onepass.py --json docs/benchmarks/data/bench_onepass.json  # also save the figures
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from layerdiff.adapters.torch_adapter import framework_stats

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

TITLE = "A hand-written one-pass reduction"
METHOD = """What a compiled one-pass reduction would save on the statistics of large gradients (the 0.5B model's
`stats` step spends 0.31-0.52 s on 732M gradient elements): min, max, sum and sum of squares of one float32 tensor
(default 136M elements, the 0.5B model's tied embedding gradient) in one read with AVX vectors, compiled by gcc -O3
into a temporary library and run on one core, against the torch statistics layerdiff takes
(torch_adapter.framework_stats, torch's own threads). Best of N repeats of each, alternating; the results of the two
are checked to agree. Nothing of it ships."""
ELEMENTS, REPEATS = 136_000_000, 5

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8 pick(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

void stats_f32(const float *x, size_t n, double *out) {  /* min, max, sum, sum of squares */
    v8 lo, hi;
    for (int k = 0; k < 8; k++) { lo[k] = __builtin_inff(); hi[k] = -__builtin_inff(); }
    double total = 0, square = 0;
    size_t i = 0;
    for (; i + 1024 <= n; i += 1024) {  /* float32 partial sums over 1024 elements, added in float64 */
        v8 s0 = {0}, s1 = {0}, q0 = {0}, q1 = {0};
        for (size_t j = i; j < i + 1024; j += 16) {
            v8 a, b;
            __builtin_memcpy(&a, x + j, 32);
            __builtin_memcpy(&b, x + j + 8, 32);
            lo = pick(a < lo, a, lo); hi = pick(a > hi, a, hi);
            lo = pick(b < lo, b, lo); hi = pick(b > hi, b, hi);
            s0 += a; s1 += b; q0 += a * a; q1 += b * b;
        }
        for (int k = 0; k < 8; k++) { total += s0[k] + s1[k]; square += q0[k] + q1[k]; }
    }
    float low = __builtin_inff(), high = -__builtin_inff();
    for (int k = 0; k < 8; k++) { low = lo[k] < low ? lo[k] : low; high = hi[k] > high ? hi[k] : high; }
    for (; i < n; i++) { float a = x[i]; low = a < low ? a : low; high = a > high ? a : high;
                         total += a; square += (double)a * a; }
    out[0] = low; out[1] = high; out[2] = total; out[3] = square;
}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, help=f"float32 elements (default {ELEMENTS:_}: the 0.5B "
                        "model's tied embedding gradient; --quick 16_000_000)")
    parser.add_argument("--repeats", type=int, help=f"best of N (default {REPEATS}; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="16M elements, best of 3: checks the tool")
    parser.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    args = parser.parse_args()
    run = benchlib.BenchRun("bench_onepass", TITLE, METHOD)
    args.elements = args.elements or (16_000_000 if args.quick else ELEMENTS)
    args.repeats = args.repeats or (3 if args.quick else REPEATS)
    if shutil.which("gcc") is None:
        raise SystemExit("gcc not found: nothing to measure")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "onepass.c").write_text(SOURCE)
        library = Path(tmp) / "onepass.so"
        subprocess.run(["gcc", "-O3", "-mavx", "-mfma", "-shared", "-fPIC", "-o", str(library),
                        str(Path(tmp) / "onepass.c")], check=True)
        onepass = ctypes.CDLL(str(library)).stats_f32
        onepass.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        tensor = torch.randn(args.elements)
        out = np.zeros(4)
        c_times, torch_times = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            onepass(tensor.data_ptr(), tensor.numel(), out.ctypes.data)
            c_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            stats = framework_stats(tensor)
            torch_times.append(time.perf_counter() - start)
    gb = tensor.numel() * 4 / 1e9
    best_c, best_torch = min(c_times), min(torch_times)
    print(f"{tensor.numel():,} float32 elements ({gb:.2f} GB), best of {args.repeats}, torch threads "
          f"{torch.get_num_threads()}")
    print(f"one pass in C (one core): {best_c * 1e3:.1f} ms = {gb / best_c:.1f} GB/s")
    print(f"layerdiff's torch statistics: {best_torch * 1e3:.1f} ms = {gb / best_torch:.1f} GB/s "
          f"({best_torch / best_c:.2f}x the C pass)")
    l2 = float(np.sqrt(out[3]))
    l2_rel = abs(l2 - stats['l2']) / stats['l2']
    print(f"agree: min {out[0] == stats['min']}, max {out[1] == stats['max']}, "
          f"l2 rel diff {l2_rel:.1e}")
    if args.json:
        rows = [["one pass in C (one core)", f"{best_c * 1e3:.1f} ms", f"{gb / best_c:.1f} GB/s"],
                [f"layerdiff's torch statistics ({torch.get_num_threads()} threads)", f"{best_torch * 1e3:.1f} ms",
                 f"{gb / best_torch:.1f} GB/s"]]
        note = (f"{tensor.numel():,} float32 elements ({gb:.2f} GB), best of {args.repeats}; the torch statistics take "
                f"{best_torch / best_c:.2f}x the C pass. Agree: min {out[0] == stats['min']}, "
                f"max {out[1] == stats['max']}, l2 relative difference {l2_rel:.1e}.")
        run.write(args.json, quick=args.quick or args.elements < ELEMENTS or args.repeats < REPEATS,
                  headline=f"C one pass {best_c * 1e3:.1f} ms vs torch statistics {best_torch * 1e3:.1f} ms "
                           f"({best_torch / best_c:.2f}x) on {tensor.numel() / 1e6:.0f}M float32",
                  tables=[benchlib.table("Statistics of one float32 tensor", ["reduction", "best time", "speed"], rows,
                                         note)],
                  results={"elements": tensor.numel(), "gb": gb, "repeats": args.repeats,
                           "torch_threads": torch.get_num_threads(), "c_s": c_times, "torch_s": torch_times,
                           "best_c_s": best_c, "best_torch_s": best_torch, "torch_over_c": best_torch / best_c,
                           "agree": {"min": bool(out[0] == stats["min"]), "max": bool(out[1] == stats["max"]),
                                     "l2_rel_diff": l2_rel}})


if __name__ == "__main__":
    main()
