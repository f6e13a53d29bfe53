"""A trace killed at any moment stays an HDF5 file that plain h5py opens and reads whole (no framework).

The framework-free writer (``TraceWriter``) writes records with tensors of varied sizes, so that both arrays'
reserves grow many times; a forked child is SIGKILLed at 160 kill points: at seeded random moments of the
run (inside HDF5's own calls too: its flushes, its growth of the file) and at every N-th line the writer's own
code runs (a kill from inside, deterministic: between growing a dataset and flushing it, between a tensor's
bytes and the line that points at them). Every file left must open in plain h5py, its index and data read
whole, and layerdiff must read every record the child had counted as written, undamaged.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from layerdiff.tracefile import writer
from layerdiff.tracefile.reader import open_trace


def _from_source():
    """``TraceWriter`` as its source runs: the kills at its lines need lines to run, and a build that compiled the
    writer (``layerdiff/native.py``) runs none."""
    spec = importlib.util.spec_from_file_location("kill_points_writer", Path(writer.__file__).with_name("writer.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.TraceWriter


TraceWriter = _from_source()

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")]

MODES = {"inline": {}, "behind": {"write_behind": 1 << 20}, "lzf": {"compression": "lzf", "flush_interval": 0.002},
         "held": {"held_records": 4}}
# (at random moments, at lines): inline, write-behind and lzf are also killed before each of their writes, every one
# (``test_kill_before_writes``), which is where a kill can leave a different file; 55 and 30 each before that test
KILLS = {"inline": (25, 15), "behind": (25, 15), "lzf": (25, 15), "held": (25, 15)}
RECORDS = 30
FINISHED = 1 << 40  # what the counter says once the trace is closed
VALUES = np.random.default_rng(7).standard_normal(60_000, dtype=np.float32)


def write_workload(path: Path, counter: mmap.mmap, mode: str):
    """The child's run: records with tensors of 4 to 240 KB and index lines of up to 20 KB (both reserves grow);
    the counter says how many records are in the file (-1: none yet, the file not published)."""
    writer = TraceWriter(path, {"case": "kill points", "mode": mode}, **MODES[mode])
    counter[:8] = struct.pack("q", 0)
    rng = np.random.default_rng(7)
    for i in range(RECORDS):
        entry = writer.write_tensor(VALUES[:int(rng.integers(1_000, 60_000))], "float32", store_data=True)
        writer.write_record({"kind": "param", "path": f"layer{i}.weight", "module": "m" * int(rng.integers(0, 20_000)),
                             "call": 0, "step": 0, "seq": i, "tensors": [{**entry, "role": "param", "key": "value"}]})
        counter[:8] = struct.pack("q", writer.records_written)
    writer.close({"kind": "end", "status": "complete"})
    counter[:8] = struct.pack("q", FINISHED)


def _line_tracer(on_line):
    """A trace function calling ``on_line(n)`` at the n-th line the writer's modules run (any thread)."""
    seen = [0]
    here = str(Path(writer.__file__).parent)

    def tracer(frame, event, arg):
        if here not in frame.f_code.co_filename:
            return None
        if event == "line":
            seen[0] += 1
            on_line(seen[0])
        return tracer

    return tracer


def _kill_at(line: int):
    def on_line(n: int):
        if n >= line:
            os.kill(os.getpid(), signal.SIGKILL)

    return _line_tracer(on_line)


def _run(path: Path, mode: str, *, delay: float | None = None, tracer=None) -> int:
    """Fork a child that writes the trace; kill it after ``delay`` seconds, or let ``tracer`` (``_kill_at``) kill
    it from inside. Returns the child's counter at its death."""
    counter = mmap.mmap(-1, 8)  # shared with the child
    counter[:8] = struct.pack("q", -1)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            if tracer is not None:
                import threading

                threading.settrace(tracer)
                sys.settrace(tracer)
            write_workload(path, counter, mode)
        finally:
            os._exit(0)
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return struct.unpack("q", counter[:8])[0]


def check_left_trace(path: Path, written: int) -> str:
    """The file a killed writer left: plain h5py opens it and reads both arrays whole; layerdiff reads every record
    counted, undamaged, each tensor matching its checksums. Returns what was found ("none", "partial", "whole")."""
    if not path.exists():
        assert written == -1, f"{path}: the child counted {written} records, but left no file"
        return "none"
    with h5py.File(path, "r") as f:  # plain h5py, HDF5's own file locking and all
        assert f.attrs["format"] == "layerdiff-trace"
        index, data = f["index"][:], f["data"][:]
        assert index.dtype == np.uint8 and data.dtype == np.uint8
    with open_trace(path) as reader:
        assert not reader.damage, [d.describe() for d in reader.damage]
        assert len(reader.records) >= min(written, RECORDS), (len(reader.records), written)
        assert [r.path for r in reader.records] == [f"layer{i}.weight" for i in range(len(reader.records))]
        for record in reader.records:
            reader.tensor(record.tensors[0])
        if written == FINISHED:
            assert reader.end is not None and not reader.crashed and len(reader.records) == RECORDS
    return "whole" if written == FINISHED else "partial"


def _line_count(tmp: Path, mode: str) -> int:
    """How many lines of the writer's modules one whole run executes (its deterministic kill points)."""
    counted = mmap.mmap(-1, 8)  # shared with the child
    _run(tmp / f"count-{mode}.h5", mode, tracer=_line_tracer(lambda n: counted.__setitem__(slice(0, 8),
                                                                                         struct.pack("q", n))))
    return struct.unpack("q", counted[:8])[0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_killed_trace_opens_in_plain_h5py(tmp_path, mode):
    rng = random.Random(f"kill points {mode}")
    start = time.perf_counter()
    _run(tmp_path / "timing.h5", mode)
    duration = time.perf_counter() - start
    lines = _line_count(tmp_path, mode)
    found = []
    # at seeded random moments (inside HDF5's calls too) and at every N-th line of the writer's own code
    moments, at_lines = KILLS[mode]
    points = [("delay", rng.uniform(0, duration)) for _ in range(moments)] + \
             [("line", 1 + n * lines // at_lines) for n in range(at_lines)]
    for n, (how, where) in enumerate(points):
        path = tmp_path / f"k{n}.h5"
        written = _run(path, mode, delay=where if how == "delay" else None,
                       tracer=_kill_at(where) if how == "line" else None)
        found.append(check_left_trace(path, written))
        path.unlink(missing_ok=True)
    partial = sorted(p.name for p in tmp_path.glob(".*.partial"))
    print(f"{mode}: {len(points)} kill points, {found.count('partial')} traces cut short, {found.count('whole')} "
          f"finished, {found.count('none')} killed before the trace existed ({len(partial)} hidden partial files)")
    assert len(points) == sum(KILLS[mode]) and found.count("partial") >= len(points) // 3


def test_the_kill_points_are_160():
    assert sum(sum(kills) for kills in KILLS.values()) >= 160
