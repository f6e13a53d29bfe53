"""What a Megatron-core run says about itself, read by the torch adapter: its parallel layout, the global names
of its pipeline stage's layers and its expert-parallel rank's experts, which parameters' gradients are partial
sums, and which Python call is one step of a pipeline schedule.

Megatron is never imported here: its facts are read from the modules it has already loaded
(``sys.modules``) and from the model's own attributes (``TransformerLayer.layer_number``,
``MoELayer.local_expert_indices``, a parameter's ``sequence_parallel`` flag). A model that is no Megatron model,
or a process where Megatron's parallel state was never initialized, has none of these facts."""
from __future__ import annotations

import re
import sys
from types import FrameType
from typing import Any, Iterable, Sequence

from layerdiff.adapters.frames import running_frame
from layerdiff.runs.parallel import ParallelLayout, global_path

_STATE = "megatron.core.parallel_state"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
# megatron-core's pipeline schedules (``get_forward_backward_func()``): one call runs every microbatch of a step
_SCHEDULE_FUNCTIONS = frozenset({"forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                                 "forward_backward_pipelining_with_interleaving"})
_LAYER = re.compile(r"^(.*\.)?layers\.(\d+)$")


def _state() -> Any:
    state = sys.modules.get(_STATE)
    if state is None or not state.model_parallel_is_initialized():
        return None
    return state


def _size_and_rank(state: Any, name: str) -> tuple[int, int]:
    size = getattr(state, f"get_{name}_world_size", None)
    rank = getattr(state, f"get_{name}_rank", None)
    if size is None or rank is None:
        return 1, 0
    return int(size()), int(rank())


def parallel_layout(model: Any) -> ParallelLayout | None:
    """The layout of a Megatron model on this rank, or None when Megatron's parallel state is not initialized."""
    state = _state()
    if state is None:
        return None
    named_modules, config = model.named_modules(), getattr(model, "config", None)
    layout = ParallelLayout()
    for key, group in (("tp", "tensor_model_parallel"), ("pp", "pipeline_model_parallel"),
                       ("ep", "expert_model_parallel"), ("dp", "data_parallel"), ("cp", "context_parallel")):
        size, rank = _size_and_rank(state, group)
        layout[key] = size  # type: ignore[literal-required]  # the keys are the TypedDict's own
        if key != "cp":
            layout[f"{key}_rank"] = rank  # type: ignore[literal-required]
    layout["sequence_parallel"] = bool(getattr(config, "sequence_parallel", False)) and layout["tp"] > 1
    renamed, experts = global_paths(named_modules)
    if renamed:
        layout["global_paths"] = renamed
    if experts and layout["ep"] > 1:  # the other expert-parallel ranks of this stage hold other experts
        layout["own_modules"] = experts
        layout["split_modules"] = expert_containers(experts)
    if layout["dp"] > 1 and not getattr(config, "calculate_per_token_loss", False) and \
            any(getattr(p, "main_grad", None) is not None for p in model.parameters()):
        layout["grad_mean"] = True  # Megatron's DDP averages the ranks' gradients: each rank's loss is its own
    return layout


def parts_layout(parts: Sequence[Any]) -> tuple[ParallelLayout, dict[int, int]] | None:
    """The layout of a rank's Megatron model chunks (virtual pipeline stages: Megatron's interleaved schedule), and
    each chunk's stage (id(chunk) -> index): chunk ``vp_stage`` v of pipeline rank r is stage v x PP + r of the
    PP x VPP stages, its layers named locally from 0 (``stage_paths``: each stage's global names). None when a
    chunk says no ``vp_stage`` or Megatron's parallel state is not initialized."""
    state, first = _state(), parallel_layout(parts[0])
    if state is None or first is None:
        return None
    pp, rank = _size_and_rank(state, "pipeline_model_parallel")
    stages: dict[int, int] = {}
    paths: dict[str, dict[str, str]] = {}
    for part in parts:
        vp_stage = getattr(part, "vp_stage", None)
        if not isinstance(vp_stage, int) or isinstance(vp_stage, bool):
            return None
        stage = stages[id(part)] = vp_stage * pp + rank
        paths[str(stage)] = global_paths(part.named_modules())[0]
    first.pop("global_paths", None)
    held = sorted(stages.values())
    first["pp"], first["pp_rank"], first["pp_stages"], first["stage_paths"] = pp * len(parts), held[0], held, paths
    return first, stages


def global_paths(named_modules: Iterable[tuple[str, Any]]) -> tuple[dict[str, str], list[str]]:
    """({local path: global path}, [global paths of the experts held here]) of a rank's modules: a transformer
    layer whose (1-based, global) ``layer_number`` is not its local index + 1 is renamed, and so is the expert an
    MoE layer holds as ``local_experts.i`` when its ``local_expert_indices`` say it is expert j != i. Each global
    path is whole (an expert of a renamed layer is named under the layer's global name): a module's global name
    is its longest renamed prefix's, replaced once."""
    layers: dict[str, str] = {}
    experts: dict[str, str] = {}
    modules = dict(named_modules)
    for path, module in modules.items():
        number = getattr(module, "layer_number", None)
        found = _LAYER.match(path)
        if found and isinstance(number, int) and not isinstance(number, bool) and number - 1 != int(found.group(2)):
            layers[path] = f"{found.group(1) or ''}layers.{number - 1}"
        indices = getattr(module, "local_expert_indices", None)
        if isinstance(indices, (list, tuple)):
            for local, index in enumerate(indices):
                expert = f"{path}.experts.local_experts.{local}" if path else f"experts.local_experts.{local}"
                if expert in modules:
                    experts[expert] = expert.rpartition(".")[0] + f".{index}"
    held = [global_path(layers, name) for name in experts.values()]
    renamed = {local: global_path(layers, name) for local, name in experts.items() if local != name}
    return {**layers, **renamed}, held


def expert_containers(experts: list[str]) -> list[str]:
    """The modules that hold a rank's experts (``...mlp.experts``): under expert parallelism each rank's runs its
    own experts on every rank's tokens, a different part of the layer's work on each rank."""
    return sorted({path.rpartition(".local_experts.")[0] for path in experts if ".local_experts." in path})


def grad_placement(config: Any, param: Any) -> dict[str, Any] | None:
    """How a parameter's gradient, as recorded (at accumulation, before Megatron reduces it), makes the step's:

    - a norm's weight under sequence parallelism (its ``sequence_parallel`` flag): each tensor-parallel rank
      normalized only its slice of the sequence, so its gradient is a partial sum that ``finalize_model_grads``
      adds up over the ranks;
    - under Megatron's DistributedDataParallel (the parameter has a ``main_grad``), each data-parallel rank's
      gradient is its own batch's: DDP scales them by 1 / data-parallel size and adds them up over the
      parameter's data-parallel group (an expert's: the expert-data-parallel group).

    Either way a ``P(sum)`` placement, with the ``scale`` applied after the sum. None for a tensor-parallel
    shard (joined by its parameter's placement) and where nothing is reduced, or where the scale is the user's
    (``calculate_per_token_loss``: the step's tokens divide it)."""
    state = _state()
    if state is None:
        return None
    tp, tp_rank = _size_and_rank(state, "tensor_model_parallel")
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        return None
    partial = tp > 1 and bool(getattr(param, "sequence_parallel", False))
    ddp = getattr(param, "main_grad", None) is not None and not getattr(config, "calculate_per_token_loss", False)
    expert = getattr(param, "allreduce", True) is False
    dp = int(state.get_data_parallel_world_size(with_context_parallel=True))
    group, rank = _size_and_rank(state, "expert_data_parallel") if expert else \
        (dp, int(state.get_data_parallel_rank(with_context_parallel=True)))
    scale = 1.0 / dp if ddp else 1.0
    if not partial and (not ddp or (group == 1 and scale == 1.0)):
        return None
    mesh, coord = ([tp, group], [tp_rank, rank]) if partial else ([group], [rank])
    place = {"placements": ["P(sum)"], "mesh": mesh, "coord": coord, "global_shape": list(param.shape),
             "source": "megatron"}
    if scale != 1.0:
        place["scale"] = scale
    return place


def grad_increments(param: Any) -> bool:
    """Megatron's DistributedDataParallel moves each backward's gradient into ``main_grad`` and clears ``grad``:
    every recorded gradient is then one microbatch's contribution, to be added up over the step, not the running
    total it is without it."""
    return getattr(param, "main_grad", None) is not None


def schedule_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the Megatron pipeline schedule call that is running, if any: every model call made inside
    one such call (one per microbatch, on every pipeline stage) belongs to one step."""
    return running_frame(frame, _SCHEDULES, _SCHEDULE_FUNCTIONS)
