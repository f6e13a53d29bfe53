"""What a traced module says about itself, read without a framework: its scalar hyper-parameters (attributes and
the ``key=value`` pairs of its extra repr), its parameters and the model's own configuration object."""
from __future__ import annotations

import re
from typing import Any, Iterable

_KV = re.compile(r"(\w+)=([^,=()\[\]]+|\([^)]*\)|\[[^\]]*\])(?=,|$)")
_MAX_STR = 100

# (path, type name, hyper-parameters, [(parameter leaf, shape)]): one module as weight transfer matches it
ModuleEntry = tuple[str, str, dict[str, Any], list[tuple[str, tuple[int, ...]]]]


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


def typed_parameters(named_modules, named_parameters) -> list:
    """(name, parameter, type name of its module) for weight transfer, from a framework's two iterators."""
    types = {name: type(module).__name__ for name, module in named_modules}
    return [(name, p, types.get(name.rpartition(".")[0])) for name, p in named_parameters]


def module_entries(named_modules: Iterable[tuple[str, Any]], named_parameters: Iterable[tuple[str, Any]]
                   ) -> list[ModuleEntry]:
    """(path, type name, hyper-parameters, [(parameter leaf, shape)]) per module in the model's own order: what
    weight transfer needs to match a model's modules with another's (``core.modules.from_model``)."""
    params: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, p in named_parameters:
        module, _, leaf = name.rpartition(".")
        params.setdefault(module, []).append((leaf, tuple(p.shape)))
    return [(path, type(m).__name__, hyper_parameters(m, extra_repr_values(safe_extra_repr(m))), params.get(path, []))
            for path, m in named_modules]


def hyper_parameters(module, repr_values: dict) -> dict:
    """Scalar attributes of a module (eps, p, scaling, ...) plus the ``key=value`` pairs of its extra repr
    (``repr_values``, from ``extra_repr_values``: a traced module's are parsed again only when the text changes).

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
    for key, value in repr_values.items():
        out.setdefault(key, value)
    return out


def extra_repr_values(extra_repr: str) -> dict:
    """The ``key=value`` pairs of a module's extra repr, as values."""
    out: dict = {}
    for key, text in _KV.findall(extra_repr or ""):
        out.setdefault(key, _parse_literal(text))
    return out


def model_config(model) -> dict | None:
    """The model's own configuration object, as plain values: ``{"kind": "hf", "values": {...}}`` for a Hugging
    Face / PaddleFormers ``PretrainedConfig`` (``to_dict``), ``"mcore"`` for a dataclass such as Megatron-core's
    ``TransformerConfig``; None when the model has none. Lets align compare the two runs' configurations."""
    import dataclasses

    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        if callable(getattr(config, "to_dict", None)):
            kind, values = "hf", config.to_dict()
        elif dataclasses.is_dataclass(config):
            kind, values = "mcore", {f.name: getattr(config, f.name, None) for f in dataclasses.fields(config)}
        else:
            return None
    except Exception:  # a user's config object must never break tracing
        return None
    plain = {k: v for k, v in values.items() if isinstance(k, str) and (
        _scalar(v) or (isinstance(v, (list, tuple)) and len(v) <= 16 and all(_scalar(x) for x in v)))}
    return {"kind": kind, "values": plain}


def safe_extra_repr(module) -> str:
    try:
        return module.extra_repr()
    except Exception:  # a user's extra_repr must never break tracing
        return ""
