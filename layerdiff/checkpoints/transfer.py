"""Weight transfer between frameworks through a neutral form: PyTorch parameter names and layouts.

Layout rules come from the rule sets (``match.rules``) and are applied by module type (a Paddle ``Linear`` weight is
[in, out]), never guessed from shapes. Every unmatched or shape-mismatched parameter is reported at once.
The file form is safetensors, so nothing is ever unpickled.
"""
from __future__ import annotations

import numpy as np

from layerdiff.adapters import detect_framework, load_adapter
from layerdiff.checkpoints import safetensors_io
from layerdiff.errors import LayerdiffError
from layerdiff.match import modules, paramplan
from layerdiff.match.layouts import canonical_param_name
from layerdiff.match.mapping import match_modules
from layerdiff.match.paramplan import ParamSource
from layerdiff.match.rename import RenameRules
from layerdiff.match.rules import RuleSet, ruleset
from layerdiff.tracefile.tensors import summarize


def neutral_state(model, rules: RuleSet | None = None) -> dict:
    """name -> (array, dtype name) in PyTorch layout, copied out of the model."""
    adapter = load_adapter(detect_framework(model))
    rules = rules or ruleset()
    out = {}
    for name, tensor, module_type in adapter.parameters(model):
        stored = adapter.to_stored(tensor)
        if stored is None:
            raise LayerdiffError(f"{name}: dtype cannot be exported")
        array, dtype = stored
        if rules.is_transposed(adapter.name, module_type, name):
            array = array.T
        out[canonical_param_name(name)] = (np.array(array, copy=True, order="C"), dtype)
    return out


def load_neutral(model, state: dict, mapping: RenameRules | None = None, strict: bool = True,
                 rules: RuleSet | None = None) -> int:
    """Assign ``state`` (from ``neutral_state`` or a file) to ``model``'s parameters; return how many.

    Names that match (after ``mapping``, the same rules as ``align --map``) are taken as they are; when they
    do not all match, the model's modules are matched with the state's (names, block indices, shapes; fused
    modules from the rule set: Megatron's ``linear_qkv`` is built from q/k/v and split back). Nothing is
    assigned unless every parameter is accounted for.
    """
    adapter = load_adapter(detect_framework(model))
    rename, rules = mapping or RenameRules(), rules or ruleset()
    params = adapter.parameters(model)
    stored = rules.param_homes(state)  # a fused norm's weight (linear_qkv.layer_norm_weight) where it belongs
    state = {home: state[name] for home, name in stored.items()}
    own_names = {canonical_param_name(rename(name)) for name, _, _ in params}
    for name, pieces in per_expert_names(state).items():  # stacked experts for a model that keeps them apart
        if name not in own_names:
            array, dtype = state.pop(name)
            state.update({piece: (array[e], dtype) for e, piece in enumerate(pieces)})
            stored.update({piece: name for piece in pieces})
    stacked = {}  # model parameter -> the names of its per-expert pieces
    if own_names <= state.keys():
        plan = {name: ParamSource(name, "same", (canonical_param_name(rename(name)),)) for name, _, _ in params}
        groups = {}
    else:
        plan, groups, stacked = _inferred_plan(adapter, model, state, params, rename, rules)
    problems: list[str] = []
    assignments: list[tuple] = []
    used: set[str] = set()
    for name, tensor, module_type in params:
        pieces = stacked.get(name, [name])  # an expert tensor of all experts is built expert by expert
        missing = [piece for piece in pieces if piece not in plan]
        if missing:
            problems.append(f"{name}: no {canonical_param_name(rename(missing[0]))} in the source")
            continue
        sources = [plan[piece] for piece in pieces]
        for source in sources:
            used.update(source.sources)
        try:
            arrays = [paramplan.build(source, lambda n: state[n][0], groups.get(source.name, 1))
                      for source in sources]
        except LayerdiffError as exc:  # parts in a layout not converted (``paramplan.plan``'s ``relayout``)
            problems.append(str(exc))
            continue
        array = np.stack(arrays) if name in stacked and len({a.shape for a in arrays}) == 1 else arrays[0]
        dtype = state[sources[0].sources[0]][1]
        if rules.is_transposed(adapter.name, module_type, name):
            array = array.T
        shape = list(tensor.shape)
        if list(array.shape) != shape:
            described = ", ".join(source.describe() for source in sources[:2]) + (", ..." if len(sources) > 2 else "")
            problems.append(f"{name}: source {described} has shape {list(array.shape)}, the model wants {shape}")
            continue
        assignments.append((tensor, np.ascontiguousarray(array), dtype))
    if strict:
        problems += [f"{stored[key]}: in the source, but no parameter takes it" for key in sorted(set(state) - used)]
    if problems:
        raise LayerdiffError(f"cannot transfer weights ({len(problems)} problems): " + "; ".join(problems))
    for tensor, array, dtype in assignments:
        adapter.assign(tensor, array, dtype)
    return len(assignments)


