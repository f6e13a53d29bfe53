"""Steps run as microbatches, read as one call per module per step.

Under a pipeline schedule (Megatron's ``get_forward_backward_func()``) one step runs the model once per
microbatch: every module is called M times in the step, on M slices of the batch, and each parameter's gradient
arrives once per microbatch. The tracer marks those calls with their microbatch (``CallRecord.micro``). Compared
with a run that took the whole batch in one call, the M calls of a module are one call whose tensors are joined
along the batch axis (which axis, the other run's shape decides, as for a run of ranks:
``compare.per_rank.resolve``), and a parameter's gradients are the step's: the last running total, or the sum of
the increments (``ParamRecord.increment``: Megatron's DistributedDataParallel adds each microbatch's gradient
into its own buffer). Two runs with the same microbatches are compared call by call, unjoined.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from msgspec.structs import replace

from layerdiff.match.joins import alike, batch_axis, scalar_loss, token_shapes
from layerdiff.match.operands import combine_stats, scaled_stats, scaled_values, summed_stats, unknown_stats
from layerdiff.tracefile.records import (MICROBATCHES, CallRecord, Merge, OpRecord, ParamRecord, Producer, Record,
                                        TensorEntry)
from layerdiff.tracefile.tensors import as_float, encode_float


def microbatch_counts(records: list[Record]) -> dict[int, int]:
    """{step: number of microbatches} of the steps run as microbatches."""
    counts: dict[int, int] = {}
    for rec in records:
        if isinstance(rec, CallRecord) and rec.micro is not None:
            counts[rec.step] = max(counts.get(rec.step, 0), rec.micro + 1)
    return counts


def joined_pair(reader_a: Any, reader_b: Any) -> tuple[Any, Any]:
    """The two readers as they compare: a run whose steps ran as microbatches and the other run did not (or in
    other microbatches) is read with its microbatches joined; two runs alike are left as they are."""
    counts = [microbatch_counts(r.records) for r in (reader_a, reader_b)]
    if counts[0] == counts[1]:
        return reader_a, reader_b
    return tuple(Joined(r) if any(m > 1 for m in c.values()) else r  # type: ignore[return-value]
                 for r, c in zip((reader_a, reader_b), counts))


class Joined:
    """A reader (a trace, or a run of ranks) whose microbatched steps read as one call per module per step (see
    the module docstring); the joined tensors are read from the wrapped reader, part by part."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.path: Path = inner.path
        self.meta = {**inner.meta, "microbatches_joined": True}
        self.crashed, self.end = inner.crashed, inner.end
        self.damage, self.unverified = inner.damage, inner.unverified  # checksums: what reading it found
        # each microbatch's gradients times this are its share of the step's (``ParallelLayout``; None: as they are)
        self._grad_scale: float | None = (inner.meta.get("parallel") or {}).get("microbatch_grad_scale")
        self._next_offset = min([0, *(t.offset for rec in inner.records for t in rec.tensors
                                      if t.offset is not None)]) - 1
        self._renumbered: dict[tuple, int] = {}  # (phase, path, original call) -> joined call
        self._counts: dict[int, int] = {}  # step -> its microbatches (``microbatch_counts``)
        self.records = self._join(inner.records)
        self.ops = self._join_ops(inner.ops)  # each operation of a module's k-th call, over the microbatches

    # -- joining ------------------------------------------------------------------------------------------
    def _join(self, records: list[Record]) -> list[Record]:
        counts = self._counts = microbatch_counts(records)
        groups: dict[tuple, list[Record]] = {}
        order: list[tuple] = []
        seen_in_micro: dict[tuple, int] = {}
        for rec in records:
            key = self._group_key(rec, counts, seen_in_micro)
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append(rec)
        self._tokens = token_shapes(records)
        self._loss_grads = _loss_gradients(records)
        calls: dict[tuple, int] = {}  # (kind, phase, path) -> joined calls so far
        renumbered = self._renumbered
        joined: list[Record] = []
        for key in order:
            parts = groups[key]
            first = parts[0]
            count_key = (first.kind, first.phase, first.path)
            call = calls.get(count_key, 0)
            calls[count_key] = call + 1
            for part in parts:
                if isinstance(part, CallRecord):
                    renumbered[(part.phase, part.path, part.call)] = call
            made = self._joined_record(parts, call)
            assert not isinstance(made, OpRecord)
            joined.append(made)
        return [self._reparented(rec, renumbered) for rec in joined]

    def _join_ops(self, ops: list[OpRecord]) -> list[OpRecord]:
        """The operations of the joined calls: the ``index``-th operation of a module's k-th call in each microbatch,
        joined as that call's tensors are (its producers pointing at the joined calls)."""
        groups: dict[tuple, tuple[int, list[OpRecord]]] = {}  # -> (the joined call, the parts)
        for op in ops:
            call = self._renumbered.get(("forward", op.path, op.call)) \
                if op.micro is not None and self._counts.get(op.step, 1) > 1 else None
            key: tuple = ("own", id(op)) if call is None else (op.step, op.phase, op.path, call, op.index)
            groups.setdefault(key, (op.call if call is None else call, []))[1].append(op)
        out: list[OpRecord] = []
        for call, parts in groups.values():
            joined = self._joined_record(parts, call)
            assert isinstance(joined, OpRecord)
            producers = joined.producers and {name: self._renumbered_producer(producer)
                                              for name, producer in joined.producers.items()}
            out.append(replace(joined, micro=None, producers=producers))
        return out

    def _renumbered_producer(self, producer: Producer) -> Producer:
        """A producer that names a module call (a child's, an enclosing one's) under the joined call's number."""
        if producer.kind not in ("call", "outer") or producer.call is None:
            return producer
        return replace(producer, call=self._renumbered.get(("forward", producer.path, producer.call), producer.call))

    @staticmethod
    def _group_key(rec: Record, counts: dict[int, int], seen: dict[tuple, int]) -> tuple:
        """Records of one step that join: a module's k-th call in each microbatch; a parameter's gradients."""
        if counts.get(rec.step, 1) < 2:
            return ("own", id(rec))
        if isinstance(rec, CallRecord) and rec.micro is not None:
            k = seen.get((rec.step, rec.micro, rec.phase, rec.path), 0)
            seen[(rec.step, rec.micro, rec.phase, rec.path)] = k + 1
            return ("call", rec.step, rec.phase, rec.path, k)
        if isinstance(rec, ParamRecord) and rec.kind == "param_grad":
            return ("grad", rec.step, rec.path)
        return ("own", id(rec))

    def _joined_record(self, parts: Sequence[Record | OpRecord], call: int) -> Record | OpRecord:
        first = parts[0]
        if len(parts) == 1 and not (self._grad_scale is not None and isinstance(first, ParamRecord)
                                    and first.kind == "param_grad"):
            return replace(first, call=call)
        if isinstance(first, ParamRecord):
            scale = self._grad_scale
            if not first.increment:  # each record is the running total: the last is the step's gradient
                if scale is None or not parts[-1].tensors:
                    return replace(parts[-1], call=call)
                return replace(parts[-1], call=call, tensors=[self._joined_entry([parts[-1].tensors[0]], "sum", scale)])
            tensors = [self._joined_entry([p.tensors[0] for p in parts], "sum", scale)] if first.tensors else []
            return replace(first, call=call, tensors=tensors, increment=False)
        tensors = []
        for entry in first.tensors:
            found = [next((t for t in p.tensors if t.role == entry.role and t.key == entry.key), None)
                     for p in parts]
            if any(t is None for t in found):
                continue  # a tensor not every microbatch had: left out, as a record only one rank holds
            parts_found = [t for t in found if t is not None]
            objective = self._objective(first, entry, parts_found)
            scale = self._grad_scale if entry.role in ("grad_output", "grad_input") else None
            tensors.append(self._joined_entry(parts_found, "sum", objective) if objective is not None
                           else self._joined_entry(parts_found, self._batch_join(first, found), scale))
        return replace(first, call=call, tensors=tensors)

    def _objective(self, rec: Record | OpRecord, entry: TensorEntry, parts: list[TensorEntry]) -> float | None:
        """The scale of a loss's join (a floating scalar the model returns, and its gradient), None for any other
        tensor. Each microbatch's backward started from its loss with gradient g_i (1/M where the training code
        divides each microbatch's loss by their number M; 1 where each is its share of the whole batch's mean
        already): the step's loss is the sum of g_i x loss_i, and the gradient of that sum is 1, as the whole
        batch's is. With no backward (inference), the mean of the microbatches' losses."""
        if not isinstance(rec, CallRecord) or rec.parent is not None or not scalar_loss(entry) or \
                entry.role not in ("output", "grad_output"):
            return None
        grads = self._loss_grads.get((rec.step, rec.path, entry.key))
        if not grads or len(grads) != len(parts) or any(g != grads[0] for g in grads) or not grads[0]:
            return 1.0 / len(parts) if entry.role == "output" else None  # no (uniform) backward: the mean
        return grads[0] if entry.role == "output" else 1.0 / sum(grads)

    def _batch_join(self, rec: Record | OpRecord, parts: list) -> str | int:
        """How a tensor's microbatches join: "replicate" when each had it alike (a mask, rotary angles), else
        along the batch axis of the microbatch's batch size (``joins.batch_axis``). A tensor with no such axis
        is left for the other run's shape to decide ("batches")."""
        if alike(parts):
            return "replicate"
        axis = batch_axis(parts[0].shape, (self._tokens.get(rec.step) or (None,))[0])
        return "batches" if axis is None else axis

    def _rank_major(self, parts: list[TensorEntry], axis: int, scale: float | None = None) -> TensorEntry | None:
        """A microbatched run of data-parallel ranks: each microbatch's call joined its ranks' shares along the
        batch axis (rank 0's, rank 1's), but the ranks split the batch first (rank 0 the first share, its
        microbatches one after the other). Joined that way round: each rank's microbatches in turn, then the
        ranks (None: not such parts)."""
        first = parts[0].merge
        count = len(parts[0].parts)
        if first is None or count < 2 or any(
                p.merge is None or p.merge.over == MICROBATCHES or p.merge.how != "concat" or p.merge.dim != axis
                or p.merge.ranks != first.ranks or p.merge.scale != first.scale or len(p.parts) != count
                for p in parts):
            return None
        shares = [self._concat([p.parts[j] for p in parts], axis,
                               Merge("concat", axis, ranks=(first.rank_of(j),) * len(parts)))
                  for j in range(count)]
        outer = first.scale if scale is None else (first.scale or 1.0) * scale  # the ranks', then the microbatches'
        stats = scaled_stats(combine_stats([p.stats for p in parts]), scale) or \
            unknown_stats([p.stats for p in parts], sum(math.prod(p.shape) for p in parts))  # a partial sum's
        return self._concat(shares, axis, Merge("concat", axis, ranks=first.ranks, scale=outer), stats=stats)

    def _concat(self, parts: list[TensorEntry], axis: int, merge: Merge,
                stats: Mapping[str, Any] | None = None) -> TensorEntry:
        """``parts`` joined along ``axis`` (their statistics combined, and scaled as the join is, unless given)."""
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        if stats is None:  # parts of unknown statistics (a partial sum over ranks): the join's are unknown too
            stats = scaled_stats(combine_stats([p.stats for p in parts]), merge.scale) or \
                unknown_stats([p.stats for p in parts], math.prod(shape))
        return self._joined(parts, shape, stats, merge)

    def _joined(self, parts: list[TensorEntry], shape: list[int], stats: Mapping[str, Any],
                merge: Merge) -> TensorEntry:
        """An entry made of ``parts``: a region of its own (a negative offset) when every part has stored bytes."""
        offset = nbytes = None
        if all(p.offset is not None for p in parts):
            offset, self._next_offset = self._next_offset, self._next_offset - 1
            nbytes = sum(p.nbytes or 0 for p in parts)
        return replace(parts[0], shape=shape, stats=stats, merge=merge, parts=tuple(parts), offset=offset,
                       nbytes=nbytes, placement=None)

    def _joined_entry(self, parts: list[TensorEntry], how: str | int, scale: float | None = None) -> TensorEntry:
        """``how``: "sum" (gradients; scaled by ``scale``, a loss), "replicate", "batches" (undecided), or the axis
        to join on; ``scale`` also multiplies a join along an axis (gradients under ``microbatch_grad_scale``)."""
        if isinstance(how, int):
            return self._rank_major(parts, how, scale) or \
                self._concat(parts, how, Merge("concat", how, over=MICROBATCHES, scale=scale))
        stats: Mapping[str, Any]
        if how == "sum":
            stats = summed_stats([p.stats for p in parts], parts[0].stats.get("numel", 0), scale)
            return self._joined(parts, list(parts[0].shape), stats, Merge(how, over=MICROBATCHES, scale=scale))
        elif how == "replicate":
            stats = parts[0].stats
            scale = None  # each microbatch had it alike: one copy, as it was
        else:
            stats = scaled_stats(combine_stats([p.stats for p in parts]), scale) or \
                unknown_stats([p.stats for p in parts], parts[0].stats.get("numel", 0))
        return self._joined(parts, list(parts[0].shape), stats, Merge(how, over=MICROBATCHES, scale=scale))

    @staticmethod
    def _reparented(rec: Record, renumbered: dict[tuple, int]) -> Record:
        if isinstance(rec, CallRecord) and rec.parent is not None:
            parent = (rec.parent[0], renumbered.get((rec.phase, rec.parent[0], rec.parent[1]), rec.parent[1]))
            return replace(rec, parent=parent, micro=None)
        return replace(rec, micro=None) if isinstance(rec, CallRecord) else rec

    # -- reading ------------------------------------------------------------------------------------------
    def part_values(self, entry: TensorEntry) -> list:
        if _joined_here(entry):
            return [self.inner.tensor(part) for part in entry.parts]
        return self.inner.part_values(entry)

    def tensor(self, entry: TensorEntry) -> np.ndarray:
        if not _joined_here(entry):
            return self.inner.tensor(entry)
        merge = entry.merge
        assert merge is not None
        values = self.part_values(entry)
        if merge.how == "sum":
            total = np.sum([as_float(v, entry.dtype).astype(np.float64) for v in values], axis=0)
            return encode_float(total if merge.scale is None else total * merge.scale, entry.dtype)
        if merge.how == "concat":
            return scaled_values(np.concatenate(values, axis=merge.axis), entry.dtype, merge.scale)
        return values[0]  # a copy each microbatch had alike (a mask), or not resolved yet

    def tensor_chunks(self, entry: TensorEntry, chunk_elems: int) -> Iterator[np.ndarray]:
        if not _joined_here(entry):
            return self.inner.tensor_chunks(entry, chunk_elems)
        flat = self.tensor(entry).reshape(-1)
        return (flat[start:start + chunk_elems] for start in range(0, flat.size, chunk_elems))

    def data_segments(self, entry: TensorEntry) -> list | None:
        return None if _joined_here(entry) else self.inner.data_segments(entry)

    def size_bytes(self) -> int:
        return self.inner.size_bytes()

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "Joined":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _loss_gradients(records: list[Record]) -> dict[tuple, list[float]]:
    """{(step, root path, key): the gradient each microbatch's backward gave that floating scalar output (its
    loss), in order}: what the training code scaled each microbatch's loss by."""
    out: dict[tuple, list[float]] = {}
    for rec in records:
        if isinstance(rec, CallRecord) and rec.parent is None and rec.phase == "backward" and rec.micro is not None:
            for t in rec.tensors:
                mean = t.stats.get("mean")
                if t.role == "grad_output" and not t.shape and isinstance(mean, float):
                    out.setdefault((rec.step, rec.path, t.key), []).append(mean)
    return out


def _joined_here(entry: TensorEntry) -> bool:
    return entry.merge is not None and entry.merge.over == MICROBATCHES

