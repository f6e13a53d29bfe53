"""What a run under torch's own data parallelism says about itself, read by the torch adapter.

- ``DistributedDataParallel``: every rank holds the whole model and runs its own share of the batch; the
  gradients are averaged over the ranks by an all-reduce after each parameter's gradient is accumulated, so the
  gradient a parameter's hook sees is that rank's own (a partial sum, scaled by 1 / ranks).
- FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank holds a shard of each parameter (a DTensor placed
  ``S(0)`` on the mesh) and gathers whole weights to compute, so its activations are its own share's, never a
  weight's shards; its gradients are reduce-scattered already averaged into the parameter's shard. HSDP (a 2-D
  mesh, ``Replicate`` then ``Shard``) is the same over both dimensions.

Either way each rank is a data-parallel replica (``ParallelLayout``: ``dp``, ``dp_rank``, ``grad_mean``), and
the ranks of the run join as one process that took the whole batch: activations along the batch axis, a loss as
the mean of the ranks' losses, gradients as their mean. A model that also places weights for tensor parallelism
(FSDP with TP on one mesh) is not described here: its DTensor placements say how its weights join, not how its
ranks share the batch."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from layerdiff.runs.parallel import ParallelLayout


def parallel_layout(model: Any) -> ParallelLayout | None:
    """The layout of a model wrapped for data parallelism on this rank, or None (not distributed, one rank, or
    another kind of parallelism)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    ddp = ddp_module(model)
    if ddp is not None:
        size, rank = dist.get_world_size(ddp.process_group), dist.get_rank(ddp.process_group)
        return _layout(size, rank, sharded_storage=False) if size > 1 else None
    mesh = _fsdp_mesh(model)
    if mesh is None:
        return None
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    rank = 0
    for size, at in zip(mesh.shape, coordinate):
        rank = rank * size + at
    return _layout(mesh.size(), rank, sharded_storage=True) if mesh.size() > 1 else None


def _layout(size: int, rank: int, sharded_storage: bool) -> ParallelLayout:
    layout = ParallelLayout(tp=1, tp_rank=0, pp=1, pp_rank=0, ep=1, ep_rank=0, dp=size, dp_rank=rank, cp=1,
                            sequence_parallel=False, grad_mean=True)
    if sharded_storage:
        layout["sharded_storage"] = True
    return layout


def ddp_module(model: Any) -> Any:
    """``model`` when it is a ``DistributedDataParallel`` wrapper (the module traced), else None: a model traced
    inside its wrapper shows nothing of it."""
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def _fsdp_mesh(model: Any) -> Any:
    """The device mesh FSDP2 shards every parameter over, when the model is ``fully_shard``-ed and every DTensor
    parameter is placed only for it (``Shard`` on a 1-D mesh; ``Replicate, Shard`` on HSDP's 2-D one); None
    otherwise."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch without FSDP2
        return None
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    meshes = set()
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        placements = tuple(p.placements)
        shard_only = len(placements) == 1 and isinstance(placements[0], Shard)
        hybrid = len(placements) == 2 and isinstance(placements[0], Replicate) and isinstance(placements[1], Shard)
        if not (shard_only or hybrid):
            return None  # a placement for tensor parallelism too
        meshes.add(p.device_mesh)
    return meshes.pop() if len(meshes) == 1 else None


def grad_placement(model: Any, param: Any) -> dict[str, Any] | None:
    """Under ``DistributedDataParallel``, a parameter's gradient as its hook sees it is this rank's own, which
    DDP then averages over the ranks: a ``P(sum)`` placement with scale 1 / ranks. None otherwise (FSDP2 hands
    the hook the averaged shard, placed by its DTensor)."""
    ddp = ddp_module(model) if dist.is_available() and dist.is_initialized() else None
    if ddp is None or not getattr(param, "requires_grad", False):
        return None
    size, rank = dist.get_world_size(ddp.process_group), dist.get_rank(ddp.process_group)
    if size < 2:
        return None
    return {"placements": ["P(sum)"], "mesh": [size], "coord": [rank], "global_shape": list(param.shape),
            "scale": 1.0 / size, "source": "ddp"}
