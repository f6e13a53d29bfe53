"""Recipe: a small Mixtral-style mixture of experts as transformers' ``MixtralForCausalLM`` and as a Megatron-core
``GPTModel`` with MoE layers (SequentialMLP experts, top-2 router), on CPU, with the same weights.

    layerdiff trace megatron_moe --arg impl=hf -o hf.h5
    layerdiff trace megatron_moe --arg defect=router -o mg.h5
    layerdiff align hf.h5 mg.h5          # origin: model.layers.0.mlp.gate

The HF model is built from a seed; its weights go to Megatron as Megatron-Bridge converts them: q/k/v per query
group into ``linear_qkv``, the router ``gate`` into ``router``, each expert's slice of the 3-D
``experts.gate_up_proj`` ([gate; up]) into ``local_experts.N.linear_fc1`` and of ``down_proj`` into
``linear_fc2``. Logits agree to ~1e-7. The routers hand on the same choice differently (HF: logits, top-k scores
and indices; Megatron: dense top-k probabilities and a routing map): align compares them over all experts.

Megatron on CPU as in ``megatron_llama`` (gloo, inference RNG tracker, rotary on the CPU), plus the router:
``TopKRouter.gating`` moves its weight to CUDA and megatron-core 0.16.1's ``router_gating_linear`` needs
Transformer Engine, so ``CPUTopKRouter`` computes the same logits with ``F.linear``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# defect -> (direction, module path in the HF model where it originates)
DEFECTS = {
    "router": ("forward", "model.layers.0.mlp.gate"),  # layer 0's router weight x(1 + 1e-3)
    "expert": ("forward", "model.layers.1.mlp"),       # up rows of layer 1's expert 2 x(1 + 1e-3): inside the
                                                       # experts, which HF runs in one call
    "expert_rank": ("forward", "model.layers.1.mlp"),  # the same on expert 3: with ep=2, on rank 1 only
}

CONFIG = {"vocab": 64, "hidden": 32, "ffn": 64, "heads": 4, "kv_heads": 2, "layers": 2, "experts": 4, "top_k": 2,
          "eps": 1e-5, "rope_theta": 10000.0}


def hf_model(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    c = CONFIG
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                           num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                           num_key_value_heads=c["kv_heads"], num_local_experts=c["experts"],
                           num_experts_per_tok=c["top_k"], rms_norm_eps=c["eps"], rope_theta=c["rope_theta"],
                           tie_word_embeddings=False, router_jitter_noise=0.0, attn_implementation="eager")
    return MixtralForCausalLM(config).eval()


def hf_to_megatron(state: dict) -> dict:
    """Mixtral names and layouts -> GPTModel's: linear_qkv rows per query group [its q heads; k; v]."""
    c = CONFIG
    hd, kv = c["hidden"] // c["heads"], c["kv_heads"]
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"], "output_layer.weight": state["lm_head.weight"]}
    for i in range(c["layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (state[h + f"self_attn.{n}_proj.weight"].reshape(kv, -1, c["hidden"]) for n in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, c["hidden"])
        out[m + "self_attention.linear_proj.weight"] = state[h + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = state[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = state[h + "post_attention_layernorm.weight"]
        out[m + "mlp.router.weight"] = state[h + "mlp.gate.weight"]
        for e in range(c["experts"]):
            local = m + f"mlp.experts.local_experts.{e}."
            out[local + "linear_fc1.weight"] = state[h + "mlp.experts.gate_up_proj"][e]
            out[local + "linear_fc2.weight"] = state[h + "mlp.experts.down_proj"][e]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def expert_shard(state: dict, model) -> dict:
    """The experts this expert-parallel rank holds, under their local names: ``local_experts.i`` of layer L is
    global expert ``local_expert_indices[i]`` (every other tensor is whole on every rank)."""
    out = {k: v for k, v in state.items() if ".local_experts." not in k}
    for i, layer in enumerate(model.decoder.layers):
        for local, index in enumerate(layer.mlp.local_expert_indices):
            prefix = f"decoder.layers.{i}.mlp.experts.local_experts."
            out.update({f"{prefix}{local}.{k[len(prefix) + len(str(index)) + 1:]}": v for k, v in state.items()
                        if k.startswith(f"{prefix}{index}.")})
    return out


def routers_on_cpu(model) -> None:
    """Every MoE layer's ``TopKRouter`` of a GPTModel computes its logits on the CPU with ``F.linear`` (the same
    logits; its own ``gating`` moves the weight to CUDA and needs Transformer Engine)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            router.__class__ = _cpu_router_class(type(router))


@functools.cache
def _cpu_router_class(base: type) -> type:
    class CPUTopKRouter(base):  # type: ignore[misc, valid-type]
        """``TopKRouter`` whose logits stay on the CPU and need no Transformer Engine."""

        def gating(self, input):
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            return F.linear(input.to(dtype), self.weight.to(dtype))

    return CPUTopKRouter


def megatron_model(state: dict, ep: int = 1, dp: int = 1):
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from layerdiff.recipes import megatron_llama

    if ep * dp == 1:
        megatron_llama.init_cpu_megatron(1)
    else:  # data parallel ranks, of which ``ep`` share the experts (each holds experts / ep of them)
        from layerdiff.recipes import megatron_parallel

        megatron_parallel.init_parallel(1, 1, ep=ep, dp=dp)
    c = CONFIG
    config = megatron_llama.transformer_config(
        {**c, "intermediate": c["ffn"]}, moe_ffn_hidden_size=c["ffn"], num_moe_experts=c["experts"],
        moe_router_topk=c["top_k"], moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep)
    spec = get_gpt_layer_local_spec(num_experts=c["experts"], moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=c["vocab"], max_sequence_length=256, position_embedding_type="rope",
                     rotary_base=c["rope_theta"], share_embeddings_and_output_weights=False)
    model.rotary_pos_emb.__class__ = megatron_llama.CPURotaryEmbedding
    routers_on_cpu(model)
    missing, unexpected = model.load_state_dict(expert_shard(state, model), strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
    return model


def build(defect: str | None = None, *, impl: str = "megatron", batch: int = 2, seq: int = 8, seed: int = 0,
          ep: int = 1, dp: int = 1):
    """``dp`` > 1 (under ``torchrun --nproc-per-node DP``): Megatron data parallel, each rank running its share
    of the batch, ``ep`` of them sharing the experts (expert parallelism), trained as Megatron trains
    (``megatron_parallel.trainer``: its schedule, DistributedDataParallel and ``finalize_model_grads``)."""
    if defect is not None and (defect not in DEFECTS or impl != "megatron"):
        raise ValueError(f"defect {defect!r}: choose from {', '.join(DEFECTS)} (injected into impl=megatron)")
    if dp > 1 and (impl != "megatron" or batch % dp):
        raise ValueError(f"dp={dp}: Megatron's data parallel ranks split the batch ({batch}) evenly")
    hf = hf_model(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, CONFIG["vocab"], (batch, seq), generator=generator)
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)  # as transformers' ForCausalLMLoss
    if impl == "hf":
        def logits():
            return hf(input_ids=ids).logits
        model = hf
    elif impl == "megatron":
        from layerdiff.recipes import megatron_llama

        model = megatron_model(hf_to_megatron(hf.state_dict()), ep=ep, dp=dp)
        _inject(model, defect)
        if dp > 1:
            return _data_parallel(model, ids, seq, dp, defect)
        megatron_llama.reserve_attention_buffer(batch * CONFIG["heads"] * seq * seq)
        positions, mask = megatron_llama.positions_and_mask(batch, seq)

        def logits():
            return model(ids, positions, mask)
    else:
        raise ValueError(f"impl {impl!r}: 'hf' or 'megatron'")

    def step():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits().float().view(-1, CONFIG["vocab"]), labels, ignore_index=-100)
        loss.backward()
        return loss

    return {"model": model, "step": step, "meta": {"recipe": "megatron_moe", "impl": impl, "defect": defect},
            "logits": logits}


def _inject(model, defect: str | None):
    """Each defect on the global expert or layer it names, on the rank that holds it."""
    layers = model.decoder.layers
    with torch.no_grad():
        if defect == "router":
            layers[0].mlp.router.weight.mul_(1 + 1e-3)
        elif defect in ("expert", "expert_rank"):  # global expert 2 (expert_rank: 3) of layer 1
            index = 2 if defect == "expert" else 3
            held = layers[1].mlp.local_expert_indices
            if index in held:
                layers[1].mlp.experts.local_experts[held.index(index)].linear_fc1.weight[CONFIG["ffn"]:].mul_(1 + 1e-3)


def _data_parallel(model, ids: torch.Tensor, seq: int, dp: int, defect: str | None) -> dict:
    """This data-parallel rank's share of the batch through Megatron's schedule and DDP."""
    from megatron.core import parallel_state

    from layerdiff.recipes import megatron_llama, megatron_parallel

    rank = parallel_state.get_data_parallel_rank()
    mine = ids.split(ids.shape[0] // dp)[rank]
    megatron_llama.reserve_attention_buffer(mine.shape[0] * CONFIG["heads"] * seq * seq)
    positions, mask = megatron_llama.positions_and_mask(mine.shape[0], seq)

    def forward_step(data, model):
        batch = next(data)
        return model(batch, positions, mask), lambda logits: megatron_parallel.causal_lm_loss(logits, batch)

    step = megatron_parallel.trainer(model, forward_step, lambda: iter([mine]), microbatches=1, seq=seq,
                                     micro=mine.shape[0], lr=0.0)
    return {"model": model, "step": step, "meta": {"recipe": "megatron_moe", "impl": "megatron", "defect": defect,
                                                   "dp": dp, "ep": parallel_state.get_expert_model_parallel_world_size()}}
