"""A tensor one run holds spread over ranks, compared piece by piece: which rank's shard or copy is off.

``runs.ranks`` joins the ranks' tensors by their placement; what it cannot decide from one run alone (a plain
tensor of unknown placement) is decided here, against the other run's tensor.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from layerdiff.match.joins import line_up, resolved_as, unresolved
from layerdiff.tracefile.records import TensorEntry


def resolve(entry: TensorEntry, other_shape: Sequence[int]) -> TensorEntry:
    """A per-rank ("ranks") entry, or a step's microbatches ("batches"), read against another run's tensor of
    ``other_shape``: replicated when the shapes line up (up to layout; a mask every microbatch had alike),
    shards along the one axis that, N times longer, lines them up; else as is."""
    if not unresolved(entry):
        return entry
    way = line_up(entry, other_shape, lambda w: resolved_as(entry, w).shape)
    return entry if way is None else resolved_as(entry, way)


def rank_slices(entry: TensorEntry, values_in_b_layout: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]] | None:
    """The other run's values cut the way this merged entry's ranks hold them: one piece per rank (the whole for
    replicated copies), or None when the entry is not per-rank comparable (partial sums)."""
    merge, n = entry.merge, len(entry.parts)
    if merge is None:
        return None
    if merge.how == "replicate" or (merge.how == "ranks" and n > 1):
        return [values_in_b_layout] * n
    if merge.how == "concat":
        sizes = [p.shape[merge.axis] for p in entry.parts]
        return np.split(values_in_b_layout, list(itertools.accumulate(sizes))[:-1], axis=merge.axis)
    if merge.how == "concat_parts":
        per_part = [np.array_split(part, n, axis=merge.axis)
                    for part in np.split(values_in_b_layout, merge.part_count, axis=merge.axis)]
        return [np.concatenate([chunks[rank] for chunks in per_part], axis=merge.axis) for rank in range(n)]
    return None
