"""Matching pass: pair the records of two traces by module path and call index.

Paths that differ between the runs are translated by regex rename rules applied to trace B's names, so the
report speaks in trace A's names. Records present on one side only are returned, never dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LayerdiffError


class RenameRules:
    """Ordered ``PATTERN=REPLACEMENT`` regex substitutions turning B's module paths into A's."""

    def __init__(self, rules=()):
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
        for pattern, repl in self.rules:
            path = pattern.sub(repl, path)
        return path

    def as_list(self):
        return [[p.pattern, r] for p, r in self.rules]


def record_key(rec: dict, path: str | None = None) -> tuple:
    return rec["kind"], rec.get("phase"), rec["path"] if path is None else path, rec["call"]


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


def match_tensors(tensors_a, tensors_b):
    """Pair tensor entries by (role, key); return (pairs, only_a, only_b)."""
    index_b = {(t["role"], t["key"]): t for t in tensors_b}
    pairs, only_a, seen = [], [], set()
    for ta in tensors_a:
        k = (ta["role"], ta["key"])
        tb = index_b.get(k)
        if tb is None:
            only_a.append(ta)
        else:
            seen.add(k)
            pairs.append((ta, tb))
    only_b = [t for t in tensors_b if (t["role"], t["key"]) not in seen]
    return pairs, only_a, only_b
