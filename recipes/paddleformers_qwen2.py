"""Recipe: PaddleFormers' own Qwen2ForCausalLM (paddleformers 1.0.0, Paddle dygraph, CPU, fp32, built from a config).

    layerdiff trace paddleformers_qwen2 -o pf.h5
    layerdiff trace torch_qwen2 -o pt.h5
    layerdiff align pt.h5 pf.h5

The model is ``paddleformers.transformers.Qwen2ForCausalLM`` itself, not a port: eager attention (PaddleFormers'
default ``_attn_implementation``), unfused q/k/v and gate/up projections (the config's defaults), so parameter
names are HF's. Weights are ``qwen2_shared.weights`` with Linear weights transposed to Paddle's [in, out]
(``lm_head`` is PaddleFormers' ``LMHead``, [vocab, hidden] like torch's). PaddleFormers' own loss (``criterion``)
does not shift labels (its data pipeline does) while HF's does, so both recipes' ``step`` compute the loss from the
logits the same way: HF's causal-LM loss, fp32 cross entropy of position t against token t+1, mean over B*(S-1).

paddleformers 1.1+ builds Qwen2ForCausalLM on ``paddlefleet``, which PyPI does not serve: the test extra installs
``paddleformers>=1.0,<1.1``.
"""
from __future__ import annotations

import huggingface_hub
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

if not hasattr(huggingface_hub, "repo_type_and_id_from_hf_id"):
    # gone in huggingface_hub 2.x; paddleformers 1.0.0 imports it at load time (only its push-to-hub code calls it)
    huggingface_hub.repo_type_and_id_from_hf_id = None

import paddleformers
from paddleformers.transformers import Qwen2Config, Qwen2ForCausalLM
from paddleformers.transformers.qwen2 import modeling as qwen2_modeling

try:
    from layerdiff.recipes import llama_shared
    from layerdiff.recipes import qwen2_shared as shared
except ImportError:  # loaded as a file: layerdiff trace recipes/paddleformers_qwen2.py:build
    import llama_shared
    import qwen2_shared as shared

DEFECTS = {name: llama_shared.DEFECTS[name] for name in ("eps", "act", "weight")}  # same origins as torch_qwen2
# own-code defects: a port that replaces one of PaddleFormers' helpers with its own (``helper``: this file's line is
# named), and a wrong constant that PaddleFormers' own attention code applies (``constant``: the attention's scaling
# set by the port; PaddleFormers' line is named)
CODE_DEFECTS = {"helper": "forward", "constant": "forward"}


def rotate_half_swapped(x):
    """A port's own ``rotate_half`` (PaddleFormers' ``qwen2.modeling.rotate_half``) with the halves' signs
    swapped: the ``helper`` defect."""
    half = x.shape[-1] // 2
    return paddle.cat([x[..., half:], -x[..., :half]], axis=-1)  # defect: helper


def _inject(model, defect):
    layers = model.model.layers
    if defect == "helper":  # for this process: PaddleFormers' attention calls the module's rotate_half
        qwen2_modeling.rotate_half = rotate_half_swapped
    elif defect == "constant":
        layers[1].self_attn.scaling *= 1.01
    elif defect == "eps":
        layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    elif defect == "act":
        layers[0].mlp.act_fn = nn.GELU()
    elif defect == "weight":
        k = layers[1].self_attn.k_proj
        with paddle.no_grad():
            k.weight.set_value(k.weight * (1 + 1e-4))
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join([*DEFECTS, *CODE_DEFECTS])}")


def build_model(*, layers: int = 2, seed: int = 0):
    cfg = shared.config(layers=layers)
    config = Qwen2Config(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["max_positions"],
                         rms_norm_eps=cfg["eps"], rope_theta=cfg["rope_theta"], tie_word_embeddings=False,
                         attention_dropout=0.0, _attn_implementation="eager")
    model = Qwen2ForCausalLM(config)
    state = {name: np.ascontiguousarray(w.T) if name.endswith("_proj.weight") else w  # [out, in] -> [in, out]
             for name, w in shared.weights(cfg, seed).items()}
    own = model.state_dict()
    if set(own) != set(state):
        raise RuntimeError(f"weights do not fit the model: missing {sorted(set(own) - set(state))}, "
                           f"unexpected {sorted(set(state) - set(own))}")
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    return model, cfg


def build(defect: str | None = None, *, layers: int = 2, batch: int = 2, seq: int = 16, seed: int = 0,
          backward: bool = True):
    model, cfg = build_model(layers=layers, seed=seed)
    _inject(model, defect)
    input_ids = paddle.to_tensor(shared.input_ids(cfg, batch, seq, seed))

    def step():
        if backward:
            model.clear_gradients(set_to_zero=False)
            logits = model(input_ids=input_ids, return_dict=True).logits.astype("float32")
            loss = F.cross_entropy(logits[:, :-1].reshape([-1, cfg["vocab"]]), input_ids[:, 1:].reshape([-1]))
            loss.backward()
        else:
            with paddle.no_grad():
                loss = model(input_ids=input_ids, return_dict=True).logits.astype("float32").mean()
        return loss

    return {"model": model, "step": step,
            "meta": {"recipe": "paddleformers_qwen2", "defect": defect, "paddleformers": paddleformers.__version__}}
