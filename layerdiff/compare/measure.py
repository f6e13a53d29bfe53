"""The measuring pass of align: match two traces' records (``match``) and compute metrics for every tensor pair.

The expensive part of an alignment; its result (the report's measured half) is judged by ``judge.evaluate``,
which needs nothing else, so a saved report can be judged again under other tolerances without the traces."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional, cast

import msgspec
import numpy as np

from layerdiff import schema
from layerdiff.compare import per_rank
from layerdiff.compare.configs import diff_configs, from_values
from layerdiff.compare.metrics import CHUNK_ELEMS, compare_arrays, compare_data, compare_stats
from layerdiff.compare.nonfinite import first_nonfinite
from layerdiff.compare.recompute import recompute_check
from layerdiff.compare.replayed import MAX_ELEMENTS, REPLAYED, dimension, own_error
from layerdiff.compare.settings import settings_report
from layerdiff.compare.spec import Comparison
from layerdiff.compare.tasks import Workers
from layerdiff.compare.workers import aligned_pairs, compare_pairs
from layerdiff.errors import LayerdiffError
from layerdiff.match import modules
from layerdiff.match.joins import line_up, resolved_as, root_calls, unresolved, ways
from layerdiff.match.layouts import LayoutRules, TokenOrder, relate_shapes
from layerdiff.match.mapping import ModuleMapping, match_modules
from layerdiff.match.microbatches import joined_pair
from layerdiff.match.operands import Operand
from layerdiff.match.ops import OpPair, arguments_diff, pair_ops
from layerdiff.match.pairing import RecordPair, TensorPair, match_records
from layerdiff.match.rules import RuleSet
from layerdiff.match.sides import TraceSide, token_order
from layerdiff.tracefile.checksums import DamagedTensorError
from layerdiff.tracefile.records import MICROBATCHES, CallRecord, EndRecord, OpRecord, Record, TensorEntry
from layerdiff.tracefile.tensors import as_float


# ---------------------------------------------------------------------------------------------------------
# Pass 1: measure
# ---------------------------------------------------------------------------------------------------------
def trace_summary(reader) -> schema.RunSummary:
    meta = reader.meta
    end = reader.end or EndRecord(status="interrupted")
    return {"path": str(reader.path), "framework": meta.get("framework"),
            "framework_version": meta.get("framework_version"), "model_class": meta.get("model_class"),
            "mode": meta.get("mode"), "records": len(reader.records), "complete": not reader.crashed,
            "status": end.status or "interrupted", "failure": cast(Optional[schema.Failure], end.failure),
            "warnings": end.warnings, "param_dtypes": meta.get("param_dtypes"),
            "autocast_dtypes": list(end.autocast_dtypes),
            "target": (meta.get("user") or {}).get("target"), "target_args": (meta.get("user") or {}).get("target_args"),
            "devices": meta.get("devices"), "damage": [d.describe() for d in reader.damage],
            "unverified": reader.unverified}


def _short(rec: Record) -> schema.ShortRecord:
    return {"kind": rec.kind, "phase": rec.phase, "path": rec.path, "call": rec.call}


def _region(entry: TensorEntry):
    return entry.offset, entry.nbytes, entry.dtype


def _compare_declared(reader_a, reader_b, ta: TensorEntry, tb: TensorEntry, rule) -> schema.Metrics:
    """B's tensor through a user-declared layout transform, then compared as A's shape."""
    if ta.offset is None or tb.offset is None:
        metrics = compare_stats(ta.stats, tb.stats)  # statistics survive transposes and reshapes
    else:
        try:
            b = LayoutRules.apply(rule, _values(reader_b, tb))
        except ValueError as exc:
            return {"basis": "shape", "mismatch": f"layout {rule[2]} on B's {tb.shape}: {exc}",
                    "numel": math.prod(ta.shape)}
        if list(b.shape) != list(ta.shape):
            return {"basis": "shape", "mismatch": f"shape {ta.shape} vs {list(b.shape)} after {rule[2]}",
                    "numel": math.prod(ta.shape)}
        metrics = _compare_values(_values(reader_a, ta), b)
    metrics["note"] = f"B compared after layout rule {rule[2]}"
    return metrics


def _values(reader, t: TensorEntry) -> np.ndarray:
    """Decoded values: float32 (for fp32/fp16/bf16) or float64 (fp64, integers)."""
    values = as_float(reader.tensor(t), t.dtype)
    return values if values.dtype in (np.float32, np.float64) else values.astype(np.float64)


PADDING_MASK_KEYS = ("kwargs.attention_mask",)
_PADDING_MAX_ELEMENTS = 1 << 26  # a side: larger tensors are compared at every position, as they are streamed


def padding_masks(reader_a, reader_b) -> dict[int, np.ndarray]:
    """step -> the positions to compare ([batch, seq] booleans), where both runs' root call was given the same
    ``attention_mask`` of ones and zeros with some zeros (padding).

    Why: the values a model computes at padded positions are never used (the loss and the other positions do not
    read them), and implementations differ there by design: with a left-padded batch, a query whose keys are all
    masked gets a uniform average from eager attention and something else from SDPA, so eager against SDPA was
    "divergent" at the first attention. Tensors that lead with [batch, seq] are compared at the other positions."""
    roots_b: dict[int, CallRecord] = {}
    for rb in root_calls(reader_b.records):
        roots_b.setdefault(rb.step, rb)  # a step's first (microbatches: the first one's mask)
    masks: dict[int, np.ndarray] = {}
    seen: set[int] = set()
    for ra in root_calls(reader_a.records):
        other = roots_b.get(ra.step)
        if other is None or ra.step in seen:
            continue
        seen.add(ra.step)
        ea = next((t for t in ra.tensors if t.key in PADDING_MASK_KEYS and t.role == "input"), None)
        eb = next((t for t in other.tensors if t.key in PADDING_MASK_KEYS and t.role == "input"), None)
        if ea is None or eb is None or ea.offset is None or eb.offset is None or len(ea.shape) != 2 or \
                list(ea.shape) != list(eb.shape):
            continue
        try:
            va, vb = _values(reader_a, ea), _values(reader_b, eb)
        except DamagedTensorError:
            continue
        if np.array_equal(va, vb) and np.isin(va, (0, 1)).all() and not va.all():
            masks[ra.step] = va != 0
    return masks


def _unpadded(metrics: schema.Metrics, a: Operand, b: Operand, relation, readers, keep: np.ndarray) -> schema.Metrics:
    """The pair compared at the positions ``keep`` marks, where A's tensor (as compared) leads with [batch, seq];
    ``metrics`` as they were otherwise."""
    if tuple(a.shape[:2]) != keep.shape or relation.kind not in ("same", "reshape", "permute") or \
            math.prod(a.shape) > _PADDING_MAX_ELEMENTS or metrics.get("basis") != "data":
        return metrics
    reader_a, reader_b = readers
    va, vb = relation.views(_side("A", a.values, reader_a), _side("B", b.values, reader_b))
    rows = keep.reshape(-1)
    kept = _compare_values(va.reshape(rows.size, -1)[rows], vb.reshape(rows.size, -1)[rows])
    note = f"{int(rows.size - rows.sum())} of {rows.size} positions left out: padding (attention_mask 0 in both runs)"
    # the per-rank and per-microbatch metrics (``ranks``, ``microbatches``) stay as measured, over every position
    return {**metrics, **kept, "note": f"{metrics['note']}; {note}" if metrics.get("note") else note}


def _compare_values(a: np.ndarray, b: np.ndarray) -> schema.Metrics:
    return compare_arrays(np.ascontiguousarray(a), np.ascontiguousarray(b), str(a.dtype), str(b.dtype))


def _prepared(tp: TensorPair, path_a: str, layouts: LayoutRules, swap: TokenOrder | bool):
    """(A's operand, B's operand, a declared layout rule or None, how their shapes relate)."""
    a, b = _resolved(tp.a, tp.b.shape), _resolved(tp.b, tp.a.shape)
    relation = relate_shapes(a.shape, b.shape, _grouped(swap, a, b) if tp.activation else False)
    if relation.kind == "broadcast" and tp.role.startswith("grad"):
        relation = replace(relation, summed=True)  # a tensor used broadcast gathers the gradients of every copy
    return a, b, layouts.find(path_a), relation


def _grouped(swap: TokenOrder | bool, a: Operand, b: Operand) -> TokenOrder | bool:
    """The token order of a pair whose sequence-first side joined its ranks' flattened tokens one after the other
    (an MoE router's input over data-parallel ranks): each rank's block is sequence-first on its own."""
    if not isinstance(swap, TokenOrder):
        return swap
    operand = a if swap.sequence_first == "a" else b
    merge = operand.entry.merge
    if merge is not None and merge.over == "ranks" and merge.how == "concat" and merge.dim == 0 and \
            len(operand.entry.parts) > 1 and operand.shape and operand.shape[0] == swap.batch * swap.seq:
        return replace(swap, groups=len(operand.entry.parts))
    return swap


def _stored_key(a: Operand, b: Operand, rule, relation):
    """The key of a pair compared straight from its stored bytes, element by element (None: another way)."""
    if rule is None and relation.ok and a.has_data and b.has_data and a.plain and b.plain \
            and relation.kind in ("same", "reshape"):
        return (_region(a.entry), _region(b.entry), a.shape, b.shape)
    return None


@dataclass
class _Measured:
    """Metrics of stored pairs compared by workers, keyed like ``_pair_metrics``' memo, and the pairs whose tasks
    failed on a cluster (key -> why): those are named in the report, not compared here."""

    memo: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)


def _compare_in_workers(pairs, readers, layouts: LayoutRules, swap: TokenOrder | bool, workers: Workers,
                        progress) -> _Measured:
    """The pairs compared straight from stored bytes, by workers (``compare.workers``: processes of this machine
    for traces over ``LOCAL_MIN_BYTES`` a side, or a Dask cluster's whenever a scheduler is given); nothing when
    they are too few bytes to be worth it, or there are no workers."""
    if not workers.parallel:
        return _Measured()
    jobs = {}
    for pair in pairs:
        for tp in pair.tensors:
            a, b, rule, relation = _prepared(tp, pair.a.path, layouts, swap)
            key = _stored_key(a, b, rule, relation)
            if key is None or key in jobs:
                continue
            segments_a, segments_b = (r.data_segments(o.entry)
                                      for r, o in zip(readers, (a, b)))
            if segments_a and segments_b:
                pieces = aligned_pairs(segments_a, a.entry.dtype, segments_b, b.entry.dtype)
                if pieces:
                    jobs[key] = pieces
    total = sum(piece.nbytes() for pieces in jobs.values() for piece in pieces)
    if not workers.sends(total // 2):
        return _Measured()
    if progress is not None:
        progress.start(total)
    stored = [piece for pieces in jobs.values() for piece in pieces]
    groups = [n for n, pieces in enumerate(jobs.values()) for _ in pieces]
    with workers.pool() as pool:
        results = compare_pairs(stored, pool, progress, groups=groups)
    if progress is not None:
        progress.close()
    keys = list(jobs)
    return _Measured({key: m for key, m in zip(keys, results.metrics) if m is not None},
                     {keys[n]: f"{reason} ({pool.where})" for n, reason in results.failed.items()})


@dataclass(frozen=True)
class _TaskFailed:
    """A tensor pair whose tasks failed on a cluster: named in the report, not compared."""

    reason: str


def _pair_metrics(tp: TensorPair, path_a: str, readers, measured: _Measured, layouts: LayoutRules,
                  swap: TokenOrder | bool, keep: np.ndarray | None = None) -> schema.Metrics | _TaskFailed | None:
    """Metrics for one tensor pair (None: it cannot be compared from what the traces hold). A pair of stored
    regions already compared (records share deduplicated tensors, or workers compared it) is not read again."""
    reader_a, reader_b = readers
    memo = measured.memo
    a, b, rule, relation = _prepared(tp, path_a, layouts, swap)
    if rule is not None and a.plain and b.plain:
        return _compare_declared(reader_a, reader_b, a.entry, b.entry, rule)
    if not relation.ok:
        return {"basis": "shape", "mismatch": f"shape {list(a.shape)} vs {list(b.shape)}",
                "numel": math.prod(a.shape)}
    if a.has_data and b.has_data:
        key = _stored_key(a, b, rule, relation)
        if key is not None and key in measured.failed:
            return _TaskFailed(measured.failed[key])
        try:
            if key is not None:
                if key not in memo:
                    memo[key] = _compare_stored(a, b, reader_a, reader_b)
                if "damaged" in memo[key]:
                    return _damaged_metrics(a, b, memo[key]["damaged"])
                metrics: schema.Metrics = {**memo[key]}
            else:
                try:
                    va, vb = relation.views(_side("A", a.values, reader_a), _side("B", b.values, reader_b))
                except ValueError as exc:  # a fused split that the sizes do not allow
                    return {"basis": "shape", "mismatch": f"cannot derive the compared tensor: {exc}",
                            "numel": math.prod(a.shape)}
                metrics = _compare_values(va, vb)
            per_rank = _per_rank_metrics(a, b, relation, reader_a, reader_b)
        except DamagedTensorError as exc:
            return _damaged_metrics(a, b, str(exc))
        if per_rank:
            micro = per_rank.pop(MICROBATCHES, None)
            metrics[per_rank.pop("over", "ranks")] = per_rank  # type: ignore[literal-required]
            if micro:
                metrics[MICROBATCHES] = micro  # type: ignore[literal-required]
    else:
        sa, sb = a.stats(), b.stats()
        if sa is None or sb is None or relation.summed:  # a sum's statistics do not follow from its terms'
            return None
        metrics = compare_stats(sa, sb)  # min/max/mean/RMS survive reshapes, permutations and broadcasting
    notes = list(tp.notes)
    for side, operand in (("A", a), ("B", b)):
        merge = operand.entry.merge if operand.op == "value" else None
        if merge and len(operand.entry.parts) > 1:
            notes.append(f"{side}: {_joined(merge, len(operand.entry.parts))}")
    if a.transposed != b.transposed:
        notes.append(f"compared transposed ({'B' if b.transposed else 'A'} stores this weight as [in, out])")
    for side, operand in (("A", a), ("B", b)):
        text = operand.describe()
        if text and not operand.transposed and operand.op not in ("part", "masked", "cos", "sin"):  # noted already
            notes.append(f"{side}: {text}")
    if relation.note():
        notes.append(relation.note())
    if notes:
        metrics["note"] = "; ".join(dict.fromkeys(notes))
    if keep is not None and tp.activation and a.has_data and b.has_data:  # ``padding_masks``
        try:
            metrics = _unpadded(metrics, a, b, relation, readers, keep)
        except (DamagedTensorError, ValueError):
            pass  # compared at every position, as measured above
    return metrics


def _joined(merge, n: int) -> str:
    """How a tensor of several ranks or microbatches was joined, in words."""
    if merge.over == MICROBATCHES:
        if merge.how == "sum" and merge.scale is not None:  # a loss: each weighted by its backward's gradient
            return f"{n} microbatches added up, x{merge.scale:.6g}"
        if merge.how == "concat" and merge.scale is not None:  # gradients of microbatches' own mean losses
            return f"{n} microbatches joined on axis {merge.dim}, x{merge.scale:.6g}"
        return f"{n} microbatches " + {"concat": f"joined on axis {merge.dim}", "sum": "added up",
                                       "replicate": "alike (the first compared)",
                                       "batches": "unresolved"}.get(merge.how, merge.how)
    if merge.how == "sum" and merge.scale is not None and n > 1 and abs(merge.scale * n - 1) < 1e-12:
        return f"{n} ranks' mean"  # each rank's own share's (a loss, a gradient under data parallelism)
    return f"{n} ranks' " + {
        "concat": f"shards joined on axis {merge.dim}",
        "concat_parts": f"shards joined part by part on axis {merge.dim}",
        "replicate": "copies (rank 0's compared; each rank's checked)", "sum": "partial sums added",
        "ranks": "tensors, unresolved"}.get(merge.how, merge.how)


def _compare_stored(a: Operand, b: Operand, reader_a, reader_b) -> schema.Metrics:
    """Two stored tensors compared element by element as they are read, each verified against its checksums:
    the metrics, or ``{"damaged": why}`` when either side's bytes do not match them."""
    try:
        return compare_data(_side("A", reader_a.tensor_chunks, a.entry, CHUNK_ELEMS),
                            _side("B", reader_b.tensor_chunks, b.entry, CHUNK_ELEMS), a.dtype, b.dtype)
    except DamagedTensorError as exc:
        return {"damaged": str(exc)}


def _side(name: str, read, *args):
    """``read(*args)`` (a tensor's values, or its pieces as they are read), its damage named as run ``name``'s."""
    try:
        result = read(*args)
    except DamagedTensorError as exc:
        raise DamagedTensorError(f"{name}: {exc}") from None
    if isinstance(result, np.ndarray):
        return result
    return _named_pieces(name, result)


def _named_pieces(name: str, pieces):
    try:
        yield from pieces
    except DamagedTensorError as exc:
        raise DamagedTensorError(f"{name}: {exc}") from None


def _damaged_metrics(a: Operand, b: Operand, why: str) -> schema.Metrics:
    """A pair whose stored bytes are damaged on one side: compared by the statistics of its (verified) index
    line instead, with the damage said (``damaged``); ``DamagedTensorError`` when there are none to compare."""
    sa, sb = a.stats(), b.stats()
    if sa is None or sb is None:
        raise DamagedTensorError(why)
    metrics = compare_stats(sa, sb)
    metrics["damaged"] = why
    return metrics


def _resolved(operand: Operand, other_shape) -> Operand:
    """A tensor left per rank, or a step's microbatches, read against the other run's shape
    (``per_rank.resolve``); a value derived from such tensors (a part of a fused output) is joined the one way
    that makes the derived value line up with the other run's."""
    if not any(unresolved(e) for e in operand.entries):
        return operand
    if operand.op == "value":
        return replace(operand, entries=(per_rank.resolve(operand.entry, other_shape),))
    def joined(way) -> Operand:
        first = resolved_as(operand.entry, way) if unresolved(operand.entry) else operand.entry
        return replace(operand, entries=(first, *(_joined_like(e, way, first, operand.op)
                                                  for e in operand.entries[1:])))

    best = line_up(operand.entry, other_shape, lambda way: joined(way).shape)
    return operand if best is None else joined(best)


def _joined_like(entry: TensorEntry, way, first: TensorEntry, op: str) -> TensorEntry:
    """Another entry of a derived value, joined as its first entry is: the same way where the entries are parts of
    one tensor; for the bias an output is added to (``add_bias``), the way that lines it up with that output's last
    axis (a Megatron row-parallel linear's bias, a copy on every rank, was joined along the output's axis 1, which
    it does not have: an internal error)."""
    if not unresolved(entry):
        return entry
    if op == "add_bias":
        return per_rank.resolve(entry, tuple(first.shape[-1:]))
    return resolved_as(entry, way) if way in ways(entry) else entry


def _per_rank_metrics(a: Operand, b: Operand, relation, reader_a, reader_b) -> dict[str, Any] | None:
    """For a tensor one run holds spread over ranks: each rank's shard or copy against the matching piece of the
    other run, so a report can say "rank 1's shard of ..." ({rank: metrics})."""
    for side, operand, reader, other, other_reader in (("b", b, reader_b, a, reader_a), ("a", a, reader_a, b, reader_b)):
        if operand.op != "value" or operand.transposed or len(operand.entry.parts) < 2 \
                or not hasattr(reader, "part_values") or other.op != "value":
            continue
        other_values = other.values(other_reader)
        if side == "b":
            laid_out = relation.to_b(other_values)
        else:
            laid_out = other_values.reshape(operand.shape) if math.prod(operand.shape) == other_values.size else None
        pieces = per_rank.rank_slices(operand.entry, laid_out) if laid_out is not None else None
        if pieces is None:
            return None
        out: dict[str, Any] = {}
        copies = []
        merge = operand.entry.merge
        gathered: dict[int, tuple[list, list]] = {}  # a rank's pieces (several: its microbatches, in turn)
        by_micro: dict[int, tuple[list, list]] = {}  # ... and a microbatch's, over the ranks
        for rank, micro, mine, theirs, scale in _rank_pieces(reader, operand.entry, pieces):
            mine = as_float(mine, operand.entry.dtype).reshape(-1)
            if scale != 1.0:  # each part is the rank's own loss's gradient
                mine = mine * scale
            theirs = np.ascontiguousarray(theirs).reshape(-1)
            if mine.size != theirs.size:
                return None
            for groups, key in ((gathered, rank), (by_micro, micro)):
                if key is not None:
                    groups.setdefault(key, ([], []))[0].append(mine)
                    groups[key][1].append(theirs)
        def whole(pieces: list) -> np.ndarray:
            return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

        def compared(mine: np.ndarray, theirs: np.ndarray) -> schema.Metrics:  # A's first
            return _compare_values(theirs, mine) if side == "b" else _compare_values(mine, theirs)

        for rank, (ours, others) in gathered.items():
            copies.append(whole(ours))
            out[str(rank)] = compared(copies[-1], whole(others))
        if by_micro:  # data-parallel ranks' microbatches (each rank's joined first): each microbatch apart too
            out[MICROBATCHES] = {"how": "shards", "run": side,
                                 **{str(k): compared(whole(m), whole(o)) for k, (m, o) in sorted(by_micro.items())}}
        sharded = operand.entry.merge is not None and operand.entry.merge.how in ("concat", "concat_parts")
        out["how"] = "shards" if sharded else "copies"
        out["run"] = side  # whose ranks these are
        if merge is not None and merge.over == MICROBATCHES:
            out["over"] = MICROBATCHES  # each microbatch's slice: reported apart from ranks
            return out
        if not sharded and any(not np.array_equal(copies[0], c) for c in copies[1:]):
            # copies that should be equal are not: do they add up to the other run's (a missing all-reduce)?
            total = np.sum(np.stack([c.astype(np.float64) for c in copies]), axis=0)
            out["sum"] = _compare_values(pieces[0].reshape(-1).astype(np.float64), total)
        return out
    return None


def _rank_pieces(reader, entry, pieces: list, micro: int | None = None):
    """(rank, microbatch, its stored part, the other run's matching piece, the part's scale) for each part of a
    merged entry, down through parts joined over ranks themselves (a data-parallel replica's tensor-parallel
    ranks; a rank's microbatches, parts of one rank, which give the microbatch, else None): a rank can come
    several times. The scale is what the joins multiply a part by (a rank's own loss's gradient: their mean)."""
    merge = entry.merge
    scale = merge.scale if merge is not None and merge.scale is not None else 1.0
    one_rank = merge is not None and len(entry.parts) > 1 and \
        len({merge.rank_of(i) for i in range(len(entry.parts))}) == 1
    inner = [per_rank.rank_slices(part, piece) if merge is not None and merge.over == "ranks" and
             part.merge is not None and part.merge.over == "ranks" and len(part.parts) > 1 else None
             for part, piece in zip(entry.parts, pieces)]
    # a part compared piece by piece further down is not read whole here
    values = reader.part_values(entry) if any(x is None for x in inner) else [None] * len(inner)
    for i, (part, mine, piece, slices) in enumerate(zip(entry.parts, values, pieces, inner)):
        if slices is None:
            yield (merge.rank_of(i) if merge is not None else i), (i if one_rank else micro), mine, piece, scale
            continue
        for rank, sub_micro, value, theirs, own in _rank_pieces(reader, part, slices, i if one_rank else micro):
            yield rank, sub_micro, value, theirs, own * scale


def _tensor_row(tp: TensorPair, metrics: schema.Metrics) -> schema.TensorResult:
    def nonfinite(op):
        return sum(e.stats.get("nan", 0) + e.stats.get("inf", 0) for e in op.entries if e.stats)

    row: schema.TensorResult = {
        "role": tp.role, "key": tp.key, "dtype_a": tp.a.dtype, "dtype_b": tp.b.dtype,
        "shape_a": list(tp.a.shape), "shape_b": list(tp.b.shape), "metrics": metrics,
        "nonfinite_a": nonfinite(tp.a), "nonfinite_b": nonfinite(tp.b)}
    if _one_value(tp.a):  # a loss or a scalar: its value, shown step by step
        row["value_a"] = tp.a.entries[0].stats.get("mean")
    if _one_value(tp.b):
        row["value_b"] = tp.b.entries[0].stats.get("mean")
    if tp.key_b != tp.key:
        row["key_b"] = tp.key_b
        if tp.a.plain and tp.b.plain and not tp.notes:
            metrics["matched_by"] = f"position and shape (B's key: {tp.key_b})"
    return row


def _one_value(op: Operand) -> bool:
    """One stored tensor of one element (a loss)."""
    return len(op.entries) == 1 and (op.entries[0].stats or {}).get("numel") == 1


NO_LAYOUTS = LayoutRules()  # operations' tensors: the user's --layout rules name modules and parameters


def _op_info(op: OpRecord, forward: dict[tuple[str, int, int], OpRecord]) -> schema.OpInfo:
    """What a report says of one side's operation (arguments and producers from its forward record)."""
    first = forward.get((op.path, op.call, op.index), op)
    info: schema.OpInfo = {"index": op.index, "name": op.name, "kind": op.op, "source": op.source or first.source,
                           "function": op.function or first.function, "args": first.args or {}}
    if first.producers:
        info["producers"] = {key: msgspec.to_builtins(p) for key, p in first.producers.items()}
    if first.in_place:
        info["in_place"] = True
    return info


def _op_row(pair: OpPair, tensors: list[schema.TensorResult], skipped: list[str], ancestors: dict, rules: RuleSet,
            forward: list[dict[tuple[str, int, int], OpRecord]]) -> schema.Row:
    """The row of a pair of operations: it hangs under its module call in the judged tree (``judge.tree``)."""
    ra, rb = pair.a, pair.b[0]
    row: schema.Row = {
        "kind": "op", "phase": ra.phase, "path": ra.path, "path_b": rb.path, "call": ra.call, "step": ra.step,
        "type_a": ra.name, "type_b": rb.name, "family_a": rules.op_kind(ra.op), "family_b": rules.op_kind(rb.op),
        "begin": ra.begin, "end": ra.end, "parent": [ra.path, ra.call],
        "ancestors": [[ra.path, ra.call], *ancestors.get((ra.path, ra.call), [])],
        "op": _op_info(ra, forward[0]), "op_b": _op_info(rb, forward[1]), "error_a": ra.error, "error_b": rb.error,
        "tensors": tensors, "only_a": pair.only_a, "only_b": pair.only_b}
    if skipped:
        row["skipped"] = skipped
    row["args_diff"] = {} if pair.how.startswith("fused") else \
        arguments_diff(row["op"].get("args"), row["op_b"].get("args"), rules.op_arguments)
    return row


def _replay_own(pair: RecordPair | OpPair, tensors: list[schema.TensorResult], rules: RuleSet, readers) -> None:
    """An operation of ``compare.replayed``'s table, one input and one output stored in each run: each run's output
    against the reference's operation (A's dimension) replayed in float64 from that run's own input, as
    ``own_error`` {"a", "b"} of the output's metrics (where either cannot be replayed, nothing)."""
    ra = pair.a
    out = next((t for t in tensors if t["role"] == "output"), None)
    if ra.phase != "forward" or len(pair.b) != 1 or out is None:
        return
    families = [rules.op_kind(r.op) if isinstance(r, OpRecord) else rules.family(r.type or r.module_type)
                for r in (ra, pair.b[0])]
    if families[0] != families[1] or families[0] not in REPLAYED:
        return
    dim = dimension(ra.hparams, ra.args if isinstance(ra, OpRecord) else None)
    errors: dict[str, float] = {}
    for side, rec, reader in (("a", ra, readers[0]), ("b", pair.b[0], readers[1])):
        ins = [e for e in rec.tensors if e.role == "input"]
        outs = [e for e in rec.tensors if e.role == "output"]
        if len(ins) != 1 or len(outs) != 1 or not (ins[0].stored and outs[0].stored) or \
                math.prod(ins[0].shape) > MAX_ELEMENTS:
            return
        try:
            x, y = (_values(reader, e).reshape(e.shape) for e in (ins[0], outs[0]))
        except DamagedTensorError:
            return
        error = own_error(families[0], x, y, dim)
        if error is None:
            return
        errors[side] = error
    out["metrics"] = {**out["metrics"], "own_error": errors}


def _describe_row(rec: Record | OpRecord) -> str:
    """A record as a damage line names it."""
    if isinstance(rec, OpRecord):
        return f"op {rec.phase} {rec.path or '<root>'} call {rec.call} operation {rec.index} ({rec.name})"
    if isinstance(rec, CallRecord):
        return f"call {rec.phase} {rec.path or '<root>'} call {rec.call}"
    return f"{rec.kind} {rec.path}"


def _data_bytes(rec: Record | OpRecord) -> int:
    return sum(t.nbytes or 0 for t in rec.tensors)


def _ancestors(records) -> dict:
    """(path, call) -> A's chain of enclosing calls, innermost first: a row whose parent has no counterpart hangs
    under its nearest ancestor that has one."""
    parents = {(r.path, r.call): tuple(r.parent) if r.parent else None
               for r in records if r.kind == "call" and r.phase == "forward"}
    out = {}
    for key in parents:
        chain, seen, up = [], {key}, parents[key]
        while up is not None and up not in seen:
            chain.append(list(up))
            seen.add(up)
            up = parents.get(up)
        out[key] = chain
    return out


def module_mapping(reader_a, reader_b, how: Comparison) -> ModuleMapping:
    """Which module of B is which of A (``match.mapping``), from the two traces' records."""
    return match_modules(modules.from_records(reader_a.records), modules.from_records(reader_b.records), how.rules,
                         how.rename, how.auto_map)


def measure(reader_a, reader_b, how: Comparison | None = None, *, progress=None,
            mapping: ModuleMapping | None = None) -> schema.Report:
    """Match the two traces (inferring renamed and fused modules unless ``how`` says not to) and compute metrics for
    every tensor pair (large stored tensors by ``how.workers``: processes of this machine or a Dask cluster)."""
    how = how or Comparison()
    rename, layouts, rules = how.rename, how.layouts, how.rules
    # each run's recomputations against its own forward, in its own numbering (before microbatches are joined)
    recomputed = {"a": recompute_check(reader_a), "b": recompute_check(reader_b)}
    reader_a, reader_b = joined_pair(reader_a, reader_b)  # a step run as microbatches against one that was not
    for reader in (reader_a, reader_b):
        if not any(r.kind == "call" for r in reader.records):
            if reader.damage:
                raise LayerdiffError(f"{reader.path}: damaged, no usable module call left ({len(reader.damage)} "
                                     f"damaged: {reader.damage[0].describe()}{'; ...' if len(reader.damage) > 1 else ''})")
            raise LayerdiffError(f"{reader.path}: holds no module calls (interrupted before its first flush, "
                                 "or damaged)")
    side_a = TraceSide(reader_a.records, reader_a.meta, rules, reader_a)
    side_b = TraceSide(reader_b.records, reader_b.meta, rules, reader_b)
    if mapping is None:  # a mapping made elsewhere (bisect's statistics run of the whole candidate) is reused
        mapping = module_mapping(reader_a, reader_b, how)
    matching = match_records(side_a, side_b, mapping)
    _check_related(matching, reader_a, reader_b, rules)
    swap = token_order(side_a, side_b)
    op_pairing = pair_ops(reader_a.ops, reader_b.ops, matching.pairs, mapping, rules, reader_a.records,
                          reader_b.records)
    pairs: list[RecordPair | OpPair] = [*matching.pairs, *op_pairing.pairs]
    measured = _compare_in_workers(pairs, (reader_a, reader_b), layouts, swap, how.workers, progress)
    not_compared: list[schema.NotCompared] = []
    if progress is not None:
        progress.start(sum(_data_bytes(p.a) + sum(_data_bytes(rb) for rb in p.b) for p in pairs))
    records: list[schema.Row] = []
    damaged: list[tuple[str, str]] = []  # (why: "A: ..." or "B: ...", what) of tensors whose bytes are damaged
    ancestors = _ancestors(reader_a.records)
    forward_ops = [{(op.path, op.call, op.index): op for op in reader.ops if op.phase == "forward"}
                   for reader in (reader_a, reader_b)]
    padding = padding_masks(reader_a, reader_b) if how.skip_padding else {}
    for pair in pairs:
        ra, rb = pair.a, pair.b[0]
        tensors: list[schema.TensorResult] = []
        skipped = list(pair.skipped)
        for tp in pair.tensors:
            try:
                metrics = _pair_metrics(tp, ra.path, (reader_a, reader_b), measured,
                                        NO_LAYOUTS if isinstance(ra, OpRecord) else layouts, swap,
                                        padding.get(ra.step))
            except DamagedTensorError as exc:
                skipped.append(f"{tp.role}:{tp.key} (damaged: {exc})")
                damaged.append((str(exc), f"{_describe_row(ra)} {tp.role} {tp.key}: {exc}"))
                continue
            if isinstance(metrics, _TaskFailed):
                skipped.append(f"{tp.role}:{tp.key} (not compared: {metrics.reason})")
                not_compared.append({"phase": ra.phase, "path": ra.path, "call": ra.call,
                                     "tensor": f"{tp.role}:{tp.key}", "reason": metrics.reason})
            elif metrics is None:
                skipped.append(f"{tp.role}:{tp.key} (statistics only: a part or transform needs the values)")
            else:
                if "damaged" in metrics:
                    damaged.append((metrics["damaged"], f"{_describe_row(ra)} {tp.role} {tp.key}: "
                                    f"{metrics['damaged']} (compared by its statistics)"))
                tensors.append(_tensor_row(tp, metrics))
        _replay_own(pair, tensors, rules, (reader_a, reader_b))
        if isinstance(pair, OpPair):
            records.append(_op_row(pair, tensors, skipped, ancestors, rules, forward_ops))
            if progress is not None:
                progress.advance(_data_bytes(pair.a) + _data_bytes(pair.b[0]))
            continue
        assert not isinstance(ra, OpRecord) and not isinstance(rb, OpRecord)
        row: schema.Row = {
               "kind": ra.kind, "phase": ra.phase, "path": ra.path,
               "path_b": " + ".join(r.path for r in pair.b),
               "call": ra.call, "step": ra.step, "type_a": ra.type, "type_b": rb.type,
               "begin": ra.begin if isinstance(ra, CallRecord) else ra.seq,
               "end": ra.end if isinstance(ra, CallRecord) else ra.seq,
               "parent": list(ra.parent) if ra.parent else None, "ancestors": ancestors.get((ra.path, ra.call), []),
               "module": ra.module, "hparams_a": ra.hparams, "hparams_b": rb.hparams,
               "family_a": rules.family(ra.type or ra.module_type),
               "family_b": rules.family(rb.type or rb.module_type),
               "error_a": ra.error, "error_b": next((r.error for r in pair.b if r.error), None),
               "tensors": tensors, "only_a": pair.only_a, "only_b": pair.only_b}
        if skipped:
            row["skipped"] = skipped
        if pair.inputs_inside:
            row["inputs_inside"] = pair.inputs_inside
        if pair.dropped:
            row["dropped"] = pair.dropped
        if ra.tied:
            row["tied"] = ra.tied
        for side, rec in (("held_a", ra), ("held_b", rb)):
            if rec.ranks_held:  # run by some ranks only: a pipeline stage, an expert-parallel rank
                row[side] = list(rec.ranks_held)  # type: ignore[literal-required]
        ops = op_pairing.calls.get((ra.path, ra.call)) if ra.kind == "call" else None
        if ops is not None and ra.phase == "forward":
            row["ops"] = cast(schema.OpsSummary, ops)
        elif ops is not None and ops.get("gradient_changed"):  # what the backward judgement needs of them
            row["ops_gradient_changed"] = ops["gradient_changed"]
        records.append(row)
        if progress is not None:
            progress.advance(_data_bytes(ra) + sum(_data_bytes(r) for r in pair.b))
    bases = {t["metrics"]["basis"] for r in records if r["kind"] != "param_grad_use" for t in r["tensors"]} - {"shape"}
    same_model = reader_a.meta.get("model_class") == reader_b.meta.get("model_class")
    phases = {phase: {side: any(r.kind == "call" and r.phase == phase for r in reader.records)
                      for side, reader in (("a", reader_a), ("b", reader_b))} for phase in ("forward", "backward")}
    summaries = {"a": trace_summary(reader_a), "b": trace_summary(reader_b)}
    for why, what in damaged:
        summaries["b" if why.startswith("B") else "a"].setdefault("damage", []).append(what)
    for side, check in recomputed.items():
        if check is not None:
            summaries[side].setdefault("damage", []).extend(check.get("damaged", []))
    return {"report_version": schema.REPORT_VERSION, "a": summaries["a"], "b": summaries["b"],
            "basis": bases.pop() if len(bases) == 1 else ("mixed" if bases else "none"),
            "map": rename.as_list(), "layouts": layouts.as_list(), "rules": rules.describe(), "records": records,
            "structure": "same_model" if same_model else "ported", "phases": phases,
            "same_file": _same_file(reader_a.path, reader_b.path),
            "mapping": [m.as_dict() for m in mapping.renamed()],
            "unmatched_modules": {"a": mapping.only_a, "b": mapping.only_b},
            "only_a": [_short(r) for r in matching.only_a], "only_b": [_short(r) for r in matching.only_b],
            "first_nonfinite": {"a": first_nonfinite(reader_a.records, ops=reader_a.ops),
                                "b": first_nonfinite(reader_b.records, ops=reader_b.ops)},
            "settings": settings_report(_run_settings(reader_a), _run_settings(reader_b), _same_weights(records)),
            "config_diff": _config_diff(reader_a.meta, reader_b.meta), "not_compared": not_compared,
            "recompute": recomputed}


def _same_weights(records: list[schema.Row]) -> bool:
    """Whether the two runs' parameters were found identical when first recorded (their values or, in stats
    traces, their statistics): then no seed explains an initialization."""
    params = [r for r in records if r["kind"] == "param"]
    first = min((r["step"] for r in params), default=None)  # later values differ by their training, not a seed
    values = [t for r in params if r["step"] == first for t in r["tensors"]]
    return bool(values) and all(t["metrics"].get("identical") for t in values)


def _run_settings(reader) -> dict:
    """A trace's settings, with what is known only once the run ended: what automatic mixed precision computed in,
    and whether its forward drew random numbers."""
    end = reader.end
    return {**reader.meta, "autocast_dtypes": list(end.autocast_dtypes) if end else [],
            "rng_drawn": end.rng_drawn if end else None}


def _config_diff(meta_a: dict, meta_b: dict) -> list | None:
    """The hyper-parameters the two models' own configurations set differently (None: a trace holds none)."""
    a, b = meta_a.get("model_config"), meta_b.get("model_config")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    try:
        return diff_configs(from_values(a.get("values") or {}, a.get("kind", "hf"), "A"),
                            from_values(b.get("values") or {}, b.get("kind", "hf"), "B"))["differ"]
    except (TypeError, ValueError, AttributeError):  # a damaged or foreign config in a trace: not compared
        return None


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_related(matching, reader_a, reader_b, rules: RuleSet):
    """Refuse to compare traces of unrelated models: nothing below the root matches, or types disagree."""
    calls = [(p.a, p.b[0]) for p in matching.pairs if p.a.kind == "call" and p.a.path]
    if not calls:
        a_paths = sorted({r.path for r in reader_a.records if r.kind == "call" and r.path})[:2]
        b_paths = sorted({r.path for r in reader_b.records if r.kind == "call" and r.path})[:2]
        raise LayerdiffError(f"the traces share no module paths (A: {', '.join(a_paths) or 'none'}; "
                             f"B: {', '.join(b_paths) or 'none'}): different models? map names with "
                             "--map 'B_PATTERN=A_NAME'")
    same_type = sum(1 for ra, rb in calls if rules.family(ra.type) == rules.family(rb.type))
    if same_type < 0.5 * len(calls):
        raise LayerdiffError(f"only {same_type} of {len(calls)} matched module calls have the same type: the "
                             "traces look like different models")
    matched = {"a": {ra.path for ra, _ in calls}, "b": {rb.path for _, rb in calls}}
    shares = []
    for side, reader in (("a", reader_a), ("b", reader_b)):
        paths = {r.path for r in reader.records if r.kind == "call" and r.path}
        shares.append(len(matched[side] & paths) / max(len(paths), 1))
    if max(shares) < 0.5:  # a shared lm_head is not a shared model
        raise LayerdiffError(f"only {len(matched['a'])} modules of A and B could be matched ({shares[0]:.0%} of A's, "
                             f"{shares[1]:.0%} of B's): the traces look like different models; if they are one "
                             "model renamed, map names with --map or a rule file")
