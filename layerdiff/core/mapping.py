"""Infer which module of trace B is which module of trace A when their names differ.

Real ports rename things (``linear1`` vs ``dense1``), add wrapper modules, or drop some. Starting from the
roots, children of matched modules are paired by a similarity score: type family, output shapes, parameter
shapes, local name, and position among siblings. A child of B that matches nothing is tried as a wrapper: its
own children may match the A children left over (and the other way round). Each pairing gets a confidence.
The result is a list of explicit rename rules the user can save, edit and pass back with ``--map``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .layouts import canonical_param_name, type_family

MIN_SCORE = 0.5


@dataclass
class ModuleInfo:
    path: str
    family: str
    out_shapes: tuple
    param_shapes: tuple
    order: int
    children: list = field(default_factory=list)

    @property
    def local(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass
class MappingEntry:
    b_path: str
    a_path: str
    confidence: float
    reason: str

    def rule(self) -> tuple[str, str]:
        """A rename rule for this module and its own parameters (``path`` or ``path.leaf``)."""
        return rf"^{re.escape(self.b_path)}(\.[^.]+)?$", self.a_path + r"\1"


def module_tree(records) -> dict:
    """path -> ModuleInfo for the first step's forward calls (first call of each path)."""
    params = {}
    for r in records:
        if r["kind"] == "param" and r["call"] == 0:
            module = r.get("module", r["path"].rpartition(".")[0])
            leaf = canonical_param_name(r["path"]).rpartition(".")[2]
            params.setdefault(module, []).append((leaf, tuple(sorted(r["tensors"][0]["shape"]))))
    infos, parents = {}, {}
    calls = sorted((r for r in records if r["kind"] == "call" and r["phase"] == "forward" and r["call"] == 0),
                   key=lambda r: r["begin"])
    for order, r in enumerate(calls):
        outs = tuple(tuple(t["shape"]) for t in r["tensors"] if t["role"] == "output")
        infos[r["path"]] = ModuleInfo(r["path"], type_family(r.get("type")), outs,
                                      tuple(sorted(params.get(r["path"], []))), order)
        parents[r["path"]] = r["parent"][0] if r.get("parent") else None
    for path, parent in parents.items():
        if parent in infos and parent != path:
            infos[parent].children.append(infos[path])
    return infos


def _score(a: ModuleInfo, b: ModuleInfo, position_gap: int) -> float:
    score = 0.35 if a.family == b.family else 0.0
    if a.out_shapes and a.out_shapes == b.out_shapes:
        score += 0.25
    if a.param_shapes == b.param_shapes:
        score += 0.2 if a.param_shapes else 0.05
    if a.local == b.local:
        score += 0.15
    score += 0.05 / (1 + position_gap)
    return score


def infer_mapping(records_a, records_b, known=None) -> list[MappingEntry]:
    """Rules for B modules whose path (after ``known`` renames) is not in A."""
    known = known or (lambda p: p)
    tree_a, tree_b = module_tree(records_a), module_tree(records_b)
    entries: list[MappingEntry] = []
    matched_a: set = set()

    def pair(a: ModuleInfo, b: ModuleInfo):
        """Match the children of two modules already matched to each other."""
        left_a = [c for c in a.children if c.path not in matched_a]
        left_b = list(b.children)
        exact = {c.path: c for c in left_a}
        pending = []
        for cb in left_b:  # names that already agree (possibly through the user's rules)
            ca = exact.get(known(cb.path))
            if ca is not None:
                matched_a.add(ca.path)
                left_a.remove(ca)
                pair(ca, cb)
            else:
                pending.append(cb)
        for cb in pending:
            left_a = [c for c in left_a if c.path not in matched_a]  # a wrapper pass may have claimed some
            candidates = [(ca, _score(ca, cb, abs(left_a.index(ca) - pending.index(cb)))) for ca in left_a]
            ca, score = max(candidates, key=lambda c: c[1], default=(None, 0.0))
            if ca is not None and score >= MIN_SCORE:
                matched_a.add(ca.path)
                left_a.remove(ca)
                reasons = [w for w, ok in (("type", ca.family == cb.family), ("output shapes", ca.out_shapes == cb.out_shapes),
                                           ("parameter shapes", ca.param_shapes == cb.param_shapes),
                                           ("name", ca.local == cb.local)) if ok]
                entries.append(MappingEntry(cb.path, ca.path, round(min(score, 1.0), 2),
                                            "same " + ", ".join(reasons) if reasons else "position"))
                pair(ca, cb)
            elif cb.children:  # an extra wrapper in B: its children may stand for A's
                pair(_Virtual(a, left_a), cb)
        for ca in list(left_a):  # an extra wrapper in A: B's leftovers may be its children
            if ca.children and ca.path not in matched_a:
                rest = [c for c in b.children if not any(e.b_path == c.path for e in entries)
                        and known(c.path) not in tree_a]
                if rest:
                    pair(ca, _Virtual(b, rest))

    root_a, root_b = tree_a.get(""), tree_b.get("")
    if root_a is not None and root_b is not None:
        matched_a.add("")
        pair(root_a, root_b)
    return entries


class _Virtual(ModuleInfo):
    """A module seen through a wrapper: the same path, with a chosen set of children."""

    def __init__(self, base: ModuleInfo, children: list):
        super().__init__(base.path, base.family, base.out_shapes, base.param_shapes, base.order, list(children))


def rules_text(entries: list[MappingEntry]) -> str:
    """The mapping as an editable ``--map`` file."""
    lines = ["# layerdiff module mapping: B_PATTERN=A_NAME, one per line; edit and pass back with --map FILE"]
    for e in entries:
        pattern, repl = e.rule()
        lines.append(f"# {e.b_path} -> {e.a_path}  (confidence {e.confidence:.2f}: {e.reason})")
        lines.append(f"{pattern}={repl}")
    return "\n".join(lines) + "\n"
