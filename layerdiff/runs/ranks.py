"""A run of several ranks (one trace per rank in a directory), read as one trace.

``layerdiff trace`` in a job of N ranks writes ``RUN/rank0.h5 ... RUN/rank{N-1}.h5``. ``open_run(RUN)`` gives a
reader with the same interface as ``TraceReader`` whose records hold full tensors again:

- a tensor recorded with a placement (DTensor ``S(d)``/``R``/``P(sum)``, a Megatron tensor-parallel parameter) is
  concatenated along ``d`` in mesh order, taken from one rank, or summed: only what a placement marks partial is
  summed;
- a plain tensor of a module whose weight is sharded is a shard of the layer's output (column-parallel: outputs
  on the last axis) or input (row-parallel), as Megatron and DTensor's local outputs are; a plain tensor stored
  at the same bytes as one of those (a layer's output is the next module's input) shares its placement;
- any other plain tensor is left per rank ("ranks"): compared with another run it is read as replicated when
  the shapes agree (each rank's copy is then checked) or as shards when the other side is N times longer along
  one axis. A plain tensor that disagrees across ranks is a finding, never a partial sum.

Each merged entry keeps its parts, so a comparison can say which rank's shard or copy differs.
"""
from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any, Mapping, TypeVar, Union

import numpy as np
from msgspec.structs import replace

from layerdiff.errors import TraceFormatError
from layerdiff.tracefile.index import Damage
from layerdiff.match.joins import alike, batch_axis, root_calls, scalar_loss, token_shapes
from layerdiff.match.operands import combine_stats, scaled_stats, scaled_values, summed_stats, unknown_stats
from layerdiff.runs.parallel import global_path
from layerdiff.runs.stages import stage_views
from layerdiff.tracefile.reader import TraceReader
from layerdiff.tracefile.records import (OUTPUT_PLUS_BIAS, CallRecord, EndRecord, Merge, OpRecord, ParamRecord, Record,
                                        TensorEntry)
from layerdiff.tracefile.tensors import as_float, encode_float

RANK_FILE = re.compile(r"^rank(\d+)\.h5$")
_ONE_COPY = ("replicate", "ranks")  # merges read as rank 0's tensor (the per-rank comparison checks the others)
_SHARD = re.compile(r"^S\((-?\d+)\)$")


def _rank_number(path) -> int:
    """The rank of a file named ``rank{N}.h5`` (``rank_files`` lists only such files)."""
    found = RANK_FILE.match(Path(path).name)
    if found is None:
        raise TraceFormatError(f"{path}: not a rank's trace (rank{{N}}.h5)")
    return int(found.group(1))


def rank_files(path) -> list | None:
    """The per-rank trace files of a run directory, in rank order (None if ``path`` is not such a directory)."""
    path = Path(path)
    if not path.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := RANK_FILE.match(p.name)))
    return [p for _, p in found] if found else None


def open_run(path, rules=None):
    """A trace file's reader, or a run directory's merged reader (``rules``: the rule set, for fused layers)."""
    files = rank_files(path)
    if files is None:
        if Path(path).is_dir():
            raise TraceFormatError(f"{path}: a directory without rank*.h5 traces (a multi-rank run writes "
                                   "RUN/rank0.h5, RUN/rank1.h5, ...)")
        return TraceReader(path)
    return RankedRun(path, files, rules)


def _placement_kind(entry: TensorEntry):
    """("concat", dim) | ("replicate", None) | ("sum", None) from a recorded 1-D placement; None otherwise."""
    place = entry.placement
    if not place or len(place.get("placements", ())) != 1:
        return None
    text = place["placements"][0]
    shard = _SHARD.match(text)
    if shard:
        return "concat", int(shard.group(1))
    if text == "R":
        return "replicate", None
    if text.startswith("P("):
        return "sum", None, place.get("scale")
    return None


_STRIDED = re.compile(r"^_S\((-?\d+), *(\d+)\)$")  # FSDP's _StridedShard(dim, split_factor)


def _storage_split(entry: TensorEntry, layout: Mapping[str, Any]) -> tuple[tuple | None, tuple | None] | None:
    """A weight's (or its gradient's: never an activation's, whose DTensor placements are tensor parallelism's
    alone) placement under FSDP with tensor parallelism (``sharded_storage``, tp > 1), split into (how the
    tensor-parallel ranks of one replica join, how the replicas then join); None elsewhere.

    Its placements are [data-parallel, tensor-parallel] on the 2-D mesh, or FSDP's alone on the first dimension's
    mesh (a norm's weight: one copy per tensor-parallel rank). Where both split the same axis, FSDP's
    ``_StridedShard(d, k)`` cut each of the k tensor-parallel pieces: each replica's join holds a slice of every
    piece, and the replicas join piece by piece (``concat_parts``)."""
    place = entry.placement
    if not place or not layout.get("sharded_storage") or (layout.get("tp") or 1) < 2:
        return None
    placements = list(place.get("placements") or ())
    if len(placements) == 1:
        placements.append("R")
    if len(placements) != 2:
        return None
    dp_text, tp_text = placements
    tp_shard = _SHARD.match(tp_text)
    tp_how = ("concat", int(tp_shard.group(1))) if tp_shard else ("replicate", None) if tp_text == "R" else None
    strided, dp_shard = _STRIDED.match(dp_text), _SHARD.match(dp_text)
    if strided:
        dp_how: tuple | None = ("concat_parts", int(strided.group(1)), int(strided.group(2)))
    else:
        dp_how = ("concat", int(dp_shard.group(1))) if dp_shard else ("replicate", None) if dp_text == "R" else None
    return tp_how, dp_how


def _said_not_gated(meta: Mapping[str, Any]) -> bool:
    """Whether the run's Megatron config says its MLPs are not gated (``gated_linear_unit: false``: GPT-2's,
    StarCoder's): its linear_fc1 is then one tensor, each rank's shard a plain slice of it, not [gate_r; up_r]
    (joined part by part, that made a GPT-style model at TP=2 differ from itself at TP=1 in every fc1)."""
    config = meta.get("model_config") or {}
    return config.get("kind") == "mcore" and (config.get("values") or {}).get("gated_linear_unit") is False


