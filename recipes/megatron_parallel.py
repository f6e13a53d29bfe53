"""Recipe: the small Llama of ``torch_llama`` as a Megatron-core ``GPTModel`` trained the way Megatron trains it:
tensor, sequence, pipeline and data parallel (``dp``: each rank its share of the batch), with microbatches,
through megatron-core's own schedule and its DistributedDataParallel, on CPU ranks (gloo).

    layerdiff trace torch_llama --arg layers=4 -o hf.h5                                   # the reference
    torchrun --standalone --nproc-per-node 2 -m layerdiff trace megatron_parallel \\
        --arg layers=4 --arg tp=2 --arg sp=true -o tp_sp                                  # TP=2 + sequence parallel
    torchrun --standalone --nproc-per-node 2 -m layerdiff trace megatron_parallel \\
        --arg layers=4 --arg pp=2 --arg microbatches=2 --arg first_stage_layers=3 -o pp   # PP=2, uneven, 2 microbatches
    torchrun --standalone --nproc-per-node 4 -m layerdiff trace megatron_parallel \\
        --arg layers=4 --arg tp=2 --arg pp=2 -o tp_pp                                     # TP=2 x PP=2 on 4 ranks
    torchrun --standalone --nproc-per-node 4 -m layerdiff trace megatron_parallel \
        --arg layers=4 --arg tp=2 --arg dp=2 -o tp_dp                                     # TP=2 x DP=2 on 4 ranks
    torchrun --standalone --nproc-per-node 2 -m layerdiff trace megatron_parallel \\
        --arg pp=2 --arg vpp=2 --arg microbatches=2 --arg batch=4 -o vpp                  # 4 virtual stages
    torchrun --standalone --nproc-per-node 2 -m layerdiff trace megatron_parallel \
        --arg pp=2 --arg microbatches=2 --arg batch=4 --arg recompute=full -o pp_recompute  # + activation recompute
    layerdiff align hf.h5 pp

One ``step()`` is one training iteration as Megatron runs it: ``get_forward_backward_func()`` runs every
microbatch forward and backward (``forward_step`` below is the user's forward-step function, with its loss
function), Megatron's ``finalize_model_grads`` all-reduces what it must (the norms' gradients under sequence
parallelism), and, with ``lr`` > 0, plain SGD updates the weights from Megatron's ``main_grad`` (the same update
``torch_llama --arg lr=...`` makes). The model, its weights and its input ids are ``megatron_llama``'s (the same
as ``torch_llama``'s); each pipeline stage loads the layers it holds, found by their global ``layer_number``,
and each tensor-parallel rank its shard.

CPU shims, all in this file (Megatron is not edited): Megatron's parallel code asks for
``torch.cuda.current_device()`` (buffers of the sequence-parallel collectives, the pipeline's p2p buffers, DDP's
gradient buffers), which here names the CPU; a ``torch.overrides.TorchFunctionMode`` turns the few tensors
created with ``device="cuda"`` (the schedule's token counter) into CPU tensors while a step runs; the local
spec's torch norms refuse sequence parallelism, so ``SequenceParallelRMSNorm`` is torch's ``RMSNorm`` with its
weight flagged ``sequence_parallel``, as Transformer Engine's norms flag theirs (what ``finalize_model_grads``
looks for). Everything else (the schedules, p2p, the collectives, DDP) is megatron-core's own code.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes import megatron_llama as base
except ImportError:  # loaded as a file: layerdiff trace recipes/megatron_parallel.py:build
    import llama_shared as shared
    import megatron_llama as base

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

# defect -> (direction, module path in the HF reference (torch_llama --arg layers=4) where it originates)
DEFECTS = {
    # sp: the final norm's weight is not flagged sequence_parallel, so finalize_model_grads never all-reduces its
    # gradient (Megatron-LM #1446): each TP rank keeps its partial sum, and after the update the copies differ
    "sp_norm": ("backward", "model.norm"),
    # sp: layer 1's attention output projection scatters its partial sums over the sequence without adding them
    # (a reduce-scatter that lost its reduction)
    "reduce_scatter": ("forward", "model.layers.1.self_attn.o_proj"),
    # pp with an uneven split: the last stage's loader takes its layers' offset as if the split were even
    "offset": ("forward", "model.layers.3.input_layernorm"),
    # pp: the last stage's layer 3 passes back a wrong gradient w.r.t. its MLP's input (x1.01)
    "stage_backward": ("backward", "model.layers.3.mlp.down_proj"),
}


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, its weight flagged ``sequence_parallel`` under sequence parallelism as Transformer
    Engine's norms flag theirs: each TP rank normalizes its slice of the sequence, so the weight's gradient is a
    partial sum that ``finalize_model_grads`` all-reduces."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class CPUDevices(TorchFunctionMode):
    """Tensors that Megatron creates on ``device="cuda"`` are made on the CPU (only while a step runs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def init_parallel(tp: int, pp: int, ep: int = 1, dp: int = 1, vpp: int = 1):
    """Gloo process group of the launcher (one in-memory group without one), Megatron's parallel state at
    tensor-parallel size ``tp``, pipeline size ``pp`` and expert-parallel size ``ep`` over ``tp * pp * dp``
    ranks (expert parallelism is carved out of data parallelism), ``vpp`` virtual stages on each pipeline rank, the
    no-op RNG tracker (dropout is 0)."""
    dist = torch.distributed
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # what Megatron allocates its buffers on
    world = tp * pp * dp
    if not dist.is_initialized():
        if world == 1 and "WORLD_SIZE" not in os.environ:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("gloo")
    if dist.get_world_size() != world or dp % ep:
        raise ValueError(f"tp={tp} x pp={pp} x dp={dp} (ep={ep} divides dp) needs {world} ranks (torchrun "
                         f"--nproc-per-node {world}); this job has {dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    base.without_cuda_generator()


def stage_state(state: dict, model: GPTModel, offset: int | None = None) -> dict:
    """The part of a full GPTModel state that this pipeline stage holds, under its local names: layer i is the
    global layer its ``layer_number`` says (``offset``: a loader that computes the stage's first layer itself)."""
    out = {}
    for i, layer in enumerate(model.decoder.layers):
        number = (layer.layer_number - 1) if offset is None else offset + i
        prefix = f"decoder.layers.{number}."
        out.update({f"decoder.layers.{i}.{k[len(prefix):]}": v for k, v in state.items() if k.startswith(prefix)})
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"):
        if _has(model, name.rpartition(".")[0]):  # the first stage's embedding, the last stage's head
            out[name] = state[name]
    return out


def _has(model, path: str) -> bool:
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def build_model(*, layers: int, tp: int, pp: int, sp: bool, first_stage_layers: int | None, seed: int,
                defect: str | None, dp: int = 1, vpp: int = 1, recompute: str | None = None):
    """This rank's GPTModel, or with ``vpp`` > 1 its list of model chunks (virtual pipeline stages: chunk v holds
    the layers of stage v x pp + this rank), each loaded with the layers it holds; and the shared config."""
    init_parallel(tp, pp, dp=dp, vpp=vpp)
    torch.manual_seed(seed)
    cfg = shared.config(layers=layers)
    uneven = first_stage_layers is not None and pp == 2
    config = base.transformer_config(
        cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        pipeline_dtype=torch.float32, batch_p2p_sync=False,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first_stage_layers if uneven else None,
        num_layers_in_last_pipeline_stage=layers - first_stage_layers if uneven else None,
        **base.recompute_options(recompute))
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    norm = SequenceParallelRMSNorm
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    full = base.hf_to_megatron(shared.weights(cfg, seed), cfg)
    offset = parallel_state.get_pipeline_model_parallel_rank() * (layers // pp) if defect == "offset" else None
    chunks = []
    for vp_stage in range(vpp) if vpp > 1 else [None]:
        stage_layers = [layer] * get_num_layers_to_build(config, vp_stage=vp_stage)  # this stage's layers only
        model = GPTModel(config, TransformerBlockSubmodules(layer_specs=stage_layers, layer_norm=norm),
                         vocab_size=cfg["vocab"], max_sequence_length=4096, position_embedding_type="rope",
                         rotary_base=cfg["rope_theta"], share_embeddings_and_output_weights=False,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage)
        model.rotary_pos_emb.__class__ = base.CPURotaryEmbedding
        model.rotary_pos_emb.rotary_base = cfg["rope_theta"]
        state = stage_state(full, model, offset)
        state = base.megatron_shard(state, tp, parallel_state.get_tensor_model_parallel_rank())
        missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
        assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
        chunks.append(model)
    return (chunks if vpp > 1 else chunks[0]), cfg


def _inject(model: GPTModel, defect: str | None, first_stage_layers: int | None):
    if defect in (None, "offset"):
        return
    if defect == "sp_norm":
        if model.decoder.final_layernorm is not None:
            del model.decoder.final_layernorm.weight.sequence_parallel
    elif defect == "reduce_scatter":
        layers = [layer for layer in model.decoder.layers if layer.layer_number == 2]
        for layer in layers:
            proj = layer.self_attention.linear_proj
            proj.explicit_expert_comm = True  # its forward then hands on its partial sums as they are

            def scattered(x, forward=proj.forward):
                out, bias = forward(x)
                return mappings.scatter_to_sequence_parallel_region(out), bias

            proj.forward = scattered
    elif defect == "stage_backward":
        for layer in model.decoder.layers:
            if layer.layer_number == 4:
                fc2 = layer.mlp.linear_fc2
                fc2.forward = lambda x, forward=fc2.forward: forward(base._ScaleGrad.apply(x, 1.01))
    else:
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor):
    """transformers' causal-LM loss on (vocab-parallel) logits: the mean over the positions that have a label."""
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]  # as transformers' ForCausalLMLoss
    mask = (labels != -100).float()
    # a copy: vocab_parallel_cross_entropy subtracts the max from its input in place
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), labels.clamp(min=0))
    loss = (per_token * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach()}


