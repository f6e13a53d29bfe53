"""Recipe: ``torch_llama`` over data-parallel ranks (gloo, CPU), wrapped in ``DistributedDataParallel`` or in FSDP2
(``fully_shard`` on each decoder layer and on the model).

    torchrun --standalone --nproc-per-node 2 -m layerdiff trace torch_llama_dp -o dp_run --arg defect=weight
    layerdiff align dp_run          # each rank against rank 0: names the first module where a replica differs
    torchrun --standalone --nproc-per-node 2 -m layerdiff trace torch_llama_dp -o fsdp_run \
        --arg wrap=fsdp --arg split=true --arg lr=0.1 --steps 2
    layerdiff trace torch_llama --arg batch=4 --arg lr=0.1 --steps 2 -o ref.h5
    layerdiff align ref.h5 fsdp_run     # the ranks joined: one process that took the whole batch

By default every rank is given the same batch, so every replica must compute the same numbers; ``split=true``
gives each rank its own share of a batch of ``batch`` x ranks sequences, as data parallelism does. ``DEFECTS``
are desyncs on one rank: a weight changed after DDP's initial broadcast (a rank that loaded another checkpoint
shard); ``input`` gives rank 1 another batch (with 3 ranks or more a desync: the others agree; with 2 it reads as
each rank's own share); any defect of ``torch_llama`` is planted on every rank (a port's bug).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes import torch_llama, torch_llama_tp
except ImportError:  # loaded as a file
    import llama_shared as shared
    import torch_llama
    import torch_llama_tp

# defect -> (direction, origin in the model's names (DDP's wrapper left out), the ranks that differ)
DEFECTS = {
    "weight": ("forward", "model.layers.1.mlp.up_proj", [1]),  # rank 1's up_proj weight x(1 + 1e-3)
}


def build(defect: str | None = None, *, batch: int = 2, seq: int = 16, seed: int = 0, wrap: str = "ddp",
          split: bool = False, lr: float = 0.0, tp: int = 1, param_dtype: str | None = None, ac: bool = False,
          **kwargs):
    """``wrap``: "ddp", "fsdp", "hsdp" (FSDP2 on a 2-D mesh: 2 replicas, each sharding over half the ranks), or
    "fsdp1" (``FullyShardedDataParallel``, a unit per decoder layer, ``use_orig_params``);
    ``split``: each data-parallel replica its own share of the batch; ``lr`` > 0:
    each step is a training step (plain SGD); ``tp`` > 1 (with ``wrap=fsdp``): each replica is ``tp`` ranks of
    tensor parallelism (``torch_llama_tp``'s plan) on a 2-D mesh (data parallel x tensor parallel), torchtitan's
    layout; ``param_dtype`` (with ``wrap=fsdp``): FSDP's ``MixedPrecisionPolicy`` casts the gathered weights to it
    for computing ("bfloat16"), the weights held and the gradients reduced in float32; ``ac``: each decoder layer
    in torch's ``checkpoint_wrapper`` before it is wrapped for data parallelism (torchtitan's activation
    checkpointing): backward recomputes it."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if tp > 1 and (wrap != "fsdp" or world % tp):
        raise ValueError(f"tp={tp} needs wrap=fsdp and a number of ranks it divides (got {wrap}, {world} ranks)")
    rank, replicas = dist.get_rank() // tp, world // tp  # this rank's data-parallel replica, and their number
    model, cfg = torch_llama.build_model(seed=seed, **kwargs)
    if defect in shared.DEFECTS:
        torch_llama.inject(model, defect)  # the same bug on every rank
    elif defect not in (None, "input", *DEFECTS):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join([*DEFECTS, 'input', *shared.DEFECTS])}")
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer)
    if wrap == "ddp":
        replica = DistributedDataParallel(model)  # broadcasts rank 0's parameters to every rank
    elif wrap == "fsdp1":  # FullyShardedDataParallel, one unit per decoder layer and one for the rest
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        replica = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                           use_orig_params=True, device_id=torch.device("cpu"))
    elif wrap in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (replicas, tp), mesh_dim_names=("dp", "tp")) if wrap == "fsdp" else {
            "dp": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))}
        if tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh["tp"], torch_llama_tp.plan(len(model.model.layers), None))
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mixed = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype) if param_dtype else None,
                                     reduce_dtype=torch.float32 if param_dtype else None)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=mixed)
        replica = fully_shard(model, mesh=mesh["dp"], mp_policy=mixed)
    else:
        raise ValueError(f"unknown wrap {wrap!r}; choose ddp, fsdp, hsdp or fsdp1")
    if defect == "weight" and dist.get_rank() == 1:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(1 + 1e-3)
    ids = shared.input_ids(cfg, batch * replicas if split else batch, seq, seed + (rank == 1 and defect == "input"))
    input_ids = torch.from_numpy(ids[rank * batch:(rank + 1) * batch] if split else ids)
    optimizer = torch.optim.SGD(replica.parameters(), lr=lr) if lr > 0 else None

    def step():
        replica.zero_grad(set_to_none=True)
        loss = replica(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss

    return {"model": replica, "step": step, "input_ids": input_ids,
            "meta": {"recipe": "torch_llama_dp", "defect": defect, "world_size": world, "wrap": wrap, "split": split,
                     "tp": tp}}
