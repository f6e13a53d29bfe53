"""A tensor as compared: a stored entry of a trace, or a value derived from stored entries.

Most comparisons read two stored tensors. A port that fuses, splits or re-represents a tensor needs a derived
one instead: one part of a fused output, the parts merged back, a sum of gradients that meet in one input, the
cosine of rotary angles, a mask as "masked" flags. An ``Operand`` says which entries and what to do with them;
``values`` computes it from a reader, ``stats`` from the entries' statistics where that is possible (statistics
survive merging and permuting, not splitting or cosines).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from layerdiff.match import fusion
from layerdiff.tracefile.records import TensorEntry
from layerdiff.tracefile.tensors import FLOAT_DTYPES, as_float, encode_float

_FLOAT_KINDS = ("float", "bfloat", "complex")


def dtype_kind(dtype: str) -> str:
    """float, int or bool: tensors of different kinds are never compared with each other."""
    if dtype.startswith(_FLOAT_KINDS):
        return "float"
    return "bool" if dtype == "bool" else "int"


@dataclass(frozen=True)
class Operand:
    entries: tuple[TensorEntry, ...]  # stored entries (dtype, shape, stats and, in full mode, offset/nbytes)
    # value | part | merge | sum | add_bias | cos | sin | masked | masked_scores | shift_left | topk_dense | topk_map
    op: str = "value"
    axis: int = 0
    sizes: tuple = ()
    groups: int = 1
    index: int = 0
    transposed: bool = False  # entries stored [in, out] (Paddle Linear): transposed before anything else
    bool_masked: bool = False  # masked: True in a boolean mask means "masked" (Megatron), else "attend"
    summary: TensorEntry | None = None  # add_bias: the sum's own statistics, recorded beside (statistics traces)

    @classmethod
    def stored(cls, entry: TensorEntry, transposed: bool = False) -> Operand:
        return cls((entry,), transposed=transposed)

    @property
    def entry(self) -> TensorEntry:
        return self.entries[0]

    @property
    def plain(self) -> bool:
        return self.op == "value" and not self.transposed

    @property
    def dtype(self) -> str:
        return "float32" if self.op in ("cos", "sin", "masked", "topk_map") else self.entry.dtype

    def _base_shape(self, entry) -> tuple:
        shape = tuple(entry.shape)
        return shape[::-1] if self.transposed and len(shape) == 2 else shape

    @property
    def shape(self) -> tuple:
        base = self._base_shape(self.entry)
        if self.op == "part":
            axis = self.axis % len(base)
            return base[:axis] + (self.sizes[self.index],) + base[axis + 1:]
        if self.op == "merge":
            axis = self.axis % len(base)
            return base[:axis] + (sum(self._base_shape(e)[axis] for e in self.entries),) + base[axis + 1:]
        if self.op in ("topk_dense", "topk_map"):  # top-k choices spread over all ``sizes[0]`` experts
            return base[:-1] + (self.sizes[0],)
        return base

    @property
    def has_data(self) -> bool:
        return all(e.offset is not None for e in self.entries)

    def stats(self) -> Mapping[str, Any] | None:
        """Summary statistics of the operand, when its entries' statistics determine them."""
        if self.op == "value":
            return self.entry.stats
        if self.op == "merge":
            return combine_stats([e.stats for e in self.entries])
        if self.op == "topk_dense":  # the chosen scores, and a zero for every expert not chosen
            scores, zeros = self.entry.stats, math.prod(self.shape) - math.prod(self.entry.shape)
            return combine_stats([scores, {"numel": zeros, "min": 0.0, "max": 0.0, "mean": 0.0, "l2": 0.0}])
        if self.op == "add_bias" and self.summary is not None:  # a sum's statistics do not follow from its terms'
            return self.summary.stats
        return None

    def values(self, reader) -> np.ndarray:
        arrays = [self._load(reader, e) for e in self.entries]
        if self.op == "value":
            return arrays[0]
        if self.op == "part":
            return fusion.split(arrays[0], self.axis, self.sizes, self.groups)[self.index]
        if self.op == "merge":
            return fusion.merge(arrays, self.axis, self.groups)
        if self.op == "sum":
            return np.sum(np.stack([a.astype(np.float64) for a in arrays]), axis=0)
        if self.op == "add_bias":  # an output and the bias its module left for the caller to add (last axis)
            return arrays[0] + arrays[1]
        if self.op == "cos":
            return np.cos(arrays[0].astype(np.float64)).astype(np.float32)
        if self.op == "sin":
            return np.sin(arrays[0].astype(np.float64)).astype(np.float32)
        if self.op == "masked":
            return masked_flags(arrays[0], self.entry.dtype, self.bool_masked)
        if self.op == "masked_scores":
            return masked_scores(arrays[0])
        if self.op in ("topk_dense", "topk_map"):  # (scores,) indices -> [tokens, experts], zero where not chosen
            indices = arrays[-1].astype(np.int64)
            chosen = arrays[0] if self.op == "topk_dense" else np.ones(indices.shape, np.float32)
            dense = np.zeros(indices.shape[:-1] + (self.sizes[0],), dtype=chosen.dtype)
            np.put_along_axis(dense, indices, chosen, axis=-1)
            return dense
        if self.op == "shift_left":  # labels as a pipeline that shifts them hands them over
            x = arrays[0]
            return np.concatenate([x[..., 1:], np.full(x.shape[:-1] + (1,), -100, dtype=x.dtype)], axis=-1)
        raise ValueError(f"unknown operand {self.op!r}")

    def _load(self, reader, entry) -> np.ndarray:
        raw = reader.tensor(entry)
        values = as_float(raw, entry.dtype) if entry.dtype in FLOAT_DTYPES else raw
        if self.op not in ("masked", "topk_dense", "topk_map") and values.dtype not in (np.float32, np.float64):
            values = values.astype(np.float64)
        return values.T if self.transposed and values.ndim == 2 else values

    def describe(self, part_names=()) -> str | None:
        """What was done to the stored tensor, for the report (None for a plain stored tensor)."""
        if self.op == "part":
            name = part_names[self.index] if self.index < len(part_names) else f"part {self.index}"
            grouped = f", {self.groups} groups" if self.groups > 1 else ""
            return f"{name} part of the fused tensor{grouped}"
        if self.op == "merge":
            return f"{len(self.entries)} parts merged" + (f" in {self.groups} groups" if self.groups > 1 else "")
        if self.op == "sum":
            return f"sum of {len(self.entries)} gradients"
        if self.op == "add_bias":
            return "output with the bias its module returned beside it added"
        if self.op in ("cos", "sin"):
            return f"{self.op} of rotary angles"
        if self.op == "masked":
            return "mask as masked/attended flags"
        if self.op == "masked_scores":
            return f"attention scores, masked positions (<= {MASKED_SCORE:g}) as -inf"
        if self.op == "shift_left":
            return "labels shifted left by one (last -100), as the other run's pipeline does"
        if self.op == "topk_dense":
            return f"top-k scores spread over the {self.sizes[0]} experts"
        if self.op == "topk_map":
            return f"top-k choices as flags over the {self.sizes[0]} experts"
        return "stored transposed" if self.transposed else None


