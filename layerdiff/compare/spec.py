"""How two traces are compared, as one object: tolerances, B's renames into A's names, declared layouts, the
rule set, whether renamed modules are inferred and where the arithmetic runs. Made and checked once (from the
CLI's flags or the Python API's keywords) and handed unchanged to matching, measuring, judging and replay."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from os import PathLike
from typing import Iterable

from layerdiff.compare.tasks import Workers
from layerdiff.compare.tolerance import TolerancePolicy, check_value, parse_rule
from layerdiff.errors import LayerdiffError
from layerdiff.match.layouts import LayoutRules
from layerdiff.match.rename import RenameRules
from layerdiff.match.rules import RuleSet, ruleset


@dataclass(frozen=True)
class Comparison:
    """How two traces are compared (the flags align and bisect share). ``policy``: tolerances; ``rename``: B's
    module paths into A's (``--map``); ``layouts``: declared layout transforms (``--layout``); ``rules``: the rule
    set (built-in plus ``--rules`` files); ``auto_map``: infer renamed and fused modules from the evidence;
    ``workers``: where the units of work run (``--workers``, ``--scheduler``; this process unless told);
    ``skip_padding``: leave out the positions where both runs' ``attention_mask`` is 0 (``--all-positions``: not)."""

    policy: TolerancePolicy = field(default_factory=TolerancePolicy)
    rename: RenameRules = field(default_factory=RenameRules)
    layouts: LayoutRules = field(default_factory=LayoutRules)
    rules: RuleSet = field(default_factory=ruleset)
    auto_map: bool = True
    rule_files: tuple[str, ...] = ()  # the files ``rules`` was made from (worker processes make it again from them)
    workers: Workers = field(default_factory=Workers)
    skip_padding: bool = True

    @classmethod
    def of(cls, *, atol: float | None = None, rtol: float | None = None, cos: float | None = None,
           tol: Iterable[str] | None = (), map: Iterable[str] | None = (),  # noqa: A002
           layout: Iterable[str] | None = (), rules: Iterable[str | PathLike[str]] | None = (),
           auto_map: bool = True, workers: Workers | None = None, all_positions: bool = False) -> Comparison:
        """From the options as the CLI and the Python API name them; a bad value is a ``LayerdiffError`` naming the
        option."""
        try:
            parsed = [parse_rule(text) for text in tol or ()]
            for name, value in (("atol", atol), ("rtol", rtol), ("cos", cos)):
                if value is not None:
                    check_value(name, value)
        except (ValueError, re.error) as exc:
            raise LayerdiffError(f"bad tolerance: {exc}") from None
        try:
            layouts = LayoutRules(list(layout or ()))
        except ValueError as exc:
            raise LayerdiffError(str(exc)) from None
        files = tuple(str(p) for p in rules or ())
        return cls(TolerancePolicy(atol, rtol, cos, parsed), RenameRules.parse(list(map or ())), layouts,
                   ruleset(list(files)), auto_map, files, workers or Workers(), not all_positions)
