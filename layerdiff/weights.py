"""Weight transfer between frameworks through a neutral form: PyTorch parameter names and layouts.

Layout rules come from ``core.layouts`` and are applied by module type (a Paddle ``Linear`` weight is
[in, out]), never guessed from shapes. Every unmatched or shape-mismatched parameter is reported at once.
The file form is safetensors, so nothing is ever unpickled.
"""
from __future__ import annotations

import numpy as np

from .adapters import detect_framework, load_adapter
from .core import safetensors_io
from .core.layouts import canonical_param_name, is_transposed
from .core.match import RenameRules
from .errors import LayerdiffError


def neutral_state(model) -> dict:
    """name -> (array, dtype name) in PyTorch layout, copied out of the model."""
    adapter = load_adapter(detect_framework(model))
    out = {}
    for name, tensor, module_type in adapter.parameters(model):
        stored = adapter.TENSORS.to_stored(tensor)
        if stored is None:
            raise LayerdiffError(f"{name}: dtype cannot be exported")
        array, dtype = stored
        if is_transposed(adapter.FRAMEWORK, module_type, name):
            array = array.T
        out[canonical_param_name(name)] = (np.array(array, copy=True, order="C"), dtype)
    return out


def load_neutral(model, state: dict, mapping: RenameRules | None = None, strict: bool = True) -> int:
    """Assign ``state`` (from ``neutral_state`` or a file) to ``model``'s parameters; return how many.

    ``mapping`` renames the model's parameter names to the state's (same rules as ``align --map``).
    Nothing is assigned unless every parameter matches.
    """
    adapter = load_adapter(detect_framework(model))
    rename = mapping or RenameRules()
    plan, problems, used = [], [], set()
    for name, tensor, module_type in adapter.parameters(model):
        key = canonical_param_name(rename(name))
        if key not in state:
            problems.append(f"{name}: no {key} in the source")
            continue
        array, dtype = state[key]
        if is_transposed(adapter.FRAMEWORK, module_type, name):
            array = array.T
        shape = list(tensor.shape)
        used.add(key)  # claimed, even if its shape is wrong: reported once, below
        if list(array.shape) != shape:
            problems.append(f"{name}: source {key} has shape {list(array.shape)}, the model wants {shape}")
            continue
        plan.append((tensor, np.ascontiguousarray(array), dtype))
    if strict:
        problems += [f"{key}: in the source, but no parameter takes it" for key in sorted(set(state) - used)]
    if problems:
        raise LayerdiffError(f"cannot transfer weights ({len(problems)} problems): " + "; ".join(problems))
    for tensor, array, dtype in plan:
        adapter.assign(tensor, array, dtype)
    return len(plan)


def transfer_weights(src_model, dst_model, mapping: RenameRules | None = None, strict: bool = True) -> int:
    """Copy every parameter of ``src_model`` into ``dst_model`` (any frameworks); return how many."""
    return load_neutral(dst_model, neutral_state(src_model), mapping, strict)


def export_weights(model, path, *, overwrite: bool = False):
    framework = detect_framework(model)
    safetensors_io.save(path, neutral_state(model), {"format": "layerdiff-neutral", "layout": "torch",
                                                     "source_framework": framework}, overwrite=overwrite)


def import_weights(model, path, mapping: RenameRules | None = None, strict: bool = True) -> int:
    state, _ = safetensors_io.load(path)
    return load_neutral(model, state, mapping, strict)