def trainer(model: GPTModel | list[GPTModel], forward_step, batches, *, microbatches: int, seq: int, micro: int,
            lr: float):
    """One training iteration as Megatron runs one: the model (each of its chunks) wrapped in its
    DistributedDataParallel, every microbatch (``batches()``: an iterator over them, one per chunk) through
    ``get_forward_backward_func()``, its ``finalize_model_grads``, and with ``lr`` > 0 plain SGD from ``main_grad``.
    Returns the mean loss."""
    chunks = model if isinstance(model, list) else [model]
    with CPUDevices():
        ddps = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk) for chunk in chunks]
    chunks[0].config.finalize_model_grads_func = finalize_model_grads

    def step():
        for ddp in ddps:
            ddp.zero_grad_buffer()
        with CPUDevices():
            losses = get_forward_backward_func()(forward_step_func=forward_step,
                                                 data_iterator=[batches() for _ in ddps] if len(ddps) > 1
                                                 else batches(), model=ddps, num_microbatches=microbatches,
                                                 seq_length=seq, micro_batch_size=micro, forward_only=False)
        if lr > 0:
            with torch.no_grad():
                for chunk in chunks:
                    for p in chunk.parameters():
                        p.add_(p.main_grad, alpha=-lr)
        return sum(float(x["lm loss"]) for x in losses) / microbatches if losses else None

    return step


