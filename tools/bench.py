#!/usr/bin/env python
"""layerdiff benchmark: tracing overhead, write throughput, flush cost, align throughput and memory.

    python tools/bench.py                 # default run (a few minutes)
    python tools/bench.py --quick         # smaller/faster variant (about a minute)
    python tools/bench.py --json out.json # also save every number as JSON
    python tools/bench.py --profile       # additionally print cProfile hot spots (traced step and align)

It only prints numbers, next to the targets of the spec; it never asserts or judges.

Model: ``recipes/torch_llama.py`` (transformers Llama built from a config), layers=4, hidden=256, heads=8,
kv_heads=8, vocab=32000, intermediate=688, batch=2, seq=128; one step = zero_grad + forward with labels +
backward, on CPU.

Sections
1. Step time: median wall time per step untraced vs traced in "stats" and "full" mode. Untraced is measured
   before and after the traced blocks (drift check); every traced block starts with one untimed traced step
   (it also records parameter values) and ``os.sync()`` runs before every block, so one block's dirty page
   cache does not slow the next one down. CPU seconds per step (process_time, all threads) are shown too:
   wall >> CPU/threads means the step waited (disk write-back, throttling).
2. Write throughput: the tensors of one traced step (the first step of a trace, i.e. what a 1-step trace
   holds) are collected, then written again by a fresh ``TraceWriter`` (``write_tensor(store_data=True)``
   for each + ``flush()``), versus a raw sequential write of the same byte count (``write()`` of 8 MiB blocks,
   unbuffered) to the same directory. Both are timed from opening the file up to (a) the last write/flush,
   excluding fsync ("page cache" numbers) and (b) after ``os.fsync`` ("durable" numbers). ``os.sync()`` runs
   before each timed write. The writer's time includes the summary statistics it computes for every tensor;
   that part is timed alone, too. Flush cost: traced step with flush_interval=0 vs the default 1.0.
3. Align: full traces of the reference model, of an identical reference (small: an independent second run;
   large: a byte copy of the reference trace) and of a defective model (defect="eps"); small = 1 step, large =
   10 steps (--quick: 3). Each ``align(open_trace(a), open_trace(b))`` runs in a fresh subprocess that reports
   its times and ``ru_maxrss`` before/after. MB/s per side = tensor bytes of one trace / (open + align) seconds.
   "warm" = the traces are in the page cache (just written); "cold" = their pages were dropped first
   (fsync + posix_fadvise DONTNEED on the two files only).

Traces live in a temporary directory under /tmp that is removed at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `recipes`

MODEL_KW = dict(layers=4, hidden=256, heads=8, kv_heads=8, vocab=32000, intermediate=688, batch=2, seq=128)
MB = 1e6
BLOCK = 8 << 20

CONFIGS = {
    "default": dict(warmup=3, untraced=8, stats=8, full=6, flush_stats=6, flush_full=6, write_reps=3,
                    small_steps=1, large_steps=10, cold=("small", "large")),
    "quick": dict(warmup=2, untraced=4, stats=4, full=3, flush_stats=3, flush_full=3, write_reps=1,
                  small_steps=1, large_steps=3, cold=("small",)),
}


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def log(msg: str = ""):
    print(msg, flush=True)


def quiet_disk():
    """Write back all dirty pages so the next measurement does not pay for the previous one."""
    os.sync()


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def timed_steps(step, n: int):
    walls, cpus = [], []
    for _ in range(n):
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus


def fmt_list(xs, unit="s"):
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]" + unit


def drop_cache(path):
    """Evict one file's pages from the page cache (after writing them back); other files are untouched."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def hot_functions(profile, top: int = 12) -> list[dict]:
    import pstats

    st = pstats.Stats(profile)
    total = st.total_tt or 1e-12
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})" if file != "~" else func,
                     "ncalls": nc, "tottime": tt, "cumtime": ct, "share": tt / total})
    rows.sort(key=lambda r: r["tottime"], reverse=True)
    return [{"total_s": total}] + rows[:top]


def print_hot(title: str, rows: list[dict]):
    log(f"  {title}: total {rows[0]['total_s']:.3f} s profiled")
    log(f"    {'tottime s':>9} {'share':>6} {'cumtime s':>9} {'ncalls':>7}  function")
    for r in rows[1:]:
        log(f"    {r['tottime']:9.3f} {r['share']:6.1%} {r['cumtime']:9.3f} {r['ncalls']:7d}  {r['function']}")


