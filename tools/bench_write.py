#!/usr/bin/env python
"""What checksums cost a full trace's write speed: this checkout against a commit without them. Prints numbers,
asserts nothing.

    python tools/bench_write.py                     # about three minutes
    python tools/bench_write.py --quick             # one round a side (checks the tool)
    python tools/bench_write.py --before 7ea0088    # the commit to compare with (default: the last without checksums)
    python tools/bench_write.py --json docs/benchmarks/data/bench_write.json

Both sides run the same code paths in processes of their own, one side's ``layerdiff`` (and ``recipes``) copied
into a temporary directory each (the other side from ``git archive``), alternating, so that both see the same
machine:

1. The writer. The records and tensors of one full traced step of the benchmark Llama (as bench.py: 4 layers,
   hidden 256, vocab 32000, batch 2 x 128), written again into a new trace by each side's ``TraceWriter`` (inline:
   each record in the file before the next; this side hashes every tensor and every index line): MB/s.
2. A traced step. The benchmark Llama's step traced in full mode with the defaults (the writer behind the step),
   against the same step untraced: the traced step's time, and the tensor bytes it writes per second.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "7ea0088"  # the last commit whose traces carry no checksums
ALTERNATIONS = 3  # processes a side, alternating
WRITER_ROUNDS = 5  # writes of the step's records in each process (median)
STEPS = 3  # traced and untraced steps in each process (median)
TITLE = "Checksums: their cost to a full trace's write speed"
METHOD = """Each side (this checkout, and a commit without checksums) runs in processes of its own, its layerdiff copied
into a temporary directory, alternating, 3 processes a side. The writer: the records and tensors of one full traced
step of the benchmark Llama (4 layers, hidden 256, vocab 32000, batch 2 x 128) are written again into a new trace by
the side's TraceWriter (inline), 5 times a process, os.sync() before each, median: MB of tensors per second. A traced
step: the benchmark Llama's step traced in full mode with the defaults (the writer behind the step), 3 timed steps
after a first, and 3 untraced: median step times. The figure of each side is the median over its processes."""

CHILD = r'''
import json, os, statistics, sys, time
import numpy as np

def main():
    data, out, rounds, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    import layerdiff
    from layerdiff.tracefile.writer import TraceWriter
    records = json.loads(open(os.path.join(data, "records.json")).read())
    arrays = np.load(os.path.join(data, "tensors.npz"))
    tensors = [arrays[f"t{i}"] for i in range(len(arrays.files))]
    nbytes = sum(a.nbytes for a in tensors)
    writes = []
    for r in range(rounds):
        path = os.path.join(out, f"w{r}.h5")
        os.sync()
        t0 = time.perf_counter()
        writer = TraceWriter(path, {"bench": True})
        it = iter(tensors)
        for rec in records:
            entries = []
            for t in rec["tensors"]:
                t = dict(t)
                if t.pop("stored"):
                    t.update(writer.write_tensor(next(it), t["dtype"], store_data=True, stats=t["stats"]))
                entries.append(t)
            writer.write_record({**rec, "tensors": entries})
        writer.close({"kind": "end", "status": "complete"})
        writes.append(time.perf_counter() - t0)
        os.remove(path)
    import torch
    from layerdiff.recipes import torch_llama
    built = torch_llama.build(**json.loads(sys.argv[5]))
    for _ in range(2):
        built["step"]()
    untraced = []
    for _ in range(steps):
        t0 = time.perf_counter(); built["step"](); untraced.append(time.perf_counter() - t0)
    path = os.path.join(out, "step.h5")
    traced = []
    with layerdiff.trace(built["model"], path) as tracer:
        built["step"]()
        before = tracer.session.writer.tensor_bytes
        for _ in range(steps):
            t0 = time.perf_counter(); built["step"](); traced.append(time.perf_counter() - t0)
        step_bytes = (tracer.session.writer.tensor_bytes - before) / steps
    os.remove(path)
    print(json.dumps({"writer_s": statistics.median(writes), "tensor_bytes": nbytes,
                      "untraced_s": statistics.median(untraced), "traced_s": statistics.median(traced),
                      "step_bytes": step_bytes}))

main()
'''


def _copy_tree(target: Path, revision: str | None):
    """``layerdiff`` (with ``recipes`` as ``layerdiff/recipes``, as installed) of ``revision``, or of this checkout
    as it is (None), under ``target``."""
    if revision is None:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(ROOT / "layerdiff", target / "layerdiff", ignore=ignore)
        shutil.copytree(ROOT / "recipes", target / "layerdiff" / "recipes", ignore=ignore)
        return
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "layerdiff", "recipes"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    shutil.move(str(target / "recipes"), str(target / "layerdiff" / "recipes"))


def _step_records(data: Path):
    """One full traced step of the benchmark Llama, as records (JSON) and their stored tensors (npz), in order."""
    import msgspec
    import numpy as np

    import layerdiff
    from layerdiff.recipes import torch_llama
    from layerdiff.tracefile.reader import open_trace

    built = torch_llama.build(**benchlib.MODEL_KW)
    built["step"]()
    with layerdiff.trace(built["model"], data / "one.h5"):
        built["step"]()
    records, arrays = [], []
    with open_trace(data / "one.h5") as reader:
        for rec in reader.records:
            tensors = []
            for t in rec.tensors:
                entry = {k: v for k, v in msgspec.to_builtins(t).items() if k not in ("offset", "nbytes", "checksums")}
                entry["stored"] = t.offset is not None
                if entry["stored"]:
                    arrays.append(np.array(reader.tensor(t)))
                tensors.append(entry)
            records.append({**msgspec.to_builtins(rec), "tensors": tensors})
    (data / "records.json").write_text(json.dumps(records))
    np.savez(data / "tensors.npz", **{f"t{i}": a for i, a in enumerate(arrays)})
    os.remove(data / "one.h5")
    return len(records), sum(a.nbytes for a in arrays)


def _run_side(tree: Path, data: Path, work: Path, rounds: int, steps: int) -> dict:
    benchlib.QuietWaiter(120).wait()  # the two sides compared on a machine as quiet as it gets (2 minutes at most)
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(data), str(work), str(rounds), str(steps),
                           json.dumps(benchlib.MODEL_KW)], capture_output=True, text=True, env=env, cwd=work,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"a side failed ({tree}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {**med, "writer_mb_s": med["tensor_bytes"] / med["writer_s"] / 1e6,
            "traced_mb_s": med["step_bytes"] / med["traced_s"] / 1e6, "runs": runs}


def _cost(before: float, after: float) -> float:
    """How much slower ``after`` is than ``before`` (times), as a share: 0.03 is 3% slower."""
    return after / before - 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE}: no checksums)")
    p.add_argument("--alternations", type=int, help=f"processes a side (default {ALTERNATIONS}; --quick 1)")
    p.add_argument("--quick", action="store_true", help="one process a side, 2 writes, 2 steps: checks the tool")
    p.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    args = p.parse_args(argv)
    run = benchlib.BenchRun("bench_write", TITLE, METHOD, packages=("numpy", "torch", "h5py"))
    alternations = args.alternations or (1 if args.quick else ALTERNATIONS)
    rounds, steps = (2, 2) if args.quick else (WRITER_ROUNDS, STEPS)
    sides = {"before": {"revision": args.before, "runs": []}, "after": {"revision": None, "runs": []}}
    with tempfile.TemporaryDirectory(prefix="layerdiff-write-") as d:
        tmp = Path(d)
        data = tmp / "data"
        data.mkdir()
        count, nbytes = _step_records(data)
        print(f"one full traced step of the benchmark Llama: {count} records, {nbytes / 1e6:.0f} MB of tensors")
        for name, side in sides.items():
            side["tree"] = tmp / name
            _copy_tree(side["tree"], side["revision"])
        for i in range(alternations):
            for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                work = tmp / f"{name}-{i}"
                work.mkdir()
                result = _run_side(sides[name]["tree"], data, work, rounds, steps)
                sides[name]["runs"].append(result)
                print(f"  {name}: writer {result['tensor_bytes'] / result['writer_s'] / 1e6:.0f} MB/s, traced step "
                      f"{result['traced_s'] * 1e3:.0f} ms (untraced {result['untraced_s'] * 1e3:.0f} ms)")
    before, after = _summary(sides["before"]["runs"]), _summary(sides["after"]["runs"])
    writer_cost = _cost(before["writer_s"], after["writer_s"])
    step_cost = _cost(before["traced_s"], after["traced_s"])
    print(f"writer: {before['writer_mb_s']:.0f} MB/s without checksums ({args.before}), {after['writer_mb_s']:.0f} "
          f"MB/s with them: {100 * writer_cost:+.1f}% time")
    print(f"traced step: {before['traced_s'] * 1e3:.0f} ms without, {after['traced_s'] * 1e3:.0f} ms with: "
          f"{100 * step_cost:+.1f}% time (untraced {after['untraced_s'] * 1e3:.0f} ms)")
    if args.json:
        commit = run.commit
        rows = [["the writer (inline), MB of tensors per second", f"{before['writer_mb_s']:.0f} MB/s",
                 f"{after['writer_mb_s']:.0f} MB/s", f"{100 * writer_cost:+.1f}%"],
                ["a traced step (full mode, defaults)", f"{before['traced_s'] * 1e3:.0f} ms "
                 f"({before['traced_mb_s']:.0f} MB/s)", f"{after['traced_s'] * 1e3:.0f} ms "
                 f"({after['traced_mb_s']:.0f} MB/s)", f"{100 * step_cost:+.1f}%"],
                ["the same step untraced", f"{before['untraced_s'] * 1e3:.0f} ms",
                 f"{after['untraced_s'] * 1e3:.0f} ms", ""]]
        run.write(args.json, quick=args.quick or alternations < ALTERNATIONS,
                  headline=f"checksums cost {100 * writer_cost:+.1f}% of the writer's time and "
                           f"{100 * step_cost:+.1f}% of a traced step's (target: within 5%)",
                  tables=[benchlib.table("Write speed without and with checksums",
                                         ["measure", f"without ({args.before})", f"with ({commit})",
                                          "time, with vs without"], rows,
                                         f"{count} records, {nbytes / 1e6:.0f} MB of tensors per step; median of "
                                         f"{alternations} processes a side.")],
                  results={"before": {k: v for k, v in before.items()}, "after": after,
                           "before_commit": args.before, "writer_cost": writer_cost, "traced_step_cost": step_cost,
                           "alternations": alternations})
    return 0


if __name__ == "__main__":
    sys.exit(main())
