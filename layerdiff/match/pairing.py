"""Pairing: the records of two traces paired through the module mapping, and the tensors inside each pair.

Records pair by module (``mapping``: same names, or inferred), phase and call index; a record of a module that
one side fuses pairs with the fused module's record and compares one part of it (``fused``). Tensors inside a
pair of records pair by name (positional arguments carry their parameter names), then by role, kind (float,
integer, boolean) and shape when the choice is unique, then through the rule set's value transforms (rotary
angles vs cos/sin, boolean vs additive masks). A tensor present on one side only is returned, never dropped.
Paths are reported in trace A's names."""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

from msgspec.structs import replace

from layerdiff.match.fused import FusedLink, FusedLinks, merged_parts, other_roles, split_pairs, sum_over_parts
from layerdiff.match.joins import candidate_shapes, unresolved
from layerdiff.match.layouts import relate_shapes
from layerdiff.match import paramplan
from layerdiff.match.mapping import Match, ModuleMapping
from layerdiff.match.operands import Operand, dtype_kind
from layerdiff.match.sides import ROLE_ORDER, TraceSide, token_order, torch_shape
from layerdiff.tracefile.records import (OUTPUT_PLUS_BIAS, CallRecord, ParamRecord, Record, TensorEntry,
                                        bias_beside)

HIDDEN_NAMES = {"hidden_states", "hidden_state", "hidden", "x", "xs", "input", "input_", "inputs", "input_tensor", "h"}
_POSITIONAL = re.compile(r"^(args\.\d+|out)(\.\d+)*$")


# ---------------------------------------------------------------------------------------------------------
# Record pairs
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorPair:
    role: str
    key: str  # A's key; a fused A tensor compared part by part gets "[part]" appended
    key_b: str
    a: Operand
    b: Operand
    notes: tuple = ()
    activation: bool = True  # an activation or gradient (not a parameter): may be sequence-first


@dataclass
class RecordPair:
    a: Record
    b: tuple  # B's record(s): several when A's module is fused and B's is split
    tensors: list = field(default_factory=list)
    only_a: list = field(default_factory=list)  # "role:key" of tensors with no counterpart
    only_b: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # tensors compared elsewhere (a sum on another part)
    inputs_inside: str | None = None  # B's module that computes this call's inputs inside itself, unrecorded
    dropped: list = field(default_factory=list)  # one-sided inputs ("role:key") its caller got in both runs


@dataclass
class Matching:
    pairs: list = field(default_factory=list)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)


def _module_of(rec: Record) -> str:
    return rec.module_path


def match_records(side_a: TraceSide, side_b: TraceSide, mapping: ModuleMapping) -> Matching:
    result = Matching()
    used: set[int] = set()
    links = FusedLinks(side_a, side_b)
    for ra in side_a.records:
        match = mapping.for_a(_module_of(ra))
        twins = [] if match is None else [side_b.twin(ra, p) for p in match.b]
        if match is not None and match.inside and isinstance(ra, CallRecord):
            twin = twins[0]
            twins = [_inside(ra, twin if isinstance(twin, CallRecord) else None, match, side_b)]
        sources = [s for s in twins if s is not None]
        if not sources and isinstance(ra, ParamRecord):
            moved = side_b.home_twin(ra, side_a, lambda path: (m.b if (m := mapping.for_a(path)) else ()))
            if moved is not None and id(moved) not in used:
                match, twins, sources = Match((ra.module_path,), (moved.module_path,), None, 1.0,
                                              ("moved_params",)), [moved], [moved]
        if match is None or not sources or len(sources) < len(twins):
            result.only_a.append(ra)
            continue
        used.update(id(s) for s in sources)
        first = sources[0]
        if match.fused_side is None and isinstance(first, CallRecord) and not side_a.children.get(ra.path):
            sources = [_with_absorbed(first, match, side_b, mapping)]
        pair = _pair(ra, tuple(sources), match, links)
        _not_recorded(pair, sources[0], match)
        if isinstance(ra, CallRecord) and match.fused_side is None:
            _runs_moved_work(pair, match, side_a, side_b, mapping)
        result.pairs.append(pair)
    result.only_b = [rb for rb in side_b.records if id(rb) not in used]
    _mark_dropped(result.pairs)
    return result


_IN = {"forward": "input", "backward": "grad_output"}


