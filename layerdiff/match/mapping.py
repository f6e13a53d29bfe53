"""Which module of run B is which module of run A, from all the evidence the runs leave.

Ports rename (``wq`` ~ ``q_proj``), fuse (Megatron's ``linear_qkv`` is q, k and v), wrap, drop and re-nest
modules. The matching works in three passes:

1. Fixed pairs: the same path (after the user's ``--map`` rules) is the same module.
2. Units - modules that own parameters or have no children, and fused groups (q, k, v siblings standing for the
   other side's ``linear_qkv``, declared in the rule set) - are matched within each block (the same integers in
   the path: ``layers.3`` never pairs with ``layers.4``) by a score: parameter value fingerprints (transferred
   weights are equal up to layout), name tokens, type family, parameter and output sizes, and position among the
   block's units. Highest scores first; a unit is matched at most once.
3. Containers are matched by the units they hold (a container of B whose matched units are mostly those of a
   container of A is that container). A container matched on neither side adds no level: its matched children
   hang under their nearest matched ancestor.

Each match keeps its evidence, printed with the mapping, and a confidence. The result serves align (pairing
records), replay (renaming the candidate's modules), weight transfer and checkpoint diff.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from layerdiff.match.layouts import ACTIVATION_FAMILIES
from layerdiff.match.modules import ModuleInfo
from layerdiff.match.rules import FusedRule, RuleSet

MIN_SCORE = 2.0
FULL_SCORE = 8.0
MIN_OVERLAP = 0.5


# Names a type also answers to: an MoE router is "gate" in HF (a gate projection's name), "router" in Megatron
_FAMILY_TOKENS = {"router": ("router",)}


@dataclass(frozen=True)
class Match:
    """A's module(s) and B's: one each, or the parts on one side and the fused module on the other."""

    a: tuple
    b: tuple
    rule: str | None = None
    confidence: float = 1.0
    evidence: tuple = ()
    inside: str | None = None  # B's module that runs B's side inside itself (a Linear applying its activation)

    @property
    def fused_side(self) -> str | None:
        if len(self.a) > 1:
            return "b"
        if len(self.b) > 1:
            return "a"
        return None

    def as_dict(self) -> dict:
        """The JSON form: ``a``/``b`` are single paths (kept from report version 1); ``a_parts``/``b_parts`` list
        every path when one side is fused."""
        out = {"a": self.a[0], "b": self.b[0], "confidence": self.confidence, "reason": ", ".join(self.evidence)}
        if self.rule:
            out.update(rule=self.rule, a_parts=list(self.a), b_parts=list(self.b))
        if self.inside:
            out["inside"] = self.inside
        return out


@dataclass
class ModuleMapping:
    matches: list = field(default_factory=list)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)

    def __post_init__(self):
        self._by_a = {p: m for m in self.matches for p in m.a}
        self._by_b = {p: m for m in self.matches for p in m.b}

    def for_a(self, path: str) -> Match | None:
        return self._by_a.get(path)

    def for_b(self, path: str) -> Match | None:
        return self._by_b.get(path)

    def renamed(self) -> list:
        """Matches whose names differ (what the report and ``--save-map`` show)."""
        return [m for m in self.matches if m.a != m.b]

    def b_to_a(self) -> dict:
        """B module path -> A module path for one-to-one matches (fused parts are renamed by ``for_b``)."""
        return {m.b[0]: m.a[0] for m in self.matches if len(m.a) == len(m.b) == 1}


@dataclass
class _Unit:
    """One module, or the parts of a fused group, as the unit that pass 2 matches."""

    paths: tuple
    info: ModuleInfo
    token: str
    family: str
    params: dict  # leaf -> (numel, Fingerprint or None)
    out_numel: int | None
    rule: FusedRule | None = None
    rank: float = 0.0
    also: tuple = ()  # other tokens its type answers to

    @property
    def local(self) -> str:
        return "+".join(p.rpartition(".")[2] for p in self.paths)


def _unit(infos: list, rules: RuleSet, rule: FusedRule | None = None) -> _Unit:
    first = infos[0]
    params: dict = {}
    for info in infos:
        for p in info.params:
            numel = 1
            for d in p.shape:
                numel *= d
            old = params.get(p.leaf)
            if old is None:
                params[p.leaf] = (numel, p.fingerprint)
            else:
                fp = old[1].combine(p.fingerprint) if old[1] is not None and p.fingerprint is not None else None
                params[p.leaf] = (old[0] + numel, fp)
    outs = [sum(i.out_numels) for i in infos if i.out_numels]
    parent = first.parent.rpartition(".")[2] if first.parent else None
    token = rule.name if rule is not None and len(infos) > 1 else rules.token(first.local, parent)
    if rule is None and len(infos) == 1:
        rule = rules.fused_rule(first.local)
    family = rules.family(first.type) if first.type else ""
    also = _FAMILY_TOKENS.get(family, ())
    if rule is not None and len(infos) == 1:
        # a module a rule fuses answers to its parts' names too: Megatron's linear_fc1 is [gate; up] in a gated
        # MLP and the up projection alone (GPT-2's c_fc) in one that is not; the parameters' sizes tell which
        also += tuple(rule.parts)
    return _Unit(tuple(i.path for i in infos), first, token, family, params,
                 sum(outs) if len(outs) == len(infos) else None, rule, also=also)


def _param_evidence(a: _Unit, b: _Unit) -> tuple[float, str | None]:
    if not a.params and not b.params:
        return 0.0, None
    if not a.params or not b.params:
        return -1.0, None
    same = differ = 0
    for leaf, (numel, fp) in a.params.items():
        other = b.params.get(leaf)
        if other is None or other[0] != numel:
            return -1.5, None
        if fp is not None and other[1] is not None and fp.informative:
            if fp.same(other[1]):
                same += 1
            else:
                differ += 1
    if len(b.params) != len(a.params):
        return -1.0, None
    if same and not differ:
        return 4.0, "same weights"
    return 0.5, "parameter sizes"


def _score(a: _Unit, b: _Unit) -> tuple[float, list]:
    score, evidence = 0.0, []
    delta, text = _param_evidence(a, b)
    score += delta
    if text:
        evidence.append(text)
    if a.token == b.token or a.token in b.also or b.token in a.also:
        score += 1.5
        evidence.append("name" if a.local == b.local else f"name {a.local}~{b.local}")
    if a.family and b.family:
        if a.family == b.family:
            score += 1.0
            evidence.append(f"type {a.family}")
        elif not {a.family, b.family} <= ACTIVATION_FAMILIES:  # a swapped activation is a defect to show
            score -= 2.0
    if a.out_numel and b.out_numel:
        if a.out_numel == b.out_numel:
            score += 0.5
            evidence.append("output size")
        else:
            score -= 0.5
    closeness = 1.0 - abs(a.rank - b.rank)
    score += closeness
    if closeness > 0.8:
        evidence.append("position")
    return score, evidence


def _group_parts(units: list, fused_rules: set, rules: RuleSet) -> list:
    """Stand the parts of a fused module in for it: siblings whose tokens are a rule's parts become one unit."""
    out: list = []
    used: set[int] = set()
    by_parent: dict = {}
    for u in units:
        by_parent.setdefault(u.info.parent, []).append(u)
    for rule in fused_rules:
        for siblings in by_parent.values():
            if any(u.rule is rule and len(u.paths) == 1 for u in siblings):
                continue  # this side fuses them too
            found = [next((u for u in siblings if u.token == t and id(u) not in used and len(u.paths) == 1), None)
                     for t in rule.parts]
            parts = [u for u in found if u is not None]
            if len(parts) == len(found):
                used.update(id(u) for u in parts)
                out.append(_unit([u.info for u in parts], rules, rule))
    return [u for u in units if id(u) not in used] + out


