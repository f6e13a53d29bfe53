"""One small adapter per framework. Each imports only its own framework, and only when asked for."""
from __future__ import annotations

import importlib

from ..errors import LayerdiffError

FRAMEWORKS = ("torch", "paddle", "mindspore")


def detect_framework(model) -> str:
    """The framework a model belongs to, from its class hierarchy (no framework is imported to find out)."""
    for cls in type(model).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if root in FRAMEWORKS:
            return root
    raise LayerdiffError(f"cannot trace a {type(model).__module__}.{type(model).__name__}: expected a "
                         "torch.nn.Module, paddle.nn.Layer or mindspore.nn.Cell")


def load_adapter(framework: str):
    try:
        return importlib.import_module(f"{__name__}.{framework}_adapter")
    except ModuleNotFoundError as exc:
        if framework in FRAMEWORKS and exc.name and exc.name.startswith(f"{__name__}."):
            raise LayerdiffError(f"no layerdiff adapter for {framework} yet") from None
        raise