def _mark_dropped(pairs: list):
    """The inputs a call gets in one run only that its caller got in both: the caller's own code handed the tensor
    on in one run and not in the other (dropped it), as opposed to a tensor one run's code makes and the other's
    never does (a port's attention that takes position_ids where the other's does not)."""
    by_a = {(p.a.phase, p.a.path, p.a.call): p for p in pairs if isinstance(p.a, CallRecord)}
    by_b = {(rb.phase, rb.path, rb.call): p for p in pairs if isinstance(p.a, CallRecord) for rb in p.b}
    for pair in pairs:
        ra, rb = pair.a, pair.b[0]
        if not isinstance(ra, CallRecord) or not isinstance(rb, CallRecord):
            continue
        role = _IN[ra.phase]
        for items, rec, index, side in ((pair.only_a, ra, by_a, "a"), (pair.only_b, rb, by_b, "b")):
            parent = index.get((rec.phase, *rec.parent)) if rec.parent else None
            if parent is None:
                continue
            given = [e for tp in parent.tensors if tp.role == role for e in getattr(tp, side).entries]
            for item in items:
                item_role, _, key = item.partition(":")
                entry = next((t for t in rec.tensors if t.role == item_role == role and t.key == key), None)
                if entry is not None and any(_same_tensor(entry, e) for e in given):
                    pair.dropped.append(item)


def _same_tensor(x: TensorEntry, y: TensorEntry) -> bool:
    """One tensor handed on: its stored bytes (a tensor seen again in a step is stored once), or, in a statistics
    trace, its shape, dtype and statistics."""
    if x.offset is not None and y.offset is not None:
        return x.offset == y.offset and x.nbytes == y.nbytes
    return x.shape == y.shape and x.dtype == y.dtype and x.stats == y.stats


_ABSORBED_ROLES = {"input": "output", "grad_input": "grad_output"}


def absorbed_child(path_b: str, match: Match, side_b: TraceSide, mapping: ModuleMapping) -> str | None:
    """The child that B's module runs inside itself although its counterpart in A sits outside A's module."""
    a_path = match.a[0]
    for child in side_b.children.get(path_b, []) + side_b.backward_children.get(path_b, []):
        other = mapping.for_b(child)
        if other is not None and not any(p == a_path or p.startswith(a_path + ".") for p in other.a):
            return child
    return None


def _with_absorbed(rb: CallRecord, match: Match, side_b: TraceSide, mapping: ModuleMapping) -> CallRecord:
    """B's module may run, inside itself, a child whose counterpart in A sits outside A's module (mindformers'
    ``w1`` Linear applies its SiLU as a child; HF's ``gate_proj`` does not): then B's own result is that child's
    input, and B's record stands in with it as output (and the child's input gradient as grad_output)."""
    child = absorbed_child(rb.path, match, side_b, mapping)
    if child is None:
        return rb
    twin = side_b.calls.get((rb.phase, child, rb.call))
    inner = [replace(t, role=_ABSORBED_ROLES[t.role], key=f"{child.rpartition('.')[2]}:{t.key}")
             for t in (twin.tensors if twin is not None else ()) if t.role in _ABSORBED_ROLES]
    kept = [t for t in rb.tensors if t.role not in ("output", "grad_output")]
    return replace(rb, tensors=kept + inner, absorbed=child)  # without a record of the child: its input unseen


def _inside(ra: CallRecord, twin: CallRecord | None, match: Match, side_b: TraceSide) -> CallRecord | None:
    """B's record of a module that B's ``match.inside`` runs inside itself, completed with what that module's own
    record shows of it: its result is the outer module's (forward: the output; backward: the gradient w.r.t. it).
    A cell with a backward of its own is recorded in backward only, with its input gradient: its forward is made
    here, from the outer module's output (its input, computed inside, is not recorded)."""
    outer = side_b.calls.get((ra.phase, match.inside, ra.call))
    if outer is None:
        return twin
    role = "output" if ra.phase == "forward" else "grad_output"
    have = twin.tensors if twin is not None else []
    if any(t.role == role for t in have):
        return twin
    given = [t for t in outer.tensors if t.role == role]
    base = twin if twin is not None else replace(outer, path=match.b[0], type=side_b.types.get(match.b[0]),
                                                 parent=(match.inside, ra.call), hparams=None, scalars=None,
                                                 arg_names=None, ops=None, producers=None)
    return replace(base, tensors=[t for t in have if t.role != role] + given)


