#!/usr/bin/env python
"""layerdiff benchmark: tracing overhead, write throughput, flush cost, align throughput and memory.

    python tools/bench.py                 # default run (a few minutes)
    python tools/bench.py --quick         # smaller/faster variant (about a minute)
    python tools/bench.py --json out.json # also save every number as JSON (read by tools/bench_pages.py)
    python tools/bench.py --profile       # additionally print cProfile hot spots (traced step and align)
    python tools/bench.py --threads 1     # torch.set_num_threads(1) (default: torch's default)
    python tools/bench.py --frameworks torch,paddle,mindspore  # only the step-time overhead, per framework,
                                          # each in its own interpreter (tools/bench_frameworks.py; ~4 min)

It only prints numbers, next to the targets of the spec; it never asserts or judges.

Model: ``recipes/torch_llama.py`` (transformers Llama built from a config), layers=4, hidden=256, heads=8,
kv_heads=8, vocab=32000, intermediate=688, batch=2, seq=128; one step = zero_grad + forward with labels +
backward, on CPU.

Noise: the machine may be shared. Before each measurement block the script waits (within a total budget:
45 s, --quick 5 s) until other processes leave the CPUs idle; every block reports how many CPU cores *other*
processes kept busy meanwhile ("others"; /proc/stat minus this process and its children). Configurations
are measured in interleaved rounds, so busy phases of the machine hit all of them alike. Medians over all
steps are the headline numbers; the median over "quiet" blocks (others < 0.3 cores) and the best single
step are printed next to them. With 2 torch threads on 2 cores, one competing busy process can make a
step several times slower, so compare quiet medians / bests when "others" is high.

Sections
1. Step time: rounds of [untraced, stats, full, stats flush_interval=0, full flush_interval=0] blocks (order
   rotated each round). A traced block opens a fresh trace, runs one untimed traced step (the first step
   also records parameter values), then times K steps. ``os.sync()`` runs before every block so one block's
   dirty page cache is not written back during the next. CPU seconds per step (process_time, all threads)
   are shown too. Sustained full-mode tracing over 10 consecutive steps is reported in section 3.
2. Write throughput: the tensors of one traced step (the first step of a trace, i.e. what a 1-step trace
   holds) are collected, then written again by a fresh ``TraceWriter`` (``write_tensor(store_data=True)``
   for each + ``flush()``), versus a raw sequential write of the same byte count (``write()`` of 8 MiB blocks,
   unbuffered) to the same directory. Both are timed from opening the file up to (a) the last write/flush,
   excluding fsync ("page cache" numbers) and (b) after ``os.fsync`` ("durable" numbers). ``os.sync()`` runs
   before each timed write; the order alternates. The writer's time includes the summary statistics it
   computes for every tensor; that part is also timed alone.
3. Align: full traces of the reference model, of an identical reference (small: an independent second run;
   large: a byte copy of the reference trace) and of a defective model (defect="eps"); small = 1 step, large =
   10 steps (--quick: 3). Each ``align(open_trace(a), open_trace(b))`` runs in a fresh interpreter that reports
   its times, ``ru_maxrss`` before/after and VmHWM. Those interpreters are started by a small helper process
   launched before this script imports anything big, because Linux carries ``ru_maxrss`` over from the
   process that spawns a child (a child of the bench itself would start with the bench's peak).
   MB/s per side = tensor bytes of one trace / (open + align) seconds. "warm" = the traces are in the page
   cache (just written); "cold" = their pages were dropped first (fsync + posix_fadvise DONTNEED on the two
   files only; a host-level cache below the VM may still serve them).

Traces live in a temporary directory under /tmp that is removed at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `recipes`
SELF = str(Path(__file__).resolve())
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402
from benchlib import (MB, MODEL_KW, QUIET_CORES, WAITER, Load, current_rss, drop_cache, fmt_list,  # noqa: E402
                      hot_functions, log, maxrss, med, print_hot, quiet_disk, run_block, timed_steps, vm_hwm)

TITLE = "Tracing overhead, write throughput and align"
METHOD = """A transformers Llama (recipes/torch_llama.py: 4 layers, hidden 256, 8 heads, vocab 32000, intermediate 688,
batch 2 x 128 tokens), one step = zero_grad + forward with labels + backward on the CPU. Step time: interleaved
rounds of untraced, `stats`, `full` and flush_interval=0 blocks (order rotated each round); a traced block opens a
fresh trace, runs one untimed traced step (the first also records parameter values), then times K steps; os.sync()
and a wait for idle CPUs precede every block. Medians over all timed steps are the headline, with the median over
quiet blocks (other processes < 0.3 cores) and the best step beside them. Write throughput: the tensors of one full
traced step written again by a fresh TraceWriter against a raw sequential write of the same bytes to the same
directory, with and without fsync; the writer's time includes the summary statistics, also timed alone. Align: full
traces of the reference, an identical pair and the RMSNorm eps defect (small: 1 step; large: 10 steps, --quick 3),
each align in a fresh interpreter reporting its time and peak RSS; MB/s per side = one trace's tensor bytes /
(open + align) seconds; warm = the traces in the page cache, cold = their pages dropped first."""

BLOCK = 8 << 20

CONFIGS = {
    "default": dict(warmup=3, rounds=4, steps_per_block=3, write_reps=4, align_reps=2,
                    small_steps=1, large_steps=10, cold=("small", "large"), quiet_budget=45.0),
    "quick": dict(warmup=2, rounds=2, steps_per_block=1, write_reps=2, align_reps=1,
                  small_steps=1, large_steps=3, cold=("small",), quiet_budget=5.0),
}
STEP_CONFIGS = [("untraced", None), ("stats", dict(mode="stats")), ("full", dict(mode="full")),
                ("stats flush0", dict(mode="stats", flush_interval=0)),
                ("full flush0", dict(mode="full", flush_interval=0))]


# ---------------------------------------------------------------------------------------------------------
# child processes for align (clean ru_maxrss)
# ---------------------------------------------------------------------------------------------------------
class Spawner:
    """A small stdlib-only helper process that starts the align interpreters, so their ru_maxrss starts low."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, SELF, "--_spawner"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.cpu = 0.0  # CPU seconds of the interpreters it started (ours, though not yet in our children's time)

    def run(self, args: list[str]) -> dict:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        self.cpu += out.get("cpu", 0.0)
        return out

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def spawner_loop():
    for line in sys.stdin:
        args = json.loads(line)
        t0 = os.times()
        p = subprocess.run([sys.executable, SELF, *args], capture_output=True, text=True)
        t1 = os.times()
        cpu = (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)
        sys.stdout.write(json.dumps({"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "cpu": cpu}) + "\n")
        sys.stdout.flush()


def run_align_child(spawner: Spawner, a, b, profile: bool = False) -> dict:
    WAITER.wait()
    load = Load()
    out = spawner.run(["--_align-child", str(a), str(b)] + (["--profile"] if profile else []))
    others = load.others(extra_own=out.get("cpu", 0.0))
    lines = [ln for ln in out["stdout"].splitlines() if ln.startswith("{")]
    if out["rc"] != 0 or not lines:
        return {"error": f"exit {out['rc']}: {out['stderr'].strip()[-2000:]}"}
    r = json.loads(lines[-1])
    r["others_cores"] = others
    return r


def align_child(a: str, b: str, profile: bool):
    """Runs in a fresh interpreter: one align, its times and its memory."""
    import cProfile

    import h5py  # noqa: F401  (imported lazily by open_trace; import it first so it is not counted as align memory)

    from layerdiff.compare.spec import Comparison
    from layerdiff.compare.tasks import Workers
    from layerdiff.judge.evaluate import align
    from layerdiff.tracefile.reader import open_trace

    rss_before, maxrss_before, hwm_before = current_rss(), maxrss(), vm_hwm()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    ra, rb = open_trace(a), open_trace(b)
    t_open = time.perf_counter() - t0
    rss_open = current_rss()
    report = align(ra, rb, Comparison(workers=Workers(None)))  # as the CLI: worker processes for traces over 512 MB a side
    t_total = time.perf_counter() - t0
    if prof:
        prof.disable()
    maxrss_after, hwm_after = maxrss(), vm_hwm()
    tensors = [t for r in report["records"] for t in r["tensors"]]

    def side(r):
        end_bytes = r.end.tensor_bytes if r.end is not None else None
        return end_bytes or sum(t.nbytes or 0 for rec in r.records for t in rec.tensors)

    fd = report["forward"]["first_divergence"]
    out = {"open_s": t_open, "align_s": t_total - t_open, "total_s": t_total,
           "bytes_a": side(ra), "bytes_b": side(rb), "records_a": len(ra.records), "records_b": len(rb.records),
           "tensor_pairs": len(tensors), "identical_pairs": sum(1 for t in tensors if t["metrics"].get("identical")),
           "verdict": report["verdict"], "forward_origin": fd and fd.get("module"),
           "rss_before": rss_before, "rss_after_open": rss_open, "maxrss_before": maxrss_before,
           "maxrss_after": maxrss_after, "peak_delta": maxrss_after - rss_before,
           "vmhwm_before": hwm_before, "vmhwm_after": hwm_after}
    if prof:
        out["hot"] = hot_functions(prof)
    ra.close()
    rb.close()
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------------------------
# 1. step time untraced / stats / full, and flush cost
# ---------------------------------------------------------------------------------------------------------
def bench_steps(cfg, tmp: Path, res: dict, model, step):
    import torch

    k, rounds = cfg["steps_per_block"], cfg["rounds"]
    log(f"\n[1] step time: {rounds} interleaved rounds x {k} timed steps per configuration "
        f"(torch threads={torch.get_num_threads()})")
    for _ in range(cfg["warmup"]):
        step()
    blocks = {name: [] for name, _ in STEP_CONFIGS}
    for r in range(rounds):
        order = STEP_CONFIGS[r % len(STEP_CONFIGS):] + STEP_CONFIGS[:r % len(STEP_CONFIGS)]
        for name, opts in order:
            blocks[name].append(run_block(model, step, opts, k, tmp / f"step_{name.replace(' ', '_')}.h5"))
    agg = {}
    for name, _ in STEP_CONFIGS:
        bl = blocks[name]
        walls = [w for b in bl for w in b["walls"]]
        quiet = [w for b in bl if b["others"] < QUIET_CORES for w in b["walls"]]
        agg[name] = {"walls": walls, "median": med(walls), "min": min(walls), "quiet_walls": quiet,
                     "quiet_median": med(quiet) if len(quiet) >= 2 else None,
                     "cpu_median": med([c for b in bl for c in b["cpus"]]),
                     "others_cores": [b["others"] for b in bl], "last_block": {k_: v for k_, v in bl[-1].items()
                                                                             if k_ not in ("walls", "cpus")}}
        if "first_step" in bl[0]:
            agg[name]["first_step_median"] = med([b["first_step"] for b in bl])
    base = agg["untraced"]
    log(f"  {'configuration':13s} {'median':>7s} {'quiet med (n)':>14s} {'best':>7s} {'cpu/step':>8s} "
        f"{'x median':>8s} {'x quiet':>7s} {'x best':>6s}  others (cores, per block)  all steps (s)")
    for name, _ in STEP_CONFIGS:
        a = agg[name]
        a["ratio_median"] = a["median"] / base["median"]
        a["ratio_min"] = a["min"] / base["min"]
        a["ratio_quiet"] = (a["quiet_median"] / base["quiet_median"]
                            if a["quiet_median"] and base["quiet_median"] else None)
        qm = f"{a['quiet_median']:.4f} ({len(a['quiet_walls'])})" if a["quiet_median"] else f"n/a ({len(a['quiet_walls'])})"
        rq = f"{a['ratio_quiet']:6.2f}x" if a["ratio_quiet"] else "    n/a"
        log(f"  {name:13s} {a['median']:7.4f} {qm:>14s} {a['min']:7.4f} {a['cpu_median']:8.3f} "
            f"{a['ratio_median']:7.2f}x {rq} {a['ratio_min']:5.2f}x  "
            f"{' '.join(f'{o:.2f}' for o in a['others_cores']):25s} {fmt_list(a['walls'], '')}")
    log(f"  (quiet med = median over blocks during which other processes used < {QUIET_CORES} cores; "
        f"best = fastest single step)")
    full = agg["full"]["last_block"]
    stats = agg["stats"]["last_block"]
    log(f"  first traced step of a trace (records parameter values too): stats {agg['stats']['first_step_median']:.3f} s, "
        f"full {agg['full']['first_step_median']:.3f} s (medians)")
    log(f"  full mode: {full['tensor_bytes_per_step'] / MB:.1f} MB of tensor data and {full['records_per_step']:.0f} "
        f"records per steady-state step; a {full['steps']}-step trace: tensor_bytes {full['tensor_bytes'] / MB:.1f} MB, "
        f"file {full['file_bytes'] / MB:.1f} MB (HDF5+index overhead "
        f"{100 * (full['file_bytes'] / full['tensor_bytes'] - 1):.2f}%), close {full['close_s']:.3f} s")
    log(f"  stats mode: a {stats['steps']}-step trace file is {stats['file_bytes'] / MB:.2f} MB")
    res["step"] = agg
    use = "quiet_median" if agg["full"]["quiet_median"] and agg["stats"]["quiet_median"] else "min"
    extra = agg["full"][use] - agg["stats"][use]
    if extra > 0:
        res["full_store_mb_s_effective"] = full["tensor_bytes_per_step"] / extra / MB
        log(f"  cost of storing data (full - stats, {'quiet medians' if use == 'quiet_median' else 'bests'}): "
            f"{extra:.3f} s/step -> {res['full_store_mb_s_effective']:.0f} MB/s of tensor data stored while tracing")
    flush = {}
    for mode in ("stats", "full"):
        a, b = agg[f"{mode} flush0"], agg[mode]
        n = a["last_block"]["records_per_step"]
        flush[mode] = {"interval0_median": a["median"], "default_median": b["median"],
                       "ratio": a["median"] / b["median"], "interval0_min": a["min"], "default_min": b["min"],
                       "ratio_min": a["min"] / b["min"], "flushes_per_step": n,
                       "per_flush_ms_min": 1e3 * (a["min"] - b["min"]) / max(n, 1)}
        log(f"  flush cost, {mode}: flush_interval=0 vs 1.0 per step: medians {a['median']:.4f} vs {b['median']:.4f} s "
            f"({flush[mode]['ratio']:.2f}x), bests {a['min']:.4f} vs {b['min']:.4f} s ({flush[mode]['ratio_min']:.2f}x); "
            f"{n:.0f} flushes/step -> {flush[mode]['per_flush_ms_min']:+.3f} ms per flush (bests)")
    res["flush"] = flush


# ---------------------------------------------------------------------------------------------------------
# 2. writer throughput vs raw sequential write
# ---------------------------------------------------------------------------------------------------------
def collect_step_tensors(model, step, path):
    """The (array, dtype) pairs the writer received during the first step of a full trace: each tensor it stored,
    read back from the trace (the writer's methods cannot be replaced on a build that compiled it)."""
    import numpy as np

    import layerdiff
    from layerdiff.tracefile.reader import open_trace

    with layerdiff.trace(model, path, mode="full", overwrite=True):
        step()
    collected, stored = [], set()
    with open_trace(path) as trace:
        for record in (*trace.records, *trace.ops, *trace.recomputed):
            for entry in record.tensors:
                if entry.offset is not None and entry.offset not in stored:
                    stored.add(entry.offset)
                    collected.append((np.array(trace.tensor(entry), copy=True), entry.dtype))
    os.remove(path)
    return collected


def time_writer(collected, path, profile=None):
    from layerdiff.tracefile.writer import TraceWriter

    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    w = TraceWriter(path, {"bench": "writer"}, overwrite=True)
    for arr, dtype in collected:
        w.write_tensor(arr, dtype, store_data=True)
    w.flush()
    t_cached = time.perf_counter() - t0
    if profile is not None:
        profile.disable()
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


def bench_write(cfg, tmp: Path, res: dict, model, step, profile: bool = False):
    from layerdiff.tracefile.tensors import summarize

    log("\n[2] write throughput: TraceWriter on the tensors of one traced step vs raw sequential write")
    collected = collect_step_tensors(model, step, tmp / "collect.h5")
    ntensors = len(collected)
    nbytes = sum(a.nbytes for a, _ in collected)
    t_summary = []
    for _ in range(2):
        t0 = time.perf_counter()
        for arr, dtype in collected:
            summarize(arr, dtype)
        t_summary.append(time.perf_counter() - t0)
    t_summary = min(t_summary)
    block = os.urandom(BLOCK)
    times = {"writer_cached": [], "writer_durable": [], "raw_cached": [], "raw_durable": []}
    others = []
    for rep in range(cfg["write_reps"]):
        for which in (("writer", "raw") if rep % 2 == 0 else ("raw", "writer")):
            quiet_disk()
            WAITER.wait()
            load = Load()
            if which == "writer":
                c, d, nbytes = time_writer(collected, tmp / "writer.h5")
            else:
                c, d = time_raw(nbytes, tmp / "raw.bin", block)
            others.append(load.others())
            times[f"{which}_cached"].append(c)
            times[f"{which}_durable"].append(d)
    if profile:
        import cProfile

        quiet_disk()
        prof = cProfile.Profile()
        time_writer(collected, tmp / "writer_profile.h5", prof)  # profiles TraceWriter() + write_tensor + flush
        hot = hot_functions(prof)
        res.setdefault("profile", {})["writer"] = hot
    del collected
    gc.collect()
    w = {"tensors": ntensors, "bytes": nbytes, "summary_s": t_summary, "others_cores": others,
         **{f"{k}_s": v for k, v in times.items()}}
    for kind in ("cached", "durable"):
        ws, rs = med(times[f"writer_{kind}"]), med(times[f"raw_{kind}"])
        w[f"writer_{kind}_mb_s"] = nbytes / ws / MB
        w[f"raw_{kind}_mb_s"] = nbytes / rs / MB
        w[f"pct_{kind}"] = 100 * rs / ws
        w[f"pct_{kind}_best"] = 100 * min(times[f"raw_{kind}"]) / min(times[f"writer_{kind}"])
    w["summary_mb_s"] = nbytes / t_summary / MB
    w["writer_minus_summary_cached_mb_s"] = nbytes / max(med(times["writer_cached"]) - t_summary, 1e-9) / MB
    res["write"] = w
    log(f"  {nbytes / MB:.1f} MB in {ntensors} tensors (first step of a full trace: activations, gradients, "
        f"parameter values and gradients); {cfg['write_reps']} rep(s) each, alternating, os.sync() before each; "
        f"others: {' '.join(f'{o:.2f}' for o in others)} cores")
    for kind, label in (("cached", "excluding fsync (page cache)"), ("durable", "including fsync (durable)  ")):
        log(f"  {label}: writer {w[f'writer_{kind}_mb_s']:6.0f} MB/s {fmt_list(times[f'writer_{kind}'])}   "
            f"raw {w[f'raw_{kind}_mb_s']:6.0f} MB/s {fmt_list(times[f'raw_{kind}'])}   writer = "
            f"{w[f'pct_{kind}']:.0f}% of raw (best-of: {w[f'pct_{kind}_best']:.0f}%)")
    log(f"  inside the writer's time, summary statistics (tensors.summarize) alone take {t_summary:.3f} s "
        f"({w['summary_mb_s']:.0f} MB/s); the writer without them: ~{w['writer_minus_summary_cached_mb_s']:.0f} MB/s")
    if profile:
        print_hot("[profile] TraceWriter.write_tensor + flush over one step's tensors", hot)


# ---------------------------------------------------------------------------------------------------------
# 3. align throughput and memory
# ---------------------------------------------------------------------------------------------------------
def make_trace(defect, path, steps: int) -> dict:
    import layerdiff
    from recipes.torch_llama import build

    b = build(defect, **MODEL_KW)
    load = Load()
    t0 = time.perf_counter()
    with layerdiff.trace(b["model"], path, mode="full", overwrite=True) as tracer:
        walls, _ = timed_steps(b["step"], steps)
    seconds = time.perf_counter() - t0
    w = tracer.session.writer
    info = {"path": str(path), "defect": defect, "steps": steps, "seconds": seconds, "step_walls": walls,
            "tensor_bytes": w.tensor_bytes, "file_bytes": os.path.getsize(path), "records": w.records_written,
            "others_cores": load.others()}
    del b, tracer
    gc.collect()
    return info


def bench_align(cfg, tmp: Path, res: dict, spawner: Spawner, profile: bool):
    log(f"\n[3] align throughput and peak RSS (fresh interpreter per align; small = {cfg['small_steps']} step, "
        f"large = {cfg['large_steps']} steps of the same model)")
    traces = {}
    for size, steps in (("small", cfg["small_steps"]), ("large", cfg["large_steps"])):
        quiet_disk()
        ref = make_trace(None, tmp / f"{size}_ref.h5", steps)
        if size == "small":
            same = make_trace(None, tmp / f"{size}_ref2.h5", steps)
            same["how"] = "independent second run"
        else:
            t0 = time.perf_counter()
            shutil.copyfile(ref["path"], tmp / f"{size}_ref2.h5")
            same = dict(ref, path=str(tmp / f"{size}_ref2.h5"), how="byte copy of the reference",
                        seconds=time.perf_counter() - t0)
        quiet_disk()
        bad = make_trace("eps", tmp / f"{size}_eps.h5", steps)
        traces[size] = {"ref": ref, "same": same, "eps": bad}
        log(f"  {size}: {steps} step(s) per trace, {ref['tensor_bytes'] / MB:.0f} MB tensor data, "
            f"{ref['file_bytes'] / MB:.0f} MB file, {ref['records']} records; identical pair: {same['how']}")
        for name, info in (("ref", ref), ("eps", bad)):
            log(f"    tracing {name}: {info['seconds']:.2f} s = {info['tensor_bytes'] / info['seconds'] / MB:.0f} MB/s "
                f"sustained, steps {fmt_list(info['step_walls'])} (others {info['others_cores']:.2f} cores)")
    res["align"] = {"traces": traces}
    quiet_disk()
    plan = [(size, pair, "warm") for size in ("small", "large") for pair in ("same", "eps")]
    plan += [(size, "eps", "cold") for size in cfg["cold"]]
    runs = []
    log(f"  {'size':5s} {'pair':10s} {'cache':5s} {'MB/side':>7s} {'open s':>6s} {'align s':>7s} {'MB/s/side':>9s} "
        f"{'maxrss0':>7s} {'maxrss1':>7s} {'rss0':>5s} {'+peak':>5s} {'VmHWM':>6s} {'others':>6s}  verdict / origin / "
        f"identical tensor pairs")
    for size, pair, cache in plan:
        reps = cfg["align_reps"] if cache == "warm" else 1
        a, b = traces[size]["ref"]["path"], traces[size][pair]["path"]
        for _ in range(reps):
            if cache == "cold":
                drop_cache(a)
                drop_cache(b)
            r = run_align_child(spawner, a, b)
            r.update(size=size, pair="identical" if pair == "same" else "defect eps", cache=cache)
            runs.append(r)
            if "error" in r:
                log(f"  {size:5s} {r['pair']:10s} {cache:5s} FAILED {r['error']}")
                continue
            r["mb_s_per_side"] = r["bytes_a"] / r["total_s"] / MB
            log(f"  {size:5s} {r['pair']:10s} {cache:5s} {r['bytes_a'] / MB:7.0f} {r['open_s']:6.3f} {r['align_s']:7.2f} "
                f"{r['mb_s_per_side']:9.0f} {r['maxrss_before'] / MB:7.0f} {r['maxrss_after'] / MB:7.0f} "
                f"{r['rss_before'] / MB:5.0f} {r['peak_delta'] / MB:5.0f} {r['vmhwm_after'] / MB:6.0f} "
                f"{r['others_cores']:6.2f}  {r['verdict']} / {r['forward_origin']} / "
                f"{r['identical_pairs']}/{r['tensor_pairs']}")
    log("  (MB columns: maxrss0/1 = ru_maxrss before/after the align, rss0 = RSS before it, "
        "+peak = maxrss1 - rss0, VmHWM = the child's own high-water mark)")
    ok = [r for r in runs if "error" not in r]
    best = {}
    for r in ok:
        key = (r["size"], r["pair"], r["cache"])
        cur = best.setdefault(key, {"size": r["size"], "pair": r["pair"], "cache": r["cache"], "bytes": r["bytes_a"],
                                    "mb_s": [], "peak_delta": 0, "maxrss_after": 0})
        cur["mb_s"].append(r["mb_s_per_side"])
        cur["peak_delta"] = max(cur["peak_delta"], r["peak_delta"])
        cur["maxrss_after"] = max(cur["maxrss_after"], r["maxrss_after"])
    growth = {}
    for pair in ("identical", "defect eps"):
        s, l_ = best.get(("small", pair, "warm")), best.get(("large", pair, "warm"))
        if s and l_:
            growth[pair] = l_["peak_delta"] / max(s["peak_delta"], 1)
            log(f"  peak RSS increase over the child's start, large/small ({pair}): "
                f"{l_['peak_delta'] / MB:.0f} / {s['peak_delta'] / MB:.0f} MB = {growth[pair]:.2f}x for "
                f"{l_['bytes'] / s['bytes']:.1f}x the data (target: not growing)")
    res["align"].update(runs=runs, summary=list(best.values()), peak_delta_growth=growth)
    if profile:
        log("\n[profile] cProfile of align (separate runs, warm cache)")
        for size, pair in (("small", "eps"), ("small", "same")):
            r = run_align_child(spawner, traces[size]["ref"]["path"], traces[size][pair]["path"], profile=True)
            if "hot" in r:
                print_hot(f"align {size} {'defect eps' if pair == 'eps' else 'identical'} "
                          f"({r['bytes_a'] / MB:.0f} MB/side, {r['total_s']:.2f} s)", r["hot"])
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
def summary_rows(res: dict) -> list[tuple[str, str, str]]:
    """(metric, value, target) of the summary, printed at the end and saved in the JSON's tables."""
    rows = []
    s = res.get("step")
    if s:
        def q(x, fmt):
            return fmt.format(x) if x else "n/a"

        for name in ("untraced", "stats", "full"):
            rows.append((f"step time, {name} (median / quiet median / best)",
                         f"{s[name]['median'] * 1e3:.1f} / {q(s[name]['quiet_median'] and s[name]['quiet_median'] * 1e3, '{:.1f}')}"
                         f" / {s[name]['min'] * 1e3:.1f} ms", "-"))
        for name, target in (("stats", "<= 1.3x"), ("full", "report")):
            rows.append((f"{name} / untraced (median; quiet median; best)",
                         f"{s[name]['ratio_median']:.2f}x; {q(s[name]['ratio_quiet'], '{:.2f}x')}; "
                         f"{s[name]['ratio_min']:.2f}x", target))
        fb = s["full"]["last_block"]
        rows += [("full: tensor bytes per steady-state step", f"{fb['tensor_bytes_per_step'] / MB:.1f} MB", "report"),
                 (f"full: {fb['steps']}-step trace, tensor_bytes / file size",
                  f"{fb['tensor_bytes'] / MB:.1f} / {fb['file_bytes'] / MB:.1f} MB", "report")]
        if "full_store_mb_s_effective" in res:
            rows.append(("full: bytes per step / (full - stats step time)",
                         f"{res['full_store_mb_s_effective']:.0f} MB/s", "report"))
    a = res.get("align")
    if a:
        for size in ("small", "large"):
            t = a["traces"][size]["ref"]
            rows.append((f"full: sustained tracing, {t['steps']}-step trace",
                         f"{t['tensor_bytes'] / t['seconds'] / MB:.0f} MB/s, {med(t['step_walls']) * 1e3:.0f} ms/step",
                         "report"))
    w = res.get("write")
    if w:
        rows += [("writer, excl. fsync", f"{w['writer_cached_mb_s']:.0f} MB/s", "-"),
                 ("raw sequential write, excl. fsync", f"{w['raw_cached_mb_s']:.0f} MB/s", "-"),
                 ("writer / raw, excl. fsync (medians; bests)", f"{w['pct_cached']:.0f}%; {w['pct_cached_best']:.0f}%",
                  ">= 70%"),
                 ("writer, incl. fsync", f"{w['writer_durable_mb_s']:.0f} MB/s", "-"),
                 ("raw sequential write, incl. fsync", f"{w['raw_durable_mb_s']:.0f} MB/s", "-"),
                 ("writer / raw, incl. fsync (medians; bests)",
                  f"{w['pct_durable']:.0f}%; {w['pct_durable_best']:.0f}%", ">= 70%"),
                 ("summary statistics alone (inside writer)", f"{w['summary_mb_s']:.0f} MB/s", "-")]
    f = res.get("flush")
    if f:
        for mode in ("stats", "full"):
            rows.append((f"{mode}: step flush_interval=0 vs 1.0 (medians; bests)",
                         f"{f[mode]['ratio']:.2f}x; {f[mode]['interval0_min'] * 1e3:.0f} vs "
                         f"{f[mode]['default_min'] * 1e3:.0f} ms = {f[mode]['ratio_min']:.2f}x", "report"))
    if a:
        for b in a["summary"]:
            rows.append((f"align {b['size']} {b['pair']} {b['cache']} ({b['bytes'] / MB:.0f} MB/side)",
                         f"{med(b['mb_s']):.0f} MB/s/side", ">= 1000 MB/s/side"))
        for b in a["summary"]:
            if b["cache"] == "warm":
                rows.append((f"align {b['size']} {b['pair']}: peak RSS, + over child start",
                             f"{b['maxrss_after'] / MB:.0f} MB, +{b['peak_delta'] / MB:.0f} MB", "not growing"))
        for pair, g in a["peak_delta_growth"].items():
            rows.append((f"align {pair}: peak RSS increase large/small", f"{g:.2f}x", "~1x"))
        if any("error" in r for r in a["runs"]):
            rows.append(("align runs that failed", str(sum("error" in r for r in a["runs"])), "0"))
    return rows


def summary(res: dict):
    rows = summary_rows(res)
    width = max(len(r[0]) for r in rows) if rows else 10
    vwidth = max(len(r[1]) for r in rows) if rows else 10
    line = "=" * (width + vwidth + 22)
    log("\n" + line)
    log("SUMMARY (value and target; no judgement)")
    log(f"{'metric':{width}}  {'value':>{vwidth}}  target")
    log("-" * len(line))
    for name, value, target in rows:
        log(f"{name:{width}}  {value:>{vwidth}}  {target}")
    log(line)


def figures(res: dict) -> dict:
    """The summary's figures as numbers (the JSON's "results"; every measurement stays under its own key too)."""
    out = {}
    s = res.get("step")
    if s:
        keys = ("median", "quiet_median", "min", "cpu_median", "ratio_median", "ratio_quiet", "ratio_min")
        out["step_s"] = {name: {k: s[name].get(k) for k in keys} for name in s}
        fb = s["full"]["last_block"]
        out["full_tensor_bytes_per_step"] = fb["tensor_bytes_per_step"]
        out["full_trace"] = {k: fb[k] for k in ("steps", "tensor_bytes", "file_bytes")}
        if "full_store_mb_s_effective" in res:
            out["full_store_mb_s_effective"] = res["full_store_mb_s_effective"]
    w = res.get("write")
    if w:
        out["write"] = {k: v for k, v in w.items() if not isinstance(v, list)}
    if res.get("flush"):
        out["flush"] = res["flush"]
    a = res.get("align")
    if a:
        out["sustained_tracing"] = {size: {"steps": t["ref"]["steps"],
                                           "mb_s": t["ref"]["tensor_bytes"] / t["ref"]["seconds"] / MB,
                                           "step_s_median": med(t["ref"]["step_walls"])}
                                    for size, t in a["traces"].items()}
        out["align"] = [{"size": b["size"], "pair": b["pair"], "cache": b["cache"], "bytes_per_side": b["bytes"],
                         "mb_s_per_side_median": med(b["mb_s"]), "peak_rss": b["maxrss_after"],
                         "peak_rss_over_start": b["peak_delta"]} for b in a["summary"]]
        out["align_peak_delta_growth"] = a["peak_delta_growth"]
        out["align_failed_runs"] = sum("error" in r for r in a["runs"])
    return out


def write_json(bench_run, path: str, res: dict, quick: bool, unreaped_cpu: float = 0.0):
    """--json: the run's metadata, the summary as a table and its figures (benchlib.BenchRun); every key this JSON
    had before stays at the top level."""
    s, headline = res.get("step"), []
    if s:
        headline.append(f"`stats` {s['stats']['ratio_median']:.2f}x, `full` {s['full']['ratio_median']:.2f}x the "
                        "untraced step (medians)")
    for b in (res.get("align") or {}).get("summary", []):
        if (b["size"], b["pair"], b["cache"]) == ("small", "identical", "warm"):
            headline.append(f"align {med(b['mb_s']):.0f} MB/s per side ({b['bytes'] / MB:.0f} MB, warm)")
    note = (f"Configuration {res['config']['name']!r}: {res['config']['rounds']} interleaved rounds x "
            f"{res['config']['steps_per_block']} timed steps per block; large align trace "
            f"{res['config']['large_steps']} steps. Values only, next to the targets of the spec; no judgement.")
    bench_run.write(path, quick=quick, headline="; ".join(headline),
                    tables=[benchlib.table("Summary", ["metric", "value", "target"], summary_rows(res), note)],
                    results=figures(res), extra=res, unreaped_cpu=unreaped_cpu)


def environment() -> dict:
    import h5py
    import numpy
    import torch
    import transformers

    with open("/proc/loadavg") as f:
        loadavg = f.read().split()[:3]
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "loadavg": loadavg}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and a 3-step large trace")
    p.add_argument("--json", metavar="FILE", help="also save the results as JSON")
    p.add_argument("--profile", action="store_true", help="also print cProfile hot spots (traced step, align)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads(N) (default: torch's own default)")
    p.add_argument("--frameworks", metavar="LIST",
                   help="instead of the torch bench: step overhead (untraced/stats/full) for a comma-separated "
                        "subset of torch,paddle,mindspore, one subprocess each (see tools/bench_frameworks.py)")
    p.add_argument("--_align-child", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    p.add_argument("--_spawner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._spawner:
        spawner_loop()
        return 0
    if args._align_child:
        align_child(*args._align_child, profile=args.profile)
        return 0

    if args.frameworks:
        sys.path.insert(0, str(Path(SELF).parent))
        import bench_frameworks

        return bench_frameworks.main(["--frameworks", args.frameworks] + (["--profile"] if args.profile else [])
                                     + (["--json", args.json] if args.json else []))

    spawner = Spawner()  # before anything big is imported: its children inherit its (small) ru_maxrss
    try:
        return run(args, spawner)
    finally:
        spawner.close()


def run(args, spawner: Spawner) -> int:
    bench_run = benchlib.BenchRun("bench", TITLE, METHOD, packages=("numpy", "torch", "transformers", "h5py"))
    import torch

    from recipes.torch_llama import build

    if args.threads:
        torch.set_num_threads(args.threads)

    cfg_name = "quick" if args.quick else "default"
    cfg = CONFIGS[cfg_name]
    t_start = time.perf_counter()
    env = environment()
    log(f"layerdiff bench ({cfg_name}): model {MODEL_KW}, CPU, forward+backward with labels")
    log(f"env: python {env['python']}, torch {env['torch']} ({env['torch_threads']} threads, {env['cpus']} cpus), "
        f"transformers {env['transformers']}, numpy {env['numpy']}, h5py {env['h5py']} (HDF5 {env['hdf5']}); "
        f"load average at start {' '.join(env['loadavg'])}")
    res: dict = {"config": {"name": cfg_name, **cfg, "model": MODEL_KW}, "env": env}
    WAITER.budget = cfg["quiet_budget"]
    tmp = Path(tempfile.mkdtemp(prefix="layerdiff-bench-", dir="/tmp"))
    log(f"temp dir: {tmp}")
    try:
        b = build(None, **MODEL_KW)
        model, step = b["model"], b["step"]
        bench_steps(cfg, tmp, res, model, step)
        bench_write(cfg, tmp, res, model, step, args.profile)
        if args.profile:
            profile_steps(tmp, res, model, step)
        del b, model, step
        gc.collect()
        bench_align(cfg, tmp, res, spawner, args.profile)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t_start
    res["waited_for_quiet_s"] = WAITER.waited
    summary(res)
    with open("/proc/loadavg") as f:
        log(f"total bench time {res['seconds']:.0f} s (of which {WAITER.waited:.0f} s waiting for other processes to "
            f"leave the CPUs idle, budget {WAITER.budget:.0f} s); load average at end {' '.join(f.read().split()[:3])}")
    if args.json:
        write_json(bench_run, args.json, res, quick=args.quick, unreaped_cpu=spawner.cpu)
        log(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
