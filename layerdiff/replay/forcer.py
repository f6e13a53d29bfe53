"""Replay's source of values: the reference trace's inputs, outputs and gradients served to the candidate's hooks at
every module boundary, laid out as the candidate's tensors (renamed, fused or split, transposed, sequence-first).

Nothing here imports a framework: a ``Forcer`` hands numpy arrays to the adapter, which converts them."""
from __future__ import annotations

import math

import msgspec
import numpy as np

from layerdiff.compare.spec import Comparison
from layerdiff.match import fusion
from layerdiff.match.fused import FusedLinks
from layerdiff.match.layouts import LayoutRules, relate_shapes
from layerdiff.match.mapping import Match, ModuleMapping
from layerdiff.match.pairing import absorbed_child, canonical_key, pair_role, transforms_step
from layerdiff.match.sides import TraceSide, token_order
from layerdiff.tracefile.records import CallRecord, TensorEntry
from layerdiff.tracefile.tensors import FLOAT_DTYPES, as_float

_FORWARD_ROLE = {"grad_output": "output", "grad_input": "input"}


def fit_shape(values: np.ndarray, shape) -> np.ndarray | None:
    """The reference's array in the candidate's shape: as is, reshaped (same size) or broadcast ([1,S,D] to
    [B,S,D]); None when neither fits."""
    shape = tuple(shape)
    if values.shape == shape:
        return values
    if values.size == math.prod(shape):
        return values.reshape(shape)
    try:
        return np.ascontiguousarray(np.broadcast_to(values, shape))
    except ValueError:
        return None


