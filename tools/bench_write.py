#!/usr/bin/env python
"""What checksums cost a full trace's write speed: this checkout against a commit without them. Prints numbers,
asserts nothing.

    python tools/bench_write.py                     # about five minutes
    python tools/bench_write.py --quick             # two rounds (checks the tool)
    python tools/bench_write.py --before 7ea0088    # the commit to compare with (default: the last without checksums)
    python tools/bench_write.py --json docs/benchmarks/data/bench_write.json

Each side runs in a process of its own, with its own ``layerdiff`` (and ``recipes``) copied into a temporary
directory (the other side's from ``git archive``); both stay up and measure on request, one right after the other,
round after round, so that both see the same machine (a busy one too: the cost is the median of the rounds'
ratios). Each round:

1. The writer: the records and tensors of one full traced step of the benchmark Llama (as bench.py: 4 layers,
   hidden 256, vocab 32000, batch 2 x 128) written again into a new trace by the side's ``TraceWriter`` (inline:
   each record in the file before the next; with checksums, every tensor block and index line hashed): MB/s.
2. A traced step: the benchmark Llama's step traced in full mode with the defaults (the writer behind the step).
3. The same step untraced.
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
ROUNDS = 15  # rounds, each measuring both sides one right after the other (writer, traced step, untraced step)
TITLE = "Checksums: their cost to a full trace's write speed"
METHOD = """Each side (this checkout, and a commit without checksums) runs in a process of its own, its layerdiff copied
into a temporary directory; both stay up and measure on request, one right after the other (which goes first
alternates), round after round. Each round: the writer (the records and tensors of one full traced step of the
benchmark Llama, 4 layers, hidden 256, vocab 32000, batch 2 x 128, written again into a new trace by the side's
TraceWriter, inline; os.sync() before), a traced step (full mode, the defaults: the writer behind the step) and the
same step untraced. Traces are written to memory (/dev/shm) unless --dir says otherwise: with no disk to wait for,
the checksums' share of the time is the largest it can be. Figures: medians over the rounds; costs: the median of the rounds' ratios (with / without),
which a busy machine disturbs least."""

CHILD = r'''
import json, os, sys, time
import numpy as np

def main():
    data, out = sys.argv[1], sys.argv[2]
    import layerdiff
    from layerdiff.tracefile.writer import TraceWriter
    records = json.loads(open(os.path.join(data, "records.json")).read())
    arrays = np.load(os.path.join(data, "tensors.npz"))
    tensors = [arrays[f"t{i}"] for i in range(len(arrays.files))]
    import torch
    from layerdiff.recipes import torch_llama
    built = torch_llama.build(**json.loads(sys.argv[3]))
    for _ in range(2):
        built["step"]()
    path = os.path.join(out, "t.h5")

    def write():
        writer = TraceWriter(path, {"bench": True}, overwrite=True)
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

    def traced():
        with layerdiff.trace(built["model"], path, overwrite=True) as tracer:
            built["step"]()
            before = tracer.session.writer.tensor_bytes
            times = timed(built["step"])
            return {**times, "step_bytes": tracer.session.writer.tensor_bytes - before}

    def timed(fn):
        os.sync()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}

    print(json.dumps({"ready": True, "tensor_bytes": sum(a.nbytes for a in tensors)}), flush=True)
    for line in sys.stdin:  # one measurement per line asked: writer, traced or untraced
        what = line.strip()
        result = timed(write) if what == "writer" else traced() if what == "traced" else timed(built["step"])
        print(json.dumps(result), flush=True)

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


class _Side:
    """One side's process (its own layerdiff), measuring on request, so that the two sides' rounds alternate."""

    def __init__(self, tree: Path, data: Path, work: Path):
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(data), str(work), json.dumps(benchlib.MODEL_KW)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=work)
        self.tensor_bytes = self._answer()["tensor_bytes"]

    def measure(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a side's process failed (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _ratio(before: list, after: list, key: str) -> float:
    """The median over rounds of after / before, each round's two measured one right after the other."""
    return statistics.median(a[key] / b[key] for b, a in zip(before, after))


