"""Operations inside a pair of matched module calls, aligned (``ops`` tracing), and the tensors of each pair.

Two runs of "the same" code run nearly the same operations, but not exactly: a port inserts a cast or a
``contiguous``, calls one fused kernel where the other spells it out (``scaled_dot_product_attention`` against
matmul, scale, mask, softmax, matmul), or computes two independent things in the other order. The two sequences are
aligned by dynamic programming (Needleman-Wunsch) on three kinds of evidence, all read from the records without
touching tensor data:

- the operation's kind, canonical under the rule set (``true_divide`` is ``div``; ``[ops] same``);
- its output's shape;
- its output's values, through their summary statistics (agreeing values make a pair almost certain, and let a
  fused operation stand for a sequence on the other side, ``[[ops.fused]]``).

A kind that the rule set says may pass through (casts, views, copies) costs little to leave unpaired; any other
costs a full gap. Operations left over on both sides whose outputs agree are paired afterwards: independent work
done in another order. Inside a pair, inputs pair by where they came from (their producers, translated through
the pairs already made), then by position, then by shape."""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from msgspec.structs import replace

from layerdiff.match.layouts import layouts_relate
from layerdiff.match.mapping import ModuleMapping
from layerdiff.match.operands import MASKED_SCORE, Operand, dtype_kind
from layerdiff.match.paramplan import other_layout
from layerdiff.match.pairing import TensorPair
from layerdiff.match.rules import FusedOpRule, RuleSet
from layerdiff.tracefile.records import CallRecord, OpRecord, Producer, TensorEntry
from layerdiff.tracefile.tensors import FLOAT_DTYPES

_PASS_THROUGH_GAP = -0.1  # leaving a cast or a view unpaired
_GAP = -1.0
_UNLIKE = 0.1  # one kind of operation on other kinds of values: paired only where nothing likelier is at hand
_LARGEST_GRID = 250_000  # cells of the alignment table; beyond it, a matching of kinds (difflib) aligns
_AGREE_REL = 1e-3  # summary statistics this close: the same values, as evidence for pairing (not for judging)


@dataclass(frozen=True)
class OpMatch:
    """A's operation ``a`` and B's ``b``: the same operation (``how`` "same"), the same found out of order
    ("reordered"), or one side's fused operation against the other's sequence ending in its counterpart ("fused_a":
    A's ``a`` is fused, B's ``inside`` indices run inside it; "fused_b" the other way round)."""

    a: OpRecord
    b: OpRecord
    how: str = "same"
    inside: tuple[int, ...] = ()


@dataclass
class OpAlignment:
    matches: list[OpMatch] = field(default_factory=list)
    only_a: list[OpRecord] = field(default_factory=list)
    only_b: list[OpRecord] = field(default_factory=list)

    def b_of(self) -> dict[int, int]:
        """A's operation index -> B's."""
        return {m.a.index: m.b.index for m in self.matches}


_FRAMEWORK_PREFIXES = ("torch.", "paddle.", "mindspore.")
_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                     "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"})


def _canonical(args: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, tuple[Any, Any]]:
    """{name: (value as compared, value as recorded)}: argument names as the rule set's ``[ops] arguments`` spell
    them (``axis`` is ``dim``) and dtypes as every framework agrees on them (``paddle.float32``, ``Float32``)."""
    out = {}
    for key, value in args.items():
        prefix, _, leaf = key.rpartition(".")
        same = value
        if isinstance(value, str):
            bare = value.partition(".")[2] if value.startswith(_FRAMEWORK_PREFIXES) else value
            same = bare.lower() if bare.lower() in _DTYPES else value
        out[f"{prefix}.{names.get(leaf, leaf)}" if prefix else key] = (same, value)
    return out


def arguments_diff(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None,
                   names: Mapping[str, str]) -> dict[str, list[Any]]:
    """The non-tensor arguments two calls of an operation set differently ({argument: [A, B]}, as recorded), the
    framework's private ones (``_stacklevel``) and those only one side passes by name (frameworks' defaults
    differ) left out."""
    ca, cb = _canonical(a or {}, names), _canonical(b or {}, names)
    missing = (None, None)
    return {k: [ca.get(k, missing)[1], cb.get(k, missing)[1]] for k in sorted(set(ca) | set(cb))
            if ca.get(k, missing)[0] != cb.get(k, missing)[0] and not k.rpartition(".")[2].startswith("_")
            and (k in ca and k in cb or not k.startswith("kwargs."))}


def first_output(op: OpRecord) -> TensorEntry | None:
    return next((t for t in op.tensors if t.role == "output"), None)