def _not_recorded(pair: RecordPair, rb, match: Match):
    """A's tensors that B computes inside a module and never records (the input of an activation its Linear
    applies inside itself, that Linear's result before it) are not compared, and say why: not "given to one run
    only", which would be a difference of the runs."""
    inside = match.inside or getattr(rb, "absorbed", None)
    if not inside or not isinstance(rb, CallRecord):
        return
    hidden = [item for item in pair.only_a if item.partition(":")[0] in ("input", "output", "grad_output")
              and not any(t.role == item.partition(":")[0] for t in rb.tensors)]
    for item in hidden:
        pair.only_a.remove(item)
        where = f"inside B's {match.inside}" if match.inside else f"by B's {rb.path} before its {inside}"
        pair.skipped.append(f"{item} (computed {where}, not recorded there: compared where it is)")
        if match.inside and item.startswith("input:"):
            pair.inputs_inside = match.inside


# what differs by design when a module runs another module's work inside itself, after its own or before it
_CHANGED_BY_WORK = {"after": ("output", "grad_output", "grad_input"), "before": ("input", "grad_input")}


def _runs_moved_work(pair: RecordPair, match: Match, side_a: TraceSide, side_b: TraceSide,
                     mapping: ModuleMapping) -> None:
    """A module holding a parameter that the rule set says belongs to another module (``moved_params``), which the
    other run has outside this module's counterpart, runs that module's work inside itself: Megatron's
    ``shared_experts`` applies its ``gate_weight`` sigmoid gate to its own result, where transformers' Qwen2-MoE
    gates ``shared_expert``'s result with ``shared_expert_gate`` in the MoE block's code (after: the results
    differ); Transformer Engine's linear applies the norm before it (before: the inputs differ). Which, the other run
    says: whether it calls that module after the counterpart or before. What differs by design is not compared
    (the module around them compares what both runs hold); the rest is."""
    for side, other, own, theirs, for_other in ((side_a, side_b, match.a[0], match.b[0], mapping.for_a),
                                                (side_b, side_a, match.b[0], match.a[0], mapping.for_b)):
        mine = other.calls.get(("forward", theirs, 0))
        if mine is None:
            continue
        for home in side.moved_homes.get(own, ()):
            parent, _, local = home.rpartition(".")
            counterpart = for_other(parent)
            there = [f"{p}.{local}" for p in (counterpart.b if side is side_a else counterpart.a)] if counterpart else []
            found = next(((rec, p) for p in there if p != theirs and not p.startswith(theirs + ".")
                          and (rec := other.calls.get(("forward", p, 0))) is not None), None)
            if found is None:
                continue
            rec, path = found
            when = "after" if rec.begin > mine.begin else "before"
            who, whom = ("A", "B") if side is side_a else ("B", "A")
            why = (f"{who}'s {own} also runs {whom}'s {path} ({when} its own work; a parameter of it is that "
                   f"module's): a different tensor by design, compared where both runs hold it")
            kept = []
            for tp in pair.tensors:
                if tp.role in _CHANGED_BY_WORK[when]:
                    pair.skipped.append(f"{tp.role}:{tp.key} ({why})")
                else:
                    kept.append(tp)
            pair.tensors = kept
            return


def _pair(ra: Record, sources: tuple, match: Match, links: FusedLinks) -> RecordPair:
    pair = RecordPair(ra, sources)
    side_a, side_b = links.a, links.b
    if match.fused_side is None:
        pairs, pair.only_a, pair.only_b = pair_tensors(ra, sources[0], side_a, side_b)
        pair.tensors = pairs
        how = links.relaid(_module_of(ra), _module_of(sources[0]))
        if how is not None:
            _by_parts(pair, sources[0], side_a, side_b, how)
        return pair
    link = links.resolve(match)
    if match.fused_side == "b":
        _pair_part_of_b(pair, match, link, side_a, side_b)
    else:
        _pair_parts_of_a(pair, match, link, side_a, side_b)
    return pair


