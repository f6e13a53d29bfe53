"""What a run under torch's own pipeline parallelism (``torch.distributed.pipelining``, torchtitan's) says about
itself, read by the torch adapter. Pipelining is never imported here: its facts are read from the frames of the
schedule that is running, only when the process has loaded it.

- One call of a schedule's ``step`` runs every microbatch of a step: each stage's module is called once per
  microbatch, forward and backward (``schedule_frame``: the step's scope, as Megatron's schedule calls are).
- The stage a rank runs (``PipelineStage``: ``stage_index`` of ``num_stages``, its ``submod`` the traced model)
  is known only once a schedule runs it: the layout is learned at the first step (``stage_layout``).
- With ``scale_grads`` (the default) each microbatch's loss is its own mean, so every gradient of a microbatch
  (an activation's, a parameter's increment) is the number of microbatches M times the whole batch's share; the
  schedule divides the parameters' accumulated gradients by M after the last backward, where no hook sees it
  (``ParallelLayout.microbatch_grad_scale``: 1/M).
- Before the first step a stage infers its tensors' shapes by running its module once on placeholder tensors
  (``PipelineStage``'s metadata inference: uninitialized values) and once backward: none of the model's work
  (``inferring``: those calls are not recorded).
- A schedule that runs several stages on one rank (interleaved 1F1B, looped BFS) is read when the list of its
  stages' modules is traced (``ModelParts``): each record then says its stage.
- A zero-bubble schedule computes a weight's gradient apart from its input's and writes it into ``weight.grad``
  itself (``splits_weight_gradients``): each contribution is recorded as it reaches the weight."""
from __future__ import annotations

from types import FrameType
from typing import Any, Sequence

from layerdiff.adapters.frames import running_frame
from layerdiff.runs.parallel import ParallelLayout

_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"
_INFERENCE = frozenset({"_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference"})


def schedule_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the outermost running ``step`` of a pipeline schedule, if any (None when pipelining is not
    loaded)."""
    return running_frame(frame, _SCHEDULES, ("step",), outermost=True)


def is_schedule(scope: Any) -> bool:
    """Whether a step's scope (``schedule_frame``'s, or Megatron's) is a pipelining schedule's ``step``."""
    return isinstance(scope, FrameType) and scope.f_code.co_name == "step" and \
        scope.f_globals.get("__name__") == _SCHEDULES


def inferring(frame: FrameType | None) -> bool:
    """Whether a module call made from ``frame`` is a pipeline stage's metadata inference (its module run on
    placeholder tensors to learn their shapes), not the model's work."""
    return running_frame(frame, _STAGE, _INFERENCE) is not None


def splits_weight_gradients(schedule: FrameType) -> bool:
    """Whether the running ``schedule`` (its ``step`` frame) computes weights' gradients apart from the inputs'
    (zero-bubble schedules: a ``BACKWARD_WEIGHT`` action in its order of work), writing them into ``weight.grad``
    where no accumulation hook sees them."""
    runner = schedule.f_locals.get("self")
    order = getattr(runner, "pipeline_order", None)
    if not isinstance(order, dict):
        return False
    return any(getattr(getattr(action, "computation_type", None), "name", None) == "BACKWARD_WEIGHT"
               for actions in order.values() for action in actions or ())


def stage_layout(parts: Sequence[Any], schedule: FrameType,
                 known: ParallelLayout | None = None) -> tuple[ParallelLayout, dict[int, int]] | None:
    """The layout of the modules traced (``parts``: one, or the stages a schedule runs on this rank) as the running
    ``schedule`` (its ``step`` frame) runs them, over what was ``known`` before (a data-parallel layout), and the
    stage index of each (id(module) -> index); None when the schedule's stages on this rank are not those modules.
    A rank that runs several stages (an interleaved schedule: stages r, r + PP, ...) has ``pp_rank`` its first and
    ``pp_stages`` all of them."""
    runner = schedule.f_locals.get("self")
    stages = [getattr(runner, "_stage", None)] if hasattr(runner, "_stage") else \
        list(getattr(runner, "_stages", None) or [])
    indices = {id(getattr(stage, "submod", None)): getattr(stage, "stage_index", None) for stage in stages}
    counts = {getattr(stage, "num_stages", None) for stage in stages}
    mine = {id(part): indices.get(id(part)) for part in parts}
    count = counts.pop() if len(counts) == 1 else None
    if len(stages) != len(parts) or not isinstance(count, int) or count < 2 or \
            not all(isinstance(index, int) for index in mine.values()):
        return None
    held = sorted(int(index) for index in mine.values() if index is not None)
    layout = ParallelLayout(tp=1, tp_rank=0, pp=count, pp_rank=held[0], ep=1, ep_rank=0, dp=1, dp_rank=0, cp=1,
                            sequence_parallel=False)
    layout.update(known or {})
    layout["pp"], layout["pp_rank"] = count, held[0]
    if len(held) > 1:
        layout["pp_stages"] = held
    microbatches = getattr(runner, "_n_microbatches", None)
    if getattr(runner, "scale_grads", False) and isinstance(microbatches, int) and microbatches > 1:
        layout["microbatch_grad_scale"] = 1.0 / microbatches
    return layout, {key: int(index) for key, index in mine.items() if index is not None}