# ---------------------------------------------------------------------------------------------------------
# 1. step time untraced / stats / full, and flush cost
# ---------------------------------------------------------------------------------------------------------
def traced_block(model, step, path, n: int, **options):
    import layerdiff

    quiet_disk()
    with layerdiff.trace(model, path, overwrite=True, **options) as tracer:
        writer = tracer.session.writer
        first, _ = timed_steps(step, 1)  # untimed warm-up of the traced path; also records parameter values
        bytes0, records0 = writer.tensor_bytes, writer.records_written
        walls, cpus = timed_steps(step, n)
        bytes_per_step = (writer.tensor_bytes - bytes0) / n
        records_per_step = (writer.records_written - records0) / n
        t_exit = time.perf_counter()
    t_exit = time.perf_counter() - t_exit
    out = {"walls": walls, "cpus": cpus, "median": med(walls), "cpu_median": med(cpus), "first_step": first[0],
           "steps": n + 1, "tensor_bytes": writer.tensor_bytes, "file_bytes": os.path.getsize(path),
           "tensor_bytes_per_step": bytes_per_step, "records_per_step": records_per_step,
           "records": writer.records_written, "close_s": t_exit}
    os.remove(path)
    return out


def bench_steps(cfg, tmp: Path, res: dict, model, step):
    import torch

    log(f"\n[1] step time (torch threads={torch.get_num_threads()}, median of consecutive steps)")
    for _ in range(cfg["warmup"]):
        step()
    quiet_disk()
    u1, uc1 = timed_steps(step, cfg["untraced"])
    log(f"  untraced (before)  median {med(u1):.4f} s   cpu {med(uc1):.3f} s   steps {fmt_list(u1)}")
    stats = traced_block(model, step, tmp / "step_stats.h5", cfg["stats"], mode="stats")
    log(f"  stats              median {stats['median']:.4f} s   cpu {stats['cpu_median']:.3f} s   steps "
        f"{fmt_list(stats['walls'])}   (first traced step {stats['first_step']:.3f} s)")
    full = traced_block(model, step, tmp / "step_full.h5", cfg["full"], mode="full")
    log(f"  full               median {full['median']:.4f} s   cpu {full['cpu_median']:.3f} s   steps "
        f"{fmt_list(full['walls'])}   (first traced step {full['first_step']:.3f} s)")
    quiet_disk()
    u2, uc2 = timed_steps(step, cfg["untraced"])
    log(f"  untraced (after)   median {med(u2):.4f} s   cpu {med(uc2):.3f} s   steps {fmt_list(u2)}")
    untraced = med(u1 + u2)
    res["step"] = {"untraced": {"walls_before": u1, "walls_after": u2, "median": untraced,
                                "cpu_median": med(uc1 + uc2)},
                   "stats": stats, "full": full,
                   "ratio_stats": stats["median"] / untraced, "ratio_full": full["median"] / untraced}
    log(f"  -> untraced median (both blocks) {untraced:.4f} s; stats/untraced {res['step']['ratio_stats']:.2f}x "
        f"(target <= 1.3x); full/untraced {res['step']['ratio_full']:.2f}x (target: report)")
    log(f"  full mode: {full['tensor_bytes_per_step'] / MB:.1f} MB of tensor data and "
        f"{full['records_per_step']:.0f} records per steady-state step; whole trace ({full['steps']} steps): "
        f"tensor_bytes {full['tensor_bytes'] / MB:.1f} MB, file {full['file_bytes'] / MB:.1f} MB "
        f"(overhead {100 * (full['file_bytes'] / full['tensor_bytes'] - 1):.2f}%), close {full['close_s']:.3f} s")
    log(f"  stats mode: trace file {stats['file_bytes'] / MB:.2f} MB for {stats['steps']} steps")
    extra = full["median"] - stats["median"]
    if extra > 0:
        res["step"]["full_write_mb_s_effective"] = full["tensor_bytes_per_step"] / extra / MB
        log(f"  full-mode cost attributable to storing data (full - stats median) {extra:.3f} s/step -> "
            f"{res['step']['full_write_mb_s_effective']:.0f} MB/s effective")

    log("\n[2b] flush cost (flush_interval=0: flush after every record, vs default 1.0 from [1])")
    flush = {}
    for mode, n, base in (("stats", cfg["flush_stats"], stats), ("full", cfg["flush_full"], full)):
        r = traced_block(model, step, tmp / f"flush_{mode}.h5", n, mode=mode, flush_interval=0)
        flush[mode] = {"interval0": r, "default_median": base["median"],
                       "ratio": r["median"] / base["median"],
                       "per_flush_ms": 1e3 * (r["median"] - base["median"]) / max(r["records_per_step"], 1)}
        log(f"  {mode:5s} flush_interval=0  median {r['median']:.4f} s  vs 1.0: {base['median']:.4f} s  -> "
            f"{flush[mode]['ratio']:.2f}x, {r['records_per_step']:.0f} flushes/step, "
            f"~{flush[mode]['per_flush_ms']:.3f} ms per flush   steps {fmt_list(r['walls'])}")
    res["flush"] = flush