MASKED_SCORE = -1e4  # attention scores at or below this are masked positions (Megatron fills -10000.0)


def masked_scores(values: np.ndarray) -> np.ndarray:
    """Attention scores with every masked position (``MASKED_SCORE`` or below: Megatron's -10000.0, HF's -inf or
    the dtype's lowest) as -inf: the softmax gives each of them 0 either way."""
    return np.where(values <= MASKED_SCORE, -np.inf, values)


def masked_flags(values: np.ndarray, dtype: str, bool_masked: bool) -> np.ndarray:
    """1.0 where a mask hides a position, 0.0 where it lets attention through: booleans by convention, additive
    floats by their large negative values."""
    if dtype == "bool":
        hidden = values if bool_masked else ~values
    elif dtype in FLOAT_DTYPES:
        hidden = np.asarray(values) < -1.0
    else:  # integer padding masks: 1 keeps, 0 hides
        hidden = np.asarray(values) == 0
    return np.asarray(hidden, dtype=np.float32)


def unknown_stats(parts: Sequence[Mapping[str, Any]], numel: int) -> dict[str, Any]:
    """Statistics of a join that its parts' do not give (their own are unknown: sums): its size and NaN/Inf
    counts."""
    return {"numel": numel, "min": None, "max": None, "mean": None, "l2": None,
            "nan": sum(p.get("nan", 0) for p in parts), "inf": sum(p.get("inf", 0) for p in parts)}


def summed_stats(parts: Sequence[Mapping[str, Any]], numel: int, scale: float | None = None) -> dict[str, Any]:
    """Statistics of the sum of tensors (partial sums over ranks, a step's microbatches), times ``scale``: its
    size and NaN/Inf counts; the values too where every part is one finite number (a loss)."""
    stats = unknown_stats(parts, numel)
    values = [v for p in parts if p.get("numel") == 1 and isinstance(v := p.get("mean"), float) and math.isfinite(v)]
    if parts and len(values) == len(parts):
        total = math.fsum(values) * (1.0 if scale is None else scale)
        stats.update(min=total, max=total, mean=total, l2=abs(total))
    return stats


def scaled_values(stored: np.ndarray, dtype: str, scale: float | None) -> np.ndarray:
    """Stored bits of a joined tensor multiplied by ``scale`` (in float64; None: as they are)."""
    if scale is None:
        return stored
    return encode_float(as_float(stored, dtype).astype(np.float64) * scale, dtype)


def scaled_stats(stats: Mapping[str, Any] | None, scale: float | None) -> dict[str, Any] | None:
    """Statistics of a tensor multiplied by a positive ``scale`` (a data-parallel mean's 1 / ranks)."""
    if stats is None or scale is None:
        return None if stats is None else dict(stats)
    return {**stats, **{k: stats[k] * scale for k in ("min", "max", "mean", "l2") if stats.get(k) is not None}}


def combine_stats(stats: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Statistics of the concatenation of tensors, from theirs."""
    known = [s for s in stats if s is not None and s.get("min") is not None]
    if not known or len(known) < len(stats):
        return None
    numel = sum(s["numel"] for s in known)
    return {"numel": numel, "min": min(s["min"] for s in known), "max": max(s["max"] for s in known),
            "mean": sum(s["mean"] * s["numel"] for s in known) / max(numel, 1),
            "l2": math.sqrt(sum(s["l2"] ** 2 for s in known)),
            "nan": sum(s.get("nan", 0) for s in known), "inf": sum(s.get("inf", 0) for s in known)}
