"""Recipe: ``torch_llama`` replicated over ranks with ``DistributedDataParallel`` (gloo, CPU), every rank given
the same batch, so every replica must compute the same numbers.

    torchrun --standalone --nproc-per-node 2 -m layerdiff trace torch_llama_dp -o dp_run --arg defect=weight
    layerdiff align dp_run          # each rank against rank 0: names the first module where a replica differs

``DEFECTS`` are desyncs on one rank: a weight changed after DDP's initial broadcast (a rank that loaded another
checkpoint shard), or another input batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes import torch_llama
except ImportError:  # loaded as a file
    import llama_shared as shared
    import torch_llama

# defect -> (direction, origin in the model's names under DDP's "module." prefix, the ranks that differ)
DEFECTS = {
    "weight": ("forward", "module.model.layers.1.mlp.up_proj", [1]),  # rank 1's up_proj weight x(1 + 1e-3)
    "input": ("forward", "", [1]),                                     # rank 1 is given another batch
}


def build(defect: str | None = None, *, batch: int = 2, seq: int = 16, seed: int = 0, **kwargs):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, cfg = torch_llama.build_model(seed=seed, **kwargs)
    replica = DistributedDataParallel(model)  # broadcasts rank 0's parameters to every rank
    if defect == "weight" and rank == 1:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(1 + 1e-3)
    elif defect not in (None, *DEFECTS):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")
    batch_seed = seed + 1 if defect == "input" and rank == 1 else seed
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, batch_seed))

    def step():
        replica.zero_grad(set_to_none=True)
        loss = replica(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss

    return {"model": replica, "step": step,
            "meta": {"recipe": "torch_llama_dp", "defect": defect, "world_size": dist.get_world_size()}}
