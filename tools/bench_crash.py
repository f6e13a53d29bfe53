#!/usr/bin/env python
"""What crash safety costs, and what it keeps: prints numbers, asserts nothing.

    python tools/bench_crash.py            # about a minute

1. Write cost. The records and tensors of one full-mode traced step of the benchmark Llama (as in bench.py: 4 layers,
   hidden 256, vocab 32000, batch 2 x 128) are replayed into (a) layerdiff's ``TraceWriter``, which puts every
   tensor and every index line straight into chunks reserved in the file (a kill loses at most the record being
   written), and (b) a buffered h5py writer that flushes only at the end (what a writer without crash safety
   does; a kill loses everything since the last flush). The difference, per step, is set against the untraced
   step time: the overhead of crash safety. Median of R rounds, alternating order.
2. Kills. K traced loops (the small recipe model) are SIGKILLed at spread-out moments; each publishes how many
   records it had written; the file must hold at least that many. Records lost per kill are printed.

    python tools/bench_crash.py --quick    # 3 rounds, 3 kills (checks the tool)
    python tools/bench_crash.py --json docs/benchmarks/data/bench_crash.json  # also save the figures
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

ROUNDS = 7
KILLS = 8
TITLE = "Crash safety: its cost and what it keeps"
METHOD = """Write cost: the records and tensors of one full-mode traced step of the benchmark Llama (4 layers, hidden
256, vocab 32000, batch 2 x 128) are replayed into layerdiff's TraceWriter, which puts every tensor and index line
straight into chunks reserved in the file (a kill loses at most the record being written), and into a buffered h5py
writer that flushes once at the end (no crash safety: a kill loses everything since the last flush); median of R
rounds in alternating order, os.sync() before each, the difference set against the untraced step. Kills: K traced
loops of the small recipe model are SIGKILLed at spread-out moments; each publishes how many records it has written,
and the file must hold at least that many: records lost per kill are counted."""

LOOP = '''
import mmap, struct, sys, threading, time
import layerdiff
from layerdiff.recipes import torch_llama
built = torch_llama.build()
tracer = layerdiff.trace(built["model"], sys.argv[1])
with tracer, open(sys.argv[2], "r+b") as f:
    shared = mmap.mmap(f.fileno(), 8)
    w = tracer.session.writer
    def publish():
        while True:
            shared[:8] = struct.pack("q", w.records_written)
            time.sleep(0.0002)
    threading.Thread(target=publish, daemon=True).start()
    print("started", flush=True)
    while True:
        built["step"]()
'''


def _step_tensors(tmp: Path):
    """(records with their tensors as arrays, untraced step seconds) of one full traced step."""
    import torch  # noqa: F401  (the recipe needs it)

    import layerdiff
    from layerdiff.tracefile.reader import open_trace
    from layerdiff.recipes import torch_llama

    built = torch_llama.build(layers=4, hidden=256, heads=8, kv_heads=8, vocab=32000, intermediate=688, batch=2,
                              seq=128)
    for _ in range(2):
        built["step"]()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        built["step"]()
        times.append(time.perf_counter() - t0)
    with layerdiff.trace(built["model"], tmp / "one.h5"):
        built["step"]()
    with open_trace(tmp / "one.h5") as reader:
        records = []
        for rec in reader.records:  # each record's dict (its JSON line), written again with its tensors
            records.append((msgspec.to_builtins(rec), [
                np.array(reader.tensor(t)) if t.offset is not None else None for t in rec.tensors]))
    return records, statistics.median(times)


def _durable(path: Path, records):
    from layerdiff.tracefile.writer import TraceWriter

    writer = TraceWriter(path, {"bench": True}, overwrite=True)
    for rec, arrays in records:
        tensors = [writer.write_tensor(a, t["dtype"], store_data=True, stats=t["stats"]) if a is not None else t
                   for t, a in zip(rec["tensors"], arrays)]
        writer.write_record({**rec, "tensors": tensors})
    writer.close({"kind": "end", "status": "complete"})


def _buffered(path: Path, records, limit=8 << 20):
    """No crash safety: bytes gathered in memory, written and flushed once at the end."""
    import h5py

    with h5py.File(path, "w", libver="earliest") as f:
        data = f.create_dataset("data", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 20,))
        index = f.create_dataset("index", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 16,))
        buffer, lines, size = bytearray(), bytearray(), 0

        def drain():
            nonlocal buffer, size
            if buffer:
                data.resize((size + len(buffer),))
                data[size:size + len(buffer)] = np.frombuffer(buffer, dtype=np.uint8)
                size += len(buffer)
                buffer = bytearray()

        offset = 0
        for rec, arrays in records:
            for a in arrays:
                if a is not None:
                    buffer += memoryview(np.ascontiguousarray(a)).cast("B")
                    offset += a.nbytes
                    if len(buffer) >= limit:
                        drain()
            lines += (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        drain()
        index.resize((len(lines),))
        index[:] = np.frombuffer(lines, dtype=np.uint8)
        f.flush()


def write_cost(tmp: Path, rounds: int = ROUNDS) -> dict:
    records, untraced = _step_tensors(tmp)
    nbytes = sum(a.nbytes for _, arrays in records for a in arrays if a is not None)
    durable, buffered = [], []
    for i in range(rounds):
        for name, fn, out in (("durable", _durable, durable), ("buffered", _buffered, buffered))[::1 if i % 2 else -1]:
            os.sync()
            t0 = time.perf_counter()
            fn(tmp / f"{name}.h5", records)
            out.append(time.perf_counter() - t0)
    d, b = statistics.median(durable), statistics.median(buffered)
    return {"records": len(records), "tensor_mb": nbytes / 1e6, "untraced_step_ms": untraced * 1e3,
            "durable_ms": d * 1e3, "buffered_ms": b * 1e3, "durable_mb_s": nbytes / d / 1e6,
            "buffered_mb_s": nbytes / b / 1e6, "overhead_of_step": (d - b) / untraced}


def kills(tmp: Path, count: int = KILLS) -> list:
    from layerdiff.tracefile.reader import open_trace

    (tmp / "loop.py").write_text(LOOP)
    lost = []
    for i in range(count):
        trace, counter = tmp / f"k{i}.h5", tmp / f"k{i}.count"
        counter.write_bytes(b"\0" * 8)
        proc = subprocess.Popen([sys.executable, str(tmp / "loop.py"), str(trace), str(counter)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc.stdout.readline()
        time.sleep(0.1 + 0.3 * i)
        written = int.from_bytes(counter.read_bytes(), "little", signed=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with open_trace(trace) as reader:
            lost.append({"written_before_kill": written, "in_file": len(reader.records),
                         "lost": max(0, written - len(reader.records))})
    return lost


def _cost_words(cost: dict) -> str:
    """The crash-safe writer's cost over the buffered one, as a share of the untraced step; "none" when it is the
    faster of the two (a negative cost reads as a misprint)."""
    if cost["overhead_of_step"] <= 0:
        return (f"no cost (the crash-safe writer is {cost['buffered_ms'] / cost['durable_ms']:.1f}x faster than a "
                "buffered one)")
    return f"{100 * cost['overhead_of_step']:.1f}% of the untraced step"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, help=f"rounds of the write cost (default {ROUNDS}; --quick 3)")
    p.add_argument("--kills", type=int, help=f"traced loops to kill (default {KILLS}; --quick 3)")
    p.add_argument("--quick", action="store_true", help="3 rounds, 3 kills: checks the tool")
    p.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    args = p.parse_args(argv)
    run = benchlib.BenchRun("bench_crash", TITLE, METHOD, packages=("numpy", "torch", "h5py"))
    rounds = args.rounds or (3 if args.quick else ROUNDS)
    count = args.kills or (3 if args.quick else KILLS)
    with tempfile.TemporaryDirectory(prefix="layerdiff-crash-") as d:
        tmp = Path(d)
        cost = write_cost(tmp, rounds)
        print(f"one full traced step: {cost['records']} records, {cost['tensor_mb']:.0f} MB of tensors; "
              f"untraced step {cost['untraced_step_ms']:.1f} ms")
        print(f"  crash-safe writer (straight into reserved chunks): {cost['durable_ms']:.1f} ms "
              f"({cost['durable_mb_s']:.0f} MB/s)")
        print(f"  buffered writer, one flush at the end (no crash safety): {cost['buffered_ms']:.1f} ms "
              f"({cost['buffered_mb_s']:.0f} MB/s)")
        print(f"  crash safety: {_cost_words(cost)}")
        lost = kills(tmp, count)
        print(f"{count} SIGKILLs at spread-out moments: records lost per kill "
              f"{[entry['lost'] for entry in lost]} (records in the file: {[e['in_file'] for e in lost]})")
    if args.json:
        total_lost = sum(entry["lost"] for entry in lost)
        rows = [["untraced step", f"{cost['untraced_step_ms']:.1f} ms"],
                ["crash-safe writer (straight into reserved chunks)",
                 f"{cost['durable_ms']:.1f} ms ({cost['durable_mb_s']:.0f} MB/s)"],
                ["buffered writer, one flush at the end (no crash safety)",
                 f"{cost['buffered_ms']:.1f} ms ({cost['buffered_mb_s']:.0f} MB/s)"],
                ["crash safety's cost", _cost_words(cost)]]
        kill_rows = [[str(i + 1), str(e["written_before_kill"]), str(e["in_file"]), str(e["lost"])]
                     for i, e in enumerate(lost)]
        run.write(args.json, quick=args.quick or rounds < ROUNDS or count < KILLS,
                  headline=f"crash safety: {_cost_words(cost)}; "
                           f"{total_lost} records lost in {count} kills",
                  tables=[benchlib.table("Write cost of one full traced step", ["measure", "value"], rows,
                                         f"{cost['records']} records, {cost['tensor_mb']:.0f} MB of tensors; "
                                         f"median of {rounds} rounds."),
                          benchlib.table("SIGKILLs at spread-out moments",
                                         ["kill", "records written before the kill", "records in the file",
                                          "records lost"], kill_rows)],
                  results={"rounds": rounds, "write_cost": cost, "kills": lost, "records_lost": total_lost})
    return 0


if __name__ == "__main__":
    sys.exit(main())
