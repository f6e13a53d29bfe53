"""What a run under torch's own data parallelism says about itself, read by the torch adapter.

- ``DistributedDataParallel``: every rank holds the whole model and runs its own share of the batch; the
  gradients are averaged over the ranks by an all-reduce after each parameter's gradient is accumulated, so the
  gradient a parameter's hook sees is that rank's own (a partial sum, scaled by 1 / ranks).
- FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank holds a shard of each parameter (a DTensor placed
  ``S(0)`` on the mesh) and gathers whole weights to compute, so its activations are its own share's, never a
  weight's shards; its gradients are reduce-scattered already averaged into the parameter's shard. HSDP (a 2-D
  mesh, ``Replicate`` then ``Shard``) is the same over both dimensions.
- FSDP1 (``FullyShardedDataParallel``): every rank runs its own share of the batch through the whole model, its
  units gathering their flat parameters to compute; outside a unit's call a parameter is a flat piece of a rank's
  shard, so the torch adapter reads parameters and gradients gathered whole (``fsdp1_gathers``).
- FSDP2 with tensor parallelism on one 2-D mesh (torchtitan's layout: FSDP on the first dimension, TP on the
  last): each data-parallel replica is its tensor-parallel ranks (``tp``, ``tp_rank``), which split its weights
  as ``parallelize_module`` says; FSDP shards those pieces again for storage (``_StridedShard`` where both split
  the same axis).

Either way each rank is a data-parallel replica, or a tensor-parallel rank of one (``ParallelLayout``: ``dp``,
``dp_rank``, ``grad_mean``, ``sharded_storage`` for FSDP), and the ranks of the run join as one process that took
the whole batch: activations along the batch axis, a loss as the mean of the replicas' losses, gradients as
their mean."""
from __future__ import annotations

import math
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
        place = _ddp_place(ddp)
        if place is None:
            return None
        layout = _layout(*place, sharded_storage=False)
        layout["wrapped"] = "module"  # DDP holds the model as its child ``module``: the wrapper is left out
        return layout
    if fsdp1_model(model):  # every rank its share of the batch; its parameters flat shards between calls
        size = dist.get_world_size()
        return _layout(size, dist.get_rank(), sharded_storage=False) if size > 1 else None
    mesh = _fsdp_mesh(model)
    if mesh is None:
        return None
    mesh, tp = mesh
    coordinate = list(mesh.get_coordinate() or [0] * mesh.ndim)
    if tp:  # FSDP with tensor parallelism: the mesh's last dimension is the tensor-parallel one (torchtitan's)
        dp_shape, dp_coord = list(mesh.shape[:-1]), coordinate[:-1]
    else:
        dp_shape, dp_coord = list(mesh.shape), coordinate
    rank = 0
    for size, at in zip(dp_shape, dp_coord):
        rank = rank * size + at
    dp = math.prod(dp_shape)
    if dp < 2:
        return None
    layout = _layout(dp, rank, sharded_storage=True)
    if tp:
        layout["tp"], layout["tp_rank"] = int(mesh.shape[-1]), int(coordinate[-1])
    return layout


def _layout(size: int, rank: int, sharded_storage: bool) -> ParallelLayout:
    layout = ParallelLayout(tp=1, tp_rank=0, pp=1, pp_rank=0, ep=1, ep_rank=0, dp=size, dp_rank=rank, cp=1,
                            sequence_parallel=False, grad_mean=True)
    if sharded_storage:
        layout["sharded_storage"] = True
    return layout


