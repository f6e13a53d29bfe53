"""The registry of frameworks: one small adapter each (``base.FrameworkAdapter``), imported only when asked for.

A framework's adapter lives in ``<name>_adapter.py`` and exposes ``ADAPTER``; its name here is the root package of
its models' classes. The CLI, the demo, tracing, weight transfer and the checkpoint readers all take their list
of frameworks and their adapter from here.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from layerdiff.errors import LayerdiffError

if TYPE_CHECKING:
    from layerdiff.adapters.base import FrameworkAdapter

FRAMEWORKS = ("torch", "paddle", "mindspore")


# Packages whose models look like one framework's but run on another: refused with what to do instead.
UNSUPPORTED = {
    "mindnlp": "mindnlp/mindtorch models (Hugging Face code on MindSpore through torch-like modules) are not "
               "supported: they are neither torch.nn.Module nor mindspore.nn.Cell to a tracer, and mindnlp 0.5 needs "
               "mindspore<=2.7. Trace the original Hugging Face model with PyTorch, and the MindSpore side as a "
               "mindspore.nn.Cell (e.g. MindSpore Transformers, recipe mindformers_llama), then align the two",
}
UNSUPPORTED["mindtorch"] = UNSUPPORTED["mindnlp"]


def detect_framework(model: object) -> str:
    """The framework a model belongs to, from its class hierarchy (no framework is imported to find out)."""
    roots = [(cls.__module__ or "").split(".")[0] for cls in type(model).__mro__]
    refused = next((UNSUPPORTED[r] for r in roots if r in UNSUPPORTED), None)
    if refused:
        raise LayerdiffError(f"cannot trace a {type(model).__module__}.{type(model).__name__}: {refused}")
    for root in roots:
        if root in FRAMEWORKS:
            return root
    raise LayerdiffError(f"cannot trace a {type(model).__module__}.{type(model).__name__}: expected a "
                         "torch.nn.Module, paddle.nn.Layer or mindspore.nn.Cell")


def load_adapter(framework: str) -> FrameworkAdapter:
    """The adapter of ``framework`` (importing the framework itself)."""
    try:
        adapter: FrameworkAdapter = importlib.import_module(f"{__name__}.{framework}_adapter").ADAPTER
        return adapter
    except ModuleNotFoundError as exc:
        if framework in FRAMEWORKS and exc.name and exc.name.startswith(f"{__name__}."):
            raise LayerdiffError(f"no layerdiff adapter for {framework} yet") from None
        raise
