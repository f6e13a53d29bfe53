#!/usr/bin/env python
"""Tracing cost at the size people debug: a Qwen2-0.5B-shaped model (transformers, random init, 494M parameters,
fp32), batch 1 x 32 tokens, one forward + backward on the CPU. Prints numbers; asserts nothing.

    python tools/bench_scale.py               # untraced, stats, full: each in a fresh interpreter (~5 min)
    python tools/bench_scale.py --layers 4    # a smaller variant of the same shape (quick look)
    python tools/bench_scale.py --device cuda # the same on a GPU (statistics are then reduced on the device)
    python tools/bench_scale.py --dtype bfloat16  # the model in bf16 (what most ports are checked in)
    python tools/bench_scale.py --quick       # 2 layers, 1 timed step per mode (checks the tool)
    python tools/bench_scale.py --json docs/benchmarks/data/bench_scale.json  # also save the figures

For each mode: warm-up steps, the median of timed untraced steps, then (a traced mode) the median of timed steps
inside one trace, after its first step, which also records every parameter's value; peak RSS (VmHWM) and the
bytes written. Ratios are against the same process's untraced steps: this VM's speed drifts between processes
(the untraced step has measured 1.0-2.3 s). The "serial limit" of a full trace is that untraced step plus writing one step's bytes at the speed plain numpy
writes reach on this filesystem over the same volume the trace wrote (measured here, in the same run): what
tracing would cost if recording were free and writing were not overlapped with compute. The speed of one
step's bytes into a clean page cache is printed too; a trace of several GB per step outruns the kernel's
dirty-page limit and then writes at the disk's speed, as any writer would.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

RESULT = "@@RESULT "
LAYERS, STEPS = 24, 3  # the full mode; --quick: 2 layers, 1 step
TITLE = "Tracing cost at the size people debug"
METHOD = """A Qwen2-0.5B-shaped transformers model (24 layers, hidden 896, 14 heads, 2 KV heads, vocab 151936, tied
embeddings: 494M parameters, random init, fp32 unless --dtype), batch 1 x 32 tokens, one forward + backward on the
CPU (--device cuda: a GPU). Each mode (untraced, `stats`, `full`) runs in a fresh interpreter: warm-up steps, the
median of timed untraced steps, then for a traced mode the median of timed steps inside one trace after its first
step (which also records every parameter's value); peak RSS (VmHWM) and the bytes written. Ratios are against the
same process's untraced steps, because the machine's speed drifts between processes. The "serial limit" of a full
step is that untraced step plus writing one step's bytes at the speed plain numpy writes reach on the same
filesystem over the same volume (measured in the same run): what tracing would cost if recording were free and
writing did not overlap compute. Align: two one-step full traces that differ in the RMSNorm epsilon, aligned by the
CLI in a fresh process, first with the traces dropped from the page cache (POSIX_FADV_DONTNEED), then warm, then
warm with --workers 1."""

CHILD = r'''
import json, os, statistics, sys, time
import torch
import transformers
import layerdiff

mode, path, layers, steps, eps, device, dtype = sys.argv[1:3] + [int(sys.argv[3]), int(sys.argv[4]),
                                                                   float(sys.argv[5]), sys.argv[6], sys.argv[7]]
torch.manual_seed(0)
config = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                  max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=eps)
model = transformers.Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, dtype))
ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)

def step():
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    if device != "cpu":
        torch.cuda.synchronize()  # a step's time is its kernels', not their launches'

def vm_hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return 0

def timed_steps():
    out = []
    for _ in range(steps):
        t0 = time.perf_counter(); step(); out.append(time.perf_counter() - t0)
    return out

if mode == "pair":  # one full step for the align measurement
    with layerdiff.trace(model, path, mode="full", overwrite=True):
        step()
    sys.exit(0)
for _ in range(2):
    step()
written = 0
base = timed_steps()  # this process's own untraced steps: the machine's speed drifts between processes
if mode == "untraced":
    times = base
else:
    tracer = layerdiff.trace(model, path, mode=mode, overwrite=True)
    with tracer:
        step()  # the first traced step also records every parameter's value
        first = tracer.session.writer.tensor_bytes
        times = timed_steps()
        written = (tracer.session.writer.tensor_bytes - first) / steps
print("@@RESULT " + json.dumps({"mode": mode, "step_s": statistics.median(times), "steps": times,
                                "base_s": statistics.median(base),
                                "peak_rss": vm_hwm(), "bytes_per_step": written,
                                "params": sum(p.numel() for p in model.parameters())}), flush=True)
'''


def run_child(mode: str, path: Path, layers: int, steps: int, env: dict, where: tuple) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(layers), str(steps), "1e-6", *where],
                          capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{mode} child failed:\n{proc.stderr[-3000:]}")


def align_speed(directory: Path, layers: int, env: dict, where: tuple) -> dict:
    """Two one-step full traces that differ in the RMSNorm epsilon, aligned by the CLI in a fresh process: first
    with the traces evicted from the page cache (``POSIX_FADV_DONTNEED``: read from the disk), then again with
    them in it."""
    a, b = directory / "pair_a.h5", directory / "pair_b.h5"
    for path, eps in ((a, "1e-6"), (b, "1e-3")):
        subprocess.run([sys.executable, "-c", CHILD, "pair", str(path), str(layers), "0", eps, *where], check=True,
                       capture_output=True, env=env)
    out = {"bytes_per_side": a.stat().st_size}
    os.sync()  # no writeback of earlier measurements competes for the disk
    for path in (a, b):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    runs = (("cold", None), ("warm", None), ("warm, --workers 1", "1"))  # cold reads the traces into the page cache
    for cache, workers in runs:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", ALIGN_CHILD, str(a), str(b), str(directory / "align.json"),
                               *([workers] if workers else [])], capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - t0
        result = next((json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)),
                      None)
        if result is None:
            raise RuntimeError(f"align failed:\n{proc.stderr[-3000:]}")
        out[cache] = {"seconds": seconds, **result}
    for path in (a, b):
        path.unlink()
    return out


ALIGN_CHILD = r'''
import json, resource, sys
from layerdiff import cli
workers = ["--workers", sys.argv[4]] if len(sys.argv) > 4 else []
try:
    code = cli.main(["align", sys.argv[1], sys.argv[2], "--json", sys.argv[3], "--force", *workers])
except SystemExit as exc:
    code = exc.code
status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/self/status")
          if line.startswith("VmHWM")}
worker_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child's: a worker's
print("@@RESULT " + json.dumps({"exit": code, "peak_rss": status.get("VmHWM", 0), "worker_peak_rss": worker_rss}),
      flush=True)
'''


def write_speeds(directory: Path, first: int, per_step: int, steps: int) -> tuple[float, float]:
    """Plain sequential numpy writes (64 MB blocks) of what the full trace wrote, in the same order: its
    first step's bytes, then ``steps`` steps of ``per_step`` bytes. Returns (bytes per second of one step's
    bytes into a clean page cache, bytes per second over the last ``steps`` steps). Past the kernel's dirty-page
    limit, writes run at the disk's speed: a trace of several GB per step cannot beat that either."""
    import numpy as np

    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    path = directory / "raw.bin"

    def write(f, nbytes):
        t0 = time.perf_counter()
        while nbytes > 0:
            n = min(nbytes, block.size)
            f.write(memoryview(block)[:n])
            nbytes -= n
        return time.perf_counter() - t0

    os.sync()
    with open(path, "wb", buffering=0) as f:
        clean = per_step / write(f, per_step)
    path.unlink()
    os.sync()
    with open(path, "wb", buffering=0) as f:
        write(f, first)
        sustained = per_step * steps / sum(write(f, per_step) for _ in range(steps))
    path.unlink()
    return clean, sustained