# ---------------------------------------------------------------------------------------------------------
# 2. writer throughput vs raw sequential write
# ---------------------------------------------------------------------------------------------------------
def collect_step_tensors(model, step, path):
    """The (array, dtype) pairs the writer receives during the first step of a full trace."""
    import numpy as np

    import layerdiff

    collected = []
    with layerdiff.trace(model, path, mode="full", overwrite=True) as tracer:
        writer = tracer.session.writer
        original = writer.write_tensor

        def collecting(stored, dtype, *, store_data):
            collected.append((np.array(stored, copy=True, order="K"), dtype))
            return original(stored, dtype, store_data=store_data)

        writer.write_tensor = collecting
        step()
    os.remove(path)
    return collected


def time_writer(collected, path):
    from layerdiff.core.traceformat import TraceWriter

    t0 = time.perf_counter()
    w = TraceWriter(path, {"bench": "writer"}, overwrite=True)
    for arr, dtype in collected:
        w.write_tensor(arr, dtype, store_data=True)
    w.flush()
    t_cached = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t_durable = time.perf_counter() - t0
    written = w.tensor_bytes
    w.close({"kind": "end", "status": "complete"})
    os.remove(path)
    return t_cached, t_durable, written


def time_raw(nbytes: int, path, block: bytes):
    view = memoryview(block)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(len(view), left)
            f.write(view[:n])
            left -= n
        t_cached = time.perf_counter() - t0
        os.fsync(f.fileno())
        t_durable = time.perf_counter() - t0
    os.remove(path)
    return t_cached, t_durable


def bench_write(cfg, tmp: Path, res: dict, model, step):
    from layerdiff.core.tensors import summarize

    log("\n[2] write throughput: TraceWriter on the tensors of one traced step vs raw sequential write")
    collected = collect_step_tensors(model, step, tmp / "collect.h5")
    ntensors = len(collected)
    t0 = time.perf_counter()
    for arr, dtype in collected:
        summarize(arr, dtype)
    t_summary = time.perf_counter() - t0
    block = os.urandom(BLOCK)
    writer_c, writer_d, raw_c, raw_d = [], [], [], []
    for _ in range(cfg["write_reps"]):
        quiet_disk()
        c, d, written = time_writer(collected, tmp / "writer.h5")
        writer_c.append(c)
        writer_d.append(d)
        quiet_disk()
        c, d = time_raw(written, tmp / "raw.bin", block)
        raw_c.append(c)
        raw_d.append(d)
    del collected
    gc.collect()
    w = {"tensors": ntensors, "bytes": written, "summary_s": t_summary,
         "writer_cached_s": writer_c, "writer_durable_s": writer_d, "raw_cached_s": raw_c, "raw_durable_s": raw_d}
    for kind in ("cached", "durable"):
        ws, rs = med(w[f"writer_{kind}_s"]), med(w[f"raw_{kind}_s"])
        w[f"writer_{kind}_mb_s"] = written / ws / MB
        w[f"raw_{kind}_mb_s"] = written / rs / MB
        w[f"pct_{kind}"] = 100 * rs / ws
    w["writer_minus_summary_cached_mb_s"] = written / max(med(writer_c) - t_summary, 1e-9) / MB
    w["summary_mb_s"] = written / t_summary / MB
    res["write"] = w
    log(f"  {written / MB:.1f} MB in {ntensors} tensors (first step of a full trace: activations, gradients, "
        f"parameter values and gradients); median of {cfg['write_reps']} rep(s), os.sync() before each timed write")
    log(f"  excluding fsync (page cache): writer {w['writer_cached_mb_s']:7.0f} MB/s ({fmt_list(writer_c)})   "
        f"raw {w['raw_cached_mb_s']:7.0f} MB/s ({fmt_list(raw_c)})   writer = {w['pct_cached']:.0f}% of raw")
    log(f"  including fsync (durable):    writer {w['writer_durable_mb_s']:7.0f} MB/s ({fmt_list(writer_d)})   "
        f"raw {w['raw_durable_mb_s']:7.0f} MB/s ({fmt_list(raw_d)})   writer = {w['pct_durable']:.0f}% of raw")
    log(f"  of the writer's time, summary statistics (tensors.summarize) alone: {t_summary:.3f} s "
        f"({w['summary_mb_s']:.0f} MB/s); writer without them ~{w['writer_minus_summary_cached_mb_s']:.0f} MB/s")


