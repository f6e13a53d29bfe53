"""Stored tensors compared by workers: align's arithmetic on every core, or on a Dask cluster's workers.

One core compares ~1.5-2 GB/s per side, so aligning two full traces of a 0.5B model (4 GB each) takes seconds,
and a larger model's, minutes. The tensor pairs that are compared straight from their stored bytes are cut into
slices (``SLICE_BYTES`` a side; small tensors' slices gathered into tasks of about that size) and handed to a
``TaskPool`` (``compare.tasks``: processes of this machine or a Dask cluster). A worker reads its slices through
``MappedData`` (the trace file mapped at the chunk addresses HDF5 reported, which the task carries: no HDF5, no
index), verifies them against the tensor's checksums (the blocks a slice touches, sent with it) and sends back each
slice's running sums (``DataAccumulator.state``), or that its bytes are damaged; the parent merges them per pair in
slice order, so the metrics are the same wherever the slices ran, bit for bit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from layerdiff.compare.metrics import CHUNK_ELEMS, DataAccumulator, accumulate
from layerdiff.compare.tasks import TaskPool
from layerdiff.schema import Metrics
from layerdiff.tracefile.checksums import DamagedTensorError, TensorCheck
from layerdiff.tracefile.chunks import DataLocation, MappedData
from layerdiff.tracefile.tensors import storage_dtype

SLICE_BYTES = 32 << 20  # per side: small enough to share out evenly, large enough that a line costs nothing


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


@dataclass
class PairResults:
    """``compare_pairs``' answer: the metrics of each result (None where a slice of it could not be compared;
    ``{"damaged": why}`` where a slice's bytes failed their checksums) and why each missing one is missing."""

    metrics: list[Metrics | None]
    failed: dict[int, str]


def _segment(segment: tuple) -> tuple:
    """A segment as (location, offset, elements, check): one without a check has none."""
    return (*segment, None) if len(segment) == 3 else tuple(segment)