def _rank(units: list):
    ordered = sorted(units, key=lambda u: (u.info.order, u.paths))
    n = max(len(ordered) - 1, 1)
    for i, u in enumerate(ordered):
        u.rank = i / n


def _is_unit(info: ModuleInfo) -> bool:
    return bool(info.params) or not info.children


def match_modules(a: dict, b: dict, rules: RuleSet, rename=None, auto: bool = True) -> ModuleMapping:
    """Match module infos (``modules.from_*``) of two runs; ``rename`` maps B's paths to A's (the user's rules)."""
    rename = rename or (lambda p: p)
    matches: list[Match] = []
    used_a, used_b = set(), set()
    for path_b in b:  # pass 1: the same name
        path_a = rename(path_b)
        if path_a in a and path_a not in used_a:
            matches.append(Match((path_a,), (path_b,), None, 1.0, ("same name",) if path_a == path_b
                                 else ("--map rule",)))
            used_a.add(path_a)
            used_b.add(path_b)
    if auto:
        matches += _match_units(a, b, rules, used_a, used_b)
        matches += _match_absorbed(a, b, matches, used_a, used_b)
        matches += _match_containers(a, b, rules, matches, used_a, used_b)
    matched_a = {p for m in matches for p in m.a}
    matched_b = {p for m in matches for p in m.b}
    return ModuleMapping(matches, [p for p in a if p not in matched_a], [p for p in b if p not in matched_b])