# ---------------------------------------------------------------------------------------------------------
# Tensors inside a pair of records
# ---------------------------------------------------------------------------------------------------------
def canonical_key(key: str, arg_names) -> str:
    """``args.0`` -> ``hidden_states`` (the positional argument's parameter name); ``kwargs.x`` -> ``x``."""
    head, _, rest = key.partition(".")
    if head == "kwargs":
        key = rest
    elif head == "args" and arg_names:
        index, _, tail = rest.partition(".")
        if index.isdigit() and int(index) < len(arg_names):
            key = arg_names[int(index)] + (f".{tail}" if tail else "")
    first, dot, tail = key.partition(".")
    return ("hidden_states" + dot + tail) if first in HIDDEN_NAMES else key


def _positional(key: str) -> bool:
    return bool(_POSITIONAL.match(key.rpartition(":")[2]))


def pair_tensors(ra: Record, rb: Record, side_a: TraceSide, side_b: TraceSide, roles=ROLE_ORDER):
    """(tensor pairs, A's unpaired "role:key", B's unpaired "role:key") for two records of one module."""
    pairs: list[TensorPair] = []
    only_a: list[str] = []
    only_b: list[str] = []
    activation = isinstance(ra, CallRecord)
    for role in roles:
        ta = [t for t in ra.tensors if t.role == role]
        tb = [t for t in rb.tensors if t.role == role]
        if not ta and not tb:
            continue
        ta, tb = _router_choices(role, ta, tb, ra, rb, side_a, side_b, pairs)
        bias_a, bias_b = _bias_beside(role, ta, side_a), _bias_beside(role, tb, side_b)
        biases_a: dict = {}
        biases_b: dict = {}
        if (bias_a is None) != (bias_b is None):  # one run returns the sum: the other's output + bias is compared
            ta, biases_a = _without_bias(role, ta, bias_a, ra)
            tb, biases_b = _without_bias(role, tb, bias_b, rb)
        found, left_a, left_b = pair_role(ta, tb, ra, rb, side_a, side_b, before_shapes=transforms_step(
            role, ra, rb, side_a, side_b, pairs))
        for ea, eb, note in found:
            tp = TensorPair(role, ea.key, eb.key, _with_bias(side_a.operand(ra, ea), biases_a),
                            _with_bias(side_b.operand(rb, eb), biases_b), (note,) if note else (), activation)
            pairs.append(_shifted_labels(tp, ra, rb, side_a, side_b))
        only_a += [f"{role}:{t.key}" for t in left_a]
        only_b += [f"{role}:{t.key}" for t in left_b]
    return pairs, only_a, only_b


def _bias_beside(role: str, entries: list, side: TraceSide) -> tuple[TensorEntry, TensorEntry] | None:
    """(output, bias) where a module returned a bias beside its output for its caller to add
    (``RuleSet.bias_beside_output``: Megatron's linears, attention and MLP with linear biases), or None. Where both
    runs return it so, output and bias are compared as they are; where only one does, its output + bias is compared
    with the other's output (``_without_bias``)."""
    if not side.bias_beside or role not in ("output", "grad_output"):
        return None
    by_key = {t.key: t for t in entries}
    out, bias = by_key.get("out.0"), by_key.get("out.1")
    if out is None or bias is None or not bias_beside(out.shape, out.dtype, bias.shape, bias.dtype):
        return None
    return out, bias


def _without_bias(role: str, entries: list, found: tuple[TensorEntry, TensorEntry] | None,
                  record: Record) -> tuple[list, dict]:
    """The entries without the bias returned beside the output, and {id of the output's entry: (the bias's entry,
    the statistics of their sum as recorded, or None)} (forward; the gradient w.r.t. the sum is that w.r.t. the
    output, and the bias's own is its sum over tokens: left out)."""
    if found is None:
        return entries, {}
    out, bias = found
    rest = [t for t in entries if t is not bias]
    if role != "output":
        return rest, {}
    summed = next((t for t in record.tensors if t.role == OUTPUT_PLUS_BIAS and t.key == out.key), None)
    return rest, {id(out): (bias, summed)}


def _with_bias(operand: Operand, biases: dict) -> Operand:
    """``operand`` with the bias its module returned beside it added (``_without_bias``)."""
    found = biases.get(id(operand.entry)) if operand.plain else None
    if found is None:
        return operand
    bias, summed = found
    return Operand((operand.entry, bias), op="add_bias", summary=summed)


