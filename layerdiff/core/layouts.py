"""How the same model looks in different frameworks: type families, parameter names and layouts.

Declarative tables, so a new framework or layer type is a line here, not a special case in the aligner.
Framework names are plain strings: nothing here imports a framework.
"""
from __future__ import annotations

import re

# Lower-cased class name patterns -> family. The first match wins; unknown types are their own family.
TYPE_FAMILIES = [
    (r"^(linear|dense)$", "linear"),
    (r"^embedding$", "embedding"),
    (r"rmsnorm", "rmsnorm"),
    (r"^layernorm$", "layernorm"),
    (r"^(silu|siluactivation|swish)$", "silu"),
    (r"^(gelu|geluactivation|newgeluactivation|fastgeluactivation)$", "gelu"),
    (r"^relu$", "relu"),
    (r"^(modulelist|layerlist|celllist|sequential|sequentialcell)$", "list"),
    (r"^dropout$", "dropout"),
    (r"rotary", "rotary"),
]
_FAMILY_PATTERNS = [(re.compile(p), f) for p, f in TYPE_FAMILIES]

# Parameter leaf names that mean the same thing ("norm.gamma" is "norm.weight").
PARAM_ALIASES = {"gamma": "weight", "beta": "bias", "embedding_table": "weight", "moving_mean": "running_mean",
                 "moving_variance": "running_var"}

# (framework, type family, parameter leaf) -> how that framework stores it relative to PyTorch's layout.
# By module type, never guessed from shapes: a square weight looks the same either way.
TRANSPOSED = {("paddle", "linear", "weight")}


def type_family(type_name: str | None) -> str:
    name = (type_name or "").lower()
    for pattern, family in _FAMILY_PATTERNS:
        if pattern.search(name):
            return family
    return name


def canonical_param_name(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    leaf = PARAM_ALIASES.get(leaf, leaf)
    return f"{module}.{leaf}" if module else leaf


def is_transposed(framework: str | None, type_name: str | None, param_name: str) -> bool:
    leaf = canonical_param_name(param_name).rpartition(".")[2]
    return (framework, type_family(type_name), leaf) in TRANSPOSED


class LayoutRules:
    """User-declared layout transforms applied to trace B's tensors before comparison:
    ``REGEX=transpose``, ``REGEX=permute(3,2,0,1)`` or ``REGEX=reshape(-1,64)``, matched (``re.search``)
    against the record's path in A's names (a parameter name, or a module path)."""

    _SPEC = re.compile(r"^(transpose|permute|reshape)(?:\(([-\d,\s]*)\))?$")

    def __init__(self, specs=()):
        self.rules = []
        for spec in specs or ():
            pattern, eq, transform = spec.rpartition("=")
            m = self._SPEC.match(transform.strip())
            if not eq or not pattern or m is None:
                raise ValueError(f"layout rule {spec!r} should look like 'REGEX=transpose', 'REGEX=permute(1,0)' "
                                 "or 'REGEX=reshape(-1,64)'")
            args = tuple(int(x) for x in (m.group(2) or "").split(",") if x.strip())
            if m.group(1) != "transpose" and not args:
                raise ValueError(f"layout rule {spec!r}: {m.group(1)} needs its dimensions")
            self.rules.append((re.compile(pattern), m.group(1), args, transform.strip()))

    def find(self, path: str):
        """(name, args, text) of the first rule matching ``path``, or None."""
        for pattern, name, args, text in self.rules:
            if pattern.search(path):
                return name, args, text
        return None

    @staticmethod
    def apply(rule, array):
        name, args, _ = rule
        if name == "transpose":
            return array.T
        if name == "permute":
            return array.transpose(args)
        return array.reshape(args)

    @staticmethod
    def invert(rule, array, shape):
        """A's tensor in B's layout (the inverse of ``apply``): replay feeds B the reference's values."""
        name, args, _ = rule
        if name == "transpose":
            return array.T
        if name == "permute":
            return array.transpose([args.index(i) for i in range(len(args))])
        return array.reshape(shape)

    def as_list(self):
        return [[p.pattern, text] for p, _, _, text in self.rules]
