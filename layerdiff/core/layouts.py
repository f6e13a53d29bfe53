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