def _cost(ratio: float) -> float:
    """How much slower ``after`` is than ``before``, as a share: 0.03 is 3% slower."""
    return ratio - 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE}: no checksums)")
    p.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS}; --quick 2)")
    p.add_argument("--quick", action="store_true", help="2 rounds: checks the tool")
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                   help="where the traces are written (default /dev/shm, memory: no disk to wait for, so the "
                        "checksums' share of the time is the largest it can be)")
    p.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    args = p.parse_args(argv)
    run = benchlib.BenchRun("bench_write", TITLE, METHOD, packages=("numpy", "torch", "h5py"))
    rounds = args.rounds or (2 if args.quick else ROUNDS)
    sides = {"before": args.before, "after": None}
    runs: dict = {name: {"writer": [], "traced": [], "untraced": []} for name in sides}
    with tempfile.TemporaryDirectory(prefix="layerdiff-write-", dir=args.dir) as d:
        tmp = Path(d)
        data = tmp / "data"
        data.mkdir()
        count, nbytes = _step_records(data)
        print(f"one full traced step of the benchmark Llama: {count} records, {nbytes / 1e6:.0f} MB of tensors")
        procs = {}
        for name, revision in sides.items():
            _copy_tree(tmp / name, revision)
            (tmp / f"work-{name}").mkdir()
            procs[name] = _Side(tmp / name, data, tmp / f"work-{name}")
        try:
            for i in range(rounds):
                for what in ("writer", "traced", "untraced"):
                    for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                        runs[name][what].append(procs[name].measure(what))
                b, a = runs["before"]["writer"][-1], runs["after"]["writer"][-1]
                print(f"  round {i + 1}: writer {nbytes / b['wall'] / 1e6:.0f} MB/s without, "
                      f"{nbytes / a['wall'] / 1e6:.0f} MB/s with; traced step {runs['before']['traced'][-1]['wall'] * 1e3:.0f} "
                      f"ms without, {runs['after']['traced'][-1]['wall'] * 1e3:.0f} ms with")
        finally:
            for proc in procs.values():
                proc.close()
    med = {name: {what: {key: statistics.median(r[key] for r in runs[name][what]) for key in ("wall", "cpu")}
                  for what in ("writer", "traced", "untraced")} for name in sides}
    writer_cost = _cost(_ratio(runs["before"]["writer"], runs["after"]["writer"], "wall"))
    writer_cpu_cost = _cost(_ratio(runs["before"]["writer"], runs["after"]["writer"], "cpu"))
    step_cost = _cost(_ratio(runs["before"]["traced"], runs["after"]["traced"], "wall"))
    step_cpu_cost = _cost(_ratio(runs["before"]["traced"], runs["after"]["traced"], "cpu"))
    mb_s = {name: nbytes / med[name]["writer"]["wall"] / 1e6 for name in sides}
    step_bytes = statistics.median(r["step_bytes"] for r in runs["after"]["traced"])
    print(f"writer: {mb_s['before']:.0f} MB/s without checksums ({args.before}), {mb_s['after']:.0f} MB/s with them: "
          f"{100 * writer_cost:+.1f}% time ({100 * writer_cpu_cost:+.1f}% CPU time), median of the rounds' ratios")
    print(f"traced step: {med['before']['traced']['wall'] * 1e3:.0f} ms without, {med['after']['traced']['wall'] * 1e3:.0f} ms "
          f"with: {100 * step_cost:+.1f}% time ({100 * step_cpu_cost:+.1f}% CPU time; untraced {med['after']['untraced']['wall'] * 1e3:.0f} ms, "
          f"{step_bytes / 1e6:.0f} MB written a step)")
    if args.json:
        commit = run.commit
        rows = [["the writer (inline): MB of tensors per second", f"{mb_s['before']:.0f} MB/s", f"{mb_s['after']:.0f} MB/s",
                 f"{100 * writer_cost:+.1f}% ({100 * writer_cpu_cost:+.1f}% CPU)"],
                ["a traced step (full mode, defaults)", f"{med['before']['traced']['wall'] * 1e3:.0f} ms",
                 f"{med['after']['traced']['wall'] * 1e3:.0f} ms",
                 f"{100 * step_cost:+.1f}% ({100 * step_cpu_cost:+.1f}% CPU)"],
                ["the same step untraced", f"{med['before']['untraced']['wall'] * 1e3:.0f} ms",
                 f"{med['after']['untraced']['wall'] * 1e3:.0f} ms", ""]]
        run.write(args.json, quick=args.quick or rounds < ROUNDS,
                  headline=f"checksums cost {100 * writer_cost:+.1f}% of the writer's time and "
                           f"{100 * step_cost:+.1f}% of a traced step's (target: within 5%)",
                  tables=[benchlib.table("Write speed without and with checksums",
                                         ["measure", f"without ({args.before})", f"with ({commit})",
                                          "time, with vs without"], rows,
                                         f"{count} records, {nbytes / 1e6:.0f} MB of tensors a step, written to "
                                         f"{args.dir or 'the temporary directory'}; medians of {rounds} rounds, "
                                         "the cost the median of the rounds' ratios.")],
                  results={"before_commit": args.before, "rounds": rounds, "tensor_bytes": nbytes,
                           "writer_mb_s": mb_s, "medians": med, "writer_cost": writer_cost,
                           "writer_cpu_cost": writer_cpu_cost, "traced_step_cost": step_cost,
                           "traced_step_cpu_cost": step_cpu_cost, "directory": args.dir,
                           "step_bytes": step_bytes, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
