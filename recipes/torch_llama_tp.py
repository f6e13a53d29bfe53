"""Recipe: ``torch_llama`` split over ranks with PyTorch tensor parallelism (DTensor, ``parallelize_module``).

    torchrun --standalone --nproc-per-node 2 -m layerdiff trace torch_llama_tp -o tp_run
    layerdiff trace torch_llama -o ref.h5
    layerdiff align ref.h5 tp_run          # the run directory: rank0.h5, rank1.h5, merged by their placements

Attention's q/k/v and the MLP's gate/up are ``ColwiseParallel`` (each rank holds some heads / features), o and
down are ``RowwiseParallel`` (their partial results are summed across ranks), as in the PyTorch TP tutorial; the
same weights and inputs as ``torch_llama``, so a TP run and a single process agree to fp32 rounding. ``DEFECTS``
says where each injected bug originates and on which ranks. The process group (gloo, CPU) is created when the
launcher has not made one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

try:
    from layerdiff.recipes import torch_llama
except ImportError:  # loaded as a file
    import torch_llama

# defect -> (direction, origin in the single-process model's names, ranks whose shard or copy is off)
DEFECTS = {
    "shard": ("forward", "model.layers.1.mlp.up_proj", [1]),                   # rank 1's weight shard x(1 + 1e-3)
    "eps": ("forward", "model.layers.1.post_attention_layernorm", [0, 1]),     # RMSNorm eps 1e-6 -> 1e-5 everywhere
    "no_reduce": ("forward", "model.layers.0.self_attn.o_proj", [0, 1]),       # row-parallel output never summed
    "backward": ("backward", "model.layers.0.mlp.down_proj", [0, 1]),          # input gradient x1.01
}


def plan(layers: int, defect: str | None) -> dict:
    """``parallelize_module``'s plan for the model's layers (``defect``: the plan of one of ``DEFECTS``)."""
    plan = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = RowwiseParallel()
    if defect == "no_reduce":  # each rank hands on its partial sum: the all-reduce is missing
        plan["model.layers.0.self_attn.o_proj"] = RowwiseParallel(output_layouts=Partial())
    return plan


def build(defect: str | None = None, *, layers: int = 2, **kwargs):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    built = torch_llama.build({"eps": "eps", "backward": "backward"}.get(defect), layers=layers, **kwargs)
    model = built["model"]
    parallelize_module(model, mesh, plan(layers, defect))
    if defect == "shard" and dist.get_rank() == 1:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.to_local().mul_(1 + 1e-3)
    elif defect not in (None, *DEFECTS):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")
    built["meta"] = {"recipe": "torch_llama_tp", "defect": defect, "world_size": dist.get_world_size()}
    return built
