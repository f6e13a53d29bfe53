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
from typing import Any, Mapping

import numpy as np
from msgspec.structs import replace

from layerdiff.errors import TraceFormatError
from layerdiff.tracefile.index import Damage
from layerdiff.match.operands import combine_stats
from layerdiff.tracefile.reader import TraceReader
from layerdiff.tracefile.records import CallRecord, EndRecord, Merge, OpRecord, Record, TensorEntry
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
        return "sum", None
    return None


class RankedRun:
    """The ``TraceReader`` interface over a directory of per-rank traces (see the module docstring)."""

    def __init__(self, path, files, rules=None):
        from layerdiff.match.rules import builtin

        self.path = Path(path)
        self.rules = rules or builtin()
        self.every_part: dict = {}  # module -> number of parts each shard holds a slice of
        self.readers = []
        try:
            for f in files:
                self.readers.append(TraceReader(f))
        except Exception:
            self.close()
            raise
        self._check_complete(files)
        first = self.readers[0]
        self.meta_framework = first.meta.get("framework")
        self.meta = {**first.meta, "ranks": len(self.readers)}
        self.crashed = any(r.crashed for r in self.readers)
        self.damage = [Damage(f"rank {rank}: {d.where}", d.why, d.reads_as) for rank, r in enumerate(self.readers)
                       for d in r.damage]
        self.unverified = sum(r.unverified for r in self.readers)
        self.end = self._end()
        self._joined = 0  # joined entries made so far (each gets its own negative offset)
        self.records = self._merge()
        self.ops: list[OpRecord] = []  # operations are not joined across ranks: align one rank's trace for them

    @property
    def world_size(self) -> int:
        return len(self.readers)

    def _check_complete(self, files):
        sizes = {(r.meta.get("distributed") or {}).get("world_size") for r in self.readers}
        expected = sizes.pop() if len(sizes) == 1 else None
        numbers = [_rank_number(f) for f in files]
        if expected is None or numbers != list(range(expected)):
            self.close()
            raise TraceFormatError(f"{self.path}: incomplete run: traces of ranks {numbers}, but the run had "
                                   f"{expected if expected is not None else 'differing world sizes'} ranks")

    def _end(self) -> EndRecord | None:
        ends = [r.end for r in self.readers if r.end is not None]
        if len(ends) < len(self.readers):
            return None
        failed = next((e for e in ends if e.status == "error"), None)
        return replace(ends[0], status="error", failure=failed.failure) if failed else ends[0]

    # -- merging ------------------------------------------------------------------------------------------
    def _merge(self) -> list:
        per_rank = []
        for reader in self.readers:
            per_rank.append({_key(r): r for r in reader.records})
        sharded_weights = self._sharded_weights()
        shards_by_region: dict = {}
        forward_how: dict = {}  # (path, call, role, key) -> how: a gradient is spread as its tensor is
        param_how: dict = {}  # parameter name -> how: its gradient is spread as it is
        out = []
        for rec in self.readers[0].records:
            found = [index.get(_key(rec)) for index in per_rank]
            twins = [t for t in found if t is not None]
            if len(twins) < len(found):
                out.append(replace(rec, ranks_missing=[i for i, t in enumerate(found) if t is None],
                                   tensors=[self._per_rank_entry([t]) for t in rec.tensors]))
                continue
            tensors: list[TensorEntry] = []
            known: dict[tuple, tuple] = {}
            for i, entry in enumerate(rec.tensors):
                located = [t.tensors[i] if i < len(t.tensors) and t.tensors[i].key == entry.key
                           else _find(t, entry) for t in twins]
                parts = [p for p in located if p is not None]
                if len(parts) < len(located):
                    tensors.append(self._per_rank_entry([entry]))
                    continue
                how = _placement_kind(entry) or self._inferred(rec, entry, sharded_weights, shards_by_region) \
                    or forward_how.get(_forward_key(rec, entry)) or param_how.get(_param_of(rec)) \
                    or (None if rec.path in sharded_weights else _like_input(entry, known))
                how = self._every_part(rec, how)
                merged_entry = self._merged_entry(parts, how)
                if rec.kind == "param" and how:
                    param_how[rec.path] = how
                if how and how[0] == "concat":
                    known[tuple(entry.shape)] = how
                    if entry.offset is not None:
                        shards_by_region[_region(entry)] = how
                if how and isinstance(rec, CallRecord) and rec.phase == "forward":
                    forward_how[(rec.path, rec.call, entry.role, entry.key)] = how
                tensors.append(merged_entry)
            out.append(replace(rec, tensors=tensors))
        return out

    def _sharded_weights(self) -> dict:
        """module path -> (placement dim of its weight, the weight's local shape) for sharded weights; modules
        whose shards hold a slice of every part of a fused weight (Megatron's gated linear_fc1: [gate_r; up_r])
        go to ``self.every_part`` with the number of parts."""
        out = {}
        for rec in self.readers[0].records:
            if rec.kind == "param" and rec.path.rpartition(".")[2] in ("weight", "gamma") and rec.tensors:
                entry = rec.tensors[0]
                how = _placement_kind(entry)
                if how and how[0] == "concat":
                    module = rec.module_path
                    dim, local = how[1], list(entry.shape)
                    if len(local) == 2 and self.rules.is_transposed(self.meta_framework, rec.module_type, rec.path):
                        dim, local = 1 - dim % 2, local[::-1]  # Paddle's [in, out]: as PyTorch's [out, in]
                    out[module] = (dim, local)
                    rule = self.rules.fused_rule(module.rpartition(".")[2])
                    if rule is not None and rule.tp_every_part and (entry.placement or {}).get("source") == "megatron":
                        self.every_part[module] = len(rule.parts)
        return out

    def _every_part(self, rec: Record, how):
        """A shard of a fused tensor that holds a slice of every part is joined part by part."""
        module = rec.path if isinstance(rec, CallRecord) else (rec.module or "")
        if how and how[0] == "concat" and module in self.every_part:
            return "concat_parts", how[1], self.every_part[module]
        return how

    def _inferred(self, rec: Record, entry: TensorEntry, weights: dict, regions: dict):
        """The placement of a plain tensor: that of the same stored bytes elsewhere, or the layer's by its weight
        (column-parallel: the output's last axis; row-parallel: the input's)."""
        if entry.offset is not None and _region(entry) in regions:
            return regions[_region(entry)]
        if not isinstance(rec, CallRecord) or rec.path not in weights or not entry.shape:
            return None
        dim, local = weights[rec.path]
        outputs = entry.role in ("output", "grad_output")
        if dim == 0 and outputs and entry.shape[-1] == local[0]:
            return "concat", len(entry.shape) - 1
        if dim in (1, -1) and not outputs and len(local) > 1 and entry.shape[-1] == local[1]:
            return "concat", len(entry.shape) - 1
        return None

    def _merged_entry(self, parts: list[TensorEntry], how: tuple | None) -> TensorEntry:
        kind = how[0] if how else "ranks"
        dim = None
        shape = list(parts[0].shape)
        stats: Mapping[str, Any] | None
        if how and kind in ("concat", "concat_parts"):
            dim = how[1] % max(len(shape), 1)
            shape[dim] = sum(p.shape[dim] for p in parts)
            stats = combine_stats([p.stats for p in parts])
        elif kind == "sum":
            stats = {"numel": math.prod(shape), "min": None, "max": None, "mean": None, "l2": None,
                     "nan": sum(p.stats.get("nan", 0) for p in parts), "inf": sum(p.stats.get("inf", 0) for p in parts)}
        else:
            stats = parts[0].stats
        merge = Merge(kind, dim, how[2] if how and kind == "concat_parts" else None)
        return self._register(replace(parts[0], shape=shape, stats=stats or parts[0].stats, merge=merge,
                                      parts=tuple(parts), placement=None), parts)

    def _per_rank_entry(self, parts: list[TensorEntry]) -> TensorEntry:
        return self._register(replace(parts[0], merge=Merge("ranks"), parts=tuple(parts)), parts)

    def _register(self, entry: TensorEntry, parts: list[TensorEntry]) -> TensorEntry:
        """A joined entry's bytes are its parts': it gets a region of its own (a negative offset, unique in this
        run) so that comparisons memoized by region never mistake it for one rank's tensor."""
        if all(p.offset is not None for p in parts):
            self._joined += 1
            return replace(entry, offset=-self._joined, nbytes=sum(p.nbytes or 0 for p in parts))
        return replace(entry, offset=None, nbytes=None)

    # -- reading ------------------------------------------------------------------------------------------
    def part_values(self, entry: TensorEntry) -> list:
        """Each rank's stored bits of a merged entry, in rank order."""
        return [reader.tensor(part) for reader, part in zip(self.readers, entry.parts)]

    def tensor(self, entry: TensorEntry) -> np.ndarray:
        merge = entry.merge
        if merge is None:
            return self.readers[0].tensor(entry)
        if merge.how in _ONE_COPY:
            return self.readers[0].tensor(entry.parts[0])
        values = self.part_values(entry)
        if merge.how == "concat":
            return np.concatenate(values, axis=merge.axis)
        if merge.how == "concat_parts":  # [g0; u0], [g1; u1] -> [g0; g1; u0; u1]
            pieces = [np.split(v, merge.part_count, axis=merge.axis) for v in values]
            return np.concatenate([np.concatenate([p[i] for p in pieces], axis=merge.axis)
                                   for i in range(merge.part_count)], axis=merge.axis)
        if merge.how == "sum":  # added as values (bfloat16's stored bits are integers), kept as stored bits
            total = np.sum([as_float(v, entry.dtype).astype(np.float64) for v in values], axis=0)
            return encode_float(total, entry.dtype)
        return values[0]

    def tensor_chunks(self, entry: TensorEntry, chunk_elems: int):
        """The merged tensor's stored bits, flattened, in pieces (``TraceReader.tensor_chunks``). Streamed from the
        rank files, so memory stays flat, where the parts follow one another in its flat order: one rank's copy,
        shards joined on the first axis. Shards of another axis interleave and partial sums add up: those are
        joined in memory first."""
        merge, parts = entry.merge, entry.parts
        if merge is None or not parts:
            return self.readers[0].tensor_chunks(entry, chunk_elems)
        if merge.how in _ONE_COPY:
            return self.readers[0].tensor_chunks(parts[0], chunk_elems)
        if merge.how == "concat" and merge.dim == 0:
            return itertools.chain.from_iterable(reader.tensor_chunks(part, chunk_elems)
                                                 for reader, part in zip(self.readers, parts))
        flat = self.tensor(entry).reshape(-1)
        return (flat[start:start + chunk_elems] for start in range(0, flat.size, chunk_elems))

    def data_segments(self, entry: TensorEntry) -> list | None:
        """``TraceReader.data_segments`` of a merged tensor: one rank's copy, or each rank's shard when shards
        follow one another in its flat order (joined on the first axis); None for the joins made in memory."""
        merge, parts = entry.merge, entry.parts
        if merge is None or not parts:
            return self.readers[0].data_segments(entry)
        if merge.how in _ONE_COPY:
            return self.readers[0].data_segments(parts[0])
        if merge.how != "concat" or merge.dim != 0:
            return None
        segments = [reader.data_segments(part) for reader, part in zip(self.readers, parts)]
        joined: list = []
        for found in segments:
            if found is None:
                return None
            joined.extend(found)
        return joined

    def size_bytes(self) -> int:
        return sum(r.size_bytes() for r in self.readers)

    def close(self):
        for reader in self.readers:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
