"""Recipe: ``paddle_llama`` split over ranks with PaddlePaddle's auto-parallel tensor parallelism
(``dist.parallelize`` with ``ColWiseParallel`` / ``RowWiseParallel``; gloo on CPU).

    python -m paddle.distributed.launch --nproc_per_node 2 $(which layerdiff) trace paddle_llama_tp -o pd_tp
    layerdiff trace torch_llama -o ref.h5
    layerdiff align ref.h5 pd_tp           # shards joined, partial sums (row-parallel outputs) added

Hooks see distributed tensors with global shapes and their placements (``Shard``, ``Replicate``,
``Partial``); the trace keeps each rank's local part and the placement. ``DEFECTS`` says where each injected bug
originates and on which ranks. (``fleet`` mp_degree=2 layers do not run on CPU here: ``c_identity`` has no CPU
kernel.)
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist

try:
    from layerdiff.recipes import paddle_llama
except ImportError:  # loaded as a file
    import paddle_llama

# defect -> (direction, origin in the single-process model's names, ranks whose shard or copy is off)
DEFECTS = {
    "shard": ("forward", "model.layers.1.mlp.up_proj", [1]),                # rank 1's weight shard x(1 + 1e-3)
    "eps": ("forward", "model.layers.1.post_attention_layernorm", [0, 1]),  # RMSNorm eps 1e-6 -> 1e-5
    "backward": ("backward", "model.layers.0.mlp.down_proj", [0, 1]),       # input gradient x1.01
}


def build(defect: str | None = None, *, layers: int = 2, **kwargs):
    if defect not in (None, *DEFECTS):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")
    if not dist.is_initialized():
        dist.init_parallel_env()
    built = paddle_llama.build({"eps": "eps", "backward": "backward"}.get(defect), layers=layers, **kwargs)
    model = built["model"]
    if defect == "shard" and dist.get_rank() == 1:  # each rank keeps its own columns of its full copy
        weight = model.model.layers[1].mlp.up_proj.weight  # [in, out]: rank 1 owns the second half of out
        half = weight.shape[1] // 2
        with paddle.no_grad():
            scaled = weight.numpy()
            scaled[:, half:] *= 1 + 1e-3
            weight.set_value(scaled)
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["mp"])
    plan = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = dist.ColWiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = dist.RowWiseParallel()
    model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    built["model"] = model
    built["meta"] = {"recipe": "paddle_llama_tp", "defect": defect, "world_size": dist.get_world_size()}
    return built