class RankedRun:
    """The ``TraceReader`` interface over a directory of per-rank traces (see the module docstring)."""

    def __init__(self, path, files, rules=None):
        from layerdiff.match.rules import builtin

        self.path = Path(path)
        self.rules = rules or builtin()
        self.every_part: dict = {}  # module -> number of parts each shard holds a slice of
        # one reader per rank's file; ``readers``: one per pipeline stage a rank ran (``runs.stages``), once read
        self.files: list[TraceReader] = []
        self.readers: list = self.files
        try:
            for f in files:
                self.files.append(TraceReader(f))
        except Exception:
            self.close()
            raise
        self._check_complete(files)
        first = self.files[0]
        self.meta_framework = first.meta.get("framework")
        self.meta = {**first.meta, "ranks": len(self.files)}
        self.crashed = any(r.crashed for r in self.files)
        self.damage = [Damage(f"rank {rank}: {d.where}", d.why, d.reads_as) for rank, r in enumerate(self.files)
                       for d in r.damage]
        self.unverified = sum(r.unverified for r in self.files)
        self.end = self._end()
        views = [(i, view) for i, reader in enumerate(self.files) for view in stage_views(reader)]
        self.readers = [view for _, view in views]
        self.file_of = [i for i, _ in views]  # each reader's rank (its file)
        self._joined = 0  # joined entries made so far (each gets its own negative offset)
        self.layouts = [reader.meta.get("parallel") or {} for reader in self.readers]
        self.stages = [int(layout.get("pp_rank") or 0) for layout in self.layouts]
        # (batch, sequence) of each rank's share of its first step
        self._local_tokens = self._token_shares()
        self.own_shares = own_shares(self.readers, self.layouts)
        # positions of one stage's records span less than this: each stage's are shifted by it (``_placed``)
        self._span = 1 + max((_last_position(rec) for reader in self.readers for rec in reader.records), default=0)
        self.records = self._merge()
        self.ops: list[OpRecord] = self._pipeline_ops()

    def _token_shares(self) -> dict[int, tuple | None]:
        """Each rank's (batch, sequence) of its first step: its token ids' shape, or, on a later pipeline stage
        (which receives hidden states), that of the first stage's rank of its data-parallel replica."""
        tokens = {rank: next(iter(token_shapes(reader.records).values()), None)
                  for rank, reader in enumerate(self.readers)}
        replica = [int(layout.get("dp_rank") or 0) for layout in self.layouts]
        by_replica: dict[int, tuple] = {}
        for rank in sorted(tokens, key=lambda r: self.stages[r]):
            found = tokens[rank]
            if found is not None:
                by_replica.setdefault(replica[rank], found)
        return {rank: found if found is not None else by_replica.get(replica[rank]) for rank, found in tokens.items()}

    @property
    def world_size(self) -> int:
        return len(self.files)

    def _check_complete(self, files):
        sizes = {(r.meta.get("distributed") or {}).get("world_size") for r in self.files}
        expected = sizes.pop() if len(sizes) == 1 else None
        numbers = [_rank_number(f) for f in files]
        if expected is None or numbers != list(range(expected)):
            self.close()
            raise TraceFormatError(f"{self.path}: incomplete run: traces of ranks {numbers}, but the run had "
                                   f"{expected if expected is not None else 'differing world sizes'} ranks")

    def _end(self) -> EndRecord | None:
        ends = [r.end for r in self.files if r.end is not None]
        if len(ends) < len(self.files):
            return None
        failed = next((e for e in ends if e.status == "error"), None)
        return replace(ends[0], status="error", failure=failed.failure) if failed else ends[0]

    # -- merging ------------------------------------------------------------------------------------------
    def _merge(self) -> list:
        """Each rank's records under their global names, joined: the ranks of one pipeline stage by placement
        (``_merge_group``), then the stages into one model (``_join_stages``), in the order of one run."""
        ranks = range(len(self.readers))
        renamed = self._global_records()
        index = [{_key(r): r for r in records} for records in renamed]
        order: list[tuple] = []
        seen: set[tuple] = set()
        for rank in sorted(ranks, key=lambda r: (self.stages[r], r)):
            for rec in renamed[rank]:
                key = _key(rec)
                if key not in seen:
                    seen.add(key)
                    order.append(key)
        sharded_weights = self._sharded_weights(renamed)
        state = _MergeState()
        out = []
        for key in order:
            holders = [r for r in ranks if key in index[r]]
            expected = self._expected_holders(key[2], holders)
            if len(holders) < len(expected):
                rec = index[holders[0]][key]
                out.append(replace(rec, ranks_missing=self._rank_numbers([r for r in expected if r not in holders]),
                                   tensors=[self._per_rank_entry([t], [holders[0]]) for t in rec.tensors]))
                continue
            by_stage: dict[int, list[int]] = {}
            for rank in holders:
                by_stage.setdefault(self.stages[rank], []).append(rank)
            merged = [self._merge_stage([index[r][key] for r in group], group, sharded_weights, state)
                      for _, group in sorted(by_stage.items())]
            rec = merged[0] if len(merged) == 1 else _join_stages(merged)
            out.append(rec if len(holders) == len(self.readers) else
                       replace(rec, ranks_held=self._rank_numbers(holders)))
        return sorted(out, key=_position) if len(set(self.stages)) > 1 else out

    def replica_groups(self) -> list[list[int]]:
        """Ranks that hold the same layers (one pipeline stage): only they can agree on anything (tensor-parallel
        ranks on what they replicate, data-parallel ranks on their weights). Every rank of a run with no
        pipeline. With tensor and data parallelism both, the ranks of one tensor-parallel coordinate: they hold
        the same shards."""
        return self._by_stage("tp_rank" if _tensor_and_data(self.layouts) else None)

    def peer_groups(self) -> list[list[int]]:
        """With tensor and data parallelism both (tp > 1 and dp > 1): the tensor-parallel ranks of each
        data-parallel replica, which hold the same copy of every weight that is not sharded (a norm's); none
        otherwise (``replica_groups`` already holds them)."""
        return self._by_stage("dp_rank") if _tensor_and_data(self.layouts) else []

    def copy_groups(self) -> list[list[int]]:
        """Under HSDP (weights placed ``R, S(d)``): the ranks that hold the same shard of every weight, one per
        replica, which must agree on it; none otherwise (the other groups leave shards out)."""
        groups: dict[int, list[int]] = {}
        for rank, reader in enumerate(self.readers):
            place = next((rec.tensors[0].placement for rec in reader.records
                          if rec.kind == "param" and rec.tensors and rec.tensors[0].placement), None) or {}
            coord: list = list(place.get("coord") or [])
            if not self.layouts[rank].get("sharded_storage") or (place.get("placements") or [None])[0] != "R" \
                    or len(coord) != 2:
                return []
            groups.setdefault(int(coord[1]), []).append(rank)
        return [group for _, group in sorted(groups.items()) if len(group) > 1]

    def _by_stage(self, coordinate: str | None) -> list[list[int]]:
        """The ranks of each pipeline stage, split by their ``coordinate`` in the layout (None: not split)."""
        groups: dict[tuple, list[int]] = {}
        for rank, stage in enumerate(self.stages):
            at = int(self.layouts[rank].get(coordinate) or 0) if coordinate else 0
            groups.setdefault((stage, at), []).append(rank)
        return list(groups.values())

    def _global_records(self) -> list[list[Record]]:
        """Each rank's records under the whole model's names (``ParallelLayout.global_paths``: a later pipeline
        stage's layers, an expert-parallel rank's experts), their positions in time made comparable across the
        stages of a pipeline: forward runs stage by stage, backward the other way."""
        last = max((s for s in self.stages), default=0)
        out = []
        for rank, reader in enumerate(self.readers):
            renames = self.layouts[rank].get("global_paths") or {}
            split = set(self.layouts[rank].get("split_modules") or ())
            stage = self.stages[rank]
            out.append([_placed(_renamed(rec, renames) if renames else rec, stage, last, self._span)
                        for rec in unwrapped(reader.records, self.layouts[rank])
                        if not (isinstance(rec, CallRecord) and rec.path in split)])
        return out

    def _pipeline_ops(self) -> list[OpRecord]:
        """Under pipeline parallelism alone (one rank per stage) each module's operations were recorded by the one
        rank that runs it: all of them, under the whole model's names, in one run's order; a module that several
        stages each run part of (the model) has its stages' operations one after another. None otherwise:
        operations are not joined across ranks that split a module's work (align one rank's trace for them)."""
        if len(self.readers) < 2 or len(set(self.stages)) != len(self.readers):
            return []
        last = max(self.stages)
        earlier: dict[tuple, int] = {}  # (step, path, call) -> that call's forward operations on earlier stages
        out: list[OpRecord] = []
        for rank in sorted(range(len(self.readers)), key=lambda r: self.stages[r]):
            renames = self.layouts[rank].get("global_paths") or {}
            here: dict[tuple, int] = {}
            for op in self.readers[rank].ops:
                op = _renamed_op(op, renames)
                op = replace(op, tensors=[self._one_rank_entry(t, rank) for t in op.tensors])
                key = (op.step, op.path, op.call)
                out.append(_placed(_shifted(op, earlier.get(key, 0)), self.stages[rank], last, self._span))
                if op.phase == "forward":
                    here[key] = max(here.get(key, 0), op.index + 1)
            for key, count in here.items():
                earlier[key] = earlier.get(key, 0) + count
        return sorted(out, key=_position)

    def _expected_holders(self, path: str, holders: list[int]) -> list[int]:
        """The ranks that should hold a record of ``path`` found on ``holders``: every rank of the pipeline stages
        it is on, or, for a module that ranks of one stage hold apart (an expert of one expert-parallel rank:
        ``ParallelLayout.own_modules``), the ranks that own it."""
        stages = {self.stages[r] for r in holders}
        owned = [_owns(self.layouts[r], path) for r in range(len(self.readers))]
        apart = any(owned[r] for r in holders)
        return [r for r in range(len(self.readers)) if self.stages[r] in stages and (owned[r] or not apart)]

    def _merge_stage(self, twins: list[Record], ranks: list[int], sharded_weights: dict,
                     state: "_MergeState") -> Record:
        """One record that the ranks of one pipeline stage each hold, joined: by placement among tensor-parallel
        ranks, and where the stage also has several data-parallel replicas (tp > 1 and dp > 1), each replica's
        tensor-parallel ranks first, then the replicas along the batch axis (``_join_replicas``)."""
        replicas = self._replicas(ranks, twins[0])
        if replicas is None:
            return self._merge_group(twins, ranks, sharded_weights, state)
        by_rank = dict(zip(ranks, twins))
        joined = [self._merge_group([by_rank[r] for r in replica], replica, sharded_weights, state, replica=True)
                  for replica in replicas]
        return self._join_replicas(joined, replicas)

    def _replicas(self, ranks: list[int], rec: Record) -> list[list[int]] | None:
        """``ranks`` as data-parallel replicas, each its tensor-parallel ranks in order (None: one level of join
        is enough: no tensor or no data parallelism, or a module held apart, such as one rank's experts)."""
        layouts = [self.layouts[r] for r in ranks]
        if len(ranks) < 4 or not _tensor_and_data(layouts) \
                or any(_owns(lay, rec.path) or _owns(lay, getattr(rec, "module", None) or "") for lay in layouts):
            return None
        replicas: dict[int, list[int]] = {}
        for rank, layout in zip(ranks, layouts):
            replicas.setdefault(int(layout.get("dp_rank") or 0), []).append(rank)
        groups = [replicas[d] for d in sorted(replicas)]
        return groups if len(groups) > 1 and len({len(g) for g in groups}) == 1 else None

    def _join_replicas(self, records: list[Record], replicas: list[list[int]]) -> Record:
        """Data-parallel replicas' records (each already joined over its tensor-parallel ranks) as one: each
        tensor one copy where the replicas agree (a weight, a mask), else joined along the batch axis, gradients
        as their mean where the step averages them (``_batch_join``)."""
        rec = records[0]
        firsts = [replica[0] for replica in replicas]
        tensors: list[TensorEntry] = []
        for i, entry in enumerate(rec.tensors):
            parts = _counterparts(records, i, entry)
            if parts is None:
                tensors.append(entry)  # the first replica's, as joined: the others lack it
                continue
            placed = entry.parts[0] if entry.parts else entry  # the replica's join keeps its ranks' placements
            split = _storage_split(placed, self.layouts[firsts[0]]) if isinstance(rec, ParamRecord) else None
            if split is not None:
                how: tuple | None = split[1]  # FSDP's storage shards (its gradients come averaged)
            elif rec.kind == "param_grad" and self._grad_mean(firsts):
                how = ("sum", None, 1.0 / len(parts))  # each replica's own batch's: DDP's mean
            else:
                how = self._mean_of_gradients(entry, self._batch_join(rec, parts, firsts), firsts)
            tensors.append(self._merged_entry(parts, how, firsts))
        return replace(rec, tensors=tensors)

    def _merge_group(self, twins: list[Record], ranks: list[int], sharded_weights: dict,
                     state: "_MergeState", replica: bool = False) -> Record:
        """One record that the ranks of one pipeline stage each hold: its tensors joined by placement.
        ``replica``: the ranks are the tensor-parallel ranks of one data-parallel replica, whose sums over the
        replicas are left to ``_join_replicas`` (``_within_replica``)."""
        rec = twins[0]
        stage = self.stages[ranks[0]]
        tensors: list[TensorEntry] = []
        known: dict[tuple, tuple] = {}
        for i, entry in enumerate(rec.tensors):
            parts = _counterparts(twins, i, entry)
            if parts is None:
                tensors.append(self._per_rank_entry([entry], ranks[:1]))
                continue
            hybrid = _hybrid_shards(parts, ranks) if isinstance(rec, ParamRecord) else None
            if hybrid is not None:  # HSDP: the first replica's shards, joined
                tensors.append(self._merged_entry(hybrid[0], ("concat", hybrid[2]), hybrid[1]))
                continue
            region = (ranks[0], *_region(entry))
            split = _storage_split(entry, self.layouts[ranks[0]]) if replica and isinstance(rec, ParamRecord) else None
            placed = split[0] if split is not None else _placement_kind(entry)
            how = placed or self._inferred(rec, entry, sharded_weights, state.shards_by_region, region) \
                or state.forward_how.get((stage, _forward_key(rec, entry))) or state.param_how.get(_param_of(rec)) \
                or (None if rec.path in sharded_weights else _like_input(entry, known))
            how = self._every_part(rec, how) or self._data_parallel(rec, parts, ranks)
            if replica:
                how = _within_replica(entry, how)
            how = self._mean_of_gradients(entry, how, ranks)
            merged_entry = self._merged_entry(parts, how, ranks)
            if rec.kind == "param" and how:
                state.param_how[rec.path] = how
            if how and how[0] == "concat":
                known[tuple(entry.shape)] = how
                if entry.offset is not None:
                    state.shards_by_region[region] = how
            if how and isinstance(rec, CallRecord) and rec.phase == "forward":
                state.forward_how[(stage, (rec.path, rec.call, entry.role, entry.key))] = how
            tensors.append(merged_entry)
        return replace(rec, tensors=tensors)

    def _data_parallel(self, rec: Record, parts: list[TensorEntry], ranks: list[int]) -> tuple | None:
        """A tensor of data-parallel ranks that each ran their own share of the batch (Megatron's data parallel,
        tensor parallel size 1): one copy when every rank's is alike (a weight, a mask), else joined along the
        batch axis: the first axis of the rank's batch size (its token ids [b, s]; the layouts models use put it
        before heads and groups), or the first when it holds the rank's tokens flattened."""
        if len(parts) < 2 or not all((self.layouts[r].get("dp") or 1) > 1 and (self.layouts[r].get("tp") or 1) == 1
                                     for r in ranks):
            return None
        return self._batch_join(rec, parts, ranks)

    def _batch_join(self, rec: Record, parts: list[TensorEntry], ranks: list[int]) -> tuple | None:
        """How data-parallel shares of one tensor join: one copy when alike; a loss (a floating scalar output)
        as the ranks' mean where each rank's is its own share's mean (``_grad_mean``); else along the batch axis
        of the first rank's share (None: a parameter that differs, left per rank)."""
        first = parts[0]
        if alike(parts):  # a weight, a mask; one the ranks each had for their own sequences waits for the other run
            return None if self.own_shares and not isinstance(rec, ParamRecord) and first.shape else ("replicate", None)
        if not self.own_shares:  # replicas given one batch each: a tensor that differs is a desync, not shares
            return None
        if scalar_loss(first) and first.role == "output" and self._grad_mean(ranks):
            return "sum", None, 1.0 / len(parts)
        first_rank = ranks[0]
        batch, seq = self._local_tokens.get(first_rank) or (None, None)
        axis = batch_axis(first.shape, batch)
        if axis is None and batch is not None and seq is not None and first.shape and first.shape[0] == batch * seq:
            axis = 0  # the rank's tokens flattened ([b * s, ...], an MoE router's): the ranks' blocks in turn
        return ("concat", axis) if axis is not None and not isinstance(rec, ParamRecord) else None

    def _mean_of_gradients(self, entry: TensorEntry, how: tuple | None, ranks: list[int]) -> tuple | None:
        """A gradient joined along an axis over ranks each with its own loss (``_grad_mean``): the step's is
        their mean."""
        if how and how[0] == "concat" and entry.role.startswith("grad") and self._grad_mean(ranks):
            return "concat", how[1], 1.0 / len(ranks)
        return how

    def _grad_mean(self, ranks: list[int]) -> bool:
        """Data-parallel ranks whose gradients the step averages (``ParallelLayout.grad_mean``): ranks of
        different replicas (tensor-parallel ranks of one replica share its loss)."""
        replicas = {self.layouts[r].get("dp_rank") for r in ranks}
        return len(ranks) > 1 and len(replicas) == len(ranks) and all(self.layouts[r].get("grad_mean")
                                                                       for r in ranks)

    def _sharded_weights(self, records: list[list[Record]]) -> dict:
        """module path -> (placement dim of its weight, the weight's local shape) for sharded weights, over every
        pipeline stage's parameters; modules whose shards hold a slice of every part of a fused weight
        (Megatron's gated linear_fc1: [gate_r; up_r]) go to ``self.every_part`` with the number of parts."""
        out: dict[str, tuple[int, list[int]]] = {}
        for rank, held in enumerate(records):
            layout = self.layouts[rank]
            for rec in held:
                if isinstance(rec, ParamRecord) and rec.kind == "param" and rec.tensors \
                        and rec.path.rpartition(".")[2] in ("weight", "gamma") and rec.module_path not in out:
                    self._sharded_weight(rec, layout, out)
        return out

    def _sharded_weight(self, rec: ParamRecord, layout: Mapping[str, Any], out: dict) -> None:
        """``_sharded_weights``' entry for one weight, if it is split for tensor parallelism. FSDP's storage shards
        are not: every rank computes with whole weights (with tensor parallelism too, whole for its piece)."""
        entry = rec.tensors[0]
        if layout.get("sharded_storage"):
            split = _storage_split(entry, layout)
            how = split[0] if split is not None else None
            local = _tensor_parallel_piece(entry, how, int(layout.get("tp") or 1)) if how else None
        else:
            how, local = _placement_kind(entry), list(entry.shape)
        if not how or how[0] != "concat" or local is None:
            return
        module, dim = rec.module_path, how[1]
        if len(local) == 2 and self.rules.is_transposed(self.meta_framework, rec.module_type, rec.path):
            dim, local = 1 - dim % 2, local[::-1]  # Paddle's [in, out]: as PyTorch's [out, in]
        out[module] = (dim, local)
        rule = self.rules.fused_rule(module.rpartition(".")[2])
        if rule is not None and rule.tp_every_part and (entry.placement or {}).get("source") == "megatron" \
                and not _said_not_gated(self.meta):
            self.every_part[module] = len(rule.parts)

    def _every_part(self, rec: Record, how):
        """A shard of a fused tensor that holds a slice of every part is joined part by part."""
        module = rec.path if isinstance(rec, CallRecord) else (rec.module or "")
        if how and how[0] == "concat" and module in self.every_part:
            return "concat_parts", how[1], self.every_part[module]
        return how

    def _inferred(self, rec: Record, entry: TensorEntry, weights: dict, regions: dict, region: tuple):
        """The placement of a plain tensor: that of the same stored bytes elsewhere (``region``: the first
        holder's rank and the bytes' place in its file), or the layer's by its weight (column-parallel: the
        output's last axis; row-parallel: the input's)."""
        if entry.offset is not None and region in regions:
            return regions[region]
        if not isinstance(rec, CallRecord) or rec.path not in weights or not entry.shape:
            return None
        dim, local = weights[rec.path]
        outputs = entry.role in ("output", "grad_output", OUTPUT_PLUS_BIAS)
        if dim == 0 and outputs and entry.shape[-1] == local[0]:
            return "concat", len(entry.shape) - 1
        if dim in (1, -1) and not outputs and len(local) > 1 and entry.shape[-1] == local[1]:
            return "concat", len(entry.shape) - 1
        return None

    def _merged_entry(self, parts: list[TensorEntry], how: tuple | None, ranks: list[int]) -> TensorEntry:
        kind = how[0] if how else "ranks"
        dim = None
        shape = list(parts[0].shape)
        stats: Mapping[str, Any] | None
        if how and kind in ("concat", "concat_parts"):
            dim = how[1] % max(len(shape), 1)
            shape[dim] = sum(p.shape[dim] for p in parts)
            scale = how[2] if kind == "concat" and len(how) > 2 else None
            stats = scaled_stats(combine_stats([p.stats for p in parts]), scale) \
                or unknown_stats([p.stats for p in parts], math.prod(shape))  # parts of unknown statistics: sums
        elif kind == "sum":
            stats = summed_stats([p.stats for p in parts], math.prod(shape), how[2] if how and len(how) > 2 else None)
        else:
            stats = parts[0].stats
        scale = how[2] if how and kind in ("sum", "concat") and len(how) > 2 else None
        merge = Merge(kind, dim, how[2] if how and kind == "concat_parts" else None,
                      _ranks(self._rank_numbers(ranks, unique=False)), scale=scale)
        return self._register(replace(parts[0], shape=shape, stats=stats or parts[0].stats, merge=merge,
                                      parts=tuple(parts), placement=None), parts)

    def _one_rank_entry(self, entry: TensorEntry, rank: int) -> TensorEntry:
        """A tensor only ``rank`` holds, read from its trace."""
        return self._register(replace(entry, merge=Merge("replicate", ranks=(self.file_of[rank],)), parts=(entry,)),
                              [entry])

    def _per_rank_entry(self, parts: list[TensorEntry], ranks: list[int]) -> TensorEntry:
        return self._register(replace(parts[0], merge=Merge("ranks", ranks=_ranks(self._rank_numbers(ranks, False))),
                                      parts=tuple(parts)), parts)

    def _rank_numbers(self, readers: list[int], unique: bool = True) -> list[int]:
        """The ranks (their files) of some of ``readers``' indices: what joined entries and reports name (a rank that
        ran several pipeline stages is one reader per stage). ``unique``: each rank once."""
        ranks = [self.file_of[r] for r in readers]
        return list(dict.fromkeys(ranks)) if unique else ranks

    def _register(self, entry: TensorEntry, parts: list[TensorEntry]) -> TensorEntry:
        """A joined entry's bytes are its parts': it gets a region of its own (a negative offset, unique in this
        run) so that comparisons memoized by region never mistake it for one rank's tensor."""
        if all(p.offset is not None for p in parts):
            self._joined += 1
            return replace(entry, offset=-self._joined, nbytes=sum(p.nbytes or 0 for p in parts))
        return replace(entry, offset=None, nbytes=None)

    # -- reading ------------------------------------------------------------------------------------------
    def _part_readers(self, entry: TensorEntry) -> list[TraceReader | RankedRun]:
        """The reader of each part of a merged entry (the rank that holds it)."""
        merge = entry.merge
        if merge is None:
            return [self.readers[0]]
        # a part joined itself (a data-parallel replica's tensor-parallel shards) is read through this run
        return [self if part.merge is not None else self.files[merge.rank_of(i)]
                for i, part in enumerate(entry.parts)]

    def part_values(self, entry: TensorEntry) -> list:
        """Each rank's stored bits of a merged entry, in the order of its parts."""
        return [reader.tensor(part) for reader, part in zip(self._part_readers(entry), entry.parts)]

    def tensor(self, entry: TensorEntry) -> np.ndarray:
        merge = entry.merge
        if merge is None:
            return self.readers[0].tensor(entry)
        if merge.how in _ONE_COPY:
            return self._part_readers(entry)[0].tensor(entry.parts[0])
        values = self.part_values(entry)
        if merge.how == "concat":
            return scaled_values(np.concatenate(values, axis=merge.axis), entry.dtype, merge.scale)
        if merge.how == "concat_parts":  # [g0; u0], [g1; u1] -> [g0; g1; u0; u1]
            pieces = [np.split(v, merge.part_count, axis=merge.axis) for v in values]
            return np.concatenate([np.concatenate([p[i] for p in pieces], axis=merge.axis)
                                   for i in range(merge.part_count)], axis=merge.axis)
        if merge.how == "sum":  # added as values (bfloat16's stored bits are integers), kept as stored bits
            total = np.sum([as_float(v, entry.dtype).astype(np.float64) for v in values], axis=0)
            return encode_float(total * merge.scale if merge.scale is not None else total, entry.dtype)
        return values[0]

    def tensor_chunks(self, entry: TensorEntry, chunk_elems: int):
        """The merged tensor's stored bits, flattened, in pieces (``TraceReader.tensor_chunks``). Streamed from the
        rank files, so memory stays flat, where the parts follow one another in its flat order: one rank's copy,
        shards joined on the first axis. Shards of another axis interleave and partial sums add up: those are
        joined in memory first."""
        merge, parts = entry.merge, entry.parts
        if merge is None or not parts:
            return self.readers[0].tensor_chunks(entry, chunk_elems)
        readers = self._part_readers(entry)
        if merge.how in _ONE_COPY:
            return readers[0].tensor_chunks(parts[0], chunk_elems)
        if merge.how == "concat" and merge.dim == 0 and merge.scale is None:
            return itertools.chain.from_iterable(reader.tensor_chunks(part, chunk_elems)
                                                 for reader, part in zip(readers, parts))
        flat = self.tensor(entry).reshape(-1)
        return (flat[start:start + chunk_elems] for start in range(0, flat.size, chunk_elems))

    def data_segments(self, entry: TensorEntry) -> list | None:
        """``TraceReader.data_segments`` of a merged tensor: one rank's copy, or each rank's shard when shards
        follow one another in its flat order (joined on the first axis); None for the joins made in memory."""
        merge, parts = entry.merge, entry.parts
        if merge is None or not parts:
            return self.readers[0].data_segments(entry)
        readers = self._part_readers(entry)
        if merge.how in _ONE_COPY:
            return readers[0].data_segments(parts[0])
        if merge.how != "concat" or merge.dim != 0 or merge.scale is not None:
            return None
        segments = [reader.data_segments(part) for reader, part in zip(readers, parts)]
        joined: list = []
        for found in segments:
            if found is None:
                return None
            joined.extend(found)
        return joined

    def size_bytes(self) -> int:
        return sum(r.size_bytes() for r in self.files)

    def close(self):
        for reader in self.files:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _MergeState:
    """What the merge of earlier records tells about later ones: shards by their stored bytes, a gradient spread
    as its forward tensor is, a parameter's gradient as the parameter."""

    def __init__(self) -> None:
        self.shards_by_region: dict[tuple, tuple] = {}
        # (pipeline stage, (path, call, role, key)) -> how: a module several stages run (the model) has another
        # tensor on each (a stage's hidden states, the last stage's logits)
        self.forward_how: dict[tuple, tuple] = {}
        self.param_how: dict[str, tuple] = {}  # parameter name -> how


