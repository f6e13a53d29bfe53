"""Which parameter of one side is which of the other's: the same one under another name, one part of a fused
one (``q_proj.weight`` is rows of ``linear_qkv.weight``), or the other's parts merged. Weight transfer builds the
destination's parameters this way; checkpoint diff compares each of A's parameters this way. Arrays are in
PyTorch layout ([out, in]): parts are rows (axis 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from layerdiff.errors import LayerdiffError
from layerdiff.match import fusion
from layerdiff.match.layouts import canonical_param_name
from layerdiff.match.mapping import ModuleMapping
from layerdiff.match.rules import FusedRule, RuleSet


@dataclass(frozen=True)
class ParamSource:
    name: str  # this side's parameter
    op: str  # "same" | "part" | "merge" | "regroup" | "relayout" (the same parts fused in another layout, its
    # sizes not known: not converted)
    sources: tuple  # the other side's parameter name(s)
    index: int = 0  # part: which part this parameter is; regroup: the key-value heads (the grouped side's groups)
    sizes: tuple = ()  # part: every part's size along axis 0
    rule: str | None = None
    fused_module: str = ""  # the fused module's path (either side), for its group count
    siblings: tuple = ()  # part: this side's parameter for every part, in order
    grouped_here: bool = False  # regroup: this side holds the parts in groups, the other back to back

    def describe(self) -> str:
        if self.op in ("relayout", "regroup"):
            return f"{self.sources[0]}, its parts in another layout ({self.rule})"
        if self.op == "part":
            return f"part {self.index + 1} of {len(self.sizes)} of {self.sources[0]} ({self.rule})"
        if self.op == "merge":
            return f"{' + '.join(self.sources)} merged ({self.rule})"
        return self.sources[0]


def _leaf(name: str) -> tuple:
    module, _, _ = name.rpartition(".")
    return module, canonical_param_name(name).rpartition(".")[2]


def plan(mapping: ModuleMapping, own: dict, other: dict, own_side: str,
         rules: RuleSet | None = None) -> tuple[list, list, set]:
    """For each of ``own``'s parameters (name -> shape, PyTorch layout), where its value comes from in
    ``other`` (name -> shape). ``own_side`` is "a" or "b" of ``mapping``. Returns (sources, own names with no
    counterpart, other names used). With ``rules``, a module matched with one that holds the same parts fused in
    another layout (transformers' Phi-3 ``qkv_proj``, [q; k; v], against Megatron's ``linear_qkv``, per query
    group) is planned as ``relayout``: its parameters cannot be copied as they are."""
    by_leaf = {_leaf(n): n for n in other}
    own_by_leaf = {_leaf(n): n for n in own}
    sources: list = []
    missing: list = []
    used: set = set()
    for name, shape in own.items():
        module, leaf = _leaf(name)
        match = mapping.for_a(module) if own_side == "a" else mapping.for_b(module)
        if match is None:
            missing.append(name)
            continue
        mine, theirs = (match.a, match.b) if own_side == "a" else (match.b, match.a)
        if len(mine) == 1 and len(theirs) == 1:
            src = by_leaf.get((theirs[0], leaf))
            layouts = other_layout(rules.fused_rule(mine[0].rpartition(".")[2]), rules.fused_rule(
                theirs[0].rpartition(".")[2])) if rules is not None else None
            if not src:
                found = None
            elif layouts is None:
                found = ParamSource(name, "same", (src,))
            else:
                found = ParamSource(name, "relayout", (src,), rule=layouts, fused_module=mine[0])
        elif len(mine) > 1:  # this parameter is one part of the other side's fused one
            src = by_leaf.get((theirs[0], leaf))
            siblings = [own_by_leaf.get((m, leaf)) for m in mine]
            found = None
            if src and None not in siblings:
                found = ParamSource(name, "part", (src,), mine.index(module), tuple(own[n][0] for n in siblings),
                                    match.rule, theirs[0], tuple(siblings))
        else:  # this parameter is fused; the other side has its parts
            srcs = [by_leaf.get((m, leaf)) for m in theirs]
            found = ParamSource(name, "merge", tuple(srcs), rule=match.rule, fused_module=mine[0]) \
                if None not in srcs else None
        if found is None:
            missing.append(name)
        else:
            sources.append(found)
            used.update(found.sources)
    return sources, missing, used


def other_layout(rule_mine: FusedRule | None, rule_theirs: FusedRule | None) -> str | None:
    """How two matched modules' fused layouts differ (their rule sets' ``fused`` rules), where one holds its parts
    back to back and the other in groups (a part of each group after the other: Megatron's per query group); None
    where they do not (neither is fused, or both the same way; both in groups, per head or per query group, agree
    for every model that has both, with as many key-value heads as heads)."""
    if rule_mine is None or rule_theirs is None or rule_mine.parts != rule_theirs.parts or \
            bool(rule_mine.groups) == bool(rule_theirs.groups):
        return None
    layout = {True: "in groups", False: "back to back"}
    return (f"{', '.join(rule_mine.parts)}: {layout[bool(rule_theirs.groups)]} there, "
            f"{layout[bool(rule_mine.groups)]} here")


# where a query-key-value projection's key-value head count and head size are found (either side's names)
_KV_HEADS = ("num_query_groups_per_partition", "num_query_groups", "num_key_value_heads", "num_kv_heads",
             "kv_heads")  # GPT-BigCode's attention
_HEAD_DIM = ("hidden_size_per_attention_head", "head_dim", "kv_channels")
_HEADS = ("num_heads", "num_attention_heads")


def qkv_layout(rule: FusedRule | None, rows: int, hparams) -> tuple[tuple, int] | None:
    """(part sizes, key-value heads G) of a fused query-key-value projection of ``rows`` output features: H x d for
    the queries and G x d for the keys and the values, G and the head size d as ``hparams`` (dicts: the fused
    module's, its parent's) name them. Laid out by ``rule``, it holds them in G groups where the rule holds its parts
    in groups, else back to back. None where they are not found or the rule's parts are not these three."""
    found = {}
    for names in (_KV_HEADS, _HEAD_DIM, _HEADS):
        found[names] = next((h[n] for h in hparams if h for n in names
                             if isinstance(h.get(n), int) and not isinstance(h.get(n), bool) and h[n] > 0), None)
    kv, head = found[_KV_HEADS] or found[_HEADS], found[_HEAD_DIM]  # no key-value heads named: one per head (GPT-2)
    if rule is None or tuple(rule.parts) != ("q", "k", "v") or kv is None or head is None or rows <= 2 * kv * head:
        return None
    return (rows - 2 * kv * head, kv * head, kv * head), kv


def regrouped(source: ParamSource, rules: RuleSet, rows: int, hparams) -> ParamSource:
    """A ``relayout`` source made a ``regroup`` one, its parts' sizes and groups from this side's hyper-parameters
    (``qkv_layout``); left as it was where they are not found."""
    rule = rules.fused_rule(source.fused_module.rpartition(".")[2])
    layout = qkv_layout(rule, rows, hparams)
    if rule is None or layout is None:
        return source
    sizes, kv = layout
    return ParamSource(source.name, "regroup", source.sources, index=kv, sizes=sizes, rule=source.rule,
                       fused_module=source.fused_module, grouped_here=bool(rule.groups))


def inferred_regroup(source: ParamSource, rules: RuleSet, here: np.ndarray, there: np.ndarray) -> ParamSource:
    """A ``relayout`` source made a ``regroup`` one where nothing names the heads (two checkpoints): the key-value
    heads G and head size d under which the other side's values, laid out anew, show this side's (``here`` and
    ``there``: the two arrays, rows first), decided on one column (a bias: itself) as ``fusion.best_layout``
    decides. Left as it was where no candidate makes a part equal or nearly so."""
    rule = rules.fused_rule(source.fused_module.rpartition(".")[2])
    here, there = rows_first(here, there), rows_first(there, here)
    rows = here.shape[0] if here.ndim else 0
    if rule is None or tuple(rule.parts) != ("q", "k", "v") or there.shape != here.shape or rows < 3:
        return source
    column_here = (here if here.ndim == 1 else here[:, 0]).astype(np.float64)
    column_there = (there if there.ndim == 1 else there[:, 0]).astype(np.float64)
    candidates = [ParamSource(source.name, "regroup", source.sources, index=kv, sizes=(query, kv * head, kv * head),
                              rule=source.rule, fused_module=source.fused_module, grouped_here=bool(rule.groups))
                  for head in range(4, rows // 3 + 1) if rows % head == 0  # a head of fewer than 4: none known
                  for kv in range(1, rows // (3 * head) + 1)
                  if (query := rows - 2 * kv * head) % (kv * head) == 0]

    def pieces(candidate: ParamSource):
        groups_here = candidate.index if rule.groups else 1
        return zip(fusion.split(build(candidate, lambda _: column_there, candidate.index), 0, candidate.sizes,
                                groups_here), fusion.split(column_here, 0, candidate.sizes, groups_here))

    found = fusion.best_layout(candidates, pieces, float(np.linalg.norm(column_here)))
    return found if found is not None else source


def rows_first(array: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``array`` with its fused rows first where a checkpoint stores it [in, out] (GPT-2's ``Conv1D``): a 2-D
    array whose shape is ``other``'s reversed, wider than it is tall (a query-key-value projection has at least as
    many outputs as inputs)."""
    if array.ndim == 2 and other.ndim == 2 and array.shape == other.shape[::-1] and array.shape[0] < array.shape[1]:
        return array.T
    return array


def build(source: ParamSource, load, groups: int) -> np.ndarray:
    """The value of ``source.name`` from the other side's arrays (``load(name)`` -> PyTorch-layout array)."""
    if source.op == "relayout":
        raise LayerdiffError(f"{source.name} is {source.describe()}: converting between the two layouts is not "
                             "supported yet (the key-value heads and head size were not found)")
    if source.op == "regroup":  # the parts in the other side's layout, then in this side's
        there, here = (1, groups) if source.grouped_here else (groups, 1)
        return fusion.merge(fusion.split(load(source.sources[0]), 0, source.sizes, there), 0, here)
    if source.op == "same":
        return load(source.sources[0])
    if source.op == "part":
        return fusion.split(load(source.sources[0]), 0, source.sizes, groups)[source.index]
    return fusion.merge([load(n) for n in source.sources], 0, groups)


def group_count(source: ParamSource, rules: RuleSet, hparams, load=None, own_load=None) -> int:
    """The group count of a fused parameter: declared hyper-parameters first (``hparams``: dicts of the fused
    module, its parent, the parts' parent), checked against the values when both sides' arrays are at hand."""
    if source.op in ("same", "relayout"):
        return 1
    if source.op == "regroup":
        return source.index  # the key-value heads: one group each
    rule = rules.fused_rule(source.fused_module.rpartition(".")[2])
    sizes: Sequence[int]
    if source.op == "part":
        sizes = source.sizes
    else:
        sizes = [np.shape(load(n))[0] for n in source.sources] if load else []
    candidates = fusion.group_candidates(rule.groups if rule else (), hparams, sizes) if sizes else [1]
    if load is not None and own_load is not None:
        if source.op == "merge":
            fused, parts = own_load(source.name), [load(n) for n in source.sources]
        else:
            fused, parts = load(source.sources[0]), [own_load(n) for n in source.siblings]
        found = fusion.infer_groups(fused, parts, 0, candidates)
        if found is not None:
            return found
    return candidates[0]
