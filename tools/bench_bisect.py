#!/usr/bin/env python
"""layerdiff bisect benchmark: what replay, the binary search and two-pass tracing cost on a mid-size Llama.

    python tools/bench_bisect.py            # layers=8, hidden=256, vocab=32000, batch 2 x 128 (~2 min)
    python tools/bench_bisect.py --quick    # layers=8, hidden=128, vocab=4096, batch 2 x 64
    python tools/bench_bisect.py --json out.json   # also save the figures (read by tools/bench_pages.py)

Reference: torch_llama clean; candidate: the same with the RMSNorm eps defect in layer 5. Everything runs in this
process with the public Python API (bisect.replay / bisect.search, layerdiff.trace), on CPU.
Printed: the untraced step; a full-mode traced step; replay (free run + forced run + align + own-error pass) and its
forced run alone; the binary search (baseline + log2(N) splice runs); two-pass trace sizes (stats of everything,
full of everything, full of one block). It prints numbers; it never asserts.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import layerdiff  # noqa: E402
from layerdiff.replay import driver as bisect  # noqa: E402
from layerdiff.compare.spec import Comparison  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

TITLE = "Bisect: replay, binary search and two-pass tracing"
METHOD = """The torch_llama recipe with 8 layers (hidden 256, vocab 32000, batch 2 x 128; --quick: hidden 128, vocab
4096, batch 2 x 64) as the reference, and the same model with the RMSNorm eps defect in layer 5 as the candidate,
all in one process through the public Python API (bisect.replay, bisect.search, layerdiff.trace) on the CPU; the
times include building the model for every run. Measured: the untraced step (median of 3); a full-mode traced step
(build, trace, close); replay (free run, forced run, align, own-error pass) and its forced run alone; the binary
search (baseline + log2(N) splice runs) and the bytes of traces it writes; replay inside a one-block window trace
(--layers 5:6); trace sizes in stats mode, full mode and full mode of one block."""
FULL = dict(layers=8, hidden=256, heads=8, kv_heads=8, vocab=32000, intermediate=688, batch=2, seq=128)
QUICK = dict(layers=8, hidden=128, heads=4, kv_heads=4, vocab=4096, intermediate=344, batch=2, seq=64)
DEFECT = dict(defect="eps", defect_layer=5)


def timed(fn, repeat=1):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def trace_once(path, config, **options):
    built = torch_llama.build(**config)
    with layerdiff.trace(built["model"], path, overwrite=True, **options):
        built["step"]()
    return path.stat().st_size


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    run = benchlib.BenchRun("bench_bisect", TITLE, METHOD, packages=("numpy", "torch", "h5py", "transformers"))
    config = QUICK if args.quick else FULL
    out = {"config": config}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        built = torch_llama.build(**config)
        built["step"]()
        out["untraced_step_s"], _ = timed(built["step"], repeat=3)
        out["full_trace_step_s"], _ = timed(lambda: trace_once(tmp / "ref.h5", config), repeat=1)
        out["stats_bytes"] = trace_once(tmp / "ref_stats.h5", config, mode="stats")
        out["full_bytes"] = trace_once(tmp / "ref.h5", config)
        out["window_bytes"] = trace_once(tmp / "ref_window.h5", config, layers=(5, 6))
        how = Comparison()
        cand = {**config, **DEFECT}

        work = bisect.Workdir(tmp / "replay", {"bench": 1})
        out["replay_total_s"], result = timed(lambda: bisect.replay(tmp / "ref.h5", "torch_llama", cand, work, how))
        out["replay_culprit"] = result["forward"]["culprit"]["description"]
        out["replay_forced_tensors"] = result["forcing"]["forced_tensors"]
        forcer_only = bisect.Workdir(tmp / "forced", {"bench": 2})
        forcer_only.record("free", dict(work.done("free")))  # reuse the free run: time the forced run alone
        (tmp / "forced" / "free.h5").symlink_to(tmp / "replay" / "free.h5")
        out["replay_forced_run_s"], _ = timed(lambda: bisect.replay(tmp / "ref.h5", "torch_llama", cand, forcer_only,
                                                                    how))

        work = bisect.Workdir(tmp / "search", {"bench": 3})
        out["search_total_s"], result = timed(lambda: bisect.search(tmp / "ref.h5", "torch_llama", cand, work, how))
        out["search_block"] = result["block"]
        out["search_bytes"] = sum(f.stat().st_size for f in (tmp / "search").glob("*.h5"))
        out["replay_bytes"] = sum(f.stat().st_size for f in (tmp / "replay").glob("*.h5"))
        out["search_runs"] = len(result["runs"])

        work = bisect.Workdir(tmp / "window", {"bench": 4})
        out["window_replay_total_s"], result = timed(
            lambda: bisect.replay(tmp / "ref_window.h5", "torch_llama", cand, work, how))
        out["window_culprit"] = result["forward"]["culprit"]["description"]

    c = config
    print(f"model: Llama layers={c['layers']} hidden={c['hidden']} vocab={c['vocab']} batch={c['batch']}x{c['seq']}, "
          f"defect: RMSNorm eps in layer 5")
    rows = [
        ("untraced step", f"{out['untraced_step_s']:.2f} s"),
        ("full-mode traced step (build + trace + close)", f"{out['full_trace_step_s']:.2f} s"),
        ("replay, total (free run, forced run, align, own-error pass)", f"{out['replay_total_s']:.2f} s"),
        ("replay, forced run + own-error pass alone", f"{out['replay_forced_run_s']:.2f} s"),
        ("  tensors forced", str(out["replay_forced_tensors"])),
        ("  culprit", out["replay_culprit"]),
        (f"binary search, total ({out['search_runs']} runs: baseline + splices)", f"{out['search_total_s']:.2f} s"),
        ("  block", str(out["search_block"])),
        ("trace bytes written: replay's two runs / the search's runs",
         f"{out['replay_bytes'] / 1e6:.1f} MB / {out['search_bytes'] / 1e6:.1f} MB"),
        ("replay inside a one-block window trace, total", f"{out['window_replay_total_s']:.2f} s"),
        ("  culprit", out["window_culprit"]),
        ("trace size: stats mode, whole model", f"{out['stats_bytes'] / 1e6:.2f} MB"),
        ("trace size: full mode, whole model", f"{out['full_bytes'] / 1e6:.2f} MB "
                                               f"({out['full_bytes'] / out['stats_bytes']:.0f}x stats)"),
        ("trace size: full mode, --layers 5:6", f"{out['window_bytes'] / 1e6:.2f} MB "
                                                f"({out['full_bytes'] / out['window_bytes']:.1f}x smaller than full)"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if args.json:
        parent, table_rows = "", []
        for name, value in rows:  # the indented rows belong to the one above them
            if not name.startswith("  "):
                parent = name.split(",")[0]
            table_rows.append([f"{parent}: {name.strip()}" if name.startswith("  ") else name, value])
        run.write(args.json, quick=args.quick,
                  headline=f"replay {out['replay_total_s']:.1f} s, binary search {out['search_total_s']:.1f} s "
                           f"(untraced step {out['untraced_step_s']:.2f} s)",
                  tables=[benchlib.table("Bisect on the 8-layer Llama", ["measure", "result"], table_rows,
                                         f"Model: Llama layers={c['layers']} hidden={c['hidden']} vocab={c['vocab']} "
                                         f"batch={c['batch']}x{c['seq']}, defect: RMSNorm eps in layer 5.")],
                  results=out, extra=out)  # the keys this JSON had before stay at the top level


if __name__ == "__main__":
    main()
