"""Stored tensors compared in worker processes: align's arithmetic on every core.

One core compares ~1.5-2 GB/s per side, so aligning two full traces of a 0.5B model (4 GB each) takes seconds,
and a larger model's, minutes. The tensor pairs that are compared straight from their stored bytes are cut into
slices (``SLICE_BYTES`` a side) and handed out, a few at a time, to ``python -m layerdiff.compare.workers``
processes over their standard input and output (one JSON line each way). A worker reads its slices through
``MappedData`` (the trace file mapped at the chunk addresses HDF5 reported: no HDF5, no index), verifies them
against the tensor's checksums (sent with the slice) and sends back the slice's running sums
(``DataAccumulator.state``), or that its bytes are damaged; the parent merges them per pair, in any order.

Processes of our own, not ``multiprocessing``: the caller's ``__main__`` is never imported again (a script
without a main guard would run twice) and no process that may hold threads (a progress bar's) is forked.
If a worker cannot start or fails, the caller compares in-process, as without workers.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional, cast

from layerdiff.compare.metrics import CHUNK_ELEMS, DataAccumulator, accumulate
from layerdiff.schema import Metrics
from layerdiff.tracefile.checksums import DamagedTensorError, TensorCheck
from layerdiff.tracefile.chunks import DataLocation, MappedData
from layerdiff.tracefile.tensors import storage_dtype

SLICE_BYTES = 32 << 20  # per side: small enough to share out evenly, large enough that a line costs nothing
MIN_BYTES = 512 << 20  # per side: below it, starting the workers (~0.25 s) costs more than two cores save
IN_FLIGHT = 2  # slices sent ahead to each worker, so it never waits for the parent


@dataclass(frozen=True)
class StoredPair:
    """Two stored tensors with the same number of elements, compared element by element; ``check_a``/``check_b``:
    what verifies the bytes of the tensor each belongs to (its checksums; None: none recorded)."""
    location_a: DataLocation
    offset_a: int
    dtype_a: str
    location_b: DataLocation
    offset_b: int
    dtype_b: str
    numel: int
    check_a: Optional[TensorCheck] = None
    check_b: Optional[TensorCheck] = None

    def nbytes(self) -> int:
        return self.numel * (storage_dtype(self.dtype_a).itemsize + storage_dtype(self.dtype_b).itemsize)


def aligned_pairs(segments_a: list, dtype_a: str, segments_b: list, dtype_b: str) -> list[StoredPair]:
    """The ``StoredPair``s that compare two tensors stored in segments (``data_segments``: (location, byte offset,
    elements[, TensorCheck]); a run of ranks keeps its shards in one file each), cut where either side's segment
    ends; [] if their element counts differ."""
    queue_a, queue_b = [_segment(s) for s in segments_a], [_segment(s) for s in segments_b]
    if sum(s[2] for s in queue_a) != sum(s[2] for s in queue_b):
        return []
    size_a, size_b = storage_dtype(dtype_a).itemsize, storage_dtype(dtype_b).itemsize
    out = []
    while queue_a and queue_b:
        (loc_a, off_a, n_a, check_a), (loc_b, off_b, n_b, check_b) = queue_a[0], queue_b[0]
        n = min(n_a, n_b)
        if n:
            out.append(StoredPair(loc_a, off_a, dtype_a, loc_b, off_b, dtype_b, n, check_a, check_b))
        queue_a[0] = (loc_a, off_a + n * size_a, n_a - n, check_a)
        queue_b[0] = (loc_b, off_b + n * size_b, n_b - n, check_b)
        for queue in (queue_a, queue_b):
            if queue[0][2] == 0:
                queue.pop(0)
    return out


def _segment(segment: tuple) -> tuple:
    """A segment as (location, offset, elements, check): one without a check has none."""
    return (*segment, None) if len(segment) == 3 else tuple(segment)


def worker_count(requested: int | None) -> int:
    """``requested`` processes, or one per core this process may run on (at most 8) when None."""
    if requested is not None:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))  # a container's or taskset's share, not the machine's
    except AttributeError:  # no affinity call on this system
        cores = os.cpu_count() or 1
    return min(cores, 8)


def compare_pairs(pairs: list[StoredPair], workers: int, progress=None, slice_bytes: int = SLICE_BYTES,
                  groups: list[int] | None = None) -> list[Metrics] | None:
    """``compare_data``'s metrics of each pair, in order, computed by up to ``workers`` processes; None when they
    could not start or one failed (the caller then compares in-process). ``groups``: the result each pair's sums
    go to (the pieces of one comparison, from ``aligned_pairs``); one result per pair when None.
    ``progress.advance`` gets the bytes of each slice compared (both sides)."""
    groups = list(range(len(pairs))) if groups is None else groups
    locations = sorted({p.location_a for p in pairs} | {p.location_b for p in pairs}, key=lambda loc: loc.path)
    index = {loc: i for i, loc in enumerate(locations)}
    slices: list = []
    for n, pair in enumerate(pairs):
        widest = max(storage_dtype(pair.dtype_a).itemsize, storage_dtype(pair.dtype_b).itemsize)
        step = max(slice_bytes // widest // CHUNK_ELEMS, 1) * CHUNK_ELEMS  # the blocks an in-process pass sums
        for first in range(0, pair.numel, step):
            count = min(step, pair.numel - first)
            sides = [[index[location], offset, dtype, _check(check, offset, first, count, dtype)]
                     for location, offset, dtype, check in ((pair.location_a, pair.offset_a, pair.dtype_a, pair.check_a),
                                                            (pair.location_b, pair.offset_b, pair.dtype_b, pair.check_b))]
            slices.append((n, {"id": len(slices), "a": sides[0], "b": sides[1], "first": first, "count": count},
                           pair.nbytes() * count // max(pair.numel, 1)))
    sums = [DataAccumulator() for _ in range(max(groups, default=-1) + 1)]
    damaged: dict[int, str] = {}
    header = json.dumps({"locations": [[loc.path, loc.chunk, list(loc.addresses)] for loc in locations]})
    pool = _Pool(min(workers, len(slices)), header)
    try:
        for n, done, nbytes in pool.run(slices):
            if "damaged" in done:  # the slice's bytes did not match their checksums: the comparison is not used
                damaged.setdefault(groups[n], done["damaged"])
            else:
                sums[groups[n]].merge(DataAccumulator.from_state(done["state"]))
            if progress is not None:
                progress.advance(nbytes)
    except _WorkerFailed:
        return None
    finally:
        pool.close()
    return [{"damaged": damaged[n]} if n in damaged else acc.result() for n, acc in enumerate(sums)]


def _check(check: Optional[TensorCheck], offset: int, first: int, count: int, dtype: str) -> list | None:
    """What verifies a slice, as a worker receives it: the checksums of the tensor's blocks that it touches."""
    if check is None:
        return None
    size = storage_dtype(dtype).itemsize
    return check.around(offset + first * size, count * size).as_list()


