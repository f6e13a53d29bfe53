#!/usr/bin/env python
"""layerdiff benchmark, per framework: step time untraced vs traced ("stats" and "full" modes).

    python tools/bench_frameworks.py                                  # torch, paddle, mindspore (~3-4 min)
    python tools/bench_frameworks.py --frameworks paddle,mindspore    # a subset
    python tools/bench_frameworks.py --profile                        # + cProfile of traced stats steps
    python tools/bench_frameworks.py --json out.json                  # also save every number as JSON
    python tools/bench_frameworks.py --quick                          # 1 round each, 2 s quiet budget (checks it)
    python tools/bench.py --frameworks torch,paddle,mindspore         # the same, from the main bench

Model: the same Llama in each framework (``recipes/{torch,paddle,mindspore}_llama.py``, ``build(...)`` ->
{"model", "step"}) at the size of tools/bench.py: layers=4, hidden=256, heads=8, kv_heads=8, vocab=32000,
intermediate=688, batch=2, seq=128; one step = forward with labels + backward (torch: zero_grad + backward;
paddle: clear_gradients + backward; mindspore: ms.value_and_grad in PyNative mode), on CPU.

Every framework runs in its own fresh interpreter (paddle and mindspore are never imported in one process),
one after the other. Inside it, as in tools/bench.py section 1: warm-up steps, then interleaved rounds of
[untraced, stats, full] blocks (order rotated each round); a traced block opens a fresh trace with
``layerdiff.trace(model, path, mode=..., overwrite=True)``, runs one untimed traced step (the first step also
records parameter values), then times K steps. ``os.sync()`` and a wait for idle CPUs (small budget) precede
every block; "others" = CPU cores other processes kept busy. A framework stops adding rounds once its time
budget is spent (after a minimum number of rounds: torch 3, paddle 3, mindspore 2). Medians over all timed
steps are the headline; ratios are vs untraced.
"MB per full step" = tensor bytes the writer stored per steady-state step (not the first step).

It only prints numbers next to the targets (stats <= 1.3x); it never asserts or judges.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
for p in (str(ROOT), str(TOOLS)):
    if p not in sys.path:
        sys.path.insert(0, p)  # `recipes` and `benchlib` (stdlib-only at import time)

import benchlib  # noqa: E402  (run_block, timed_steps, Load, QuietWaiter, hot_functions, ...)

SELF = str(Path(__file__).resolve())
FRAMEWORKS = ("torch", "paddle", "mindspore")
CONFIGS = [("untraced", None), ("stats", dict(mode="stats")), ("full", dict(mode="full"))]
# per framework: warm-up steps, timed steps per block, rounds (max), min_rounds, and a time budget (s) after
# which no new round starts once min_rounds are done (a loaded machine shortens the run, not the minimum)
PLAN = {"torch": dict(warmup=3, k=3, rounds=4, min_rounds=3, budget=40.0),
        "paddle": dict(warmup=2, k=2, rounds=4, min_rounds=3, budget=45.0),
        "mindspore": dict(warmup=2, k=2, rounds=3, min_rounds=2, budget=75.0)}
RESULT = "@@RESULT "
QUIET_BUDGET = 15.0  # --quick: 2 s
log = benchlib.log
TITLE = "Tracing cost per framework"
METHOD = """The same Llama in PyTorch, PaddlePaddle and MindSpore (recipes/{torch,paddle,mindspore}_llama.py: 4 layers,
hidden 256, 8 heads, vocab 32000, intermediate 688, batch 2 x 128 tokens), one step = forward with labels +
backward on the CPU (MindSpore through ms.value_and_grad in PyNative mode). Every framework runs in its own fresh
interpreter, one after the other. Inside it: warm-up steps, then interleaved rounds of [untraced, stats, full] blocks
(order rotated each round); a traced block opens a fresh trace, runs one untimed traced step (the first step also
records parameter values), then times K steps; os.sync() and a wait for idle CPUs precede every block. Medians over
all timed steps are the headline, with the median over quiet blocks (other processes < 0.3 cores) and the best step
beside them; ratios are traced / untraced. "MB per full step" = tensor bytes stored per steady-state step."""


# ---------------------------------------------------------------------------------------------------------
# child: one framework
# ---------------------------------------------------------------------------------------------------------
def framework_env(fw: str) -> dict:
    if fw == "torch":
        import torch
        return {"version": torch.__version__, "threads": torch.get_num_threads()}
    if fw == "paddle":
        import paddle
        return {"version": paddle.__version__, "device": paddle.get_device()}
    import mindspore as ms
    env = {"version": ms.__version__, "device": ms.get_context("device_target"), "mode": ms.get_context("mode")}
    try:
        env["runtime_num_threads"] = ms.get_context("runtime_num_threads")
    except Exception:  # noqa: BLE001
        pass
    return env


def child(fw: str, profile: bool, quiet_budget: float, rounds_override: int | None) -> int:
    import importlib

    t0 = time.perf_counter()
    recipe = importlib.import_module(f"recipes.{fw}_llama")
    import layerdiff

    env = framework_env(fw)
    t_import = time.perf_counter() - t0
    b = recipe.build(None, **benchlib.MODEL_KW)
    model, step = b["model"], b["step"]
    t_build = time.perf_counter() - t0 - t_import
    plan = dict(PLAN[fw])
    if rounds_override:
        plan["rounds"] = rounds_override
    benchlib.WAITER.budget = quiet_budget
    log(f"  {fw} {env}: import {t_import:.1f} s, build {t_build:.1f} s; warm-up {plan['warmup']} steps, up to "
        f"{plan['rounds']} rounds x {plan['k']} timed steps per configuration (budget {plan['budget']:.0f} s)")
    warm, _ = benchlib.timed_steps(step, plan["warmup"])
    tmp = Path(tempfile.mkdtemp(prefix=f"layerdiff-bench-{fw}-", dir="/tmp"))
    blocks = {name: [] for name, _ in CONFIGS}
    t_rounds = time.perf_counter()
    try:
        for r in range(plan["rounds"]):
            if r >= min(plan["min_rounds"], plan["rounds"]) and time.perf_counter() - t_rounds > plan["budget"]:
                break
            order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
            for name, opts in order:
                blk = benchlib.run_block(model, step, opts, plan["k"], tmp / f"{fw}_{name}.h5")
                blocks[name].append(blk)
                log(f"    round {r + 1} {name:8} walls {benchlib.fmt_list(blk['walls'])}  others {blk['others']:.2f} cores"
                    + (f"  first traced step {blk['first_step']:.3f}s, close {blk['close_s']:.3f}s"
                       if opts else ""))
        prof_rows = None
        if profile:
            import cProfile

            benchlib.quiet_disk()
            with layerdiff.trace(model, tmp / f"{fw}_profile.h5", mode="stats", overwrite=True):
                step()  # first traced step (parameter values) not profiled
                prof = cProfile.Profile()
                prof.enable()
                step()
                prof.disable()
            prof_rows = benchlib.hot_functions(prof, top=12)
            # the same step untraced, for the framework's own share
            uprof = cProfile.Profile()
            uprof.enable()
            step()
            uprof.disable()
            prof_rows_untraced = benchlib.hot_functions(uprof, top=12)
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)

    agg = {}
    for name, _ in CONFIGS:
        bl = blocks[name]
        walls = [w for x in bl for w in x["walls"]]
        cpus = [c for x in bl for c in x["cpus"]]
        quiet = [w for x in bl if x["others"] < benchlib.QUIET_CORES for w in x["walls"]]
        agg[name] = {"walls": walls, "median": benchlib.med(walls), "min": min(walls), "cpu_median": benchlib.med(cpus),
                     "quiet_median": benchlib.med(quiet) if quiet else None, "n_quiet": len(quiet),
                     "others": [x["others"] for x in bl]}
        if name != "untraced":
            agg[name]["first_step_median"] = benchlib.med([x["first_step"] for x in bl])
            agg[name]["close_median"] = benchlib.med([x["close_s"] for x in bl])
            agg[name]["bytes_per_step"] = benchlib.med([x["tensor_bytes_per_step"] for x in bl])
            agg[name]["records_per_step"] = benchlib.med([x["records_per_step"] for x in bl])
    u = agg["untraced"]
    for name in ("stats", "full"):
        a = agg[name]
        a["ratio_median"] = a["median"] / u["median"]
        a["ratio_min"] = a["min"] / u["min"]
        a["ratio_quiet"] = (a["quiet_median"] / u["quiet_median"]
                            if a["quiet_median"] and u["quiet_median"] else None)
    out = {"framework": fw, "env": env, "plan": plan, "import_s": t_import, "build_s": t_build, "warmup": warm,
           "steps": agg, "rounds": len(blocks["untraced"]), "seconds": time.perf_counter() - t0}
    if profile:
        out["profile_stats_step"] = prof_rows
        out["profile_untraced_step"] = prof_rows_untraced
    print(RESULT + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------
# parent: one subprocess per framework, then the summary table
# ---------------------------------------------------------------------------------------------------------
def run_child(fw: str, args) -> dict:
    cmd = [sys.executable, SELF, "--_child", fw, "--quiet-budget", str(args.quiet_budget)]
    if args.profile:
        cmd.append("--profile")
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1, cwd=str(ROOT))
        result = None
        for line in proc.stdout:
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT):])
            elif line.startswith("  "):  # our own progress lines; frameworks' chatter is dropped
                log(line.rstrip("\n"))
        rc = proc.wait()
        err.seek(0)
        stderr = err.read()
    if rc != 0 or result is None:
        return {"framework": fw, "error": f"exit {rc}: {stderr.strip()[-3000:]}", "seconds": time.perf_counter() - t0}
    result["wall_incl_startup_s"] = time.perf_counter() - t0
    return result


def _cell(a, ratio=None):
    q = f"{a['quiet_median'] * 1e3:.0f}" if a["quiet_median"] else "n/a"
    s = f"{a['median'] * 1e3:.0f} ({q}/{a['min'] * 1e3:.0f})"
    return s if ratio is None else f"{s} {ratio:.2f}x"


def _ratios(a):
    q = f"{a['ratio_quiet']:.2f}" if a["ratio_quiet"] else "n/a"
    return f"{a['ratio_median']:.2f}/{q}/{a['ratio_min']:.2f}"


def _cpu(s):
    cu = s["untraced"]["cpu_median"]
    return (f"{cu * 1e3:.0f}/{s['stats']['cpu_median'] * 1e3:.0f}/{s['full']['cpu_median'] * 1e3:.0f} "
            f"({s['stats']['cpu_median'] / cu:.2f}x/{s['full']['cpu_median'] / cu:.2f}x)")


def _per_record(s):
    """The fixed cost a traced record adds, whatever the model's size (median step difference / records per step)."""
    return (s["stats"]["median"] - s["untraced"]["median"]) / max(s["stats"]["records_per_step"], 1)


