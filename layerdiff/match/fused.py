"""Fused modules: one side's ``linear_qkv`` is the other side's q, k and v. How the fused tensor splits into the
parts (sizes, group count checked against the weights), and the operands that compare one part, or the parts
merged or summed."""
from __future__ import annotations

from dataclasses import dataclass

from layerdiff.match import fusion
from layerdiff.match.layouts import canonical_param_name
from layerdiff.match.mapping import Match
from layerdiff.match.operands import Operand
from layerdiff.match.paramplan import other_layout
from layerdiff.match.sides import ROLE_ORDER, TraceSide, torch_shape
from layerdiff.tracefile.records import Record, TensorEntry


# ---------------------------------------------------------------------------------------------------------
# Fused modules
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedLink:
    """How one fused module splits into the other side's parts: the parts' names, their sizes along the output
    features (activations: last axis) and along the weights' rows (axis 0), and the group count."""

    parts: tuple  # the parts' module paths, in the fused tensor's order
    out_sizes: tuple | None
    row_sizes: dict  # parameter leaf -> sizes along axis 0
    groups: int
    note: str


class FusedLinks:
    """The ``FusedLink`` of each fused match, resolved once (group counts are checked against the weights)."""

    def __init__(self, side_a: TraceSide, side_b: TraceSide):
        self.a, self.b = side_a, side_b
        self.cache: dict = {}
        self.relaid_cache: dict[tuple[str, str], str | None] = {}

    def relaid(self, path_a: str, path_b: str) -> str | None:
        """How the two modules' layouts differ where they hold the same parts fused in different layouts
        (``paramplan.other_layout``), else None; asked once per pair of modules: every record pair asks."""
        key = (path_a, path_b)
        if key not in self.relaid_cache:
            self.relaid_cache[key] = other_layout(self.a.rules.fused_rule(path_a.rpartition(".")[2]),
                                                  self.b.rules.fused_rule(path_b.rpartition(".")[2]))
        return self.relaid_cache[key]

    def resolve(self, match: Match) -> FusedLink:
        key = (match.a, match.b)
        if key not in self.cache:
            self.cache[key] = self._resolve(match)
        return self.cache[key]

    def _resolve(self, match: Match) -> FusedLink:
        fused_side, parts_side = (self.b, self.a) if match.fused_side == "b" else (self.a, self.b)
        fused = match.b[0] if match.fused_side == "b" else match.a[0]
        parts = match.a if match.fused_side == "b" else match.b
        rule = fused_side.rules.fused_rule(fused.rpartition(".")[2])
        out_sizes = []
        for p in parts:
            call = parts_side.calls.get(("forward", p, 0))
            outs = [t for t in (call.tensors if call is not None else ()) if t.role == "output"]
            out_sizes.append(outs[0].shape[-1] if outs and outs[0].shape else None)
        sizes_by_module: dict[str, dict[str, int]] = {}
        weights: dict[str, dict[str, tuple]] = {}
        for (kind, module, leaf, count), rec in parts_side.params.items():
            if kind == "param" and count == 0 and module in parts:
                entry = rec.tensors[0]
                sizes_by_module.setdefault(leaf, {})[module] = torch_shape(rec, entry, parts_side)[0]
                weights.setdefault(leaf, {})[module] = (rec, entry)
        row_sizes = {leaf: tuple(sizes[p] for p in parts) for leaf, sizes in sizes_by_module.items()
                     if len(sizes) == len(parts)}
        hparams = [fused_side.hparams(fused), fused_side.hparams(fused_side.parent(fused) or ""),
                   parts_side.hparams(parts_side.parent(parts[0]) or "")]
        known_sizes = tuple(s for s in out_sizes if s is not None)
        complete = len(known_sizes) == len(out_sizes)  # every part's output size was recorded
        sizes = row_sizes.get("weight") or (known_sizes if complete else ())
        candidates = fusion.group_candidates(rule.groups if rule else (), hparams, sizes) if sizes else [1]
        groups, note = candidates[0], f"rule {rule.name if rule else 'fused'}"
        verified = self._verify(fused, parts, weights.get("weight"), fused_side, parts_side, candidates)
        if verified is not None:
            groups = verified
            note += f", {groups} group{'s' if groups > 1 else ''}, checked against the weights"
        elif groups > 1:
            note += f", {groups} groups"
        return FusedLink(tuple(parts), known_sizes if complete else None, row_sizes, groups, note)

    @staticmethod
    def _verify(fused, parts, part_weights, fused_side, parts_side, candidates):
        """The group count under which the fused weight splits exactly into the parts' weights, when both
        traces hold the values (after a weight transfer they are equal up to layout)."""
        rec = fused_side.params.get(("param", fused, "weight", 0))
        readers = (getattr(fused_side, "reader", None), getattr(parts_side, "reader", None))
        if rec is None or not part_weights or len(part_weights) != len(parts) or None in readers:
            return None
        entries = [rec.tensors[0]] + [part_weights[p][1] for p in parts]
        if not all(e.offset is not None for e in entries):
            return None
        fused_values = fused_side.operand(rec, rec.tensors[0]).values(readers[0])
        part_values = [parts_side.operand(*part_weights[p]).values(readers[1]) for p in parts]
        if any(v.ndim != fused_values.ndim for v in part_values):
            return None
        # a weight joined from tensor-parallel shards part by part ([gate_r; up_r] of each rank: the join put the
        # parts in their order): only the declared layouts. A search found 2 groups where a loader had cut the
        # fused weight in plain slices (each rank all of gate, or all of up), and the weights then "agreed"
        joined = rec.tensors[0].merge is not None and rec.tensors[0].merge.how == "concat_parts"
        return fusion.infer_groups(fused_values, part_values, 0, candidates, search=not joined)