def _buckets(infos: dict, used: set, rules: RuleSet) -> dict:
    out: dict = {}
    for info in infos.values():
        if info.path not in used and _is_unit(info) and info.path:
            out.setdefault(info.indices, []).append(_unit([info], rules))
    return out


def _match_units(a: dict, b: dict, rules: RuleSet, used_a: set, used_b: set) -> list:
    buckets_a, buckets_b = _buckets(a, used_a, rules), _buckets(b, used_b, rules)
    matches = []
    for key in sorted(set(buckets_a) & set(buckets_b)):
        units_a, units_b = buckets_a[key], buckets_b[key]
        rules_b = {u.rule for u in units_b if u.rule is not None and len(u.paths) == 1}
        rules_a = {u.rule for u in units_a if u.rule is not None and len(u.paths) == 1}
        units_a = _group_parts(units_a, rules_b - rules_a, rules)
        units_b = _group_parts(units_b, rules_a - rules_b, rules)
        _rank(units_a)
        _rank(units_b)
        candidates = []
        for ua in units_a:
            for ub in units_b:
                if (len(ua.paths) > 1 or len(ub.paths) > 1) and not _fused_pair(ua, ub):
                    continue
                score, evidence = _score(ua, ub)
                if score >= MIN_SCORE:
                    candidates.append((score, ua.rank, ub.rank, ua, ub, evidence))
        candidates.sort(key=lambda c: (-c[0], abs(c[1] - c[2])))
        taken_a, taken_b = set(), set()
        for score, _, _, ua, ub, evidence in candidates:
            if id(ua) in taken_a or id(ub) in taken_b:
                continue
            taken_a.add(id(ua))
            taken_b.add(id(ub))
            rule = (ua.rule or ub.rule).name if len(ua.paths) > 1 or len(ub.paths) > 1 else None
            if rule:
                evidence = [f"fused {rule}"] + evidence
            matches.append(Match(ua.paths, ub.paths, rule, round(min(score / FULL_SCORE, 1.0), 2), tuple(evidence)))
            used_a.update(ua.paths)
            used_b.update(ub.paths)
    return matches


def _match_absorbed(a: dict, b: dict, matches: list, used_a: set, used_b: set) -> list:
    """A module of B that runs, inside itself after its own work, a child whose counterpart in A is the call right
    after A's module: MindSpore Transformers' ``w1`` Linear applies its activation as a child, HF's ``gate_proj``
    hands its output to ``act_fn``. The child is that call, found from structure and values, whatever its class or
    name: the two modules are matched and own parameters; A's runs nothing inside itself and B's runs one child no
    other match claims (seen in forward, or in backward only: a cell with a backward of its own); the next call of
    A's parent takes A's module's output and gives one of its size; and B's module does not give what A's gives
    (it gives what comes after the activation)."""
    out = []
    for match in matches:
        if len(match.a) != 1 or len(match.b) != 1:
            continue
        ia, ib = a.get(match.a[0]), b.get(match.b[0])
        if ia is None or ib is None or ia.children or not ia.params or not ib.params:
            continue
        inner = ib.children + ib.backward_children
        if len(inner) != 1 or inner[0] in used_b:
            continue
        child = b.get(inner[0])
        if child is not None and child.out_numels and child.out_numels != ib.out_numels:
            continue
        following = _next_call(a, ia)
        if following is None or following.path in used_a or following.params or following.children or \
                following.out_numels != ia.out_numels or not _same_print(ia.out_prints, following.in_prints):
            continue
        if _same_print(ib.out_prints, ia.out_prints):
            continue  # B's module gives A's module's result: what runs inside it is something else
        evidence = [f"runs inside {ib.local}, as {following.local} runs after {ia.local}"]
        if _same_print(ib.out_prints, following.out_prints):
            evidence.append(f"{ib.local}'s output is {following.local}'s")
        out.append(Match((following.path,), (inner[0],), None, 0.9 if len(evidence) > 1 else 0.6, tuple(evidence),
                         inside=ib.path))
        used_a.add(following.path)
        used_b.add(inner[0])
    return out


