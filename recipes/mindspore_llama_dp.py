"""Recipe: ``mindspore_llama`` replicated over the ranks of an msrun job (PyNative, CPU), every rank given the same
batch and its gradients averaged with an all-reduce, so every replica must compute the same numbers.

    msrun --worker_num=2 --local_worker_num=2 --join=True -m layerdiff trace mindspore_llama_dp -o dp_run \\
          --arg defect=weight
    layerdiff align dp_run          # each rank against rank 0: names the first module where a replica differs

``DEFECTS`` are desyncs on one rank, as in ``torch_llama_dp``: a weight loaded differently on rank 1, or another
input batch.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops
from mindspore.communication import get_group_size, get_rank, init

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes import mindspore_llama
except ImportError:  # loaded as a file
    import llama_shared as shared
    import mindspore_llama

# defect -> (direction, origin, the ranks that differ)
DEFECTS = {
    "weight": ("forward", "model.layers.1.mlp.up_proj", [1]),  # rank 1's up_proj weight x(1 + 1e-3)
    "input": ("forward", "", [1]),                              # rank 1 is given another batch
}


def build(defect: str | None = None, *, batch: int = 2, seq: int = 16, seed: int = 0, **kwargs):
    if defect not in (None, *DEFECTS):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank = get_rank()
    model, cfg = mindspore_llama.build_model(seed=seed, **kwargs)
    if defect == "weight" and rank == 1:
        weight = model.model.layers[1].mlp.up_proj.weight
        weight.set_data(weight * (1 + 1e-3))
    batch_seed = seed + 1 if defect == "input" and rank == 1 else seed
    input_ids = ms.Tensor(shared.input_ids(cfg, batch, seq, batch_seed))
    weights = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda ids, labels: model(input_ids=ids, labels=labels)[0], None, weights)
    average = ops.AllReduce()
    world = get_group_size()
    state = {}

    def step():
        loss, grads = grad_fn(input_ids, input_ids)
        state["grads"] = {p.name: average(g) / world for p, g in zip(weights, grads)}
        return loss

    return {"model": model, "step": step, "grads": state,
            "meta": {"recipe": "mindspore_llama_dp", "defect": defect, "world_size": world}}
