"""Recipe: ``torch_llama`` split into pipeline stages (``torch.distributed.pipelining``, gloo, CPU), one per rank or
several (an interleaved schedule), the way torchtitan splits its models: each stage keeps the whole model's module
names.

    torchrun --standalone --nproc-per-node 2 -m layerdiff trace torch_llama_pp -o pp_run --arg batch=4
    layerdiff trace torch_llama --arg batch=4 -o ref.h5
    layerdiff align ref.h5 pp_run      # the stages and their microbatches joined: one process, the whole batch

Each step is one ``schedule.step`` (``schedule=gpipe`` or ``1f1b``; with ``stages_per_rank=2`` or more,
``interleaved1f1b``, ``loopedbfs``, ``interleavedzb``, ``zbv`` or ``dualpipev`` (zero bubble): rank r runs stages
r, r + ranks, ... (the V of ``zbv`` and ``dualpipev``: r and 2 ranks - 1 - r) and the model traced is the list of their modules, torchtitan's
``model_parts``) over ``microbatches`` slices of a batch of ``batch`` sequences; the loss is the model's (next-token cross entropy, each microbatch's mean), computed by the
schedule on the last stage. Any defect of ``torch_llama`` is planted before the split (it lands on the stage
that holds its layer).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes import torch_llama
except ImportError:  # loaded as a file
    import llama_shared as shared
    import torch_llama

DEFECTS = shared.DEFECTS


class LlamaStage(nn.Module):
    """One pipeline stage of transformers' LlamaForCausalLM: ``model`` (embeddings on the first stage, its share
    of the decoder layers, the final norm on the last) and ``lm_head`` on the last; a module another stage holds
    is None. Stage 0 takes token ids, the others the hidden states the stage before sent."""

    def __init__(self, full: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.model = _StageBody(full.model, layers, first, last)
        self.lm_head = full.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model(x)
        return self.lm_head(hidden) if self.lm_head is not None else hidden


class _StageBody(nn.Module):
    """LlamaModel's forward over the layers of one stage (a ModuleDict keyed by their global index, so that every
    module keeps its name in the whole model); causal attention through SDPA's ``is_causal`` (no mask)."""

    def __init__(self, decoder: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        self.norm = decoder.norm if last else None
        self.rotary_emb = decoder.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers.values():
            hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
        return self.norm(hidden) if self.norm is not None else hidden


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: each position predicts the next token, the mean over the positions."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def build(defect: str | None = None, *, batch: int = 2, seq: int = 16, seed: int = 0, microbatches: int = 2,
          schedule: str = "gpipe", lr: float = 0.0, dp: int = 1, stages_per_rank: int = 1,
          defect_layer: int | None = None, tp: int = 1, **kwargs):
    """``microbatches``: slices of the batch each step runs through the pipeline (they must divide ``batch``);
    ``schedule``: "gpipe" or "1f1b"; ``lr`` > 0: each step is a training step (plain SGD on each stage); ``dp`` > 1:
    that many data-parallel replicas of the pipeline, each stage sharded over them by FSDP2 on a 2-D mesh
    (pipeline x data parallel, torchtitan's layout), each replica its own ``batch`` sequences; ``stages_per_rank``:
    pipeline stages each rank runs (more than one: an interleaved schedule); ``defect_layer``: the decoder layer
    a defect is planted in (as ``torch_llama``'s); ``tp`` > 1: each stage's layers split over that many
    tensor-parallel ranks (``parallelize_module``, as ``torch_llama_tp``): the mesh is (pipeline, data parallel,
    tensor parallel), torchtitan's order."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                              ScheduleZBVZeroBubble)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % (dp * tp):
        raise ValueError(f"dp={dp} x tp={tp} does not divide the {world} ranks")
    width = dp * tp  # ranks of each pipeline rank's data-parallel replicas or tensor-parallel shards
    ranks, group, replica = world // width, None, 0
    stages = ranks * stages_per_rank
    rank = dist.get_rank() // width
    if width > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ranks, dp, tp), mesh_dim_names=("pp", "dp", "tp"))  # torchtitan's order:
        # FSDP over the data-parallel dimension shards each tensor-parallel piece again
        group = mesh["pp"].get_group()
        replica = mesh["dp"].get_local_rank() if dp > 1 else 0
    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B} if stages_per_rank == 1 else \
        {"interleaved1f1b": ScheduleInterleaved1F1B, "loopedbfs": ScheduleLoopedBFS,
         "interleavedzb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    if schedule not in schedules or batch % microbatches:
        raise ValueError(f"schedule must be {' or '.join(schedules)} with {stages_per_rank} stage(s) per rank (got "
                         f"{schedule!r}) and microbatches ({microbatches}) must divide batch ({batch})")
    full, cfg = torch_llama.build_model(seed=seed, **kwargs)
    if cfg["layers"] < stages:
        raise ValueError(f"{cfg['layers']} layers cannot make {stages} pipeline stages")
    if defect is not None:
        torch_llama.inject(full, defect, defect_layer)  # before the split: it lands on the stage that holds its layer
    bounds = [cfg["layers"] * s // stages for s in range(stages + 1)]
    mine = [rank + v * ranks for v in range(stages_per_rank)]  # rank r runs stages r, r + ranks, ...
    if schedule in ("zbv", "dualpipev"):  # the V: rank r runs stages r and 2 * ranks - 1 - r
        mine = [rank, 2 * ranks - 1 - rank]
    parts = [LlamaStage(full, range(bounds[s], bounds[s + 1]), s == 0, s == stages - 1) for s in mine]
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        try:
            from layerdiff.recipes import torch_llama_tp
        except ImportError:  # loaded as a file
            import torch_llama_tp

        for part, s in zip(parts, mine):
            plan = torch_llama_tp.plan(bounds[s + 1], None)
            parallelize_module(part, mesh["tp"], {k: v for k, v in plan.items()
                                                  if int(k.split(".")[2]) in range(bounds[s], bounds[s + 1])})
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for part in parts:
            for layer in part.model.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
    pipeline = [PipelineStage(part, s, stages, torch.device("cpu"), group=group) for part, s in zip(parts, mine)]
    runner = schedules[schedule](pipeline[0] if stages_per_rank == 1 else pipeline, microbatches,
                                 loss_fn=next_token_loss)
    ids = torch.from_numpy(shared.input_ids(cfg, batch * dp, seq, seed)[replica * batch:(replica + 1) * batch])
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr) if lr > 0 else None
    first, last = 0 in mine, stages - 1 in mine

    def step():
        for part in parts:
            part.zero_grad(set_to_none=True)
        losses: list = []
        runner.step(*([ids] if first else []), target=ids if last else None, losses=losses if last else None)
        if optimizer is not None:
            optimizer.step()
        return torch.stack(losses).mean() if losses else None

    return {"model": parts[0] if stages_per_rank == 1 else parts, "step": step, "input_ids": ids,
            "meta": {"recipe": "torch_llama_pp", "defect": defect, "stages": stages, "schedule": schedule,
                     "microbatches": microbatches, "dp": dp, "stages_per_rank": stages_per_rank, "tp": tp}}
