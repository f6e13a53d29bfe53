"""Matching pass: pair the records of two traces by module path and call index.

Paths that differ between the runs are translated by regex rename rules applied to trace B's names, so the
report speaks in trace A's names. Records present on one side only are returned, never dropped.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LayerdiffError
from .layouts import canonical_param_name


class RenameRules:
    """Ordered ``PATTERN=REPLACEMENT`` regex substitutions turning B's module paths into A's."""

    def __init__(self, rules=(), exact=None):
        self.exact = dict(exact or {})  # inferred module renames: B module path -> A module path
        self.rules = []
        for pattern, repl in rules:
            try:
                self.rules.append((re.compile(pattern), repl))
            except re.error as exc:
                raise LayerdiffError(f"bad --map pattern {pattern!r}: {exc}") from None

    @classmethod
    def parse(cls, specs) -> "RenameRules":
        """Each spec is ``PATTERN=REPLACEMENT`` or a file holding one such rule per line (# comments)."""
        pairs = []
        for spec in specs or ():
            if "=" not in spec and Path(spec).is_file():
                lines = Path(spec).read_text().splitlines()
            else:
                lines = [spec]
            for line in lines:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                pattern, eq, repl = line.partition("=")
                if not eq:
                    raise LayerdiffError(f"bad --map rule {line!r}: expected PATTERN=REPLACEMENT")
                pairs.append((pattern.strip(), repl.strip()))
        return cls(pairs)

    def __call__(self, path: str) -> str:
        if path in self.exact:
            return self.exact[path]
        module, dot, leaf = path.rpartition(".")
        if dot and module in self.exact:  # a parameter of a renamed module
            return f"{self.exact[module]}.{leaf}"
        for pattern, repl in self.rules:
            path = pattern.sub(repl, path)
        return path

    def with_exact(self, exact: dict) -> "RenameRules":
        """These rules plus exact module renames (checked first)."""
        combined = RenameRules()
        combined.rules, combined.exact = list(self.rules), {**self.exact, **exact}
        return combined

    def as_list(self):
        return [[p.pattern, r] for p, r in self.rules] + [[k, v] for k, v in self.exact.items()]


def record_key(rec: dict, path: str | None = None) -> tuple:
    path = rec["path"] if path is None else path
    if rec["kind"] in ("param", "param_grad"):  # norm.gamma is norm.weight
        path = canonical_param_name(path)
    return rec["kind"], rec.get("phase"), path, rec["call"]


@dataclass
class Matching:
    pairs: list = field(default_factory=list)   # (record_a, record_b)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)


def match_records(records_a, records_b, rename: RenameRules) -> Matching:
    by_key_b = {}
    for rb in records_b:
        by_key_b.setdefault(record_key(rb, rename(rb["path"])), rb)
    result = Matching()
    used = set()
    for ra in records_a:
        key = record_key(ra)
        rb = by_key_b.get(key)
        if rb is None or key in used:
            result.only_a.append(ra)
        else:
            used.add(key)
            result.pairs.append((ra, rb))
    result.only_b = [rb for rb in records_b if record_key(rb, rename(rb["path"])) not in used]
    return result


def _float_kind(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def shapes_compatible(a: list, b: list) -> bool:
    """Same number of elements, or one broadcasts to the other (rotary cos/sin [1, S, D] vs [B, S, D])."""
    if math.prod(a) == math.prod(b):
        return True
    ra, rb = a[::-1], b[::-1]
    for i in range(max(len(ra), len(rb))):
        x = ra[i] if i < len(ra) else 1
        y = rb[i] if i < len(rb) else 1
        if x != y and 1 not in (x, y):
            return False
    return True


def match_tensors(tensors_a, tensors_b):
    """Pair tensor entries by (role, key); the rest by role, order and shape (one framework's ``out.logits``
    is another's ``out.1``). Return (pairs, only_a, only_b); a pair matched by position has different keys."""
    index_b = {(t["role"], t["key"]): t for t in tensors_b}
    pairs, left_a, seen = [], [], set()
    for ta in tensors_a:
        k = (ta["role"], ta["key"])
        tb = index_b.get(k)
        if tb is None:
            left_a.append(ta)
        else:
            seen.add(k)
            pairs.append((ta, tb))
    left_b = [t for t in tensors_b if (t["role"], t["key"]) not in seen]
    only_b = []
    for tb in left_b:
        ta = next((t for t in left_a if t["role"] == tb["role"] and _float_kind(t["dtype"]) == _float_kind(tb["dtype"])
                   and shapes_compatible(t["shape"], tb["shape"])), None)
        if ta is None:
            only_b.append(tb)
        else:
            left_a.remove(ta)
            pairs.append((ta, tb))
    return pairs, left_a, only_b