# ---------------------------------------------------------------------------------------------------------
# 3. align throughput and memory
# ---------------------------------------------------------------------------------------------------------
def make_trace(defect, path, steps: int) -> dict:
    import layerdiff
    from recipes.torch_llama import build

    b = build(defect, **MODEL_KW)
    t0 = time.perf_counter()
    with layerdiff.trace(b["model"], path, mode="full", overwrite=True) as tracer:
        for _ in range(steps):
            b["step"]()
    seconds = time.perf_counter() - t0
    w = tracer.session.writer
    info = {"path": str(path), "defect": defect, "steps": steps, "seconds": seconds,
            "tensor_bytes": w.tensor_bytes, "file_bytes": os.path.getsize(path), "records": w.records_written}
    del b, tracer
    gc.collect()
    return info


def run_align_child(a, b, profile: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_align-child", str(a), str(b)]
    if profile:
        cmd.append("--profile")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1])


def align_child(a: str, b: str, profile: bool):
    """Runs in a fresh interpreter: one align, its times and its memory."""
    import cProfile

    from layerdiff.core.align import align
    from layerdiff.core.traceformat import open_trace

    rss_before, maxrss_before = current_rss(), maxrss()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    ra, rb = open_trace(a), open_trace(b)
    t_open = time.perf_counter() - t0
    rss_open = current_rss()
    report = align(ra, rb)
    t_total = time.perf_counter() - t0
    if prof:
        prof.disable()
    maxrss_after = maxrss()
    tensors = [t for r in report["records"] for t in r["tensors"]]
    side = lambda r: (r.end or {}).get("tensor_bytes") or sum(  # noqa: E731
        t.get("nbytes", 0) for rec in r.records for t in rec.get("tensors", ()))
    fd = report["forward"]["first_divergence"]
    out = {"open_s": t_open, "align_s": t_total - t_open, "total_s": t_total,
           "bytes_a": side(ra), "bytes_b": side(rb), "records_a": len(ra.records), "records_b": len(rb.records),
           "tensor_pairs": len(tensors), "identical_pairs": sum(1 for t in tensors if t["metrics"].get("identical")),
           "verdict": report["verdict"], "forward_origin": fd and fd.get("module"),
           "rss_before": rss_before, "rss_after_open": rss_open, "maxrss_before": maxrss_before,
           "maxrss_after": maxrss_after, "peak_delta": maxrss_after - rss_before}
    if prof:
        out["hot"] = hot_functions(prof)
    ra.close()
    rb.close()
    print(json.dumps(out))


