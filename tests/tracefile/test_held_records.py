"""Records held by the writer and written together (``held_records``, no framework): the same file as records
written one at a time, at most that many held, none held past the flush interval even while the program waits,
and none lost to an exception or a normal exit."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from layerdiff.capture.options import HELD_RECORDS, TraceOptions
from layerdiff.tracefile.reader import open_trace
from layerdiff.tracefile.writer import TraceWriter

VALUES = np.random.default_rng(3).standard_normal(4096, dtype=np.float32)


def _record(writer: TraceWriter, i: int, store: bool) -> dict:
    entry = writer.write_tensor(VALUES[:100 + 37 * i], "float32", store_data=store)
    return {"kind": "param", "path": f"p{i}", "module": "", "call": 0, "step": 0, "seq": i,
            "tensors": [{**entry, "role": "param", "key": "value"}]}


@pytest.mark.parametrize("options", [{}, {"compression": "lzf"}, {"write_behind": 1 << 20}])
def test_held_records_make_the_file_records_written_one_at_a_time_make(tmp_path, options):
    written = []
    for name, held in (("each.h5", 0), ("held.h5", 5)):
        writer = TraceWriter(tmp_path / name, {"case": "held"}, held_records=held, flush_interval=60, **options)
        counts = []
        for i in range(23):
            writer.write_record(_record(writer, i, store=True))
            counts.append(writer.records_written)
        writer.close({"kind": "end", "status": "complete"})
        written.append(counts)
        assert writer.records_written == 24 and writer.records_handed == 24
    if not options:  # inline: a record is in the file when handed, or with the fifth held
        assert written[0] == list(range(1, 24))
        assert written[1] == [(i + 1) // 5 * 5 for i in range(23)]
    with open_trace(tmp_path / "each.h5") as each, open_trace(tmp_path / "held.h5") as held:
        assert each.records == held.records and len(held.records) == 23 and not held.damage
        for rec in held.records:
            assert np.array_equal(held.tensor(rec.tensors[0]), VALUES[:100 + 37 * int(rec.path[1:])])


def _program(flush_interval: float, then: str) -> str:
    """A program that opens a writer holding up to 1000 records, hands it three (p0, p1, p2), then runs ``then``."""
    return f"""
import os, sys, time
import numpy as np
from layerdiff.tracefile.writer import TraceWriter

writer = TraceWriter(sys.argv[1], {{"case": "held"}}, held_records=1000, flush_interval={flush_interval})
for i in range(3):
    entry = writer.write_tensor(np.full(10, i, dtype=np.float32), "float32", store_data=False)
    writer.write_record({{"kind": "param", "path": f"p{{i}}", "module": "", "call": 0, "step": 0, "seq": i,
                         "tensors": [{{**entry, "role": "param", "key": "value"}}]}})
{then}"""


HANG = _program(0.2, """
print(writer.records_written, flush=True)
time.sleep(600)  # a hang: no record is handed over again
""")


def _records_in(path) -> int:
    """The records a trace still being written holds now (it reads as a crashed one)."""
    with open_trace(path) as reader:
        return len(reader.records)


def test_records_held_past_the_flush_interval_reach_the_file_while_the_program_hangs(tmp_path):
    """The program stops handing records over (a hang) and is then killed outright: the records it had handed
    were written by the writer's timer meanwhile."""
    path = tmp_path / "hang.h5"
    proc = subprocess.Popen([sys.executable, "-c", HANG, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "0"  # held when handed: 3 of at most 1000
        deadline = time.monotonic() + 60  # the timer writes them 0.2 s on; a loaded machine may take longer
        while time.monotonic() < deadline and _records_in(path) < 3:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with open_trace(path) as reader:
        assert reader.crashed and [r.path for r in reader.records] == ["p0", "p1", "p2"]
        assert [r.tensors[0].stats["max"] for r in reader.records] == [0.0, 1.0, 2.0]


RAISE = _program(60, """
try:
    raise ValueError("the model failed")
finally:
    writer.close({"kind": "end", "status": "error"})
""")


def test_an_exception_loses_no_record_held(tmp_path):
    path = tmp_path / "raise.h5"
    proc = subprocess.run([sys.executable, "-c", RAISE, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the model failed" in proc.stderr
    with open_trace(path) as reader:
        assert not reader.crashed and [r.path for r in reader.records] == ["p0", "p1", "p2"]


UNCLOSED = _program(60, """
print(writer.records_written)
""")


def test_a_program_that_ends_without_closing_the_trace_writes_what_it_held(tmp_path):
    path = tmp_path / "unclosed.h5"
    proc = subprocess.run([sys.executable, "-c", UNCLOSED, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr
    with open_trace(path) as reader:
        assert reader.crashed and [r.path for r in reader.records] == ["p0", "p1", "p2"]


FORKED = _program(60, """
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a child ending normally: its exit runs the handlers it inherited
os.waitpid(pid, 0)
print(os.path.getsize(sys.argv[1]), writer.records_written, flush=True)
os._exit(0)  # the parent killed without its exit handlers: what the child wrote shows
""")


def test_a_forked_child_that_exits_writes_none_of_the_records_its_parent_held(tmp_path):
    path = tmp_path / "forked.h5"
    proc = subprocess.run([sys.executable, "-c", FORKED, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split()[1] == "0", proc.stderr
    with open_trace(path) as reader:
        assert reader.crashed and reader.records == [] and not reader.damage


def test_what_holds_records_and_what_writes_each_at_once():
    assert TraceOptions(mode="stats").held_records == HELD_RECORDS
    assert TraceOptions(mode="full").held_records == HELD_RECORDS
    assert TraceOptions(mode="stats", write_behind=0).held_records == 0  # for hunting a crash: each in the file
    assert TraceOptions(mode="full", flush_interval=0).held_records == 0


def test_a_flush_interval_of_zero_holds_nothing(tmp_path):
    writer = TraceWriter(tmp_path / "t.h5", {"case": "zero"}, held_records=100, flush_interval=0)
    writer.write_record(_record(writer, 0, store=False))
    assert writer.records_written == 1
    writer.close({"kind": "end", "status": "complete"})
