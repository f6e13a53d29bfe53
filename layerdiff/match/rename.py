"""The user's renames of B's module paths into A's: ``--map PATTERN=REPLACEMENT`` rules (or a file of them), plus
exact renames that matching found; shared by align, replay, weight transfer and checkpoint diff."""
from __future__ import annotations

import re
from pathlib import Path

from layerdiff.errors import LayerdiffError


class RenameRules:
    """Ordered ``PATTERN=REPLACEMENT`` regex substitutions turning B's module paths into A's."""

    def __init__(self, rules=(), exact=None):
        self.exact = dict(exact or {})  # module renames: B module path -> A module path
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
            try:
                path = pattern.sub(repl, path)
            except (re.error, IndexError) as exc:
                raise LayerdiffError(f"bad --map replacement {repl!r}: {exc}") from None
        return path

    def with_exact(self, exact: dict) -> "RenameRules":
        """These rules plus exact module renames (checked first)."""
        combined = RenameRules()
        combined.rules, combined.exact = list(self.rules), {**self.exact, **exact}
        return combined

    def as_list(self):
        return [[p.pattern, r] for p, r in self.rules] + [[k, v] for k, v in self.exact.items()]