def build(defect: str | None = None, *, layers: int = 4, tp: int = 1, pp: int = 1, sp: bool = False,
          microbatches: int = 1, first_stage_layers: int | None = None, lr: float = 0.0, batch: int = 2,
          seq: int = 16, seed: int = 0, dp: int = 1, vpp: int = 1, recompute: str | None = None):
    """``vpp`` > 1: that many virtual pipeline stages on each pipeline rank (Megatron's interleaved schedule); the
    model traced is the rank's list of model chunks. ``recompute``: activation recomputation, "full" or
    "selective" (``megatron_llama.RECOMPUTE``)."""
    if sp and tp < 2:
        raise ValueError("sp=true splits activations over tensor-parallel ranks: it needs tp >= 2")
    if batch % (microbatches * dp):
        raise ValueError(f"batch {batch} does not split into {dp} data-parallel shares of {microbatches} "
                         "microbatches")
    model, cfg = build_model(layers=layers, tp=tp, pp=pp, sp=sp, first_stage_layers=first_stage_layers, seed=seed,
                             defect=defect, dp=dp, vpp=vpp, recompute=recompute)
    for chunk in model if isinstance(model, list) else [model]:
        _inject(chunk, defect, first_stage_layers)
    base.reserve_attention_buffer(batch * cfg["heads"] * seq * seq)
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, seed))
    share = batch // dp  # each data-parallel rank runs its share of the batch, in order of its rank
    input_ids = input_ids[parallel_state.get_data_parallel_rank() * share:][:share]
    micro = share // microbatches
    position_ids, attention_mask = base.positions_and_mask(micro, seq)

    def forward_step(data, model):
        """The user's forward-step function: one microbatch through the model, and the loss on it."""
        ids = next(data)
        return model(ids, position_ids, attention_mask), lambda logits: causal_lm_loss(logits, ids)

    step = trainer(model, forward_step, lambda: iter(input_ids.split(micro)), microbatches=microbatches, seq=seq,
                   micro=micro, lr=lr)
    meta = {"recipe": "megatron_parallel", "defect": defect, "tp": tp, "pp": pp, "sp": sp, "dp": dp,
            "microbatches": microbatches, "vpp": vpp}
    return {"model": model, "step": step, "meta": meta}