def ddp_module(model: Any) -> Any:
    """``model`` when it is a ``DistributedDataParallel`` wrapper (the module traced), else None: a model traced
    inside its wrapper shows nothing of it here (its first call finds the wrapper: ``wrapping_ddp``)."""
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def _fsdp_mesh(model: Any) -> tuple[Any, bool] | None:
    """(the device mesh, whether its last dimension is tensor-parallel) of a ``fully_shard``-ed model: FSDP alone
    (``Shard`` on a 1-D mesh), HSDP (``Replicate, Shard`` on a 2-D one), or FSDP with tensor parallelism (a 2-D
    mesh whose first dimension FSDP shards, ``Shard``/``_StridedShard``, and whose last is the tensor-parallel
    one; the weights that are not split for it are FSDP's alone, on the first dimension's mesh). None otherwise."""
    from torch.distributed.tensor import DTensor

    if not fsdp_model(model):
        return None
    one_d, two_d, hybrid = set(), set(), False
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        placements = tuple(p.placements)
        if len(placements) == 1 and _fsdp_shard(placements[0]):
            one_d.add(p.device_mesh)
        elif len(placements) == 2 and _fsdp_shard(placements[0]):
            two_d.add(p.device_mesh)
        elif len(placements) == 2 and placements[0].is_replicate() and _fsdp_shard(placements[1]):
            two_d.add(p.device_mesh)
            hybrid = True
        else:
            return None
    if len(two_d) > 1 or len(one_d) > 1 or (hybrid and one_d):
        return None
    if two_d:
        mesh = two_d.pop()
        if not hybrid and one_d and one_d.pop().size() != math.prod(mesh.shape[:-1]):
            return None  # the weights FSDP alone shards lie on another mesh than the first dimension's
        return mesh, not hybrid
    return (one_d.pop(), False) if one_d else None


def wrapping_ddp(frame: Any, model: Any) -> Any:
    """The ``DistributedDataParallel`` whose forward is calling ``model`` now (found from ``frame`` outwards), when
    ``model`` is the module it wraps; None otherwise."""
    ddp = torch.nn.parallel.DistributedDataParallel
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name in ("forward", "_run_ddp_forward") else None
        if isinstance(owner, ddp):
            return owner if owner.module is model else None
        frame = frame.f_back
    return None


def fsdp_model(model: Any) -> bool:
    """Whether FSDP2 (``fully_shard``) shards any of ``model``'s modules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp1_model(model: Any) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) wraps ``model`` or any of its modules."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def fsdp1_gathers(model: Any) -> bool:
    """Whether ``model`` is an FSDP1 root whose parameters can be read gathered whole, gradients too
    (``summon_full_params(with_grads=True)`` needs ``use_orig_params=True``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel) and all(
        getattr(unit, "_use_orig_params", False) for unit in FullyShardedDataParallel.fsdp_modules(model))


def _fsdp_shard(placement: Any) -> bool:
    """A placement FSDP shards a parameter by: ``Shard(d)``, or ``_StridedShard(d, k)`` where tensor parallelism
    split the same axis first (not a ``Shard`` to ``is_shard``: known by the name it prints, ``_S(d, k)``)."""
    return placement.is_shard() or str(placement).startswith("_S(")


def grad_placement(model: Any, param: Any) -> dict[str, Any] | None:
    """Under ``DistributedDataParallel``, a parameter's gradient as its hook sees it is this rank's own, which
    DDP then averages over the ranks: a ``P(sum)`` placement with scale 1 / ranks. None otherwise (FSDP2 hands
    the hook the averaged shard, placed by its DTensor)."""
    ddp = ddp_module(model) if dist.is_available() and dist.is_initialized() else None
    place = _ddp_place(ddp) if ddp is not None and getattr(param, "requires_grad", False) else None
    if place is None:
        return None
    size, rank = place
    return {"placements": ["P(sum)"], "mesh": [size], "coord": [rank], "global_shape": list(param.shape),
            "scale": 1.0 / size, "source": "ddp"}


def _ddp_place(ddp: Any) -> tuple[int, int] | None:
    """(ranks, this rank) of the group a ``DistributedDataParallel`` averages over; None for a group of one."""
    size = dist.get_world_size(ddp.process_group)
    return (size, dist.get_rank(ddp.process_group)) if size > 1 else None
