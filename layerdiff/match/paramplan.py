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
from layerdiff.match.rules import RuleSet


@dataclass(frozen=True)
class ParamSource:
    name: str  # this side's parameter
    op: str  # "same" | "part" | "merge" | "relayout" (the same parts fused in another layout: not converted)
    sources: tuple  # the other side's parameter name(s)
    index: int = 0  # part: which part this parameter is
    sizes: tuple = ()  # part: every part's size along axis 0
    rule: str | None = None
    fused_module: str = ""  # the fused module's path (either side), for its group count
    siblings: tuple = ()  # part: this side's parameter for every part, in order

    def describe(self) -> str:
        if self.op == "relayout":
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
            layouts = _other_layout(rules, mine[0], theirs[0]) if src and rules is not None else None
            found = None if not src else ParamSource(name, "same", (src,)) if layouts is None else \
                ParamSource(name, "relayout", (src,), rule=layouts, fused_module=mine[0])
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


def _other_layout(rules: RuleSet, mine: str, theirs: str) -> str | None:
    """How two matched modules' fused layouts differ, where one holds its parts back to back and the other in
    groups (a part of each group after the other: Megatron's per query group); None where they do not (neither
    is fused, or both the same way; both in groups, per head or per query group, agree for every model that has
    both, with as many key-value heads as heads)."""
    rule_mine, rule_theirs = (rules.fused_rule(path.rpartition(".")[2]) for path in (mine, theirs))
    if rule_mine is None or rule_theirs is None or rule_mine.parts != rule_theirs.parts or \
            bool(rule_mine.groups) == bool(rule_theirs.groups):
        return None
    layout = {True: "in groups", False: "back to back"}
    return (f"{', '.join(rule_mine.parts)}: {layout[bool(rule_theirs.groups)]} there, "
            f"{layout[bool(rule_mine.groups)]} here")


def build(source: ParamSource, load, groups: int) -> np.ndarray:
    """The value of ``source.name`` from the other side's arrays (``load(name)`` -> PyTorch-layout array)."""
    if source.op == "relayout":
        raise LayerdiffError(f"{source.name} is {source.describe()}: converting between the two layouts is not "
                             "supported yet")
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