def values_agree(a: TensorEntry, b: TensorEntry) -> bool:
    """Two tensors hold (nearly) the same values, by their statistics: the same element count, and mean, L2 norm,
    minimum and maximum equal to within a thousandth of the values' scale."""
    sa, sb = a.stats, b.stats
    n = sa.get("numel")
    if n is None or n != sb.get("numel") or dtype_kind(a.dtype) != dtype_kind(b.dtype):
        return False
    if sa.get("nan", 0) != sb.get("nan", 0) or sa.get("inf", 0) != sb.get("inf", 0):
        return False
    l2a, l2b = sa.get("l2"), sb.get("l2")
    if l2a is None or l2b is None:
        return l2a is None and l2b is None
    scale = max(abs(l2a), abs(l2b)) / math.sqrt(max(n, 1)) + 1e-30
    for va, vb in ((sa.get("mean"), sb.get("mean")), (sa.get("min"), sb.get("min")), (sa.get("max"), sb.get("max"))):
        if (va is None) != (vb is None) or (va is not None and vb is not None and abs(va - vb) > _AGREE_REL * scale):
            return False
    return abs(l2a - l2b) <= _AGREE_REL * max(abs(l2a), abs(l2b)) + 1e-30


def _made_from(op: OpRecord) -> tuple[str | None, str | None]:
    """The kinds of values (float, int, bool) an operation takes in its first tensor input and gives in its first
    output: what tells two operations of one kind apart when their values cannot (position ids cast to float
    against a frequency table cast to float, in two rotary embeddings that compute other values)."""
    first_in = next((t for t in op.tensors if t.role == "input"), None)
    out = first_output(op)
    return (dtype_kind(first_in.dtype) if first_in is not None else None,
            dtype_kind(out.dtype) if out is not None else None)


def _telling(a: TensorEntry | None, b: TensorEntry | None) -> bool:
    """Whether two outputs whose statistics agree say, by that alone, that operations of other kinds are one (a
    port's ``einsum`` against ``matmul``): floating values that are not all equal, in layouts that relate. A mask
    (booleans, integers) or a constant shares its statistics with too many others: HF's attention mask made by
    ``&`` of index functions, against a port's made by ``__setitem__`` into zeros, were paired on their counts of
    True, and the two codes' other steps then read as the port passing wrong tensors. Layouts: see
    ``layouts_relate``."""
    if a is None or b is None or dtype_kind(a.dtype) != "float" or a.stats.get("min") == a.stats.get("max"):
        return False
    return layouts_relate(a.shape, b.shape)


class _Evidence:
    """What the alignment knows of two operations: their canonical kinds and outputs."""

    def __init__(self, ops_a: Sequence[OpRecord], ops_b: Sequence[OpRecord], rules: RuleSet):
        self.rules = rules
        self.kinds_a = [rules.op_kind(op.op) for op in ops_a]
        self.kinds_b = [rules.op_kind(op.op) for op in ops_b]
        self.out_a = [first_output(op) for op in ops_a]
        self.out_b = [first_output(op) for op in ops_b]
        self.made_a = [_made_from(op) for op in ops_a]
        self.made_b = [_made_from(op) for op in ops_b]
        self.in_a = [[t.shape for t in op.tensors if t.role == "input"] for op in ops_a]
        self.in_b = [[t.shape for t in op.tensors if t.role == "input"] for op in ops_b]

    def agree(self, i: int, j: int) -> bool:
        """Outputs of the same values in layouts that compare: a key viewed [b, s, heads, d] holds the values of
        Megatron's [s, b * heads, d] view, in an order no comparison recovers."""
        oa, ob = self.out_a[i], self.out_b[j]
        return oa is not None and ob is not None and values_agree(oa, ob) and layouts_relate(oa.shape, ob.shape)

    def pair(self, i: int, j: int) -> float | None:
        """The score of pairing A's i-th with B's j-th; None where nothing says they are one operation."""
        same_kind = self.kinds_a[i] == self.kinds_b[j]
        oa, ob = self.out_a[i], self.out_b[j]
        if self.agree(i, j):
            if same_kind:
                return 6.0
            return 4.0 if _telling(oa, ob) else None
        if not same_kind:
            return None
        if self.made_a[i] != self.made_b[j]:
            return _UNLIKE  # integers made floats against floats made floats: most likely two operations
        if self.kinds_a[i] in self.rules.pass_through_ops and (
                (oa is not None and ob is not None and not layouts_relate(oa.shape, ob.shape)) or
                (self.in_a[i] and self.in_b[j] and
                 not any(layouts_relate(x, y) for x in self.in_a[i] for y in self.in_b[j]))):
            return None  # a cast or a view of other values in another layout (a reshape of other inputs: HF's
            # attention output against a port's key heads repeated): leaving both unpaired costs little
        return 1.0 if oa is not None and ob is not None and list(oa.shape) == list(ob.shape) else 0.5

    def gap_a(self, i: int) -> float:
        return _PASS_THROUGH_GAP if self.kinds_a[i] in self.rules.pass_through_ops else _GAP

    def gap_b(self, j: int) -> float:
        return _PASS_THROUGH_GAP if self.kinds_b[j] in self.rules.pass_through_ops else _GAP

    def fused(self, rule: FusedOpRule, out: TensorEntry | None, last: TensorEntry | None) -> float:
        """A fused operation against a sequence ending in ``last``: their outputs in layouts that relate (Megatron's
        ``baddbmm`` gives its scores as [b * heads, s, s], HF's ``matmul`` and scaling as [b, heads, s, s])."""
        if out is None or last is None or not layouts_relate(out.shape, last.shape):
            return -math.inf
        if values_agree(out, last):
            return 6.0
        return 3.0 if list(out.shape) == list(last.shape) else 2.5