def _inferred_plan(adapter, model, state: dict, params, rename: RenameRules, rules: RuleSet):
    """{model parameter (or per-expert piece): its source} from matching the model's modules with the state's,
    group counts, and {model parameter: its per-expert pieces}."""
    source_infos = modules.from_params([(n, a.shape, summarize(a, d)) for n, (a, d) in state.items()])
    entries, moved = _moved_home(adapter.module_entries(model), rules)
    experts = _stacked_experts(entries) if adapter.name == "torch" else set()
    mapping = match_modules(source_infos, modules.from_model(_per_expert(entries, experts)), rules, rename)
    own, stacked = {}, {}
    for name, tensor, module_type in params:
        shape = tuple(tensor.shape)
        name = moved.get(name, name)
        module, _, leaf = name.rpartition(".")
        if module in experts:
            stacked[name] = [f"{module}.{e}.{leaf}.weight" for e in range(shape[0])]
            own.update({piece: shape[1:] for piece in stacked[name]})
        else:
            own[name] = shape[::-1] if rules.is_transposed(adapter.name, module_type, name) else shape
    sources, _, _ = paramplan.plan(mapping, own, {n: a.shape for n, (a, _) in state.items()}, "b", rules)
    hparams = {path: h for path, _, h, _ in entries}
    sources = [paramplan.regrouped(src, rules, own[src.name][0], [hparams.get(src.fused_module), hparams.get(
        src.fused_module.rpartition(".")[0])]) if src.op == "relayout" else src for src in sources]
    groups = {}
    for src in sources:
        if src.op not in ("same", "relayout"):
            fused_parent = src.fused_module.rpartition(".")[0]
            parts_parent = src.name.rpartition(".")[0].rpartition(".")[0]
            groups[src.name] = paramplan.group_count(src, rules, [hparams.get(src.fused_module), hparams.get(
                fused_parent), hparams.get(parts_parent)], load=lambda n: state[n][0])
    plan = {s.name: s for s in sources}
    for name, home in moved.items():
        if home in plan:
            plan[name] = plan.pop(home)
    return plan, groups, stacked


def _moved_home(entries, rules: RuleSet) -> tuple[list, dict[str, str]]:
    """``entries`` with each parameter that the rule set's ``moved_params`` says belongs elsewhere shown in the
    module where it belongs (Megatron's ``shared_experts.gate_weight`` as a linear ``shared_expert_gate``, as
    transformers keeps it), right after the module that holds it; and {parameter: its name there}."""
    out: list = []
    moved: dict[str, str] = {}
    for path, type_name, hparams, params in entries:
        kept: list = []
        homes: list = []
        for leaf, shape in params:
            name = f"{path}.{leaf}" if path else leaf
            home = rules.param_home(name)
            if home == name:
                kept.append((leaf, shape))
            else:
                moved[name] = home
                module, _, home_leaf = home.rpartition(".")
                homes.append((module, "Linear", {}, [(home_leaf, shape)]))
        out.append((path, type_name, hparams, kept))
        out += homes
    return out, moved


