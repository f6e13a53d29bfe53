"""Helpers every adapter shares; framework-free."""
from __future__ import annotations

import re

_KV = re.compile(r"(\w+)=([^,=()\[\]]+|\([^)]*\)|\[[^\]]*\])(?=,|$)")
_MAX_STR = 100


def _scalar(v):
    if isinstance(v, bool) or v is None or isinstance(v, (int, float)):
        return True
    return isinstance(v, str) and len(v) <= _MAX_STR


def _parse_literal(text: str):
    text = text.strip()
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    return text


def hyper_parameters(module, extra_repr: str = "") -> dict:
    """Scalar attributes of a module (eps, p, scaling, ...) plus ``key=value`` pairs of its extra repr.

    These are what a port most often gets subtly wrong, so the report shows their differences at the origin.
    """
    out = {}
    for key, value in vars(module).items():
        if key.startswith("_") or key == "training":
            continue
        if _scalar(value):
            out[key] = value
        elif isinstance(value, (tuple, list)) and len(value) <= 8 and all(_scalar(v) for v in value):
            out[key] = list(value)
    for key, text in _KV.findall(extra_repr or ""):
        out.setdefault(key, _parse_literal(text))
    return out
