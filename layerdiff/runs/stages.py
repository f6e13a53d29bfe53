"""A rank that ran several pipeline stages, read as one rank per stage.

Why: an interleaved schedule (torch pipelining's interleaved 1F1B, looped BFS; torchtitan's ``model_parts``) runs
stages r, r + PP, ... on rank r, each its own module with the whole model's names. Their calls are in one trace,
each record with its ``stage``, the calls of a module path numbered in the order the rank made them (stage 0's
and stage 2's ``model`` calls alternate). Split by stage and numbered again within it, each stage reads as the
trace of a rank that ran that stage alone, and ``runs.ranks`` joins the stages as it joins such ranks."""
from __future__ import annotations

from typing import Any

from msgspec.structs import replace

from layerdiff.tracefile.reader import TraceReader
from layerdiff.tracefile.records import CallRecord, OpRecord, ParamUseRecord, Producer, Record


def stage_views(reader: TraceReader) -> list[Any]:
    """``reader`` itself, or, for a rank that ran several pipeline stages (``parallel.pp_stages``), one view per
    stage."""
    stages = (reader.meta.get("parallel") or {}).get("pp_stages") or []
    return [StageView(reader, int(stage), first=i == 0) for i, stage in enumerate(stages)] if len(stages) > 1 \
        else [reader]


class StageView:
    """The records and operations of one pipeline stage of a rank's trace, as a trace of that stage alone (what
    ``runs.ranks`` reads of a rank); tensors are read from the rank's file. ``first``: the rank's first stage,
    which also keeps any record that names no stage."""

    def __init__(self, reader: TraceReader, stage: int, first: bool = False):
        self.reader = reader
        self.stage = stage
        self.path = reader.path
        layout = {k: v for k, v in (reader.meta.get("parallel") or {}).items() if k not in ("pp_stages", "stage_paths")}
        layout["pp_rank"] = stage
        paths = ((reader.meta.get("parallel") or {}).get("stage_paths") or {}).get(str(stage))
        if paths is not None:  # Megatron's chunks each name their layers from 0: this stage's global names
            layout["global_paths"] = paths
        self.meta = {**reader.meta, "parallel": layout}
        self.crashed, self.damage, self.unverified, self.end = \
            reader.crashed, reader.damage, reader.unverified, reader.end
        mine = [rec for rec in reader.records if rec.stage == stage or (first and rec.stage is None)]
        calls = _numbered_again(mine)
        self.records: list[Record] = [_renumbered(rec, calls) for rec in mine]
        self.ops: list[OpRecord] = [_renumbered(op, calls) for op in reader.ops if op.stage == stage]

    def tensor(self, entry):
        return self.reader.tensor(entry)

    def tensor_chunks(self, entry, chunk_elems: int):
        return self.reader.tensor_chunks(entry, chunk_elems)

    def data_segments(self, entry):
        return self.reader.data_segments(entry)


def _numbered_again(records: list[Record]) -> dict[tuple[str, int], int]:
    """(path, call in the rank's numbering) -> the call's number within the stage: each path's calls in order."""
    calls: dict[str, set[int]] = {}
    for rec in records:
        if isinstance(rec, CallRecord):
            calls.setdefault(rec.path, set()).add(rec.call)
    return {(path, call): i for path, numbers in calls.items() for i, call in enumerate(sorted(numbers))}


def _renumbered(rec: Any, calls: dict[tuple[str, int], int]) -> Any:
    """A record with every module call it names numbered within its stage: its own, its parent's, those of the
    calls its producers name; a tied weight's per-use gradient by the using call."""
    if isinstance(rec, ParamUseRecord):
        return replace(rec, call=calls.get((rec.module or "", rec.call), rec.call))
    if not isinstance(rec, (CallRecord, OpRecord)):
        return rec
    changes: dict[str, Any] = {"call": calls.get((rec.path, rec.call), rec.call)}
    if isinstance(rec, CallRecord) and rec.parent is not None:
        path, call = rec.parent
        changes["parent"] = (path, calls.get((path, call), call))
    if rec.producers:
        changes["producers"] = {key: _producer(p, calls) for key, p in rec.producers.items()}
    return replace(rec, **changes)


def _producer(producer: Producer, calls: dict[tuple[str, int], int]) -> Producer:
    if producer.path is None or producer.call is None:
        return producer
    return replace(producer, call=calls.get((producer.path, producer.call), producer.call))