def bench_align(cfg, tmp: Path, res: dict, profile: bool):
    log(f"\n[3] align throughput and peak RSS (fresh subprocess per align; small = {cfg['small_steps']} step, "
        f"large = {cfg['large_steps']} steps)")
    traces = {}
    for size, steps in (("small", cfg["small_steps"]), ("large", cfg["large_steps"])):
        ref = make_trace(None, tmp / f"{size}_ref.h5", steps)
        if size == "small":
            same = make_trace(None, tmp / f"{size}_ref2.h5", steps)
            same["how"] = "independent second run of the reference"
        else:
            t0 = time.perf_counter()
            shutil.copyfile(ref["path"], tmp / f"{size}_ref2.h5")
            same = dict(ref, path=str(tmp / f"{size}_ref2.h5"), how="byte copy of the reference trace",
                        seconds=time.perf_counter() - t0)
        bad = make_trace("eps", tmp / f"{size}_eps.h5", steps)
        traces[size] = {"ref": ref, "same": same, "eps": bad}
        log(f"  traced {size}: {steps} step(s), {ref['tensor_bytes'] / MB:.0f} MB tensor data / "
            f"{ref['file_bytes'] / MB:.0f} MB file / {ref['records']} records per trace; tracing took "
            f"{ref['seconds']:.1f} s (ref), {bad['seconds']:.1f} s (eps); identical pair: {same['how']}")
    quiet_disk()
    runs = []
    plan = [(size, pair, "warm") for size in ("small", "large") for pair in ("same", "eps")]
    plan += [(size, "eps", "cold") for size in cfg["cold"]]
    for size, pair, cache in plan:
        a, b = traces[size]["ref"]["path"], traces[size][pair]["path"]
        if cache == "cold":
            drop_cache(a)
            drop_cache(b)
        r = run_align_child(a, b)
        r.update(size=size, pair="identical" if pair == "same" else "defect eps", cache=cache)
        runs.append(r)
        if "error" in r:
            log(f"  {size:5s} {r['pair']:10s} {cache}: FAILED {r['error']}")
            continue
        r["mb_s_per_side"] = r["bytes_a"] / r["total_s"] / MB
        log(f"  {size:5s} {r['pair']:10s} {cache:4s}: {r['bytes_a'] / MB:7.0f} MB/side  open {r['open_s']:6.3f} s  "
            f"align {r['align_s']:6.2f} s  -> {r['mb_s_per_side']:6.0f} MB/s per side   peak RSS "
            f"{r['maxrss_after'] / MB:6.0f} MB (before {r['rss_before'] / MB:.0f} MB, +{r['peak_delta'] / MB:.0f} MB)  "
            f"verdict {r['verdict']}, origin {r['forward_origin']}, identical pairs "
            f"{r['identical_pairs']}/{r['tensor_pairs']}")
    res["align"] = {"traces": traces, "runs": runs}
    deltas = {}
    for pair in ("identical", "defect eps"):
        d = {r["size"]: r["peak_delta"] for r in runs if r["pair"] == pair and r["cache"] == "warm" and "error" not in r}
        if "small" in d and "large" in d:
            deltas[pair] = d["large"] / max(d["small"], 1)
    res["align"]["peak_delta_growth"] = deltas
    for pair, g in deltas.items():
        log(f"  peak RSS increase, large/small trace ({pair}): {g:.2f}x for "
            f"{traces['large']['ref']['tensor_bytes'] / traces['small']['ref']['tensor_bytes']:.1f}x the data "
            "(target: not growing, ~1x)")
    if profile:
        log("\n  cProfile of align (separate subprocess runs, warm cache):")
        for size, pair in (("small", "eps"), ("small", "same")):
            r = run_align_child(traces[size]["ref"]["path"], traces[size][pair]["path"], profile=True)
            if "hot" in r:
                print_hot(f"align {size} {'defect eps' if pair == 'eps' else 'identical'}", r["hot"])
                res.setdefault("profile", {})[f"align_{size}_{pair}"] = r["hot"]
    for t in traces.values():
        for info in t.values():
            if os.path.exists(info["path"]):
                os.remove(info["path"])


def profile_steps(tmp: Path, res: dict, model, step):
    import cProfile

    import layerdiff

    log("\n[profile] cProfile of 3 traced steps per mode (after one warm traced step)")
    for mode in ("stats", "full"):
        path = tmp / f"profile_{mode}.h5"
        quiet_disk()
        with layerdiff.trace(model, path, mode=mode, overwrite=True):
            step()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                step()
            prof.disable()
        os.remove(path)
        rows = hot_functions(prof)
        print_hot(f"traced step, {mode} mode", rows)
        res.setdefault("profile", {})[f"step_{mode}"] = rows


