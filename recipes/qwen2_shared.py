"""What the two Qwen2 recipes share: the configuration, the weights and the input ids (numpy only).

Weights use the Hugging Face / PyTorch names and layouts (``nn.Linear.weight`` is [out, in]): those of
``llama_shared.weights`` plus Qwen2's q/k/v biases. ``paddleformers_qwen2`` transposes the Linear weights to
Paddle's [in, out]; ``torch_qwen2`` loads them as they are.
"""
from __future__ import annotations

import numpy as np

try:
    from layerdiff.recipes import llama_shared
except ImportError:  # loaded as a file: layerdiff trace recipes/torch_qwen2.py:build
    import llama_shared

DEFAULT_CONFIG = {"vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
                  "max_positions": 64, "eps": 1e-6, "rope_theta": 10000.0}


def config(**overrides) -> dict:
    cfg = dict(DEFAULT_CONFIG)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def weights(cfg: dict, seed: int = 0) -> dict:
    """name -> float32 array: llama_shared's weights, plus q/k/v biases ~ N(0, 0.02) (not HF's zeros, so that a port
    that forgets to load them is caught)."""
    out = llama_shared.weights(cfg, seed)
    rng = np.random.default_rng(seed + 2)  # seed + 1 makes the input ids
    kv = cfg["kv_heads"] * (cfg["hidden"] // cfg["heads"])
    for i in range(cfg["layers"]):
        for proj, size in (("q", cfg["hidden"]), ("k", kv), ("v", kv)):
            out[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = (rng.standard_normal(size) * 0.02).astype(np.float32)
    return out


input_ids = llama_shared.input_ids  # (cfg, batch, seq, seed) -> int64 [batch, seq]