def _router_choices(role, ta, tb, ra, rb, side_a: TraceSide, side_b: TraceSide, out: list):
    """An MoE router hands on its choice as top-k scores and expert indices (HF) or as dense probabilities and a
    routing map over all experts (Megatron): the top-k side is spread over the experts and compared with the dense
    one (its gradients too, through the forward call's indices). Returns what is left of ``ta`` and ``tb``."""
    if role not in ("output", "grad_output") or side_a.rules.family(ra.type) != "router" or \
            side_b.rules.family(rb.type) != "router":
        return ta, tb
    for topk_side in ("a", "b"):
        top, dense, top_rec, top_side = (ta, tb, ra, side_a) if topk_side == "a" else (tb, ta, rb, side_b)
        dense_rec, dense_side = (rb, side_b) if topk_side == "a" else (ra, side_a)
        probs = next((t for t in dense if dtype_kind(t.dtype) == "float" and len(t.shape) == 2), None)
        if probs is None:
            continue
        tokens, experts = probs.shape
        indices = _chosen_experts(top_side, top_rec, tokens, experts)
        if indices is None or _chosen_experts(dense_side, dense_rec, tokens, experts) is not None:
            continue  # both hand on top-k indices: the same form, compared tensor by tensor
        # the scores of the choices: the last float output of the indices' shape (transformers hands on logits,
        # scores, indices; where every expert is chosen, the logits have that shape too)
        scores = next((t for t in reversed(top) if dtype_kind(t.dtype) == "float" and t.shape == indices.shape), None)
        if scores is None:
            continue
        spread = Operand((scores, indices), op="topk_dense", sizes=(experts,))
        found = [(scores, probs, spread, Operand.stored(probs))]
        flags = next((t for t in dense if t.dtype == "bool" and list(t.shape) == [tokens, experts]), None)
        if role == "output" and flags is not None:
            found.append((indices, flags, Operand((indices,), op="topk_map", sizes=(experts,)),
                          Operand((flags,), op="masked", bool_masked=True)))  # 1.0 where chosen
        for top_entry, dense_entry, top_op, dense_op in found:
            pair = (top_entry, dense_entry, top_op, dense_op) if topk_side == "a" else \
                (dense_entry, top_entry, dense_op, top_op)
            out.append(TensorPair(role, pair[0].key, pair[1].key, pair[2], pair[3],
                                  ("router: top-k choices compared over all experts",)))
        used = {id(t) for item in found for t in item[:2]}
        return [t for t in ta if id(t) not in used], [t for t in tb if id(t) not in used]
    return ta, tb


def _chosen_experts(side: TraceSide, rec: Record, tokens: int, experts: int) -> TensorEntry | None:
    """The expert indices ([tokens, k], k <= experts: a router may choose every expert) among the outputs of
    ``rec``'s forward call."""
    forward = side.calls.get(("forward", rec.path, rec.call))
    tensors = forward.tensors if forward is not None else []
    return next((t for t in tensors if t.role == "output" and dtype_kind(t.dtype) == "int"
                 and len(t.shape) == 2 and t.shape[0] == tokens and t.shape[1] <= experts), None)


def _shifted_labels(tp: TensorPair, ra: Record, rb: Record, side_a: TraceSide, side_b: TraceSide) -> TensorPair:
    """The model's "labels" when exactly one run takes them already shifted (mindformers' data pipeline)."""
    shifted_a, shifted_b = side_a.labels_shifted, side_b.labels_shifted
    if shifted_a == shifted_b or ra.parent or tp.role != "input" or \
            canonical_key(tp.key, ra.arg_names) != "labels":
        return tp
    if shifted_b:
        return TensorPair(tp.role, tp.key, tp.key_b, Operand((tp.a.entry,), op="shift_left"), tp.b, tp.notes,
                          tp.activation)
    return TensorPair(tp.role, tp.key, tp.key_b, tp.a, Operand((tp.b.entry,), op="shift_left"), tp.notes,
                      tp.activation)


def transforms_step(role, ra, rb, side_a, side_b, out: list):
    """The transform step of ``pair_role`` for one pair of records: pairs it finds are appended to ``out``."""
    def step(left_a, left_b):
        found, left_a, left_b = _transforms(role, left_a, left_b, ra, rb, side_a, side_b)
        out.extend(found)
        return left_a, left_b

    return step