def _stacked_experts(entries) -> set:
    """Modules that keep each projection of all their experts in one 3-D parameter (transformers 5's
    ``MixtralExperts``: ``gate_up_proj`` [experts, 2 x ffn, hidden], ``down_proj``), PyTorch layout per expert."""
    return {path for path, _, _, params in entries if _stacks_experts(params)}


def _stacks_experts(params: list) -> bool:
    """Whether a module's [(leaf, shape)] are stacked experts: 3-D, as many experts in each, not a ``weight`` or
    ``bias`` (a Conv1d's weight is 3-D too)."""
    shapes = [tuple(shape) for _, shape in params]
    return bool(params) and all(len(s) == 3 for s in shapes) and len({s[0] for s in shapes}) == 1 and \
        shapes[0][0] > 1 and not {leaf for leaf, _ in params} & {"weight", "bias"}


def per_expert_names(state: dict) -> dict[str, list[str]]:
    """{a stacked experts tensor of ``state``: the names of its experts' own weights}: transformers 5 keeps each
    projection of all experts in one 3-D tensor (``mlp.experts.gate_up_proj`` [experts, 2 x ffn, hidden]) where
    checkpoints and other frameworks' models keep a linear per expert (``mlp.experts.3.gate_up_proj.weight``, which
    the rule set splits into gate and up like any fused projection). Found as in a model (``_stacks_experts``)."""
    by_module: dict[str, list[tuple[str, tuple]]] = {}
    for name, (array, _) in state.items():
        module, _, leaf = name.rpartition(".")
        by_module.setdefault(module, []).append((leaf, array.shape))
    return {f"{module}.{leaf}": [f"{module}.{e}.{leaf}.weight" for e in range(shape[0])]
            for module, params in by_module.items() if _stacks_experts(params) for leaf, shape in params}


def _per_expert(entries, experts: set) -> list:
    """``entries`` with each stacked-experts module seen as checkpoints store it: one container per expert holding
    a linear per projection (``experts.3.gate_up_proj.weight``)."""
    out = []
    for path, type_name, hparams, params in entries:
        if path not in experts:
            out.append((path, type_name, hparams, params))
            continue
        out.append((path, type_name, hparams, []))
        for e in range(params[0][1][0]):
            out.append((f"{path}.{e}", "ModuleList", {}, []))
            out += [(f"{path}.{e}.{leaf}", "Linear", {}, [("weight", tuple(shape[1:]))]) for leaf, shape in params]
    return out


def transfer_weights(src_model, dst_model, mapping: RenameRules | None = None, strict: bool = True,
                     rules: RuleSet | None = None) -> int:
    """Copy every parameter of ``src_model`` into ``dst_model`` (any frameworks, any naming the rule set
    relates); return how many."""
    return load_neutral(dst_model, neutral_state(src_model, rules), mapping, strict, rules)


def export_weights(model, path, *, overwrite: bool = False):
    framework = detect_framework(model)
    safetensors_io.save(path, neutral_state(model), {"format": "layerdiff-neutral", "layout": "torch",
                                                     "source_framework": framework}, overwrite=overwrite)


def import_weights(model, path, mapping: RenameRules | None = None, strict: bool = True,
                   rules: RuleSet | None = None) -> int:
    """Load a weights file into ``model``: a safetensors file (``export_weights``, or any in PyTorch layout) or
    a checkpoint in PyTorch layout that ``weights diff`` reads (Hugging Face folder, ``.pt``, Megatron-LM
    folder, distributed checkpoint); other layouts (Paddle's, MindSpore's) go through ``export_weights``."""
    return load_neutral(model, read_weights(path), mapping, strict, rules)


def read_weights(path) -> dict:
    """The state ``import_weights`` loads from ``path``, read without a model: a bad file is refused before one is
    built (``layerdiff trace --weights``)."""
    from pathlib import Path

    if Path(path).is_file() and Path(path).suffix == ".safetensors":
        state, _ = safetensors_io.load(path)
        return state
    from layerdiff.checkpoints import torch_layout_state

    return torch_layout_state(path)