def cuda_available() -> bool:
    """Asked in a child: importing torch here would add its memory to every measurement's parent."""
    probe = subprocess.run([sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True)
    return probe.returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, help=f"decoder layers (default {LAYERS}: Qwen2-0.5B; --quick 2)")
    p.add_argument("--steps", type=int, help=f"timed steps per mode (default {STEPS}; --quick 1)")
    p.add_argument("--quick", action="store_true", help="2 layers, 1 timed step per mode: checks the tool")
    p.add_argument("--json", help="also save the numbers as JSON (read by tools/bench_pages.py)")
    p.add_argument("--no-align", action="store_true", help="skip the align measurement (two more traces)")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="run every child with MALLOC_MMAP_THRESHOLD_=N (e.g. 131072): glibc's fixed threshold, so "
                        "large tensors never enter the main heap that loading h5py mid-run fragments (see the README)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every child's environment (repeatable), e.g. LD_PRELOAD=/usr/lib/x86_64-linux-gnu/"
                        "libjemalloc.so.2 and MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1: an allocator that "
                        "keeps freed memory, so that page faults stop setting the step's time (see the README)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model runs (cuda: statistics are reduced on the GPU; full traces copy to the host)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the model's parameters and activations")
    args = p.parse_args()
    run = benchlib.BenchRun("bench_scale", TITLE, METHOD, packages=("numpy", "torch", "transformers", "h5py"))
    args.layers = args.layers or (2 if args.quick else LAYERS)
    args.steps = args.steps or (1 if args.quick else STEPS)
    if args.device == "cuda" and not cuda_available():
        print("bench_scale: --device cuda: torch sees no CUDA device on this machine", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"bench_scale: --env {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        env[key] = value
    with tempfile.TemporaryDirectory(prefix="layerdiff-scale-", dir=os.environ.get("TMPDIR", "/tmp")) as d:
        tmp = Path(d)
        where = (args.device, args.dtype)
        res = {mode: run_child(mode, tmp / f"{mode}.h5", args.layers, args.steps, env, where)
               for mode in ("untraced", "stats", "full")}
        for mode in ("stats", "full"):
            res[mode]["file_bytes"] = (tmp / f"{mode}.h5").stat().st_size
            (tmp / f"{mode}.h5").unlink()
        per_step = int(res["full"]["bytes_per_step"]) or 1
        first = max(res["full"]["file_bytes"] - per_step * args.steps, 0)
        clean, sustained = write_speeds(tmp, first, per_step, args.steps)
        aligned = None if args.no_align else align_speed(tmp, args.layers, env, where)
    base = res["untraced"]["step_s"]
    limit = res["full"]["base_s"] + per_step / sustained
    print(f"model: Qwen2-0.5B shape, {args.layers} layers, {res['untraced']['params'] / 1e6:.0f}M parameters, {args.dtype}, "
          f"batch 1 x 32, forward + backward, {args.device.upper()}; median of {args.steps} steps per mode"
          + (f"; MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "")
          + "".join(f"; {item}" for item in args.env))
    print(f"untraced step: {base:.2f} s (peak RSS {res['untraced']['peak_rss'] / 1e9:.2f} GB)")
    for mode in ("stats", "full"):
        r = res[mode]
        print(f"{mode:5} trace: {r['step_s']:.2f} s = {r['step_s'] / r['base_s']:.2f}x the same process's untraced "
              f"step ({r['base_s']:.2f} s; {r['step_s'] / base:.2f}x the untraced process's); {r['bytes_per_step'] / 1e9:.2f} GB "
              f"of tensors per step, {r['file_bytes'] / 1e9:.2f} GB file; peak RSS {r['peak_rss'] / 1e9:.2f} GB "
              f"(+{(r['peak_rss'] - res['untraced']['peak_rss']) / 1e9:.2f} GB over untraced)")
    print(f"plain writes of the same bytes on this filesystem: {clean / 1e9:.2f} GB/s for one step into a clean page "
          f"cache, {sustained / 1e9:.2f} GB/s sustained over the trace's volume")
    print(f"serial limit of a full step (its process's untraced step + its bytes at the sustained speed): {limit:.2f} s "
          f"= {limit / res['full']['base_s']:.2f}x; full trace = {res['full']['step_s'] / limit:.2f}x that limit")
    if aligned:
        side = aligned["bytes_per_side"]
        for cache in (key for key in aligned if key != "bytes_per_side"):
            r = aligned[cache]
            workers = "" if "workers 1" in cache else f", each worker {r['worker_peak_rss'] / 1e6:.0f} MB"
            print(f"align of two one-step full traces ({side / 1e9:.2f} GB each), {cache} page cache: "
                  f"{r['seconds']:.2f} s = {side / r['seconds'] / 1e9:.2f} GB/s per side, peak RSS "
                  f"{r['peak_rss'] / 1e6:.0f} MB{workers} (exit {r['exit']})")
    if args.json:
        write_json(run, args, res, clean, sustained, limit, aligned)
    return 0


def write_json(run: benchlib.BenchRun, args, res: dict, clean: float, sustained: float, limit: float,
               aligned: dict | None):
    """The figures printed above, as tables for docs/benchmarks/ (benchlib.BenchRun)."""
    base, untraced = res["untraced"]["step_s"], res["untraced"]
    rows = [["untraced", f"{base:.2f} s", "-", "-", "-", "-", f"{untraced['peak_rss'] / 1e9:.2f} GB", "-"]]
    for mode in ("stats", "full"):
        r = res[mode]
        rows.append([f"`{mode}` trace", f"{r['step_s']:.2f} s",
                     f"{r['step_s'] / r['base_s']:.2f}x (of {r['base_s']:.2f} s)", f"{r['step_s'] / base:.2f}x",
                     f"{r['bytes_per_step'] / 1e9:.2f} GB", f"{r['file_bytes'] / 1e9:.2f} GB",
                     f"{r['peak_rss'] / 1e9:.2f} GB", f"+{(r['peak_rss'] - untraced['peak_rss']) / 1e9:.2f} GB"])
    setup = (f"Qwen2-0.5B shape, {args.layers} layers, {untraced['params'] / 1e6:.0f}M parameters, {args.dtype}, "
             f"batch 1 x 32, forward + backward, {args.device.upper()}; median of {args.steps} steps per mode"
             + (f"; MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "")
             + "".join(f"; {item}" for item in args.env) + ".")
    tables = [benchlib.table("Step time per mode", ["mode", "step", "x its process's untraced step",
                                                    "x the untraced process's", "tensors per step", "file",
                                                    "peak RSS", "peak RSS over untraced"], rows, setup),
              benchlib.table("Writes and the serial limit of a full step", ["measure", "value"], [
                  ["plain writes of one step's bytes into a clean page cache", f"{clean / 1e9:.2f} GB/s"],
                  ["plain writes, sustained over the trace's volume", f"{sustained / 1e9:.2f} GB/s"],
                  ["serial limit (its process's untraced step + its bytes at the sustained speed)",
                   f"{limit:.2f} s = {limit / res['full']['base_s']:.2f}x"],
                  ["`full` trace / serial limit", f"{res['full']['step_s'] / limit:.2f}x"]])]
    headline = (f"`stats` {res['stats']['step_s'] / res['stats']['base_s']:.2f}x, `full` "
                f"{res['full']['step_s'] / res['full']['base_s']:.2f}x its process's untraced step "
                f"({res['full']['step_s'] / limit:.2f}x the serial limit)")
    if aligned:
        side = aligned["bytes_per_side"]
        align_rows, failed = [], False
        for cache, r in aligned.items():
            if cache == "bytes_per_side":
                continue
            ok = r["exit"] in (0, 1)  # aligned or divergent; anything else is no comparison at all
            failed |= not ok
            align_rows.append([cache, f"{r['seconds']:.2f} s" if ok else f"failed ({r['seconds']:.2f} s)",
                               f"{side / r['seconds'] / 1e9:.2f} GB/s" if ok else "-",
                               f"{r['peak_rss'] / 1e6:.0f} MB", "-" if "workers 1" in cache else
                               f"{r['worker_peak_rss'] / 1e6:.0f} MB", str(r["exit"])])
        tables.append(benchlib.table(f"Align of two one-step full traces ({side / 1e9:.2f} GB each)",
                                     ["page cache", "time", "per side", "peak RSS", "each worker", "exit"],
                                     align_rows, "Exit 0: aligned, 1: divergent (expected here: the traces differ "
                                                 "in the RMSNorm epsilon); any other exit is a failed align, whose "
                                                 "time says nothing." if failed else None))
        warm = aligned.get("warm")
        if warm and warm["exit"] in (0, 1):
            headline += f"; align warm {side / warm['seconds'] / 1e9:.2f} GB/s per side"
        elif failed:
            headline += "; align failed"
    run.write(args.json, quick=args.quick or args.layers < LAYERS or args.steps < STEPS, headline=headline,
              tables=tables, results=res,
              extra={"write_speed_clean": clean, "write_speed_sustained": sustained, "serial_limit_s": limit,
                      "align": aligned,
                      "config": {"layers": args.layers, "steps": args.steps, "device": args.device,
                                 "dtype": args.dtype, "mmap_threshold": args.mmap_threshold, "env": args.env}})


if __name__ == "__main__":
    sys.exit(main())