def pair_role(ta, tb, ra, rb, side_a, side_b, before_shapes=None):
    """Pairs [(A entry, B entry, note)] by exact key, then name, then (``before_shapes``: the rule set's value
    transforms) a kind-and-shape fit where at least one side's key is positional."""
    found: list[tuple[TensorEntry, TensorEntry, str | None]] = []
    left_a: list[TensorEntry] = []
    by_key = {t.key: t for t in tb}
    used = set()
    for ea in ta:
        eb = by_key.get(ea.key)
        if eb is not None and id(eb) not in used and dtype_kind(ea.dtype) == dtype_kind(eb.dtype):
            used.add(id(eb))
            found.append((ea, eb, None))
        else:
            left_a.append(ea)
    names_b: dict[str, TensorEntry] = {}
    for eb in tb:
        if id(eb) not in used:
            names_b.setdefault(canonical_key(eb.key, rb.arg_names), eb)
    still = []
    for ea in left_a:
        eb = names_b.get(canonical_key(ea.key, ra.arg_names))
        if eb is not None and id(eb) not in used and dtype_kind(ea.dtype) == dtype_kind(eb.dtype):
            used.add(id(eb))
            found.append((ea, eb, f"matched by name (B's key: {eb.key})"))
        else:
            still.append(ea)
    left_b = [t for t in tb if id(t) not in used]
    if before_shapes is not None:
        still, left_b = before_shapes(still, left_b)
    swap = token_order(side_a, side_b)
    for same_size in (True, False):  # equal sizes first; broadcasting ([1, S, D] vs [B, S, D]) only after
        for ea in list(still):
            fits = []
            for eb in left_b:
                if dtype_kind(eb.dtype) != dtype_kind(ea.dtype):
                    continue
                # a tensor of several ranks or microbatches fits in any of the shapes its join may take
                for shape_a, shape_b in itertools.product(_shapes(ra, ea, side_a), _shapes(rb, eb, side_b)):
                    relation = relate_shapes(shape_a, shape_b, swap)
                    if relation.ok and (relation.kind != "broadcast") == same_size and \
                            (same_size or min(math.prod(shape_a), math.prod(shape_b)) > 1):
                        fits.append((relation.kind != "same", eb))
                        break
            if not fits:
                continue
            choice = min(fits, key=lambda f: f[0])[1]
            named_a = not _positional(canonical_key(ea.key, ra.arg_names))
            named_b = not _positional(canonical_key(choice.key, rb.arg_names))
            if named_a and named_b:
                continue  # two different names (labels vs position_ids): never paired by shape alone
            still.remove(ea)
            left_b.remove(choice)
            found.append((ea, choice, f"matched by position and shape (B's key: {choice.key})"))
    return found, still, left_b


def _shapes(rec: Record, entry: TensorEntry, side: TraceSide) -> list[tuple]:
    """An entry's shape as PyTorch lays it out, or the shapes it may take once its ranks' parts are joined."""
    if not unresolved(entry):
        return [torch_shape(rec, entry, side)]
    return candidate_shapes(entry)


def _key_matches(patterns, key: str, family: str) -> bool:
    for p in patterns:
        fam, colon, pattern = p.rpartition(":")
        if colon and fam != family:
            continue
        if re.fullmatch(pattern, key):
            return True
    return False


