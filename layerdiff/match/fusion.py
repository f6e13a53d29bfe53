"""Fused tensors: one side's ``linear_qkv`` output (or weight) is the other side's q, k and v back to back.

The fused axis holds ``groups`` groups; each group holds every part's slice in order:
[p0 of group 0, p1 of group 0, ..., p0 of group 1, p1 of group 1, ...]. One group is plain concatenation
([gate; up]); Megatron's QKV has one group per query group; GPT-NeoX's has one per head. ``split`` and ``merge``
are exact inverses, so weight transfer, checkpoint diff, align and replay share them.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, TypeVar

import numpy as np


def check_sizes(total: int, sizes, groups: int) -> str | None:
    """Why ``sizes`` cannot be the parts of an axis of ``total`` elements in ``groups`` groups (None if they can)."""
    if groups < 1:
        return f"{groups} groups"
    if sum(sizes) != total:
        return f"the parts' sizes {list(sizes)} add up to {sum(sizes)}, not {total}"
    bad = [s for s in sizes if s % groups]
    if bad:
        return f"part size {bad[0]} is not a multiple of {groups} groups"
    return None


def split(array: np.ndarray, axis: int, sizes, groups: int = 1) -> list:
    """The parts of a fused array along ``axis`` (``sizes``: each part's total size along that axis)."""
    axis %= array.ndim
    problem = check_sizes(array.shape[axis], sizes, groups)
    if problem:
        raise ValueError(problem)
    per_group = [s // groups for s in sizes]
    shaped = array.reshape(array.shape[:axis] + (groups, sum(per_group)) + array.shape[axis + 1:])
    parts, start = [], 0
    for size, n in zip(sizes, per_group):
        index = [slice(None)] * shaped.ndim
        index[axis + 1] = slice(start, start + n)
        parts.append(shaped[tuple(index)].reshape(array.shape[:axis] + (size,) + array.shape[axis + 1:]))
        start += n
    return parts


def merge(parts, axis: int, groups: int = 1) -> np.ndarray:
    """The fused array of ``parts`` (the inverse of ``split``)."""
    ndim = parts[0].ndim
    axis %= ndim
    pieces = []
    for p in parts:
        if p.shape[axis] % groups:
            raise ValueError(f"part size {p.shape[axis]} is not a multiple of {groups} groups")
        pieces.append(p.reshape(p.shape[:axis] + (groups, p.shape[axis] // groups) + p.shape[axis + 1:]))
    fused = np.concatenate(pieces, axis=axis + 1)
    return fused.reshape(fused.shape[:axis] + (-1,) + fused.shape[axis + 2:])


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def group_candidates(rule_groups, hparams, sizes) -> list:
    """Group counts to try, in order: the rule's integers and hyper-parameters found in ``hparams`` (a list of
    dicts: the fused module's, its parent's, the other side's), then 1; only counts that divide every part.
    ``min_part/NAME`` is the smallest part's size divided by hyper-parameter NAME (GQA: the key part holds one
    head per group, so ``min_part/head_dim`` is the number of query groups)."""
    found = []
    for g in rule_groups:
        if isinstance(g, int):
            found.append(g)
            continue
        per_part = g.startswith("min_part/")
        name = g.partition("/")[2] if per_part else g
        for h in hparams:
            value = _positive_int((h or {}).get(name))
            if value is None:
                continue
            if per_part:
                smallest = min(sizes) if sizes else 0
                if smallest % value:
                    continue
                value = smallest // value
            found.append(value)
            break
    found.append(1)
    out = []
    for g in found:
        if g not in out and all(s % g == 0 for s in sizes):
            out.append(g)
    return out


def divisors_of_all(sizes) -> list:
    """Every group count that divides each part size, smallest first (for inferring the layout from weights)."""
    g = int(np.gcd.reduce(np.array(list(sizes), dtype=np.int64)))
    return [d for d in range(1, g + 1) if g % d == 0]


def infer_groups(fused: np.ndarray, parts, axis: int = 0, candidates=(), search: bool = True) -> int | None:
    """The group count under which ``fused`` splits into ``parts`` (declared candidates first, then, with
    ``search``, every divisor): weights after a transfer are equal up to layout, so they say how the port laid
    them out (``best_layout``)."""
    sizes = [p.shape[axis] for p in parts]
    tried = list(candidates) + ([d for d in divisors_of_all(sizes) if d not in candidates] if search else [])
    norm = math.sqrt(sum(float(np.sum(np.square(p, dtype=np.float64))) for p in parts))
    return best_layout(tried, lambda g: None if check_sizes(fused.shape[axis], sizes, g) else
                       zip(split(fused, axis, sizes, g), parts), norm)


Layout = TypeVar("Layout")


def best_layout(candidates: Iterable[Layout],
                pieces: Callable[[Layout], Iterable[tuple[np.ndarray, np.ndarray]] | None],
                norm: float) -> Layout | None:
    """The candidate layout under which one side's values show the other's: ``pieces(candidate)`` pairs each part
    of the one laid out so with that part of the other (None: the candidate does not fit). A defect in one part
    still leaves the others equal: the candidate with the most parts exactly equal wins, then the smallest
    difference relative to ``norm`` (the other's); None when none makes any part equal or nearly equal."""
    best, best_key = None, None
    for candidate in candidates:
        paired = pieces(candidate)
        if paired is None:
            continue
        equal, squares = 0, 0.0
        for mine, theirs in paired:
            equal += bool(np.array_equal(mine, theirs))
            squares += float(np.sum(np.square(mine.astype(np.float64) - theirs, dtype=np.float64)))
        key = (equal, -math.sqrt(squares) / (norm or 1.0))
        if best_key is None or key > best_key:
            best, best_key = candidate, key
    if best is None or best_key is None or (best_key[0] == 0 and -best_key[1] > 1e-2):
        return None
    return best