def _next_call(infos: dict, info: ModuleInfo) -> ModuleInfo | None:
    """The call its parent makes right after this module's."""
    parent = infos.get(info.parent) if info.parent is not None else None
    if parent is None:
        return None
    siblings = sorted((infos[p] for p in parent.children if infos[p].called), key=lambda i: i.order)
    at = next((n for n, s in enumerate(siblings) if s.path == info.path), None)
    return siblings[at + 1] if at is not None and at + 1 < len(siblings) else None


def _same_print(x: tuple, y: tuple) -> bool:
    """The first float tensors of two calls hold the same values (their fingerprints agree)."""
    return bool(x and y and x[0] is not None and y[0] is not None and x[0].same(y[0]))


def _fused_pair(ua: _Unit, ub: _Unit) -> bool:
    """A group of parts pairs only with a module fused by the same rule."""
    if len(ua.paths) > 1:
        return len(ub.paths) == 1 and ub.rule is ua.rule
    return len(ua.paths) == 1 and ua.rule is ub.rule


def _descendant_matches(infos: dict, path: str, owner: dict, cache: dict) -> frozenset:
    if path in cache:
        return cache[path]
    found = set()
    for child in infos[path].children:
        if child in owner:
            found.add(owner[child])
        found |= _descendant_matches(infos, child, owner, cache)
    cache[path] = frozenset(found)
    return cache[path]


def _match_containers(a: dict, b: dict, rules: RuleSet, matches: list, used_a: set, used_b: set) -> list:
    owner_a = {p: i for i, m in enumerate(matches) for p in m.a}
    owner_b = {p: i for i, m in enumerate(matches) for p in m.b}
    cache_a: dict = {}
    cache_b: dict = {}
    conts_a = [p for p, info in a.items() if info.children and p not in used_a]
    conts_b = [p for p, info in b.items() if info.children and p not in used_b]
    desc_a = {p: _descendant_matches(a, p, owner_a, cache_a) for p in conts_a}
    desc_b = {p: _descendant_matches(b, p, owner_b, cache_b) for p in conts_b}
    candidates = []
    for pa in conts_a:
        if not desc_a[pa]:
            continue
        for pb in conts_b:
            common = len(desc_a[pa] & desc_b[pb])
            if not common:
                continue
            overlap = common / len(desc_a[pa] | desc_b[pb])
            fam_a, fam_b = rules.family(a[pa].type), rules.family(b[pb].type)
            bonus = (0.1 if fam_a == fam_b else 0.0) + (0.1 if rules.token(a[pa].local) == rules.token(b[pb].local)
                                                        else 0.0)
            if overlap >= MIN_OVERLAP:
                evidence = [f"holds {common} of the same modules"] + (["type " + fam_a] if fam_a == fam_b else [])
                candidates.append((overlap + bonus, -abs(pa.count(".") - pb.count(".")), pa, pb, evidence, overlap))
    candidates.sort(key=lambda c: (-c[0], -c[1], c[2], c[3]))
    out = []
    for _, _, pa, pb, evidence, overlap in candidates:
        if pa in used_a or pb in used_b:
            continue
        used_a.add(pa)
        used_b.add(pb)
        out.append(Match((pa,), (pb,), None, round(overlap, 2), tuple(evidence)))
    return out


def collapse_indices(path: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: repeated matches are shown once."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def rules_text(entries) -> str:
    """The mapping (the report's ``mapping`` entries) as an editable ``--map`` file; fused matches stay comments,
    since the rule set makes them."""
    lines = ["# layerdiff module mapping: B_PATTERN=A_NAME, one per line; edit and pass back with --map FILE"]
    for e in entries:
        why = f"confidence {e['confidence']:.2f}: {e['reason']}"
        if e.get("rule"):
            lines.append(f"# fused ({e['rule']}): {' + '.join(e['b_parts'])} -> {' + '.join(e['a_parts'])}  ({why})")
            continue
        lines.append(f"# {e['b']} -> {e['a']}  ({why})")
        lines.append(f"^{re.escape(e['b'])}(\\.[^.]+)?$={e['a']}\\1")
    return "\n".join(lines) + "\n"
