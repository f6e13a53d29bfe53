"""Recipe: transformers' Qwen2ForCausalLM (eager attention, fp32, built from a config: nothing is downloaded).

    layerdiff trace torch_qwen2 -o pt.h5
    layerdiff trace paddleformers_qwen2 -o pf.h5
    layerdiff align pt.h5 pf.h5

The reference for ``paddleformers_qwen2``: the same config, the same weights (``qwen2_shared.weights``) and input
ids. ``step`` computes HF's causal-LM loss from the logits (fp32 cross entropy of position t against token t+1,
mean over B*(S-1)), as ``paddleformers_qwen2`` must: PaddleFormers' own loss expects labels shifted beforehand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from layerdiff.recipes import llama_shared
    from layerdiff.recipes import qwen2_shared as shared
except ImportError:  # loaded as a file: layerdiff trace recipes/torch_qwen2.py:build
    import llama_shared
    import qwen2_shared as shared

DEFECTS = {name: llama_shared.DEFECTS[name] for name in ("eps", "act", "weight")}  # as in paddleformers_qwen2


def _inject(model, defect):
    layers = model.model.layers
    if defect == "eps":
        layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    elif defect == "act":
        layers[0].mlp.act_fn = torch.nn.GELU()
    elif defect == "weight":
        with torch.no_grad():
            layers[1].self_attn.k_proj.weight.mul_(1 + 1e-4)
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")


def build_model(*, layers: int = 2, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = shared.config(layers=layers)
    config = Qwen2Config(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["max_positions"],
                         rms_norm_eps=cfg["eps"], tie_word_embeddings=False, attention_dropout=0.0,
                         rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]})
    config._attn_implementation = "eager"
    model = Qwen2ForCausalLM(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in shared.weights(cfg, seed).items()}, strict=True)
    return model.float(), cfg


def build(defect: str | None = None, *, layers: int = 2, batch: int = 2, seq: int = 16, seed: int = 0,
          backward: bool = True):
    model, cfg = build_model(layers=layers, seed=seed)
    _inject(model, defect)
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, seed))

    def step():
        if backward:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=input_ids).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg["vocab"]), input_ids[:, 1:].reshape(-1))
            loss.backward()
        else:
            with torch.no_grad():
                loss = model(input_ids=input_ids).logits.float().mean()
        return loss

    return {"model": model, "step": step, "meta": {"recipe": "torch_qwen2", "defect": defect}}
