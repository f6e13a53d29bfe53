"""Recipe: the small Llama of ``torch_llama`` as a Megatron-core ``GPTModel`` on CPU (a port, as a user makes one).

    pip install -c constraints.txt megatron-core==0.16.1
    layerdiff trace megatron_llama -o mg.h5
    layerdiff trace torch_llama -o pt.h5
    layerdiff align pt.h5 mg.h5

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
explicitly (the default one is built on CUDA). ``build`` may be called any number of times in one process.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

try:
    from . import llama_shared as shared
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


def init_cpu_megatron():
    """World size 1 on gloo, tensor/pipeline parallel 1, no-op RNG tracker. Safe to call again."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)  # no-op when already made
    if not getattr(tensor_parallel.get_cuda_rng_tracker(), "is_inference_rng_tracker", False):
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


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
    elif defect == "qkv_part":
        rows = layers[1].self_attention.linear_qkv.weight.view(cfg["kv_heads"], (qpg + 2) * hd, -1)
        with torch.no_grad():
            rows[:, qpg * hd:(qpg + 1) * hd].mul_(1 + 1e-3)  # the K head of every query group
    elif defect == "fc1_part":
        with torch.no_grad():
            layers[0].mlp.linear_fc1.weight[cfg["intermediate"]:].mul_(1 + 1e-3)
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


def build_model(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256,
                intermediate: int | None = None, seed: int = 0, rotary_base: float | None = None):
    """GPTModel equal to torch_llama's LlamaForCausalLM, with the shared weights converted."""
    init_cpu_megatron()
    torch.manual_seed(seed)
    cfg = shared.config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                        intermediate=intermediate)
    config = TransformerConfig(
        num_layers=cfg["layers"], hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg["kv_heads"], ffn_hidden_size=cfg["intermediate"], normalization="RMSNorm",
        layernorm_epsilon=cfg["eps"], add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        cuda_graph_scope=[])  # [] = the default "full" without its deprecation warning (no CUDA graphs anyway)
    base = cfg["rope_theta"] if rotary_base is None else rotary_base
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=cfg["vocab"],
                     max_sequence_length=4096, position_embedding_type="rope", rotary_base=base,
                     share_embeddings_and_output_weights=False)
    model.rotary_pos_emb.__class__ = CPURotaryEmbedding  # keep GPTModel's instance (inv_freq already on CPU)
    model.rotary_pos_emb.rotary_base = base
    state = hf_to_megatron(shared.weights(cfg, seed), cfg)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
    return model, cfg


def build(defect: str | None = None, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int = 256, intermediate: int | None = None, batch: int = 2, seq: int = 16, seed: int = 0,
          backward: bool = True):
    model, cfg = build_model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                             intermediate=intermediate, seed=seed,
                             rotary_base=20000.0 if defect == "rotary" else None)
    _inject(model, defect, cfg)
    reserve_attention_buffer(batch * cfg["heads"] * seq * seq)
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, seed))
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    attention_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:].reshape(-1)  # as transformers' ForCausalLMLoss

    def step():
        if backward:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids, position_ids, attention_mask)  # [b, s, v] (no labels given)
            loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), labels, ignore_index=-100)
            loss.backward()
        else:
            with torch.no_grad():
                loss = model(input_ids, position_ids, attention_mask).float().mean()
        return loss

    return {"model": model, "step": step, "meta": {"recipe": "megatron_llama", "defect": defect}}