class _WorkerFailed(Exception):
    pass


class _Pool:
    """Worker processes fed slices as they finish earlier ones."""

    def __init__(self, size: int, header: str):
        self.procs = []
        self.selector = selectors.DefaultSelector()
        try:
            package_root = str(Path(__file__).resolve().parents[2])  # this very layerdiff, installed or not
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                            os.environ.get("PYTHONPATH")]))}
            for _ in range(size):
                proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
                self.procs.append(proc)
                self._send(proc, header)
                self.selector.register(cast(IO[bytes], proc.stdout), selectors.EVENT_READ, proc)  # PIPE: set
        except OSError:
            self.close()
            raise _WorkerFailed from None

    @staticmethod
    def _send(proc, line: str):
        try:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            raise _WorkerFailed from None

    def run(self, slices):
        """Yield (pair number, slice sums, slice bytes) as workers finish slices."""
        todo = list(reversed(slices))
        owner = {}  # slice id -> (pair number, bytes)
        pending = {proc.pid: 0 for proc in self.procs}
        buffers = {proc.pid: b"" for proc in self.procs}

        def feed(proc):
            while todo and pending[proc.pid] < IN_FLIGHT:
                n, task, nbytes = todo.pop()
                owner[task["id"]] = (n, nbytes)
                self._send(proc, json.dumps(task))
                pending[proc.pid] += 1

        for proc in self.procs:
            feed(proc)
        while owner:
            for key, _ in self.selector.select():
                proc = key.data
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:  # the worker died
                    raise _WorkerFailed
                *lines, buffers[proc.pid] = (buffers[proc.pid] + chunk).split(b"\n")
                for line in lines:
                    try:
                        done = json.loads(line)
                        n, nbytes = owner.pop(done["id"])
                    except (ValueError, KeyError, TypeError):  # not a line this protocol writes
                        raise _WorkerFailed from None
                    pending[proc.pid] -= 1
                    yield n, done, nbytes
                feed(proc)

    def close(self):
        for proc in self.procs:
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.selector.close()


def main():
    """A worker: the trace locations on the first line, then one slice per line; one line of sums per slice."""
    lines = sys.stdin.buffer
    header = json.loads(lines.readline())
    data = [MappedData(DataLocation(path, chunk, tuple(addresses))) for path, chunk, addresses in header["locations"]]
    out = sys.stdout.buffer
    for line in lines:
        task = json.loads(line)
        (la, oa, da, ca), (lb, ob, db, cb) = task["a"], task["b"]
        first, count = task["first"], task["count"]
        try:
            acc = accumulate(data[la].pieces(oa, first, count, da, CHUNK_ELEMS, TensorCheck.from_list(ca)),
                             data[lb].pieces(ob, first, count, db, CHUNK_ELEMS, TensorCheck.from_list(cb)), da, db)
            done = {"id": task["id"], "state": acc.state()}
        except DamagedTensorError as exc:
            side, loc = ("a", la) if _is_damaged(data[la], oa, first, count, da, ca) else ("b", lb)
            done = {"id": task["id"], "damaged": f"{side.upper()} ({header['locations'][loc][0]}): {exc}"}
        out.write(json.dumps(done).encode() + b"\n")  # json: keeps inf/nan
        out.flush()
    for mapped in data:
        mapped.close()


def _is_damaged(data: MappedData, offset: int, first: int, count: int, dtype: str, check) -> bool:
    """Whether one side's slice fails its checksums (which side a failed comparison's damage is on)."""
    try:
        for _ in data.pieces(offset, first, count, dtype, CHUNK_ELEMS, TensorCheck.from_list(check)):
            pass
    except DamagedTensorError:
        return True
    return False


if __name__ == "__main__":
    main()