def compare_pairs(pairs: list[StoredPair], pool: TaskPool, progress=None, slice_bytes: int = SLICE_BYTES,
                  groups: list[int] | None = None) -> PairResults:
    """``compare_data``'s metrics of each pair, in order, computed by ``pool``'s workers. ``groups``: the result
    each pair's sums go to (the pieces of one comparison, from ``aligned_pairs``); one result per pair when None.
    ``progress.advance`` gets the bytes of each task compared (both sides) as it finishes."""
    groups = list(range(len(pairs))) if groups is None else groups
    slices: list[tuple[int, StoredPair, int, int, int]] = []  # (pair, the pair, first element, count, bytes)
    for n, pair in enumerate(pairs):
        widest = max(storage_dtype(pair.dtype_a).itemsize, storage_dtype(pair.dtype_b).itemsize)
        step = max(slice_bytes // widest // CHUNK_ELEMS, 1) * CHUNK_ELEMS  # the blocks an in-process pass sums
        for first in range(0, pair.numel, step):
            count = min(step, pair.numel - first)
            slices.append((n, pair, first, count, pair.nbytes() * count // max(pair.numel, 1)))
    tasks = _tasks(slices, slice_bytes)
    jobs = [slices_job([slices[s] for s in task]) for task in tasks]
    weights = [sum(slices[s][4] for s in task) for task in tasks]
    done = pool.map(compare_slices, None, jobs,
                    progress=None if progress is None else lambda i: progress.advance(weights[i]))
    states: list[Any] = [None] * len(slices)
    for task, result in zip(tasks, done.results):
        for s, state in zip(task, result or [None] * len(task)):
            states[s] = state
    sums: list[DataAccumulator | None] = [DataAccumulator() for _ in range(max(groups, default=-1) + 1)]
    failed: dict[int, str] = {}
    damaged: dict[int, str] = {}
    for t, reason in done.failed.items():
        for s in tasks[t]:
            failed.setdefault(groups[slices[s][0]], reason)
    for s, state in enumerate(states):  # in slice order: the same sums wherever and whenever each slice ran
        group = groups[slices[s][0]]
        acc = sums[group]
        if isinstance(state, dict) and "damaged" in state:  # its bytes failed their checksums: not compared
            damaged.setdefault(group, state["damaged"])
        elif group in failed or acc is None:
            sums[group] = None
        else:
            acc.merge(DataAccumulator.from_state(state))
    return PairResults([{"damaged": damaged[n]} if n in damaged else None if acc is None else acc.result()
                        for n, acc in enumerate(sums)], failed)


def _tasks(slices: list, slice_bytes: int) -> list[list[int]]:
    """Slices gathered, in order, into tasks of about ``slice_bytes`` a side: a slice of a large tensor is a task
    of its own, a small model's tensors share one (a task costs ~1 ms on a cluster, a slice of 32 MB ~20 ms)."""
    tasks: list[list[int]] = []
    size = 0
    for s, (_, _, _, _, nbytes) in enumerate(slices):
        if not tasks or size + nbytes > 2 * slice_bytes:
            tasks.append([])
            size = 0
        tasks[-1].append(s)
        size += nbytes
    return tasks


def slices_job(slices: list) -> dict:
    """A task as plain data: the files its slices read (absolute paths, and the addresses of only the chunks they
    touch) and the slices, each (file, offset, dtype) of A and of B, first element and count."""
    files: dict[tuple[str, int], dict[int, int]] = {}
    out = []
    for _, pair, first, count, _ in slices:
        sides = []
        for location, offset, dtype, check in ((pair.location_a, pair.offset_a, pair.dtype_a, pair.check_a),
                                               (pair.location_b, pair.offset_b, pair.dtype_b, pair.check_b)):
            itemsize = storage_dtype(dtype).itemsize
            key = (os.path.abspath(location.path), location.chunk)
            files.setdefault(key, {}).update(location.chunks_of(offset + first * itemsize, count * itemsize))
            sides.append([list(files).index(key), offset, dtype, _check(check, offset, first, count, dtype)])
        out.append([*sides[0], *sides[1], first, count])
    return {"files": [[path, chunk, sorted(chunks.items())] for (path, chunk), chunks in files.items()],
            "slices": out}


def compare_slices(_shared: Any, job: dict) -> list[dict]:
    """A task, where it runs: the running sums of each slice of ``job`` (``slices_job``), in order, each slice
    verified against its checksums as it is read (``{"damaged": why}`` where it fails them)."""
    data = [MappedData(path, chunk, {int(i): int(address) for i, address in chunks})
            for path, chunk, chunks in job["files"]]
    try:
        out = []
        for file_a, offset_a, dtype_a, check_a, file_b, offset_b, dtype_b, check_b, first, count in job["slices"]:
            try:
                acc = accumulate(
                    data[file_a].pieces(offset_a, first, count, dtype_a, CHUNK_ELEMS, TensorCheck.from_list(check_a)),
                    data[file_b].pieces(offset_b, first, count, dtype_b, CHUNK_ELEMS, TensorCheck.from_list(check_b)),
                    dtype_a, dtype_b)
                out.append(acc.state())
            except DamagedTensorError as exc:
                side, file = ("A", file_a) if _is_damaged(data[file_a], offset_a, first, count, dtype_a, check_a) \
                    else ("B", file_b)
                out.append({"damaged": f"{side} ({job['files'][file][0]}): {exc}"})
        return out
    finally:
        for mapped in data:
            mapped.close()


def _check(check: Optional[TensorCheck], offset: int, first: int, count: int, dtype: str) -> list | None:
    """What verifies a slice, as a worker receives it: the checksums of the tensor's blocks that it touches."""
    if check is None:
        return None
    size = storage_dtype(dtype).itemsize
    return check.around(offset + first * size, count * size).as_list()


def _is_damaged(data: MappedData, offset: int, first: int, count: int, dtype: str, check) -> bool:
    """Whether one side's slice fails its checksums (which side a failed comparison's damage is on)."""
    try:
        for _ in data.pieces(offset, first, count, dtype, CHUNK_ELEMS, TensorCheck.from_list(check)):
            pass
    except DamagedTensorError:
        return True
    return False
