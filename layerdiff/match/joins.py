"""A tensor of several ranks, or of a step's microbatches, whose join waits for the other run's shape: the ways it
may be joined (one copy, or its parts along one axis; the parts may be such tensors themselves: a step's
microbatches of a tensor-parallel run's logits). Pairing tries them to find a tensor's counterpart;
``compare.per_rank.resolve`` picks the one that lines up with the counterpart."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Sequence, cast

from msgspec.structs import replace

from layerdiff.match.layouts import relate_shapes
from layerdiff.match.operands import combine_stats, scaled_stats
from layerdiff.tracefile.records import CallRecord, Merge, Record, Stats, TensorEntry
from layerdiff.tracefile.tensors import FLOAT_DTYPES

# one way to join a tensor: its own join (("keep",): decided already; ("replicate",); ("concat", axis)) and the
# way its parts are joined, when they wait too
Way = tuple[tuple, Optional["Way"]]
_KEEP = ("keep",)


def _waits(entry: TensorEntry) -> bool:
    return entry.merge is not None and entry.merge.how in ("ranks", "batches") and len(entry.parts) > 1


def _nested(entry: TensorEntry) -> bool:
    return bool(entry.parts) and unresolved(entry.parts[0])


def unresolved(entry: TensorEntry) -> bool:
    """A tensor of several ranks or microbatches whose join (or whose parts' join) waits for the other run."""
    return _waits(entry) or _nested(entry)


def ways(entry: TensorEntry) -> list[Way]:
    """Every way an unresolved entry may be joined: one copy, or its parts along one of its axes, for each way
    its parts may be joined."""
    inner: list = ways(entry.parts[0]) if _nested(entry) else [None]
    own: list[tuple] = [_KEEP]
    if _waits(entry):
        same = len({tuple(p.shape) for p in entry.parts}) == 1
        own = ([("replicate",)] if same else []) + [("concat", dim) for dim in range(len(entry.shape))
                                                    if _joinable(entry.parts, dim)]
    return [(o, i) for i in inner for o in own]


def _joinable(parts: tuple[TensorEntry, ...], dim: int) -> bool:
    """Parts that agree on every axis but ``dim`` (an expert's tokens from each rank: as many as were routed)."""
    rest = {tuple(p.shape[:dim] + p.shape[dim + 1:]) for p in parts}
    return len(rest) == 1 and all(len(p.shape) > dim for p in parts)


def resolved_as(entry: TensorEntry, way: Way) -> TensorEntry:
    """An unresolved entry joined one way (``ways``)."""
    own, inner = way
    merge = entry.merge
    assert merge is not None
    if inner is not None:
        parts = tuple(resolved_as(part, inner) for part in entry.parts)
        shape = list(parts[0].shape)
        stats = entry.stats
        if own == _KEEP and merge.how == "concat":  # its statistics were its parts' before they were joined
            shape[merge.axis] = sum(p.shape[merge.axis] for p in parts)
            stats = cast(Stats, scaled_stats(combine_stats([p.stats for p in parts]), merge.scale) or stats)
        elif own == _KEEP and merge.how == "replicate":
            stats = parts[0].stats
        entry = replace(entry, parts=parts, shape=shape, stats=stats)
    if own == _KEEP:
        return entry
    if own[0] == "replicate":
        return replace(entry, merge=Merge("replicate", ranks=merge.ranks, over=merge.over))
    dim = own[1]
    shape = list(entry.shape)
    shape[dim] = sum(p.shape[dim] for p in entry.parts)
    scale = merge.scale if merge.how == "batches" else None  # a join waiting for its axis keeps its scale
    return replace(entry, shape=shape, merge=Merge("concat", dim, ranks=merge.ranks, over=merge.over, scale=scale),
                   stats=scaled_stats(combine_stats([p.stats for p in entry.parts]), scale) or entry.stats)


def candidate_shapes(entry: TensorEntry) -> list[tuple[int, ...]]:
    """The shapes an entry may have once joined (its own, when it is no join waiting for the other run)."""
    if not unresolved(entry):
        return [tuple(entry.shape)]
    return [tuple(resolved_as(entry, way).shape) for way in ways(entry)]


def line_up(entry: TensorEntry, other_shape: Sequence[int], shape_as: Callable[[Way], Sequence[int]]) -> Way | None:
    """The way to join an unresolved entry so that what is compared (``shape_as(way)``: the entry joined, or a
    value derived from it) lines up with the other run's ``other_shape`` (``best_way`` of those that do)."""
    other = tuple(other_shape)
    shaped = [(way, tuple(shape_as(way))) for way in ways(entry)]
    same = [way for way, shape in shaped if shape == other]
    # a join that gives the other run's very shape before one that gives a reordering of it: Megatron's query
    # [s, b, 2, d] of 2 ranks joined along its heads is [s, b, 4, d]; joined along the batch of 2, [s, 4, 2, d]
    # reorders into it too, and with two ways left the join was not made (a TP=2 run against TP=1 "differed")
    return best_way(entry, same or [way for way, shape in shaped if _lines_up(other, shape)])


def _lines_up(shape: tuple, joined: tuple) -> bool:
    """The same shape, or one the shapes alone reorder into it; not a reordering they allow several ways (the
    heads of Megatron's query [s, b, 2, d] joined along the batch, [s, 4, 2, d], against [s, 2, 4, d] when s == d:
    only the join along the heads is the same shape)."""
    relation = relate_shapes(shape, joined)
    return relation.kind == "same" or (relation.kind == "permute" and not relation.ambiguous)


def best_way(entry: TensorEntry, fits: list[Way]) -> Way | None:
    """Of the ways that line an entry up with its counterpart, the one to take: the one with the fewest joins
    along an axis (a copy before shards); None when two such remain (the join cannot be told)."""
    def concats(way: Way | None) -> int:
        return 0 if way is None else (way[0][0] == "concat") + concats(way[1])

    if not fits:
        return None
    least = min(concats(w) for w in fits)
    best = [w for w in fits if concats(w) == least]
    return best[0] if len(best) == 1 else None


def alike(parts: list[TensorEntry]) -> bool:
    """Parts that are copies of one tensor (a weight, a mask every rank or microbatch had): the same shape, dtype
    and statistics. Parts whose statistics are unknown (partial sums joined already) are never shown alike."""
    first = parts[0]
    if first.stats.get("numel") and first.stats.get("l2") is None and not first.stats.get("nan"):
        return False
    return all(p.shape == first.shape and p.dtype == first.dtype and p.stats == first.stats for p in parts[1:])


def scalar_loss(entry: TensorEntry) -> bool:
    """A floating scalar (a loss the model returns, or its gradient): joined over a step's shares as their
    weighted sum, never along a batch axis."""
    return not entry.shape and entry.dtype in FLOAT_DTYPES


def batch_axis(shape: list[int], batch: int | None) -> int | None:
    """The axis along which shares of a batch of ``batch`` sequences join: the first of that size (token ids
    [b, s]; the layouts models use put it before heads and groups: [b, s, h], Megatron's [s, b, h],
    [b, heads, s, d], [s, b, groups, d])."""
    return next((d for d, n in enumerate(shape) if n == batch), None)


def root_calls(records: Iterable[Record]) -> Iterator[CallRecord]:
    """A run's root calls, forward, in order (a step of microbatches calls the root once for each)."""
    return (rec for rec in records if isinstance(rec, CallRecord) and rec.phase == "forward" and not rec.parent)


def token_shapes(records: list[Record]) -> dict[int, tuple]:
    """{step: (batch, sequence)} of a run's share of each step, from the token ids (the first 2-D integer input)
    of the step's first root call."""
    out: dict[int, tuple] = {}
    for rec in root_calls(records):
        if rec.step not in out:
            ids = next((t for t in rec.tensors if t.role == "input" and len(t.shape) == 2
                        and t.dtype.startswith(("int", "uint"))), None)
            if ids is not None:
                out[rec.step] = tuple(ids.shape)
    return out