def _transforms(role, left_a, left_b, ra, rb, side_a: TraceSide, side_b: TraceSide):
    """Pairs that a rule explains: rotary angles vs their cos and sin, masks of different conventions."""
    pairs: list[TensorPair] = []
    rules = side_a.rules
    fam_a, fam_b = rules.family(ra.type), rules.family(rb.type)
    for rule in rules.angles:
        for angles_side in ("b", "a"):
            ang_entries, ang_rec, ang_sd, ang_fam = (left_b, rb, side_b, fam_b) if angles_side == "b" else \
                (left_a, ra, side_a, fam_a)
            cs_entries, cs_rec, cs_fam = (left_a, ra, fam_a) if angles_side == "b" else (left_b, rb, fam_b)
            angle = next((t for t in ang_entries
                          if _key_matches(rule.angles, canonical_key(t.key, ang_rec.arg_names), ang_fam)), None)
            if angle is None:
                continue
            found = {which: next((t for t in cs_entries if _key_matches(
                getattr(rule, which), canonical_key(t.key, cs_rec.arg_names), cs_fam)), None) for which in ("cos", "sin")}
            cos, sin = found["cos"], found["sin"]
            if cos is None or sin is None:
                continue
            ang_entries.remove(angle)
            for which, entry in (("cos", cos), ("sin", sin)):
                cs_entries.remove(entry)
                derived = Operand((angle,), op=which)
                plain = Operand.stored(entry)
                a_op, b_op = (plain, derived) if angles_side == "b" else (derived, plain)
                pairs.append(TensorPair(role, entry.key if angles_side == "b" else angle.key + f"[{which}]",
                                        angle.key if angles_side == "b" else entry.key, a_op, b_op,
                                        (f"{rule.name}: {which} of {'B' if angles_side == 'b' else 'A'}'s angles",)))
    keys = rules.mask_keys()
    masks_a = [t for t in left_a if canonical_key(t.key, ra.arg_names) in keys]
    masks_b = [t for t in left_b if canonical_key(t.key, rb.arg_names) in keys]
    if len(masks_a) == 1 and len(masks_b) == 1:
        ea, eb = masks_a[0], masks_b[0]
        left_a.remove(ea)
        left_b.remove(eb)
        pairs.append(TensorPair(role, ea.key, eb.key, Operand((ea,), op="masked", bool_masked=side_a.bool_masked),
                                Operand((eb,), op="masked", bool_masked=side_b.bool_masked),
                                ("masks compared as masked/attended flags",)))
    return pairs, left_a, left_b


def _by_parts(pair: RecordPair, rb: Record, side_a: TraceSide, side_b: TraceSide, how: str) -> None:
    """A module matched with one that holds the same parts fused in another layout (``how``: transformers' Phi-3
    ``qkv_proj``, [q; k; v], against Megatron's ``linear_qkv``, per query group): its fused tensors (outputs and
    their gradients along the last axis, weights and theirs along their rows) compared part by part, each side's
    split in its own layout (``paramplan.qkv_layout``, from the hyper-parameters each run recorded). Statistics
    are compared as they are (a layout only orders the elements); values whose layouts are not known are left out,
    with why: compared as they are, they would differ by layout alone."""
    ra = pair.a
    path_a, path_b = _module_of(ra), _module_of(rb)
    rule_a, rule_b = side_a.rules.fused_rule(path_a.rpartition(".")[2]), side_b.rules.fused_rule(
        path_b.rpartition(".")[2])
    if rule_a is None or rule_b is None:  # ``how`` says both are fused
        return
    param = isinstance(ra, ParamRecord)
    axis = 0 if param else -1
    kept: list[TensorPair] = []
    for tp in pair.tensors:
        if not param and tp.role not in ("output", "grad_output"):
            kept.append(tp)
            continue
        if not all(e.offset is not None for o in (tp.a, tp.b) for e in o.entries):
            kept.append(TensorPair(tp.role, tp.key, tp.key_b, tp.a, tp.b,
                                   tp.notes + (f"statistics, the same in either layout ({how})",), tp.activation))
            continue
        rows = tp.a.shape[axis] if tp.a.shape else 0
        la, lb = (paramplan.qkv_layout(rule, rows, [side.hparams(path), side.hparams(path.rpartition(".")[0])])
                  for rule, side, path in ((rule_a, side_a, path_a), (rule_b, side_b, path_b)))
        if la is None or lb is None or la[0] != lb[0] or not (tp.a.plain and tp.b.plain):
            pair.skipped.append(f"{tp.role}:{tp.key} (the parts fused in another layout, {how}: compared part "
                                "by part where their attention's heads are known)")
            continue
        groups_a, groups_b = (la[1] if rule_a.groups else 1), (lb[1] if rule_b.groups else 1)
        for index, part in enumerate(rule_a.parts):
            part_a = Operand(tp.a.entries, op="part", axis=axis, sizes=la[0], groups=groups_a, index=index)
            part_b = Operand(tp.b.entries, op="part", axis=axis, sizes=lb[0], groups=groups_b, index=index)
            kept.append(TensorPair(tp.role, f"{tp.key}[{part}]", tp.key_b, part_a, part_b,
                                   tp.notes + (f"the {part} part of each ({how})",), tp.activation))
    pair.tensors = kept


