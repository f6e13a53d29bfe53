"""Recipe: the small Llama of ``torch_llama`` as a Megatron-core ``GPTModel`` on CPU (a port, as a user makes one).

    pip install -c constraints.txt megatron-core==0.16.1
    layerdiff trace megatron_llama -o mg.h5
    layerdiff trace torch_llama -o pt.h5
    layerdiff align pt.h5 mg.h5
    torchrun --standalone --nproc-per-node 2 -m layerdiff trace megatron_llama --arg tp=2 -o mg_tp   # TP=2
    layerdiff align pt.h5 mg_tp

Same config, weights (``llama_shared.weights`` converted by ``hf_to_megatron``, Megatron-Bridge's layout) and
input ids as ``torch_llama``; fp32, no Transformer Engine (``get_gpt_layer_local_spec``), every fusion off,
dropout 0. Megatron's activations are [s, b, h]; ``model(ids, position_ids, mask)`` returns logits [b, s, v]
and ``step`` computes HF's causal-LM loss on them. ``DEFECTS`` names each injected bug's origin in the HF
reference's module paths.

Megatron on CPU, handled here without editing Megatron: torch.distributed is initialised (gloo, world size
1, in-memory store) once per process; the RNG tracker is Megatron's inference variant (its fork is a no-op,
exact with dropout 0; the training one needs CUDA); ``rotary_pos_emb`` is switched to ``CPURotaryEmbedding``
(``RotaryEmbedding.get_emb`` would move ``inv_freq`` to CUDA); DotProductAttention's score buffer is
pre-allocated on the CPU (Megatron's global memory buffer allocates on CUDA); the causal mask is passed
explicitly (the default one is built on CUDA); activation recomputation (``--arg recompute=full`` or
``selective``) saves and restores the CUDA generator's state, which a CPU-only host has none of: Megatron's two
functions that read and set it do nothing there. ``build`` may be called any number of times in one process.

``tp=N`` (under ``torchrun --nproc-per-node N``, gloo on CPU): the same model at tensor_model_parallel_size=N,
every rank loading its shard of the same converted weights by Megatron's conventions (``megatron_shard``):
linear_qkv rows by whole query groups, linear_fc1 as [this rank's gate rows; its up rows], linear_proj and
linear_fc2 on their input dimension, the vocab-parallel embedding and the column-parallel output_layer on vocab
rows, norms replicated. The logits stay split over the vocabulary ([b, s, v/N] on each rank); ``step``'s loss is
Megatron's ``vocab_parallel_cross_entropy`` averaged over the positions with a label (HF's shifted labels), so
every rank holds the same loss as tp=1. Every defect applies to each rank's shard or copy.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

try:
    from layerdiff.recipes import llama_shared as shared
except ImportError:  # loaded as a file: layerdiff trace recipes/megatron_llama.py:build
    import llama_shared as shared

with warnings.catch_warnings():  # "Transformer Engine / Apex not installed": expected, the local spec uses neither
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

# defect -> (direction, module path in the HF reference (torch_llama) where it originates)
DEFECTS = {
    "eps": ("forward", "model.layers.1.post_attention_layernorm"),  # pre_mlp_layernorm eps 1e-6 -> 1e-5
    "weight": ("forward", "model.layers.1.self_attn.o_proj"),       # linear_proj weight x(1 + 1e-4)
    "qkv_part": ("forward", "model.layers.1.self_attn.k_proj"),     # K rows of linear_qkv x(1 + 1e-3)
    "fc1_part": ("forward", "model.layers.0.mlp.up_proj"),          # "up" half of linear_fc1 x(1 + 1e-3)
    "rotary": ("forward", "model.rotary_emb"),                      # rotary base 10000 -> 20000
    "owncode": ("forward", "model.layers.1"),                       # attention residual x(1 + 1e-3), own code
    "backward": ("backward", "model.layers.0.mlp.down_proj"),       # linear_fc2 grad w.r.t. input x1.01
}


# ------------------------------------------------------------------------------------ weights, both ways
def hf_to_megatron(state: dict, cfg: dict) -> dict:
    """HF Llama names/layouts -> GPTModel's (numpy). linear_qkv rows per query group: [its q heads; k; v];
    linear_fc1 rows: [gate; up]."""
    kv, hidden = cfg["kv_heads"], cfg["hidden"]
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"], "output_layer.weight": state["lm_head.weight"]}
    for i in range(cfg["layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (state[h + f"self_attn.{n}_proj.weight"].reshape(kv, -1, hidden) for n in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = np.concatenate([q, k, v], axis=1).reshape(-1, hidden)
        out[m + "self_attention.linear_proj.weight"] = state[h + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = np.concatenate([state[h + "mlp.gate_proj.weight"],
                                                           state[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = state[h + "mlp.down_proj.weight"]
        out[m + "input_layernorm.weight"] = state[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = state[h + "post_attention_layernorm.weight"]
    return out


def megatron_to_hf(state: dict, cfg: dict) -> dict:
    """The inverse of ``hf_to_megatron``."""
    hd, kv, hidden = cfg["hidden"] // cfg["heads"], cfg["kv_heads"], cfg["hidden"]
    q_rows = cfg["heads"] // kv * hd  # rows of one group's q heads
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"], "lm_head.weight": state["output_layer.weight"]}
    for i in range(cfg["layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"].reshape(kv, q_rows + 2 * hd, hidden)
        for name, part in zip("qkv", np.split(qkv, [q_rows, q_rows + hd], axis=1)):
            out[h + f"self_attn.{name}_proj.weight"] = np.ascontiguousarray(part.reshape(-1, hidden))
        out[h + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        gate, up = np.split(state[m + "mlp.linear_fc1.weight"], 2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
        out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
    return out


# ------------------------------------------------------------------------------------ Megatron on CPU
class CPURotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding without the move of ``inv_freq`` to ``torch.cuda.current_device()``;
    ``get_emb`` is otherwise the same. ``rotary_base`` is kept as an attribute so traces record it."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


def init_cpu_megatron(tp: int = 1):
    """Gloo process group, tensor parallel ``tp`` and pipeline parallel 1, no-op RNG tracker. Safe to call again.

    tp=1 without a launcher: world size 1 on an in-memory store. tp>1: the group of the launcher's environment
    (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    dist = torch.distributed
    if not dist.is_initialized():
        if tp == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("gloo")
    if tp > 1 and dist.get_world_size() % tp:
        raise ValueError(f"tp={tp} needs a multiple of {tp} ranks (torchrun --nproc-per-node {tp}); "
                         f"this job has {dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized() and \
            parallel_state.get_tensor_model_parallel_world_size() != tp:
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)  # no-op when already made
    if not getattr(tensor_parallel.get_cuda_rng_tracker(), "is_inference_rng_tracker", False):
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    without_cuda_generator()


def without_cuda_generator():
    """Activation recomputation saves and restores the CUDA generator's state: a CPU-only host has none (Megatron
    saves and restores the CPU generator's as well), so Megatron's two functions that read and set it do nothing."""
    if not torch.cuda.is_available():
        tensor_parallel.random._get_cuda_rng_state = lambda *args, **kwargs: None
        tensor_parallel.random._set_cuda_rng_state = lambda *args, **kwargs: None


def megatron_shard(state: dict, tp: int, rank: int) -> dict:
    """Tensor-parallel rank ``rank``'s part of a full GPTModel state (``hf_to_megatron``'s), Megatron's way:
    linear_qkv rows (grouped per query group) split in ``tp`` so each rank holds whole groups; linear_fc1 as
    [the rank's part of gate; its part of up]; linear_proj and linear_fc2 split on the input dimension (dim 1);
    word embeddings and output_layer split on vocab rows; norms replicated."""
    if tp == 1:
        return state
    out = {}
    for name, value in state.items():
        if name.endswith("mlp.linear_fc1.weight"):
            gate, up = np.split(value, 2)
            part = np.concatenate([np.split(gate, tp)[rank], np.split(up, tp)[rank]])
        elif name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            part = np.split(value, tp)[rank]
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            part = np.split(value, tp, axis=1)[rank]
        elif name.endswith("layernorm.weight"):
            part = value
        else:
            raise KeyError(f"no tensor-parallel rule for {name}")
        out[name] = np.ascontiguousarray(part)
    return out


def positions_and_mask(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTModel's position ids [batch, seq] (0..) and causal attention mask (True = masked), made on the CPU:
    Megatron's default mask is built on CUDA."""
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    return positions, torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def reserve_attention_buffer(numel: int, dtype=torch.float32):
    """DotProductAttention takes its score buffer ([b * heads, s, s], only the ``input`` of a beta=0 baddbmm)
    from Megatron's global memory buffer, which allocates on CUDA when too small: pre-fill it on the CPU."""
    buffers = parallel_state.get_global_memory_buffer().buffer
    if buffers.get(("mpu", dtype)) is None or buffers[("mpu", dtype)].numel() < numel:
        buffers[("mpu", dtype)] = torch.empty(numel, dtype=dtype)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient passing back through it is scaled by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _inject(model, defect, cfg):
    layers = model.decoder.layers
    hd, qpg = cfg["hidden"] // cfg["heads"], cfg["heads"] // cfg["kv_heads"]
    if defect == "eps":
        layers[1].pre_mlp_layernorm.eps = 1e-5
    elif defect == "weight":
        with torch.no_grad():
            layers[1].self_attention.linear_proj.weight.mul_(1 + 1e-4)
    elif defect == "qkv_part":  # this rank's query groups (all of them at tp=1)
        rows = layers[1].self_attention.linear_qkv.weight.view(-1, (qpg + 2) * hd, cfg["hidden"])
        with torch.no_grad():
            rows[:, qpg * hd:(qpg + 1) * hd].mul_(1 + 1e-3)  # the K head of every query group
    elif defect == "fc1_part":  # rows [gate; up] of this rank's part (of the whole at tp=1)
        fc1 = layers[0].mlp.linear_fc1.weight
        with torch.no_grad():
            fc1[fc1.shape[0] // 2:].mul_(1 + 1e-3)
    elif defect == "owncode":  # TransformerLayer's attention residual add, scaled residual
        layer, bda = layers[1], layers[1].self_attn_bda
        layer.self_attn_bda = lambda training, fused: (
            lambda out_with_bias, residual, prob: bda(training, fused)(out_with_bias, residual * (1 + 1e-3), prob))
    elif defect == "backward":
        fc2 = layers[0].mlp.linear_fc2
        forward = fc2.forward
        fc2.forward = lambda x: forward(_ScaleGrad.apply(x, 1.01))
    elif defect not in (None, "rotary"):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")


def transformer_config(cfg: dict, **layout) -> TransformerConfig:
    """The shared Llama (``cfg``) as Megatron's TransformerConfig: RMSNorm, gated SiLU MLP, no biases, dropout 0,
    every fusion off (no Transformer Engine, no CUDA); ``layout``: its parallel sizes and options, which may also
    set another architecture's norm, MLP, biases and query groups (``megatron_like_hf``)."""
    options = dict(num_query_groups=cfg["kv_heads"], normalization="RMSNorm", add_bias_linear=False,
                   gated_linear_unit=True, activation_func=F.silu)
    options.update(layout)
    return TransformerConfig(
        num_layers=cfg["layers"], hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"],
        ffn_hidden_size=cfg["intermediate"], layernorm_epsilon=cfg["eps"],
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        cuda_graph_scope=[], **options)  # [] = the default "full" without its deprecation warning (no CUDA graphs)


RECOMPUTE = {"full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
             "selective": {"recompute_granularity": "selective"}}  # Megatron's activation recomputation


def recompute_options(recompute: str | None) -> dict:
    """TransformerConfig's options for ``recompute`` (a key of ``RECOMPUTE``; None: no recomputation)."""
    if recompute is not None and recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose from {', '.join(RECOMPUTE)}")
    return RECOMPUTE.get(recompute or "", {})


def build_model(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256,
                intermediate: int | None = None, seed: int = 0, rotary_base: float | None = None, tp: int = 1,
                recompute: str | None = None):
    """GPTModel equal to torch_llama's LlamaForCausalLM, with the shared weights converted (this rank's shard of
    them at tensor-parallel size ``tp``); ``recompute``: Megatron's activation recomputation, "full" (every
    layer, ``--recompute-granularity full --recompute-method uniform``) or "selective" (core attention)."""
    init_cpu_megatron(tp)
    torch.manual_seed(seed)
    cfg = shared.config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                        intermediate=intermediate)
    config = transformer_config(cfg, **recompute_options(recompute))
    base = cfg["rope_theta"] if rotary_base is None else rotary_base
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=cfg["vocab"],
                     max_sequence_length=4096, position_embedding_type="rope", rotary_base=base,
                     share_embeddings_and_output_weights=False)
    model.rotary_pos_emb.__class__ = CPURotaryEmbedding  # keep GPTModel's instance (inv_freq already on CPU)
    model.rotary_pos_emb.rotary_base = base
    state = megatron_shard(hf_to_megatron(shared.weights(cfg, seed), cfg), tp,
                           parallel_state.get_tensor_model_parallel_rank())
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
    return model, cfg


def build(defect: str | None = None, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int = 256, intermediate: int | None = None, batch: int = 2, seq: int = 16, seed: int = 0,
          backward: bool = True, tp: int = 1, recompute: str | None = None):
    model, cfg = build_model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                             intermediate=intermediate, seed=seed,
                             rotary_base=20000.0 if defect == "rotary" else None, tp=tp, recompute=recompute)
    _inject(model, defect, cfg)
    reserve_attention_buffer(batch * cfg["heads"] * seq * seq)
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, seed))
    position_ids, attention_mask = positions_and_mask(batch, seq)
    labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:].reshape(-1)  # as transformers' ForCausalLMLoss
    if tp > 1:  # vocab-parallel logits: Megatron's cross entropy, averaged over the labelled positions
        loss_mask = (labels != -100).view(batch, seq).float()
        targets = labels.clamp(min=0).view(batch, seq)

    def causal_lm_loss(logits):
        if tp == 1:
            return F.cross_entropy(logits.float().view(-1, cfg["vocab"]), labels, ignore_index=-100)
        # a copy: vocab_parallel_cross_entropy subtracts the max from its input in place
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), targets)  # [b, s]
        return (per_token * loss_mask).sum() / loss_mask.sum()

    def logits_mean(logits):
        if tp == 1:
            return logits.float().mean()
        total = logits.float().sum()
        torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
        return total / (logits.numel() * tp)

    def step():
        if backward:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids, position_ids, attention_mask)  # [b, s, v / tp] (no labels given)
            loss = causal_lm_loss(logits)
            loss.backward()
        else:
            with torch.no_grad():
                loss = logits_mean(model(input_ids, position_ids, attention_mask))
        return loss

    meta = {"recipe": "megatron_llama", "defect": defect, "recompute": recompute}
    if tp > 1:
        meta.update(tp=tp, tp_rank=parallel_state.get_tensor_model_parallel_rank())
    return {"model": model, "step": step, "meta": meta}