class RankView:
    """One rank of a run as a trace of its own, without the tensors that ranks hold differently by design
    (shards, partial sums): comparing two views finds where replicas that should agree stop agreeing."""

    def __init__(self, run: RankedRun, rank: int):
        self.reader = run.readers[rank]
        self.path = Path(f"{run.path}/rank{rank}.h5")
        self.meta, self.crashed, self.end = self.reader.meta, self.reader.crashed, self.reader.end
        self.damage, self.unverified = self.reader.damage, self.reader.unverified
        kinds = {t.merge.how for rec in run.records for t in rec.tensors if t.merge is not None}
        left_out = {"concat", "concat_parts", "sum"}
        if kinds & left_out:  # tensor parallel: a tensor of unknown placement may be a shard, not a replica
            left_out.add("ranks")
        spread = {(_key(rec), t.role, t.key) for rec in run.records for t in rec.tensors
                  if t.merge is not None and t.merge.how in left_out}
        self.records = [replace(rec, tensors=[t for t in rec.tensors if (_key(rec), t.role, t.key) not in spread])
                        for rec in self.reader.records]
        self.ops = self.reader.ops  # one rank's own operations (replicas run the same ones)

    def tensor(self, entry):
        return self.reader.tensor(entry)

    def tensor_chunks(self, entry, chunk_elems):
        return self.reader.tensor_chunks(entry, chunk_elems)

    def data_segments(self, entry):
        return self.reader.data_segments(entry)

    def close(self):
        pass