def _holds(rule: FusedOpRule, kinds: Sequence[str]) -> bool:
    """Whether a sequence may be a fused operation spelled out: it runs one of the kinds the rule says it holds."""
    return not rule.holds or any(kind in rule.holds for kind in kinds)


def align_ops(ops_a: Sequence[OpRecord], ops_b: Sequence[OpRecord], rules: RuleSet) -> OpAlignment:
    """The two operation sequences of one pair of module calls, aligned (see the module docstring)."""
    n, m = len(ops_a), len(ops_b)
    ev = _Evidence(ops_a, ops_b, rules)
    if n * m > _LARGEST_GRID:
        pairs = _by_kinds(ev)
        result = OpAlignment([OpMatch(ops_a[i], ops_b[j]) for i, j in pairs])
    else:
        result = _dynamic(ops_a, ops_b, ev)
    _reordered(result, ops_a, ops_b, ev)
    result.matches.sort(key=lambda mt: mt.a.index)
    return result


def _dynamic(ops_a: Sequence[OpRecord], ops_b: Sequence[OpRecord], ev: _Evidence) -> OpAlignment:
    n, m = len(ops_a), len(ops_b)
    neg = -math.inf
    best = [[neg] * (m + 1) for _ in range(n + 1)]
    move: list[list[tuple]] = [[()] * (m + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    fused_a = [ev.rules.fused_op(op.op) for op in ops_a]
    fused_b = [ev.rules.fused_op(op.op) for op in ops_b]
    for i in range(n + 1):
        for j in range(m + 1):
            here = best[i][j]
            if i == 0 and j == 0:
                continue
            choice: tuple = ()
            if i and j:
                s = ev.pair(i - 1, j - 1)
                if s is not None and best[i - 1][j - 1] + s > here:
                    here, choice = best[i - 1][j - 1] + s, ("pair",)
            if i and best[i - 1][j] + ev.gap_a(i - 1) > here:
                here, choice = best[i - 1][j] + ev.gap_a(i - 1), ("gap_a",)
            if j and best[i][j - 1] + ev.gap_b(j - 1) > here:
                here, choice = best[i][j - 1] + ev.gap_b(j - 1), ("gap_b",)
            rule = fused_a[i - 1] if i else None
            if rule is not None and j and ev.kinds_b[j - 1] in rule.ends:  # A's fused op = B's ops j-span .. j-1
                s = ev.fused(rule, ev.out_a[i - 1], ev.out_b[j - 1])
                for span in range(2, min(rule.longest, j) + 1):
                    if best[i - 1][j - span] + s > here and _holds(rule, ev.kinds_b[j - span:j]):
                        here, choice = best[i - 1][j - span] + s, ("fused_a", span)
            rule = fused_b[j - 1] if j else None
            if rule is not None and i and ev.kinds_a[i - 1] in rule.ends:
                s = ev.fused(rule, ev.out_b[j - 1], ev.out_a[i - 1])
                for span in range(2, min(rule.longest, i) + 1):
                    if best[i - span][j - 1] + s > here and _holds(rule, ev.kinds_a[i - span:i]):
                        here, choice = best[i - span][j - 1] + s, ("fused_b", span)
            best[i][j], move[i][j] = here, choice
    result = OpAlignment()
    i, j = n, m
    while i or j:
        choice = move[i][j]
        if choice[0] == "pair":
            result.matches.append(OpMatch(ops_a[i - 1], ops_b[j - 1]))
            i, j = i - 1, j - 1
        elif choice[0] == "gap_a":
            result.only_a.append(ops_a[i - 1])
            i -= 1
        elif choice[0] == "gap_b":
            result.only_b.append(ops_b[j - 1])
            j -= 1
        elif choice[0] == "fused_a":
            span = choice[1]
            inside = tuple(op.index for op in ops_b[j - span:j - 1])
            result.matches.append(OpMatch(ops_a[i - 1], ops_b[j - 1], "fused_a", inside))
            i, j = i - 1, j - span
        else:
            span = choice[1]
            inside = tuple(op.index for op in ops_a[i - span:i - 1])
            result.matches.append(OpMatch(ops_a[i - 1], ops_b[j - 1], "fused_b", inside))
            i, j = i - span, j - 1
    result.only_a.reverse()
    result.only_b.reverse()
    return result


def _by_kinds(ev: _Evidence) -> list[tuple[int, int]]:
    """Very long sequences: the longest matching runs of kinds (difflib), in order."""
    matcher = difflib.SequenceMatcher(None, ev.kinds_a, ev.kinds_b, autojunk=False)
    return [(block.a + k, block.b + k) for block in matcher.get_matching_blocks() for k in range(block.size)]


def _reordered(result: OpAlignment, ops_a: Sequence[OpRecord], ops_b: Sequence[OpRecord], ev: _Evidence) -> None:
    """Operations left over on both sides whose kinds and values agree: the same work in another order."""
    paired_a = {mt.a.index for mt in result.matches}
    paired_b = {mt.b.index for mt in result.matches} | {k for mt in result.matches for k in mt.inside
                                                         if mt.how == "fused_a"}
    inside_a = {k for mt in result.matches for k in mt.inside if mt.how == "fused_b"}
    position_a = {op.index: i for i, op in enumerate(ops_a)}
    position_b = {op.index: j for j, op in enumerate(ops_b)}
    left_b = [op for op in ops_b if op.index not in paired_b]
    for op in ops_a:
        if op.index in paired_a or op.index in inside_a:
            continue
        i = position_a[op.index]
        found = next((other for other in left_b if ev.kinds_a[i] == ev.kinds_b[position_b[other.index]]
                      and ev.agree(i, position_b[other.index])), None)
        if found is not None:
            left_b.remove(found)
            result.matches.append(OpMatch(op, found, "reordered"))
    result.only_a = [op for op in ops_a if op.index not in {mt.a.index for mt in result.matches}
                     and op.index not in inside_a]
    result.only_b = left_b


# ---------------------------------------------------------------------------------------------------------
# The tensors of a pair of operations
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProducerMap:
    """Translates where a tensor came from in A's call into B's terms: ``ops`` A's operation index -> B's,
    ``inputs`` the module call's input keys (A's -> B's), ``module`` a module path of A -> B's."""

    ops: dict[int, int]
    inputs: dict[str, str]
    module: Callable[[str], str | None]

    def same(self, pa: Producer | None, pb: Producer | None) -> bool:
        if pa is None or pb is None or pa.kind != pb.kind or pa.kind in ("unknown", "outer"):
            return False
        if pa.kind == "op":
            return pa.index is not None and self.ops.get(pa.index) == pb.index and pa.key == pb.key
        if pa.kind == "input":
            return pa.key is not None and self.inputs.get(pa.key) == pb.key
        if pa.kind == "call":
            return pa.path is not None and self.module(pa.path) == pb.path and pa.call == pb.call and \
                pa.key == pb.key
        if pa.kind in ("param", "buffer") and pa.name and pb.name:
            module_a, _, leaf_a = pa.name.rpartition(".")
            module_b, _, leaf_b = pb.name.rpartition(".")
            return leaf_a == leaf_b and self.module(module_a) == module_b
        return False


def pair_inputs(a: OpRecord, b: OpRecord, producers: ProducerMap) -> list[tuple[TensorEntry, TensorEntry]]:
    """A's inputs with B's: the same producer first (``x * y`` against ``y * x``), then the same position, then the
    one input of the same kind and shape."""
    left_a = [t for t in a.tensors if t.role == "input"]
    left_b = [t for t in b.tensors if t.role == "input"]
    found: list[tuple[TensorEntry, TensorEntry]] = []
    pa_of, pb_of = a.producers or {}, b.producers or {}

    def take(test: Callable[[TensorEntry, TensorEntry], bool]) -> None:
        for ea in list(left_a):
            fits = [eb for eb in left_b if dtype_kind(ea.dtype) == dtype_kind(eb.dtype) and test(ea, eb)]
            if len(fits) == 1 or (fits and test is _same_key):
                left_a.remove(ea)
                left_b.remove(fits[0])
                found.append((ea, fits[0]))

    take(lambda ea, eb: producers.same(pa_of.get(ea.key), pb_of.get(eb.key)))
    take(_same_key)
    take(lambda ea, eb: list(ea.shape) == list(eb.shape))
    return found


def _same_key(ea: TensorEntry, eb: TensorEntry) -> bool:
    return ea.key == eb.key and math.prod(ea.shape) == math.prod(eb.shape)


def pair_outputs(a: OpRecord, b: OpRecord, role: str = "output") -> list[tuple[TensorEntry, TensorEntry]]:
    """Outputs (or gradients w.r.t. them) in order: ``out`` with ``out``, ``out.1`` with ``out.1``."""
    ta = [t for t in a.tensors if t.role == role]
    tb = [t for t in b.tensors if t.role == role]
    if len(ta) == len(tb):
        return [(ea, eb) for ea, eb in zip(ta, tb) if dtype_kind(ea.dtype) == dtype_kind(eb.dtype)]
    by_key = {t.key: t for t in tb}
    return [(ea, by_key[ea.key]) for ea in ta if ea.key in by_key]


def operand(entry: TensorEntry) -> Operand:
    return Operand.stored(entry)


# ---------------------------------------------------------------------------------------------------------
# Every pair of module calls that recorded its operations on both sides
# ---------------------------------------------------------------------------------------------------------
@dataclass
class OpPair:
    """A's operation record and B's (forward, or their backward records), with their tensors paired."""

    a: OpRecord
    b: tuple[OpRecord]
    tensors: list[TensorPair]
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    how: str = "same"  # ``OpMatch.how``: "fused_a" / "fused_b" pairs are different calls (no argument compared)


@dataclass
class OpPairing:
    """The operation pairs of two traces (``OpPair``, forward and backward), and per pair of
    module calls what was left unpaired: (A's path, call) -> {"a": count, "b": count, "only_a": [[index, name,
    source]], "only_b": [...]}."""

    pairs: list[OpPair] = field(default_factory=list)
    calls: dict[tuple[str, int], dict] = field(default_factory=dict)


def pair_ops(ops_a: Sequence[OpRecord], ops_b: Sequence[OpRecord], call_pairs: Sequence, mapping: ModuleMapping,
             rules: RuleSet, records_a: Sequence = (), records_b: Sequence = ()) -> OpPairing:
    """Align the operations of every pair of module calls that recorded them on both sides (``call_pairs``: the
    records' pairs, ``pairing.RecordPair``) and pair their tensors, forward and backward. A call's operations
    include those of the modules inside it that the other run has no counterpart for (``_Merged``: Megatron's
    ``core_attention``, whose arithmetic HF's attention runs in its own code); ``records_a``/``records_b``: the
    runs' records, whose module calls say where those modules' inputs and outputs came from."""
    forward_a, backward_a = _by_call(ops_a)
    forward_b, backward_b = _by_call(ops_b)
    calls = [{(r.path, r.call): r for r in records if isinstance(r, CallRecord) and r.phase == "forward"}
             for records in (records_a, records_b)]
    result = OpPairing()

    def module(path: str) -> str | None:
        match = mapping.for_a(path)
        return match.b[0] if match is not None and len(match.b) == 1 else None

    def relaid(pa: Producer | None, pb: Producer | None) -> str | None:
        """How a child call's output that either run hands to an operation is fused in another layout in the other
        run (``paramplan.other_layout``: GPT-2's ``c_attn``, [q; k; v], against Megatron's ``linear_qkv``, per
        head): the two tensors hold the same values in other places, and are not compared as they are."""
        for producer, matched in ((pa, mapping.for_a), (pb, mapping.for_b)):
            match = matched(producer.path) if producer is not None and producer.kind == "call" and producer.path \
                else None
            if match is not None and len(match.a) == 1 and len(match.b) == 1:
                why = other_layout(rules.fused_rule(match.a[0].rpartition(".")[2]),
                                   rules.fused_rule(match.b[0].rpartition(".")[2]))
                if why is not None:
                    return why
        return None

    inside = {"a": _unmatched_inside(forward_a, mapping.for_a), "b": _unmatched_inside(forward_b, mapping.for_b)}
    for pair in call_pairs:
        ra, rb = pair.a, pair.b[0]
        if ra.kind != "call" or ra.phase != "forward" or ra.ops is None or len(pair.b) != 1 or rb.ops is None:
            continue
        merged_a = _Merged(ra, forward_a, backward_a, _inside(inside["a"], ra), calls[0])
        merged_b = _Merged(rb, forward_b, backward_b, _inside(inside["b"], rb), calls[1])
        seq_a, seq_b = merged_a.ops, merged_b.ops
        aligned = align_ops(seq_a, seq_b, rules)
        result.calls[(ra.path, ra.call)] = summary = {
            "a": len(seq_a), "b": len(seq_b), "only_a": [[op.index, op.name, op.source] for op in aligned.only_a],
            "only_b": [[op.index, op.name, op.source] for op in aligned.only_b]}
        elsewhere = {"a": merged_a.inlined_paths, "b": merged_b.inlined_paths}
        if elsewhere["a"] or elsewhere["b"]:
            summary["unmatched_inside"] = elsewhere
        absent = [side for side, rec, seq in (("a", ra, seq_a), ("b", rb, seq_b)) if rec.ops and not seq]
        if absent:
            summary["not_in_run"] = absent
        changed = {"a": _gradient_changed(aligned.only_a, merged_a.backward),
                   "b": _gradient_changed(aligned.only_b, merged_b.backward)}
        if changed["a"] or changed["b"]:
            summary["gradient_changed"] = changed
        inputs = {tp.key: tp.key_b for tp in pair.tensors if tp.role == "input"}
        producers = ProducerMap(aligned.b_of(), inputs, module)
        for mt in aligned.matches:
            note = {"same": (), "reordered": ("found out of order",),
                    "fused_a": (f"A's {mt.a.name} against B's {len(mt.inside) + 1} operations ending in {mt.b.name}",),
                    "fused_b": (f"A's {len(mt.inside) + 1} operations ending in {mt.a.name} against B's "
                                f"{mt.b.name}",)}[mt.how]
            fused = mt.how.startswith("fused")
            in_pairs = [] if fused else pair_inputs(mt.a, mt.b, producers)
            other = {ea.key: (eb.key, why) for ea, eb in in_pairs
                     if (why := relaid((mt.a.producers or {}).get(ea.key), (mt.b.producers or {}).get(eb.key)))}
            scores = _masked_differently(mt, in_pairs, rules)
            tensors = [TensorPair("input", ea.key, eb.key, *_input_operands(ea, eb, scores), note)
                       for ea, eb in in_pairs if ea.key not in other]
            out_pairs = pair_outputs(mt.a, mt.b)
            tensors += [TensorPair("output", ea.key, eb.key, operand(ea), operand(eb), note) for ea, eb in out_pairs]
            compared, undefined = _defined(tensors)
            compared, unrelated = _laid_out_alike(compared)
            relaid_in = [f"input:{key} (fused in another layout: {why})" for key, (_, why) in other.items()]
            result.pairs.append(OpPair(mt.a, (mt.b,), compared,
                                       *_unpaired(mt.a, mt.b, tensors, ("input", "output"), other),
                                       skipped=undefined + relaid_in + unrelated, how=mt.how))
            back_a, back_b = merged_a.backward(mt.a), merged_b.backward(mt.b)
            if back_a is None or back_b is None:
                continue
            # an input's gradient sums what every output hands back: where one side's operation has outputs the
            # other's lacks (B's chunk into both halves against A's slice of one), the two are not the same sum
            whole = _all_paired(mt.a, mt.b, out_pairs)
            keys = {ea.key: eb.key for ea, eb in in_pairs if ea.key not in other} if whole else {}
            grads_b = {t.key: t for t in back_b.tensors if t.role == "grad_input"}
            tensors = [TensorPair("grad_output", ea.key, eb.key, operand(ea), operand(eb), note)
                       for ea, eb in pair_outputs(back_a, back_b, "grad_output")]
            tensors += [TensorPair("grad_input", ea.key, keys[ea.key], operand(ea), operand(grads_b[keys[ea.key]]),
                                   note)
                        for ea in back_a.tensors if ea.role == "grad_input" and keys.get(ea.key) in grads_b]
            compared, unrelated = _laid_out_alike(tensors)
            result.pairs.append(OpPair(back_a, (back_b,), compared,
                                       *_unpaired(back_a, back_b, tensors, ("grad_output", "grad_input")),
                                       skipped=unrelated, how=mt.how))
    return result


def _unmatched_inside(forward: Mapping[tuple[str, int], list[OpRecord]],
                      matched: Callable[[str], Any]) -> dict[str, list[tuple[tuple[str, int], int, int]]]:
    """The module calls whose own code recorded operations and whose module has no counterpart in the other run,
    under the nearest enclosing module that has one: its path -> [((path, call), first operation's position,
    last's)]. Their operations run inside that module's calls, and are aligned as those calls' own."""
    out: dict[str, list[tuple[tuple[str, int], int, int]]] = {}
    for key, seq in forward.items():
        if not seq or matched(key[0]) is not None:
            continue
        anchor = key[0]
        while anchor and matched(anchor) is None:
            anchor = anchor.rpartition(".")[0]
        out.setdefault(anchor, []).append((key, seq[0].begin, seq[-1].end))
    return out


def _inside(candidates: Mapping[str, list[tuple[tuple[str, int], int, int]]], call: Any) -> list[tuple[str, int]]:
    """Of ``_unmatched_inside``'s module calls under ``call``'s module, those whose operations ran during that call."""
    return [key for key, begin, end in candidates.get(call.path, ()) if call.begin <= begin and end <= call.end]


class _Merged:
    """One run's operations of a module call as the alignment sees them: its own, and those of the modules inside
    it that the other run has no counterpart for (``inlined``), in the order they ran. Where there are any, every
    operation is renumbered as the call's own, and its producers are said in the call's terms: an input of an
    inlined module is what its caller handed it, an output of one is what made it inside."""

    def __init__(self, call: Any, forward: Mapping[tuple[str, int], list[OpRecord]],
                 backward: Mapping[tuple[str, int, int], OpRecord], inlined: list[tuple[str, int]],
                 calls: Mapping[tuple[str, int], CallRecord]):
        own = forward.get((call.path, call.call), [])
        self.where = (call.path, call.call)
        self.inlined, self.calls, self.by_backward = set(inlined), calls, backward
        self.inlined_paths = sorted({path for path, _ in inlined})
        if not inlined:
            self.ops, self.recorded = list(own), {op.index: (op.path, op.call, op.index) for op in own}
            return
        ordered = sorted([*own, *(op for key in inlined for op in forward.get(key, ()))], key=lambda op: op.begin)
        self.position = {(op.path, op.call, op.index): i for i, op in enumerate(ordered)}
        self.recorded = {i: (op.path, op.call, op.index) for i, op in enumerate(ordered)}
        self.ops = [replace(op, path=call.path, call=call.call, index=i,
                            producers={key: self._said_here(p, (op.path, op.call))
                                       for key, p in op.producers.items()} if op.producers else None)
                    for i, op in enumerate(ordered)]

    def _said_here(self, producer: Producer | None, where: tuple[str, int]) -> Producer:
        """``producer``, as the call ``where`` saw it, in the merged call's terms."""
        for _ in range(64):  # each step goes one module call out or in; nesting is never this deep
            if producer is None:
                break
            if producer.kind == "op":
                index = self.position.get((where[0], where[1], producer.index or 0))
                return replace(producer, index=index) if index is not None else Producer("unknown")
            if producer.kind == "input" and where != self.where:  # what the inlined module's caller handed it
                rec = self.calls.get(where)
                if rec is None or rec.parent is None:
                    break
                producer, where = (rec.producers or {}).get(producer.key or ""), (rec.parent[0], rec.parent[1])
                continue
            if producer.kind == "call" and (producer.path, producer.call) in self.inlined:  # made inside it
                where = (producer.path or "", producer.call or 0)
                rec = self.calls.get(where)
                producer = (rec.producers or {}).get(producer.key or "") if rec is not None else None
                continue
            return producer
        return Producer("unknown")

    def backward(self, op: OpRecord) -> OpRecord | None:
        """The backward record of one of ``ops`` (the first backward), numbered as it is."""
        recorded = self.recorded.get(op.index)
        back = self.by_backward.get(recorded) if recorded is not None else None
        if back is None or not self.inlined:
            return back
        return replace(back, path=self.where[0], call=self.where[1], index=op.index, args=op.args,
                       producers=op.producers, in_place=op.in_place)  # what a report reads of its forward record


def _all_paired(a: OpRecord, b: OpRecord, out_pairs: Sequence) -> bool:
    """Whether every output of both operations has its counterpart."""
    paired_a, paired_b = {ea.key for ea, _ in out_pairs}, {eb.key for _, eb in out_pairs}
    return all(t.key in paired_a for t in a.tensors if t.role == "output") and \
        all(t.key in paired_b for t in b.tensors if t.role == "output")


def _gradient_changed(inserted: Sequence[OpRecord], backward: Callable[[OpRecord], OpRecord | None]) -> list[list]:
    """Operations that one run inserts which pass their values through unchanged (a custom autograd function, a
    cast without effect) but not their gradient: [index, name, source, function] each. Such an operation has
    no counterpart to compare with, yet its backward must be the identity too; where it is not, it is the origin
    of a backward-only divergence (a wrong hand-written backward)."""
    found = []
    for op in inserted:
        inputs = [t for t in op.tensors if t.role == "input"]
        out = first_output(op)
        back = backward(op)
        if len(inputs) != 1 or out is None or back is None or not values_agree(inputs[0], out):
            continue
        grad_out = next((t for t in back.tensors if t.role == "grad_output"), None)
        grad_in = next((t for t in back.tensors if t.role == "grad_input"), None)
        if grad_out is not None and grad_in is not None and not values_agree(grad_out, grad_in):
            found.append([op.index, op.name, op.source, op.function])
    return found


def _by_call(ops: Sequence[OpRecord]) -> tuple[dict, dict]:
    """Forward operations by (path, call), in order; backward ones by (path, call, index) (the first backward)."""
    forward: dict[tuple[str, int], list[OpRecord]] = {}
    backward: dict[tuple[str, int, int], OpRecord] = {}
    for op in ops:
        if op.phase == "forward":
            forward.setdefault((op.path, op.call), []).append(op)
        else:
            backward.setdefault((op.path, op.call, op.index), op)
    for seq in forward.values():
        seq.sort(key=lambda op: op.index)
    return forward, backward


def _masked_differently(mt: OpMatch, in_pairs: Sequence[tuple[TensorEntry, TensorEntry]], rules: RuleSet) -> bool:
    """A softmax of attention scores that the runs mask with other values (HF's -inf, Megatron's -10000.0): its
    inputs, which differ there, are compared as what the softmax makes of them (``Operand`` "masked_scores")."""
    if mt.how not in ("same", "reordered") or rules.op_kind(mt.a.op) != "softmax" or \
            rules.op_kind(mt.b.op) != "softmax":
        return False

    def masks(e: TensorEntry) -> bool:
        low = e.stats.get("min")
        return bool(e.stats.get("inf")) or (low is not None and low <= MASKED_SCORE)

    return any((masks(ea) or masks(eb)) and ((ea.stats.get("inf") or 0, ea.stats.get("min")) !=
                                             (eb.stats.get("inf") or 0, eb.stats.get("min"))) for ea, eb in in_pairs)


def _input_operands(ea: TensorEntry, eb: TensorEntry, scores: bool) -> tuple[Operand, Operand]:
    if scores and ea.dtype in FLOAT_DTYPES and eb.dtype in FLOAT_DTYPES:
        return Operand((ea,), op="masked_scores"), Operand((eb,), op="masked_scores")
    return operand(ea), operand(eb)


def _laid_out_alike(tensors: list[TensorPair]) -> tuple[list[TensorPair], list[str]]:
    """The pairs to compare, and those left out because their shapes hold the values in orders the shapes do not
    relate (``layouts_relate``): HF's key viewed [b, s, heads, d] against Megatron's [s, b * heads, d] holds the same
    values, and compared flattened it "differed" by 100 times its size."""
    compared, unrelated = [], []
    for tp in tensors:
        shape_a, shape_b = list(tp.a.entry.shape), list(tp.b.entry.shape)
        if layouts_relate(shape_a, shape_b):
            compared.append(tp)
        else:
            unrelated.append(f"{tp.role}:{tp.key} (not compared: {shape_a} against {shape_b}, laid out in orders the "
                             f"shapes do not relate)")
    return compared, unrelated


def _defined(tensors: list[TensorPair]) -> tuple[list[TensorPair], list[str]]:
    """The pairs to compare, and those left out because a side's tensor was allocated and not yet written
    (``torch.empty_like``'s output, or the tensor an in-place write is about to fill): its bytes are whatever the
    memory held, and would make the operation that allocates it the origin of any later difference."""
    compared, undefined = [], []
    for tp in tensors:
        if tp.a.entry.undefined or tp.b.entry.undefined:
            undefined.append(f"{tp.role}:{tp.key} (not compared: allocated and not yet written, its values are "
                             f"undefined)")
        else:
            compared.append(tp)
    return compared, undefined


def _unpaired(a: OpRecord, b: OpRecord, tensors: list, roles: tuple[str, ...],
              left_out: Mapping[str, tuple] | None = None) -> tuple[list[str], list[str]]:
    """A's and B's tensors with no counterpart; ``left_out``: inputs paired but not compared (A's key: (B's key,
    why)), which have one."""
    keys_a = {(tp.role, tp.key) for tp in tensors} | {("input", key) for key in left_out or {}}
    keys_b = {(tp.role, tp.key_b) for tp in tensors} | {("input", kb) for kb, _ in (left_out or {}).values()}
    return ([f"{t.role}:{t.key}" for t in a.tensors if t.role in roles and (t.role, t.key) not in keys_a],
            [f"{t.role}:{t.key}" for t in b.tensors if t.role in roles and (t.role, t.key) not in keys_b])
