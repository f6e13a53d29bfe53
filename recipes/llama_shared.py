"""What the three Llama recipes share: the configuration, the weights and the input ids (numpy only).

Weights use the Hugging Face / PyTorch names and layouts (``nn.Linear.weight`` is [out, in]); a recipe in
another framework converts them the way a real port would (Paddle ``nn.Linear.weight`` is [in, out]).
Because every framework starts from these same numbers, ``layerdiff align`` on any pair of recipe traces
compares like with like.
"""
from __future__ import annotations

import numpy as np

# defect -> (direction, module path where it originates); each recipe injects them the same way
DEFECTS = {
    "eps": ("forward", "model.layers.1.post_attention_layernorm"),   # RMSNorm eps 1e-6 -> 1e-5
    "act": ("forward", "model.layers.0.mlp.act_fn"),                 # SiLU swapped for GELU
    "weight": ("forward", "model.layers.1.self_attn.k_proj"),        # weight scaled by (1 + 1e-4)
    "owncode": ("forward", "model.layers.1.self_attn"),              # attention scaling x1.25 (own code)
    "residual": ("forward", "model.layers.1"),                       # decoder layer output x(1 + 1e-3)
    "backward": ("backward", "model.layers.0.mlp.down_proj"),        # wrong grad w.r.t. input (x1.01)
    "fp16": ("forward", "model.layers.1.mlp.up_proj"),               # fp16 round-trip inside one Linear
    "nan": ("forward", "model.layers.1.mlp.gate_proj"),              # NaN in one output element
}

# own-code defects -> the direction where they show first: each planted in a recipe's model code (not a module's
# parameters or class), on the line marked ``# defect: NAME``, in the decoder layer ``CODE_DEFECT_LAYER``; what
# ``layerdiff align`` with operations recorded (``--ops``) names, down to that line
CODE_DEFECTS = {"constant": "forward", "helper": "forward", "norm": "forward", "dtype": "forward",
                "function": "backward"}
CODE_DEFECT_LAYER = 1

# failure -> module that raises: a port whose down_proj multiplies by the untransposed weight (a shape error
# from the framework itself, mid-forward, after layer 0 and half of layer 1 ran)
FAILURES = {"crash": ("forward", "model.layers.1.mlp.down_proj")}

DEFAULT_CONFIG = {"vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
                  "eps": 1e-6, "rope_theta": 10000.0}


def config(**overrides) -> dict:
    cfg = dict(DEFAULT_CONFIG)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    if cfg["intermediate"] is None:
        cfg["intermediate"] = 2 * cfg["hidden"]
    return cfg


def weights(cfg: dict, seed: int = 0) -> dict:
    """name -> float32 array, HF LlamaForCausalLM names, torch layouts. Linear/Embedding ~ N(0, 0.02) like HF's
    init; norm weights 1 + N(0, 0.1) so that a port that forgets to load them is caught."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = cfg["hidden"], cfg["intermediate"], cfg["hidden"] // cfg["heads"]
    kv = cfg["kv_heads"] * head_dim

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    out = {"model.embed_tokens.weight": normal(cfg["vocab"], hidden)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(hidden, hidden)
        out[p + "self_attn.k_proj.weight"] = normal(kv, hidden)
        out[p + "self_attn.v_proj.weight"] = normal(kv, hidden)
        out[p + "self_attn.o_proj.weight"] = normal(hidden, hidden)
        out[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        out[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        out[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        out[p + "input_layernorm.weight"] = 1 + normal(hidden, std=0.1)
        out[p + "post_attention_layernorm.weight"] = 1 + normal(hidden, std=0.1)
    out["model.norm.weight"] = 1 + normal(hidden, std=0.1)
    out["lm_head.weight"] = normal(cfg["vocab"], hidden)
    return out


def input_ids(cfg: dict, batch: int = 2, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 1).integers(0, cfg["vocab"], size=(batch, seq), dtype=np.int64)
