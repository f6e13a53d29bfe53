"""Recipe: a Megatron-core ``GPTModel`` configured from a transformers config, as Megatron-Bridge configures one for
that architecture, on one CPU rank (``megatron_llama``'s CPU arrangements). Its weights are the user's to set:
``layerdiff.checkpoints.transfer.transfer_weights(hf_model, model)`` does it with no map.

    from layerdiff.recipes import megatron_like_hf
    model = megatron_like_hf.build(hf_model.config, ids.shape, qk_layernorm=True)   # Qwen3
    transfer_weights(hf_model, model)
    logits = megatron_like_hf.logits(model, ids)                                     # [b, s, vocab]

What is taken from the config: sizes, heads and query groups, head dim, the norms' epsilon, the activation,
rotary base and the fraction of each head it turns, tied embeddings, the MLP's width (GPT-2's ``n_inner``), and
experts (``num_local_experts`` or ``num_experts``, top-k, the experts' width, a shared expert with its sigmoid gate,
softmax over all experts first where ``norm_topk_prob`` is false). What the config does not say and Megatron-Bridge
sets per architecture comes as keyword options (``add_qkv_bias=True`` for Qwen2, ``qk_layernorm=True`` for Qwen3;
``normalization="LayerNorm"``, ``gated_linear_unit=False``, ``add_bias_linear=True`` for StarCoder 2). By default
RMSNorm, a gated MLP, no linear biases; dropout 0, fp32, every fusion off (no Transformer Engine, no CUDA):
``megatron_llama.transformer_config``.
"""
from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.nn.functional as F

try:
    from layerdiff.recipes import megatron_llama, megatron_moe
except ImportError:  # loaded as a file
    import megatron_llama
    import megatron_moe

with warnings.catch_warnings():  # "Transformer Engine / Apex not installed": expected, the local spec uses neither
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec


# transformers' activation names -> the function Megatron is given for them
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
               "gelu_new": partial(F.gelu, approximate="tanh")}
# where transformers' configs keep the norms' epsilon, by architecture
_EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")


def build(config, shape: tuple[int, int], **options) -> GPTModel:
    """A GPTModel of ``config``'s architecture for inputs of ``shape`` (batch, sequence); ``options``: more
    TransformerConfig fields (``qk_layernorm`` also picks the layer spec's query-key norms, ``normalization`` its
    norms), ``position_embedding_type`` ("rope", or "learned_absolute" for GPT-2's), and ``tp``: tensor-parallel
    ranks (torchrun's; the weights are then each rank's shard to set)."""
    tp = options.pop("tp", 1)
    megatron_llama.init_cpu_megatron(tp)
    if tp > 1:
        options["tensor_model_parallel_size"] = tp
    rope = getattr(config, "rope_parameters", None) or {}
    base = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    rotary_percent = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    positions = options.pop("position_embedding_type", "rope")
    experts = experts_options(config)
    eps = next(getattr(config, name) for name in _EPSILONS if getattr(config, name, None) is not None)
    act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or "silu"
    sizes = {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
             "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate": _mlp_width(config), "eps": eps}
    transformer = megatron_llama.transformer_config(
        sizes, kv_channels=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        activation_func=ACTIVATIONS[act], **options, **experts)
    spec = get_gpt_layer_local_spec(num_experts=experts.get("num_moe_experts"), moe_grouped_gemm=False,
                                    normalization=transformer.normalization,
                                    qk_layernorm=options.get("qk_layernorm", False))
    model = GPTModel(transformer, spec, vocab_size=config.vocab_size,
                     max_sequence_length=config.max_position_embeddings, position_embedding_type=positions,
                     rotary_base=base, rotary_percent=rotary_percent,
                     share_embeddings_and_output_weights=bool(getattr(config, "tie_word_embeddings", False)))
    if positions == "rope":
        model.rotary_pos_emb.__class__ = megatron_llama.CPURotaryEmbedding
        model.rotary_pos_emb.rotary_base = base
    megatron_moe.routers_on_cpu(model)
    batch, seq = shape
    megatron_llama.reserve_attention_buffer(batch * config.num_attention_heads * seq * seq)
    return model


def _mlp_width(config) -> int:
    """The MLP's width: GPT-2's ``n_inner`` (None: 4 x hidden), else ``intermediate_size``."""
    if hasattr(config, "n_inner"):
        return config.n_inner or 4 * config.hidden_size
    return config.intermediate_size


def experts_options(config) -> dict:
    """Megatron's MoE options for a transformers config with experts, as Megatron-Bridge sets them: top-k of the
    router's scores renormalized (Mixtral) or softmax over all experts first (Qwen2-MoE: ``norm_topk_prob``
    false), a shared expert with its sigmoid gate, the token dispatcher that runs on one CPU rank, and no auxiliary
    loss (transformers adds none without ``output_router_logits``)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return {}
    out = dict(num_moe_experts=experts, moe_router_topk=config.num_experts_per_tok,
               moe_ffn_hidden_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
               moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if not getattr(config, "norm_topk_prob", True):
        out["moe_router_pre_softmax"] = True
    shared = getattr(config, "shared_expert_intermediate_size", 0)
    if shared:
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return out


def vectors_moved(model: torch.nn.Module, seed: int = 2, scale: float = 0.1) -> torch.nn.Module:
    """``model`` with each of its 1-D parameters (norms' weights and biases) moved by seeded noise, in place: at
    their initial ones and zeros, a bias lost, left unadded or added twice would not show in a port."""
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(scale * torch.randn(p.shape, generator=noise))
    return model


def logits(model: GPTModel, ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits [b, s, vocab] for ``ids`` [b, s]: positions 0.., a causal mask
    (``megatron_llama.positions_and_mask``)."""
    return model(ids, *megatron_llama.positions_and_mask(*ids.shape))