def fused_operand(pair_rec_kind: str, role: str, entry: TensorEntry, rec: Record, side: TraceSide, link: FusedLink,
                   index: int) -> Operand | None:
    """One part of a fused tensor: activations split along their last axis, parameters along axis 0."""
    if pair_rec_kind == "call":
        if link.out_sizes is None or not entry.shape or entry.shape[-1] != sum(link.out_sizes):
            return None
        return Operand((entry,), op="part", axis=-1, sizes=link.out_sizes, groups=link.groups, index=index)
    leaf = canonical_param_name(rec.path).rpartition(".")[2]
    sizes = link.row_sizes.get(leaf)
    if sizes is None:
        return None
    return Operand((entry,), op="part", axis=0, sizes=sizes, groups=link.groups, index=index,
                   transposed=side.transposed(rec, entry))


def split_roles(rec: Record) -> tuple:
    return ("output", "grad_output") if rec.kind == "call" else ("param", "param_grad")


def other_roles(rec: Record) -> tuple:
    return tuple(r for r in ROLE_ORDER if r not in split_roles(rec))


def split_pairs(part_rec: Record, fused_rec: Record, fused_side: TraceSide, link: FusedLink, index: int):
    """[(role, part entry, the fused tensor's part as an Operand)] and the unpaired ("role:key") of each side:
    outputs and their gradients pair with the fused tensor whose last axis holds every part; parameters by
    leaf."""
    out, only_part, only_fused = [], [], []
    for role in split_roles(part_rec):
        parts = [t for t in part_rec.tensors if t.role == role]
        fused = [t for t in fused_rec.tensors if t.role == role]
        if part_rec.kind == "call" and link.out_sizes is not None:
            parts = [t for t in parts if t.shape and t.shape[-1] == link.out_sizes[index]]
            fused = [t for t in fused if t.shape and t.shape[-1] == sum(link.out_sizes)]
        for ep, ef in zip(parts, fused):
            operand = fused_operand(part_rec.kind, role, ef, fused_rec, fused_side, link, index)
            if operand is None:
                only_part.append(f"{role}:{ep.key}")
            else:
                out.append((role, ep, ef, operand))
        only_part += [f"{role}:{t.key}" for t in parts[len(fused):]]
        only_fused += [f"{role}:{t.key}" for t in fused[len(parts):]]
    return out, only_part, only_fused


def merged_parts(rec: Record, role: str, key: str, parts: tuple, side: TraceSide, axis: int) -> Operand | None:
    """The parts' tensors (``role``/``key`` of each part's twin record) as one merged operand."""
    entries = []
    for path in parts:
        twin = side.twin(rec, path)
        entry = next((t for t in (twin.tensors if twin is not None else ()) if t.role == role and t.key == key), None)
        if entry is None:
            return None
        entries.append(entry)
    return Operand(tuple(entries), op="merge", axis=axis)


def sum_over_parts(rec: Record, key: str, parts: tuple, side: TraceSide) -> Operand | None:
    entries = []
    for path in parts:
        twin = side.calls.get((rec.phase, path, rec.call))
        entry = next((t for t in (twin.tensors if twin is not None else ()) if t.role == "grad_input" and t.key == key), None)
        if entry is None:
            return None
        entries.append(entry)
    return Operand(tuple(entries), op="sum")