class Forcer:
    """Serves the reference trace's values to the candidate's hooks (step 0 of the reference).

    ``mapping`` says which module of the candidate is which of the reference (``align``'s, from the free run,
    fused modules included); without one, ``rename`` turns the candidate's paths into the reference's. A fused
    module of the candidate gets the reference's parts merged (and their input gradients summed); one part of a
    module the reference fuses gets its part. Values are laid out as the candidate's tensors ([b, s, h] ->
    [s, b, h], broadcasting), and the user's ``--layout`` rules are inverted. ``where(path_a, role)`` limits
    forcing (the binary search forces one boundary); ``backward`` forces gradients too.
    """

    def __init__(self, reader, how: Comparison | None = None, *, backward: bool = True, where=None,
                 mapping: ModuleMapping | None = None, side_b: TraceSide | None = None):
        self.reader = reader
        how = how or Comparison()
        self.side_a = TraceSide(reader.records, reader.meta, how.rules, reader)
        self.side_b = side_b or TraceSide([], {}, how.rules)
        self.links = FusedLinks(self.side_a, self.side_b)
        self.mapping = mapping
        self.rename = how.rename
        self.layouts = how.layouts
        self.swap = token_order(self.side_a, self.side_b)
        self.backward = backward
        self.where = where
        self.calls: dict[tuple, CallRecord] = {}  # (phase, path, call) -> the reference's record of step 0
        for rec in reader.records:
            if isinstance(rec, CallRecord) and rec.step == 0:
                self.calls.setdefault((rec.phase, rec.path, rec.call), rec)
        self.keys: dict = {}  # (B's path, call, forward role) -> {B's key: how to get A's gradient}
        self.forced = 0
        self.unforced: list[str] = []  # why a matched tensor could not be forced (shown in the report)

    def _match(self, path_b: str) -> Match | None:
        if self.mapping is not None:
            return self.mapping.for_b(path_b)
        return Match((self.rename(path_b),), (path_b,))

    def forward(self, frame, role: str, entries_b) -> dict:
        """{B's key: array}: the reference's values for a call's "input" or "output" tensors."""
        match = self._match(frame.path) if frame.step == 0 else None
        if match is None or (self.where is not None and not self.where(match.a[0], role)):
            return {}
        if role == "output" and self.mapping is not None and match.fused_side is None and \
                absorbed_child(frame.path, match, self.side_b, self.mapping):
            return {}  # its output is its child's (forced there); A has no tensor for what it computes before
        entries_b = [msgspec.convert(e, TensorEntry) for e in entries_b]  # the live session's, as a trace's
        pseudo_b = CallRecord(phase="forward", path=frame.path, call=frame.call, tensors=entries_b, type=frame.type,
                              arg_names=list(frame.arg_names))
        keys = self.keys.setdefault((frame.path, frame.call, role), {})
        if role == "output" and match.fused_side == "b":
            return self._merged_outputs(frame, match, entries_b, keys)
        if role == "output" and match.fused_side == "a":
            return self._part_outputs(frame, match, entries_b, keys)
        path_a = match.a[0]  # inputs are shared by a fused module's parts
        rec = self.calls.get(("forward", path_a, frame.call))
        if rec is None or not any(t.offset is not None for t in rec.tensors):
            return {}  # not recorded, or statistics only (the model itself around a --layers window)
        transformed: list = []  # rotary angles vs cos/sin, masks: compared after a transform, never forced
        pairs, _, _ = pair_role([t for t in rec.tensors if t.role == role], entries_b, rec, pseudo_b,
                                self.side_a, self.side_b,
                                before_shapes=transforms_step(role, rec, pseudo_b, self.side_a, self.side_b, transformed))
        for tp in transformed:
            self._unforced(f"{path_a or '<root>'} {role} {tp.key_b}: represented differently ({tp.notes[0].split(':')[0]}),"
                           " left as the candidate computed it")
        out = {}
        for ta, tb, _ in pairs:
            if not rec.parent and self.side_a.labels_shifted != self.side_b.labels_shifted and \
                    canonical_key(ta.key, rec.arg_names) == "labels":
                self._unforced(f"<root> {role} {tb.key}: labels shifted by one run's pipeline, left as given")
                continue
            if ta.offset is None:
                self._unforced(f"{path_a or '<root>'} {role} {ta.key}: the reference holds statistics only")
                continue
            if role == "input" and match.fused_side == "b":
                keys[tb.key] = ("sum", match.a, ta.key, tb.shape)
            elif role == "input" and match.fused_side == "a":
                keys[tb.key] = None  # one part's own input gradient: the reference only has the parts' sum
            else:
                keys[tb.key] = ("plain", path_a, ta.key, tb.shape)
            value = self._fit(self._values(ta), tb.shape, path_a, f"{path_a or '<root>'} {role} {tb.key}")
            if value is not None:
                out[tb.key] = value
        return out

    def _merged_outputs(self, frame, match: Match, entries_b, keys) -> dict:
        """B's fused output from A's parts (q, k, v -> linear_qkv)."""
        link = self.links.resolve(match)
        if link.out_sizes is None:
            return {}
        parts = [self._part_entry(p, frame.call, "forward", "output", size) for p, size in zip(match.a, link.out_sizes)]
        if None in parts:
            return {}
        out = {}
        for tb in entries_b:
            if tb.shape and tb.shape[-1] == sum(link.out_sizes):
                keys[tb.key] = ("merge", match.a, [t.key for t in parts], tb.shape, link.groups)
                merged = fusion.merge([self._values(t) for t in parts], -1, link.groups)
                value = self._fit(merged, tb.shape, match.a[0], f"{match.a[0]} (merged parts) {tb.key}")
                if value is not None:
                    out[tb.key] = value
                break
        return out

    def _part_outputs(self, frame, match: Match, entries_b, keys) -> dict:
        """One part of A's fused output (linear_qkv -> k_proj)."""
        link = self.links.resolve(match)
        if link.out_sizes is None:
            return {}
        index = match.b.index(frame.path)
        fused = self._part_entry(match.a[0], frame.call, "forward", "output", sum(link.out_sizes))
        target = next((t for t in entries_b if t.shape and t.shape[-1] == link.out_sizes[index]), None)
        if fused is None or target is None:
            return {}
        keys[target.key] = ("part", match.a[0], fused.key, target.shape, link.out_sizes, link.groups, index)
        part = fusion.split(self._values(fused), -1, link.out_sizes, link.groups)[index]
        value = self._fit(part, target.shape, match.a[0], f"{match.a[0]} (part {index}) {target.key}")
        return {} if value is None else {target.key: value}

    def _part_entry(self, path_a: str, call: int, phase: str, role: str, last: int):
        rec = self.calls.get((phase, path_a, call))
        return next((t for t in (rec.tensors if rec is not None else ()) if t.role == role and t.offset is not None
                     and t.shape and t.shape[-1] == last), None)

    def gradient(self, frame, grad_role: str, key_b: str):
        """The reference's gradient w.r.t. one of a call's outputs ("grad_output") or inputs ("grad_input"),
        for a tensor whose forward value was matched; None to keep the candidate's own."""
        if not self.backward or frame.step != 0:
            return None
        how = self.keys.get((frame.path, frame.call, _FORWARD_ROLE[grad_role]), {}).get(key_b)
        if how is None:
            return None
        kind, paths, keys_a, shape = how[:4]
        what = f"{frame.path or '<root>'} {grad_role} {key_b}"
        if kind == "plain":
            entry = self._grad_entry(paths, frame.call, grad_role, keys_a)
            return None if entry is None else self._fit(self._values(entry), shape, paths, what)
        if kind == "sum":  # the parts' input gradients meet in the fused module's one input
            entries = [self._grad_entry(p, frame.call, grad_role, keys_a) for p in paths]
            if None in entries:
                return None
            return self._fit(np.sum([self._values(e) for e in entries], axis=0), shape, paths[0], what)
        if kind == "merge":
            entries = [self._grad_entry(p, frame.call, grad_role, k) for p, k in zip(paths, keys_a)]
            if None in entries:
                return None
            return self._fit(fusion.merge([self._values(e) for e in entries], -1, how[4]), shape, paths[0], what)
        entry = self._grad_entry(paths, frame.call, grad_role, keys_a)  # one part of A's fused gradient
        if entry is None:
            return None
        sizes, groups, index = how[4:]
        return self._fit(fusion.split(self._values(entry), -1, sizes, groups)[index], shape, paths, what)

    def _grad_entry(self, path_a: str, call: int, grad_role: str, key_a: str):
        rec = self.calls.get(("backward", path_a, call))
        entry = next((t for t in (rec.tensors if rec is not None else ()) if t.role == grad_role and t.key == key_a),
                     None)
        if entry is not None and entry.offset is None:
            self._unforced(f"{path_a} {grad_role} {key_a}: the reference holds statistics only")
            return None
        return entry

    def _values(self, ta: TensorEntry) -> np.ndarray:
        raw = self.reader.tensor(ta)
        return as_float(raw, ta.dtype) if ta.dtype in FLOAT_DTYPES else raw

    def _fit(self, values: np.ndarray, shape_b, path_a: str, what: str):
        """A's values in B's layout: a declared ``--layout`` rule inverted, else the relation of the shapes."""
        rule = self.layouts.find(path_a)
        if rule is not None:
            values = LayoutRules.invert(rule, values, shape_b)
        fitted = relate_shapes(values.shape, tuple(shape_b), self.swap).to_b(values)
        if fitted is None:
            fitted = fit_shape(values, shape_b)
        if fitted is None:
            self._unforced(f"{what}: reference shape {list(values.shape)} does not fit {list(shape_b)}")
            return None
        self.forced += 1
        return np.ascontiguousarray(fitted)

    def _unforced(self, message: str):
        if len(self.unforced) < 50 and message not in self.unforced:
            self.unforced.append(message)
