"""A run spread over ranks by model parallelism, as its traces describe it (framework-free): each rank's place in
the layout, and the global names of the modules a rank names locally (a pipeline stage's layers, an
expert-parallel rank's experts). The adapters record these facts (``meta["parallel"]``); ``runs.ranks`` reads
them to join the ranks into one model."""
from __future__ import annotations

from typing import TypedDict


class ParallelLayout(TypedDict, total=False):
    """A rank's place in a parallel layout, Megatron's or torch's data parallelism's (sizes and this rank's
    coordinate in each group), whether activations are split over the sequence in the norm regions, and
    ``global_paths``: this rank's module paths that are named differently in the whole model (a later pipeline
    stage's ``decoder.layers.0`` is global layer N/PP; an expert-parallel rank's ``local_experts.0`` is global
    expert E/EP * rank)."""
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    ep: int
    ep_rank: int
    dp: int
    dp_rank: int
    cp: int
    sequence_parallel: bool
    global_paths: dict[str, str]
    own_modules: list[str]  # global paths of the modules this rank holds apart from its stage's other ranks
    grad_mean: bool  # the step's gradients are the mean of the data-parallel ranks' (each rank's loss is its own)
    wrapped: str  # the child that a data-parallel wrapper holds the model as (DDP's "module"): read as the root
    sharded_storage: bool  # parameters are sharded only to be stored (FSDP): each rank computes with whole weights,
    # so no activation is a weight's shard
    split_modules: list[str]  # modules whose work each rank of the stage splits differently (experts' containers):
    # their own records are not joined (their children, each held by one rank, are compared)
    pp_stages: list[int]  # the pipeline stages this rank runs, where it runs several (an interleaved schedule): its
    # records carry their stage; ``pp_rank`` is the first
    stage_paths: dict[str, dict[str, str]]  # per stage of ``pp_stages`` (its index as text), its ``global_paths``
    # (Megatron's model chunks each name their layers from 0)
    microbatch_grad_scale: float  # each microbatch's gradients times this are its share of the step's (torch
    # pipelining's ``scale_grads``: 1/M, the schedule divides the parameters' gradients by M where no hook sees it)


def global_path(renames: dict[str, str], path: str) -> str:
    """``path`` under its longest renamed prefix's global name (itself when none is renamed)."""
    prefix = path
    while prefix:
        if prefix in renames:
            return renames[prefix] + path[len(prefix):]
        prefix = prefix.rpartition(".")[0]
    return path