# ---------------------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------------------
def summary(res: dict):
    rows = []
    s = res.get("step")
    if s:
        rows += [("step untraced (median)", f"{s['untraced']['median'] * 1e3:.1f} ms", "-"),
                 ("step traced, stats (median)", f"{s['stats']['median'] * 1e3:.1f} ms", "-"),
                 ("step traced, full (median)", f"{s['full']['median'] * 1e3:.1f} ms", "-"),
                 ("stats / untraced", f"{s['ratio_stats']:.2f}x", "<= 1.3x"),
                 ("full / untraced", f"{s['ratio_full']:.2f}x", "report"),
                 ("full: tensor bytes per steady step", f"{s['full']['tensor_bytes_per_step'] / MB:.1f} MB", "report"),
                 (f"full: trace of {s['full']['steps']} steps, tensor_bytes / file",
                  f"{s['full']['tensor_bytes'] / MB:.1f} / {s['full']['file_bytes'] / MB:.1f} MB", "report")]
        if "full_write_mb_s_effective" in s:
            rows.append(("full: bytes/step / (full - stats time)", f"{s['full_write_mb_s_effective']:.0f} MB/s",
                         "report"))
    w = res.get("write")
    if w:
        rows += [("writer MB/s, excl. fsync", f"{w['writer_cached_mb_s']:.0f} MB/s", "-"),
                 ("raw write MB/s, excl. fsync", f"{w['raw_cached_mb_s']:.0f} MB/s", "-"),
                 ("writer / raw, excl. fsync", f"{w['pct_cached']:.0f}%", ">= 70%"),
                 ("writer MB/s, incl. fsync", f"{w['writer_durable_mb_s']:.0f} MB/s", "-"),
                 ("raw write MB/s, incl. fsync", f"{w['raw_durable_mb_s']:.0f} MB/s", "-"),
                 ("writer / raw, incl. fsync", f"{w['pct_durable']:.0f}%", ">= 70%"),
                 ("summarize alone (part of writer)", f"{w['summary_mb_s']:.0f} MB/s", "-")]
    f = res.get("flush")
    if f:
        for mode in ("stats", "full"):
            rows.append((f"{mode}: step flush_interval=0 vs 1.0",
                         f"{f[mode]['interval0']['median'] * 1e3:.1f} vs {f[mode]['default_median'] * 1e3:.1f} ms "
                         f"({f[mode]['ratio']:.2f}x)", "report"))
    a = res.get("align")
    if a:
        for r in a["runs"]:
            if "error" in r:
                rows.append((f"align {r['size']} {r['pair']} {r['cache']}", "failed", ""))
                continue
            rows.append((f"align {r['size']} {r['pair']} ({r['cache']}), {r['bytes_a'] / MB:.0f} MB/side",
                         f"{r['mb_s_per_side']:.0f} MB/s/side", ">= 1000 MB/s/side"))
        for r in a["runs"]:
            if "error" not in r and r["cache"] == "warm":
                rows.append((f"align {r['size']} {r['pair']}: peak RSS (+ over start)",
                             f"{r['maxrss_after'] / MB:.0f} MB (+{r['peak_delta'] / MB:.0f})", "flat in size"))
        for pair, g in a["peak_delta_growth"].items():
            rows.append((f"align {pair}: peak RSS increase large/small", f"{g:.2f}x", "~1x (not growing)"))
    width = max(len(r[0]) for r in rows) if rows else 10
    vwidth = max(len(r[1]) for r in rows) if rows else 10
    log("\n" + "=" * (width + vwidth + 26))
    log("SUMMARY")
    log(f"{'metric':{width}}  {'value':>{vwidth}}  target")
    log("-" * (width + vwidth + 26))
    for name, value, target in rows:
        log(f"{name:{width}}  {value:>{vwidth}}  {target}")
    log("=" * (width + vwidth + 26))


def environment() -> dict:
    import h5py
    import numpy
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "platform": platform.platform()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and a 3-step large trace")
    p.add_argument("--json", metavar="FILE", help="also save the results as JSON")
    p.add_argument("--profile", action="store_true", help="also print cProfile hot spots (traced step, align)")
    p.add_argument("--_align-child", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._align_child:
        align_child(*args._align_child, profile=args.profile)
        return 0

    import torch

    from recipes.torch_llama import build

    cfg_name = "quick" if args.quick else "default"
    cfg = CONFIGS[cfg_name]
    t_start = time.perf_counter()
    env = environment()
    log(f"layerdiff bench ({cfg_name}): model {MODEL_KW}")
    log(f"env: python {env['python']}, torch {env['torch']} ({env['torch_threads']} threads, {env['cpus']} cpus), "
        f"transformers {env['transformers']}, numpy {env['numpy']}, h5py {env['h5py']} (HDF5 {env['hdf5']})")
    res: dict = {"config": {"name": cfg_name, **cfg, "model": MODEL_KW}, "env": env}
    tmp = Path(tempfile.mkdtemp(prefix="layerdiff-bench-", dir="/tmp"))
    log(f"temp dir: {tmp}")
    try:
        b = build(None, **MODEL_KW)
        model, step = b["model"], b["step"]
        bench_steps(cfg, tmp, res, model, step)
        bench_write(cfg, tmp, res, model, step)
        if args.profile:
            profile_steps(tmp, res, model, step)
        del b, model, step
        gc.collect()
        bench_align(cfg, tmp, res, args.profile)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t_start
    summary(res)
    log(f"total bench time {res['seconds']:.0f} s (torch {torch.__version__})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        log(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