def _tensor_and_data(layouts: list[Mapping[str, Any]]) -> bool:
    """Ranks laid out with tensor and data parallelism both (tp > 1 and dp > 1)."""
    return all((lay.get("tp") or 1) > 1 and (lay.get("dp") or 1) > 1 for lay in layouts)


def _counterparts(records: list[Record], i: int, entry: TensorEntry) -> list[TensorEntry] | None:
    """The ``i``-th tensor of the first of ``records`` (``entry``) in each of them, found by role and key where
    the order differs; None when one lacks it."""
    found = [r.tensors[i] if i < len(r.tensors) and r.tensors[i].key == entry.key else _find(r, entry)
             for r in records]
    parts = [p for p in found if p is not None]
    return parts if len(parts) == len(found) else None


def _hybrid_shards(parts: list[TensorEntry], ranks: list[int]) -> tuple[list[TensorEntry], list[int], int] | None:
    """A weight (or its gradient) that HSDP holds (``R, S(d)`` on a 2-D mesh: copies over the replicas, shards
    within each): (the first replica's shards, their ranks, d); None for any other placement. The other replicas
    hold copies of those shards (compared rank against rank by ``layerdiff align RUN``)."""
    places = [p.placement or {} for p in parts]
    if not all(len(place.get("placements") or ()) == 2 and place["placements"][0] == "R"
               and _SHARD.match(place["placements"][1]) and len(place.get("coord") or ()) == 2 for place in places):
        return None
    first = [(place["coord"][1], part, rank) for place, part, rank in zip(places, parts, ranks)
             if place["coord"][0] == 0]
    if len(first) < 2:
        return None
    first.sort(key=lambda held: held[0])
    dim = _SHARD.match(places[0]["placements"][1])
    return [part for _, part, _ in first], [rank for _, _, rank in first], int(dim.group(1)) if dim else 0