def summary(results: list[dict]):
    log("\n" + "=" * 112)
    log("SUMMARY: step time, median over all timed steps (quiet median / best in brackets); ratio = traced / untraced "
        "median; target: stats <= 1.3x")
    hdr = (f"{'framework':10} {'untraced ms':>24} {'stats ms (ratio)':>32} {'full ms (ratio)':>32} "
           f"{'MB/full step':>12}")
    log(hdr)
    log("-" * len(hdr))

    for r in results:
        if "error" in r:
            log(f"{r['framework']:10} FAILED: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        s = r["steps"]
        log(f"{r['framework']:10} {_cell(s['untraced']):>24} {_cell(s['stats'], s['stats']['ratio_median']):>32} "
            f"{_cell(s['full'], s['full']['ratio_median']):>32} {s['full']['bytes_per_step'] / benchlib.MB:12.1f}")
    log("-" * len(hdr))
    log(f"{'framework':10} {'stats x (med/quiet/best)':>26} {'full x (med/quiet/best)':>26} {'cpu ms u/s/f (stats x/full x)':>32} "
        f"{'rec/step s/f':>13} {'rounds':>6} {'others max':>10}")
    for r in results:
        if "error" in r:
            continue
        s = r["steps"]
        recs = f"{s['stats']['records_per_step']:.0f}/{s['full']['records_per_step']:.0f}"
        others = max(o for n in s for o in s[n]["others"])
        log(f"{r['framework']:10} {_ratios(s['stats']):>26} {_ratios(s['full']):>26} {_cpu(s):>32} {recs:>13} "
            f"{r['rounds']:>6} {others:10.2f}")
    log("-" * 112)
    for r in results:  # the fixed cost a traced module call adds, whatever the model's size
        if "error" in r:
            continue
        log(f"{r['framework']:10} stats-mode cost per record (median step difference / records per step): "
            f"{_per_record(r['steps']) * 1e3:.3f} ms")
    log("=" * 112)
    log("cpu ms = process CPU time per step (all threads), median; less sensitive than wall time to other processes")


def write_json(run: benchlib.BenchRun, path: str, results: list[dict], quick: bool):
    """The summary above as tables for docs/benchmarks/ (benchlib.BenchRun); ``results`` as it was saved before."""
    steps, extra, failed = [], [], []
    for r in results:
        if "error" in r:
            failed.append([r["framework"], r["error"].splitlines()[-1] if r["error"] else ""])
            continue
        s, version = r["steps"], r.get("env", {}).get("version", "")
        name = f"{r['framework']} {version}".strip()
        steps.append([name, _cell(s["untraced"]), _cell(s["stats"], s["stats"]["ratio_median"]),
                      _cell(s["full"], s["full"]["ratio_median"]), f"{s['full']['bytes_per_step'] / benchlib.MB:.1f}"])
        extra.append([name, _ratios(s["stats"]), _ratios(s["full"]), _cpu(s),
                      f"{s['stats']['records_per_step']:.0f}/{s['full']['records_per_step']:.0f}", str(r["rounds"]),
                      f"{max(o for n in s for o in s[n]['others']):.2f}", f"{_per_record(s) * 1e3:.3f} ms"])
    tables = [benchlib.table("Step time", ["framework", "untraced ms", "`stats` ms (ratio)", "`full` ms (ratio)",
                                           "MB per full step"], steps,
                             "Median over all timed steps (quiet median / best in brackets); ratio = traced / "
                             "untraced median; target: `stats` <= 1.3x."),
              benchlib.table("Ratios, CPU time and records", ["framework", "`stats` x (median/quiet/best)",
                                                              "`full` x (median/quiet/best)",
                                                              "CPU ms untraced/stats/full (stats x/full x)",
                                                              "records per step stats/full", "rounds",
                                                              "others max (cores)", "`stats` cost per record"], extra,
                             "CPU ms = process CPU time per step (all threads), median; less sensitive than wall "
                             "time to other processes. Cost per record = median step difference / records per step.")]
    if failed:
        tables.append(benchlib.table("Frameworks that failed", ["framework", "error"], failed))
    ok = [r for r in results if "error" not in r]
    headline = ("`stats` / untraced (median step): "
                + ", ".join(f"{r['framework']} {r['steps']['stats']['ratio_median']:.2f}x" for r in ok)
                if ok else "every framework failed")
    run.write(path, quick=quick, headline=headline, tables=tables, results=results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help="comma-separated subset of torch,paddle,mindspore (default: all three)")
    p.add_argument("--profile", action="store_true",
                   help="also print a cProfile (top 12 by tottime) of one traced stats step and one untraced step")
    p.add_argument("--json", metavar="FILE", help="also save the results as JSON")
    p.add_argument("--rounds", type=int, help="override the number of rounds per framework")
    p.add_argument("--quiet-budget", type=float,
                   help="seconds per framework to wait, in total, for other processes to leave the CPUs idle "
                        f"(default {QUIET_BUDGET:.0f}; --quick 2)")
    p.add_argument("--quick", action="store_true", help="1 round per framework, 2 s quiet budget: checks the tool")
    p.add_argument("--_child", metavar="FW", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = args.rounds or 1
    if args.quiet_budget is None:
        args.quiet_budget = 2.0 if args.quick else QUIET_BUDGET
    if args._child:
        return child(args._child, args.profile, args.quiet_budget, args.rounds)
    run = benchlib.BenchRun("bench_frameworks", TITLE, METHOD,
                            packages=("numpy", "torch", "paddle", "mindspore", "h5py"))

    fws = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in fws if f not in FRAMEWORKS]
    if bad:
        p.error(f"unknown framework(s) {bad}; choose from {','.join(FRAMEWORKS)}")
    t0 = time.perf_counter()
    with open("/proc/loadavg") as f:
        la = " ".join(f.read().split()[:3])
    log(f"layerdiff framework bench: model {benchlib.MODEL_KW}, CPU ({os.cpu_count()} cpus), forward+backward; "
        f"python {sys.version.split()[0]}; load average at start {la}")
    log("each framework runs in its own interpreter, one after the other")
    results = []
    for fw in fws:
        log(f"\n[{fw}]")
        r = run_child(fw, args)
        results.append(r)
        if "error" in r:
            log(f"  FAILED after {r['seconds']:.0f} s:\n{r['error']}")
            continue
        log(f"  {fw}: {r['rounds']} rounds, {r['wall_incl_startup_s']:.0f} s incl. interpreter start")
        if args.profile:
            benchlib.print_hot(f"{fw}: one traced step, stats mode (cProfile)", r["profile_stats_step"])
            benchlib.print_hot(f"{fw}: the same step untraced (cProfile)", r["profile_untraced_step"])
    summary(results)
    with open("/proc/loadavg") as f:
        log(f"total {time.perf_counter() - t0:.0f} s; load average at end {' '.join(f.read().split()[:3])}")
    if args.json:
        quick = bool(args.rounds and any(args.rounds < plan["min_rounds"] for plan in PLAN.values()))
        write_json(run, args.json, results, quick)
        log(f"results saved to {args.json}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