def _pair_part_of_b(pair: RecordPair, match: Match, link: FusedLink, side_a: TraceSide, side_b: TraceSide):
    """A's record is one part (q_proj) of B's fused module (linear_qkv): compare it with that part of B's."""
    ra, rb = pair.a, pair.b[0]
    index = match.a.index(_module_of(ra))
    found, pair.only_a, pair.only_b = pair_tensors(ra, rb, side_a, side_b, other_roles(ra))
    split, only_a, only_b = split_pairs(ra, rb, side_b, link, index)
    pair.only_a += only_a
    pair.only_b += only_b
    activation = ra.kind == "call"
    fused_name = match.b[0].rpartition(".")[2]
    for role, ea, eb, part in split:
        if ea.offset is not None and eb.offset is not None:
            pair.tensors.append(TensorPair(role, ea.key, eb.key, side_a.operand(ra, ea), part,
                                           (f"{_module_of(ra).rpartition('.')[2]} part of B's {fused_name} "
                                            f"{eb.key} ({link.note})",), activation))
        elif index == 0:  # statistics only: the parts together against the fused tensor, on the first part
            merged = merged_parts(ra, role, ea.key, match.a, side_a, part.axis)
            if merged is not None:
                pair.tensors.append(TensorPair(role, ea.key, eb.key, merged, Operand.stored(eb), (
                    f"statistics of {' + '.join(p.rpartition('.')[2] for p in match.a)} together vs B's "
                    f"{fused_name}",), activation))
        else:
            pair.skipped.append(f"{role}:{ea.key} (statistics only: compared with the other parts on "
                                f"{match.a[0]})")
    for tp in found:
        if tp.role == "grad_input":
            # the parts' input gradients meet in B's one input: compared as their sum, on the first part
            if index:
                pair.skipped.append(f"{tp.role}:{tp.key} (compared as a sum on {match.a[0]})")
                continue
            summed = sum_over_parts(ra, tp.key, match.a, side_a)
            if summed is None:
                continue
            tp = TensorPair(tp.role, tp.key, tp.key_b, summed, tp.b,
                            tp.notes + (f"sum over {', '.join(p.rpartition('.')[2] for p in match.a)}",),
                            tp.activation)
        pair.tensors.append(tp)


def _pair_parts_of_a(pair: RecordPair, match: Match, link: FusedLink, side_a: TraceSide, side_b: TraceSide):
    """A's record is a fused module (linear_qkv) and B has its parts: compare A's tensor part by part."""
    ra = pair.a
    names = [p.rpartition(".")[2] for p in match.b]
    activation = ra.kind == "call"
    only_a, only_b = set(), set()
    for index, rb in enumerate(pair.b):
        split, ob, oa = split_pairs(rb, ra, side_a, link, index)
        only_a.update(oa)
        only_b.update(ob)
        for role, eb, ea, part in split:
            if ea.offset is not None and eb.offset is not None:
                pair.tensors.append(TensorPair(role, f"{ea.key}[{names[index]}]", eb.key, part,
                                               side_b.operand(rb, eb), (f"A's {ea.key} split: the "
                                                                        f"{names[index]} part ({link.note})",), activation))
            elif index == 0:  # statistics only: A's fused tensor against B's parts together
                merged = merged_parts(rb, role, eb.key, match.b, side_b, part.axis)
                if merged is not None:
                    pair.tensors.append(TensorPair(role, ea.key, eb.key, Operand.stored(ea), merged, (
                        f"statistics of B's {' + '.join(names)} together",), activation))
        if index:
            continue
        found, oa, ob = pair_tensors(ra, rb, side_a, side_b, other_roles(ra))  # inputs are shared by the parts
        only_a.update(oa)
        only_b.update(ob)
        for tp in found:
            if tp.role == "grad_input":  # the parts' input gradients add up to the fused module's
                summed = sum_over_parts(rb, tp.key_b, match.b, side_b)
                if summed is None:
                    continue
                tp = TensorPair(tp.role, tp.key, tp.key_b, tp.a, summed, tp.notes + (
                    f"B's sum over {', '.join(names)}",), tp.activation)
            pair.tensors.append(tp)
    pair.only_a, pair.only_b = sorted(only_a), sorted(only_b)