def _tensor_parallel_piece(entry: TensorEntry, how: tuple, tp: int) -> list[int] | None:
    """The shape of a tensor-parallel rank's piece of a weight (before FSDP shards it for storage): its global
    shape with the split axis cut in ``tp`` (the first, larger chunks of an uneven split)."""
    shape = list((entry.placement or {}).get("global_shape") or ())
    if how[0] != "concat" or not shape:
        return None
    dim = how[1] % len(shape)
    shape[dim] = -(-shape[dim] // tp)
    return shape


def _within_replica(entry: TensorEntry, how: tuple | None) -> tuple | None:
    """A partial sum's join among the tensor-parallel ranks of one data-parallel replica: a sum over the
    data-parallel ranks alone (a gradient DDP adds up) is the same on each of them, one copy; one over both (a
    sequence-parallel norm's) adds up the tensor-parallel ranks', its scale left to the replicas' join; one over
    the tensor-parallel ranks (a DTensor's) adds them up."""
    if not how or how[0] != "sum":
        return how
    place = entry.placement or {}
    if len(place.get("mesh") or ()) >= 2:
        return "sum", None
    # a 1-D sum is the data-parallel group's where the framework's reduction placed it (Megatron's, DDP's); a
    # DTensor's own partial sum (a column-parallel layer's input gradient) is the tensor-parallel ranks'
    return ("replicate", None) if place.get("source") in ("megatron", "ddp") else how


def _ranks(ranks: list[int]) -> tuple[int, ...] | None:
    """A part list's ranks as ``Merge.ranks`` keeps them (None for every rank in order from 0)."""
    return None if ranks == list(range(len(ranks))) else tuple(ranks)


def _owns(layout: Mapping[str, Any], path: str) -> bool:
    """Whether ``path`` is, or lies in, a module this rank holds apart from the other ranks of its stage."""
    return any(path == own or path.startswith(own + ".") for own in layout.get("own_modules") or ())


def unwrapped(records: list[Record], layout: Mapping[str, Any]) -> list[Record]:
    """A rank's records without its data-parallel wrapper (``ParallelLayout.wrapped``: DDP's ``module``): the
    wrapper's own calls (which hand its inputs and outputs through) are left out, and the model it wraps is the
    root, under its own names (``module.model.layers.0`` is ``model.layers.0``), as one process names it."""
    child = layout.get("wrapped")
    if not child:
        return records
    out: list[Record] = []
    for rec in records:
        if isinstance(rec, CallRecord):
            if rec.path == "" or not _inside(rec.path, child):
                continue
            parent = None if rec.parent is None or rec.parent[0] == "" else (_unwrap(rec.parent[0], child),
                                                                            rec.parent[1])
            out.append(replace(rec, path=_unwrap(rec.path, child), parent=parent))
        elif isinstance(rec, ParamRecord):
            out.append(replace(rec, path=_unwrap(rec.path, child),
                               module=None if rec.module is None else _unwrap(rec.module, child),
                               tied=None if rec.tied is None else [_unwrap(t, child) for t in rec.tied]))
        else:
            out.append(rec)
    return out


def _inside(path: str, child: str) -> bool:
    return path == child or path.startswith(child + ".")


def _unwrap(path: str, child: str) -> str:
    return path[len(child) + 1:] if path.startswith(child + ".") else "" if path == child else path


def _renamed(rec: Record, renames: dict[str, str]) -> Record:
    """A rank's record under the whole model's names."""
    if isinstance(rec, CallRecord):
        parent = rec.parent and (global_path(renames, rec.parent[0]), rec.parent[1])
        return replace(rec, path=global_path(renames, rec.path), parent=parent)
    if isinstance(rec, ParamRecord):
        return replace(rec, path=global_path(renames, rec.path),
                       module=None if rec.module is None else global_path(renames, rec.module),
                       tied=None if rec.tied is None else [global_path(renames, t) for t in rec.tied])
    return rec


def _renamed_op(op: OpRecord, renames: dict[str, str]) -> OpRecord:
    """A rank's operation under the whole model's names (its module's, and those its producers name)."""
    if not renames:
        return op
    producers = op.producers and {key: replace(p, path=global_path(renames, p.path)) if p.path is not None else p
                                  for key, p in op.producers.items()}
    return replace(op, path=global_path(renames, op.path), producers=producers)


def _shifted(op: OpRecord, by: int) -> OpRecord:
    """An operation numbered after ``by`` operations of its call that an earlier stage ran (and the operations
    it names as producers with it)."""
    if not by:
        return op
    producers = op.producers and {key: replace(p, index=p.index + by) if p.kind == "op" and p.index is not None
                                  else p for key, p in op.producers.items()}
    return replace(op, index=op.index + by, producers=producers)


_Timed = TypeVar("_Timed", bound=Union[Record, OpRecord])  # a record with a place in time


def _last_position(rec: Record | OpRecord) -> int:
    return rec.end if isinstance(rec, (CallRecord, OpRecord)) else getattr(rec, "seq", 0)


def _backward(rec: Record | OpRecord) -> bool:
    if isinstance(rec, (CallRecord, OpRecord)):
        return rec.phase == "backward"
    return rec.kind in ("param_grad", "param_grad_use")


def _placed(rec: _Timed, stage: int, last: int, span: int) -> _Timed:
    """A record's place in time among every stage's: a pipeline runs forward from stage 0 to the last and
    backward the other way, so each stage's positions are shifted by ``span`` times its place in that order."""
    shift = span * ((last - stage) if _backward(rec) else stage)
    if not shift:
        return rec
    if isinstance(rec, (CallRecord, OpRecord)):
        return replace(rec, begin=rec.begin + shift, end=rec.end + shift)
    if isinstance(rec, ParamRecord):
        return replace(rec, seq=rec.seq + shift)
    return rec


def _position(rec: Record | OpRecord) -> tuple:
    """Records in the order one process writes them: by step, then as they were completed."""
    return rec.step, _last_position(rec)


def _join_stages(merged: list[Record]) -> Record:
    """A module that several pipeline stages each run part of (the model, the decoder that holds the layers):
    its inputs are the first stage's and its outputs the last stage's; backward, the gradients w.r.t. its
    outputs arrive at the last stage and those w.r.t. its inputs leave the first."""
    first, last = merged[0], merged[-1]
    if not isinstance(first, CallRecord) or not isinstance(last, CallRecord):
        return first
    incomplete = any(isinstance(r, CallRecord) and r.incomplete for r in merged)
    error = next((r.error for r in merged if r.error), None)
    if first.phase == "forward":
        tensors = [t for t in first.tensors if t.role == "input"] + [t for t in last.tensors if t.role != "input"]
        return replace(first, tensors=tensors, end=last.end, incomplete=incomplete, error=error)
    tensors = [t for t in last.tensors if t.role == "grad_output"] + \
        [t for t in first.tensors if t.role == "grad_input"]
    return replace(first, tensors=tensors, begin=last.begin, incomplete=incomplete, error=error)


_GRAD_OF = {"grad_output": "output", "grad_input": "input"}


def _param_of(rec: Record):
    """A parameter gradient (whole or one use) is spread over the ranks as its parameter is."""
    return rec.path if rec.kind in ("param_grad", "param_grad_use") else None


def _forward_key(rec: Record, entry: TensorEntry):
    """The forward tensor a gradient belongs to (it is spread over the ranks as that tensor is)."""
    if not isinstance(rec, CallRecord) or rec.phase != "backward" or entry.role not in _GRAD_OF:
        return None
    return rec.path, rec.call, _GRAD_OF[entry.role], entry.key


def _like_input(entry: TensorEntry, known: dict):
    """An output shaped like a sharded input of the same call (an activation, a dropout on a shard)."""
    if entry.role not in ("output", "grad_input"):
        return None
    return known.get(tuple(entry.shape))


def _key(rec: Record) -> tuple:
    if isinstance(rec, CallRecord):
        return rec.kind, rec.phase, rec.path, None, rec.call
    return rec.kind, None, rec.path, rec.module, rec.call


def _region(entry: TensorEntry):
    return entry.offset, entry.nbytes, entry.dtype


def _find(rec: Record, entry: TensorEntry) -> TensorEntry | None:
    return next((t for t in rec.tensors if t.role == entry.role and t.key == entry.key), None)


# ---------------------------------------------------------------------------------------------------------
# Ranks against each other: what data-parallel replicas must agree on
# ---------------------------------------------------------------------------------------------------------
def replica_exempt(run: RankedRun, peers: bool = False) -> list[list]:
    """The tensors that ranks hold differently by design (shards, partial sums; in a tensor-parallel run also the
    plain tensors of unknown placement, which may be shards): left out when ranks are compared with each other.
    Plain data (``[record key, role, tensor key]`` each), so a worker comparing two ranks gets it with its task
    and opens those two ranks' traces only. ``peers``: for the tensor-parallel ranks of one data-parallel replica
    (``RankedRun.peer_groups``), by how the replica's ranks were joined."""
    def joined(t: TensorEntry) -> str | None:
        """How the ranks compared hold ``t``: how it was joined (a replica's ranks: how their part was)."""
        inner = t.parts[0] if peers and t.parts and t.parts[0].merge is not None else t
        return inner.merge.how if inner.merge is not None else None

    # a gradient's partial sums say nothing of shards (data-parallel replicas' gradients are partial sums too)
    kinds = {joined(t) for rec in run.records if rec.kind != "param_grad" for t in rec.tensors if t.merge is not None}
    left_out = {"concat", "concat_parts", "sum"}
    if kinds & left_out:  # tensor parallel: a tensor of unknown placement may be a shard, not a replica
        left_out.add("ranks")
    # Megatron marks its tensor-parallel shards: every other weight is a copy on each rank of its stage
    copies = {"ranks"} if any(run.layouts) else set()
    spread = {(_key(rec), t.role, t.key) for rec in run.records for t in rec.tensors if t.merge is not None
              and joined(t) in left_out and not (rec.kind == "param" and joined(t) in copies)}
    return [[list(key), role, name] for key, role, name in sorted(spread, key=repr)]


def own_shares(readers: list, layouts: list) -> bool:
    """Whether data-parallel replicas were given their own shares of the batch, as data parallelism does: no two
    replicas' first root calls (at the same pipeline stage) had the same inputs. Replicas given one batch each,
    but for one that was given another, are replicas that lost step (a desync), not shares."""
    firsts: dict[tuple[int, int], Any] = {}
    for reader, layout in zip(readers, layouts):
        place = (int(layout.get("pp_rank") or 0), int(layout.get("dp_rank") or 0))
        if place not in firsts:
            firsts[place] = next(root_calls(reader.records), None)
    pairs = [(a, b) for (pa, a), (pb, b) in itertools.combinations(firsts.items(), 2) if pa[0] == pb[0]]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return False
    return not any(_same_inputs(a, b) for a, b in pairs)


def _same_inputs(a: CallRecord, b: CallRecord) -> bool:
    inputs_a, inputs_b = ([t for t in rec.tensors if t.role == "input"] for rec in (a, b))
    return len(inputs_a) == len(inputs_b) and all(alike([x, y]) for x, y in zip(inputs_a, inputs_b))


class RankView:
    """One rank's trace as a trace of its own, without the tensors that ranks hold differently by design
    (``replica_exempt``): comparing two views finds where replicas that should agree stop agreeing.
    ``own_shares``: the data-parallel ranks were given their own shares of the batch (``own_shares``): their
    weights alone must agree."""

    def __init__(self, reader: TraceReader, exempt: list[list], own_shares: bool = True):
        self.reader = reader
        self.path = reader.path
        self.meta, self.crashed, self.end = self.reader.meta, self.reader.crashed, self.reader.end
        self.damage, self.unverified = self.reader.damage, self.reader.unverified
        layout = reader.meta.get("parallel") or {}
        renames = layout.get("global_paths") or {}
        split = set(layout.get("split_modules") or ())
        own_data = (layout.get("dp") or 1) > 1 and own_shares  # data-parallel ranks, each its own share of the batch
        spread = {(tuple(key), role, name) for key, role, name in exempt}
        records = [_renamed(rec, renames) if renames else rec  # the run's names
                   for rec in unwrapped(self.reader.records, layout)]
        self.records = [replace(rec, tensors=[t for t in rec.tensors if (_key(rec), t.role, t.key) not in spread
                                              and (not own_data or rec.kind == "param")])
                        for rec in records if not _owns(layout, rec.path)
                        and not (isinstance(rec, CallRecord) and rec.path in split)
                        and (not own_data or rec.kind != "param_grad")]
        self.ops = self.reader.ops if not own_data else []  # one rank's own operations (replicas run the same)

    def tensor(self, entry):
        return self.reader.tensor(entry)

    def tensor_chunks(self, entry, chunk_elems):
        return self.reader.tensor_chunks(entry, chunk_elems)

    def data_segments(self, entry):
        return self.reader.data_segments(entry)

    def close(self):
        pass
