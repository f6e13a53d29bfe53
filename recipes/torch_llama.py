"""Recipe: a small Llama-style decoder (transformers, built from a config: nothing is downloaded).

    layerdiff trace torch_llama -o ref.h5
    layerdiff trace torch_llama -o bad.h5 --arg defect=eps
    layerdiff align ref.h5 bad.h5

``build`` follows the ``layerdiff trace`` TARGET contract: keyword arguments in, ``{"model", "step"}`` out.
The ``defect`` argument injects one known bug, so the recipe doubles as test material; ``DEFECTS`` says
where each one lives (the module ``layerdiff align`` must name).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

try:
    from layerdiff.recipes import llama_shared as shared
except ImportError:  # loaded as a file: layerdiff trace recipes/torch_llama.py:build
    import llama_shared as shared

DEFECTS = shared.DEFECTS  # defect -> (direction, module path where it originates)


class _WrongInputGrad(torch.autograd.Function):
    """A linear layer whose backward scales the gradient w.r.t. its input by 1.01: a backward-only bug."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return (grad @ weight) * 1.01, grad_w, None


def _rmsnorm_by_division(self, hidden_states):
    """An honest reimplementation of LlamaRMSNorm with a different op order (division instead of rsqrt)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states / torch.sqrt(variance + self.variance_epsilon))


def inject(model, defect: str, layer: int | None = None):
    """``layer`` moves a defect to another decoder layer (the binary-search tests use 8 layers)."""
    layers = _LayerPicker(model.model.layers, layer)
    if defect == "eps":
        layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    elif defect == "act":
        layers[0].mlp.act_fn = torch.nn.GELU()
    elif defect == "weight":
        with torch.no_grad():
            layers[1].self_attn.k_proj.weight.mul_(1 + 1e-4)
    elif defect == "owncode":
        layers[1].self_attn.scaling *= 1.25
    elif defect == "residual":
        forward = layers[1].forward
        layers[1].forward = lambda *a, **k: forward(*a, **k) * (1 + 1e-3)
    elif defect == "backward":
        down = layers[0].mlp.down_proj
        down.forward = lambda x: _WrongInputGrad.apply(x, down.weight, down.bias)
    elif defect == "fp16":
        up = layers[1].mlp.up_proj
        up.forward = lambda x: F.linear(x.half().float(), up.weight).half().float()
    elif defect == "nan":
        gate = layers[1].mlp.gate_proj

        def forward_with_nan(x):
            out = F.linear(x, gate.weight)
            out[0, 0, 0] = float("nan")
            return out

        gate.forward = forward_with_nan
    elif defect == "reimpl":  # not a bug: eager attention and a division-based RMSNorm
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = types.MethodType(_rmsnorm_by_division, module)
    elif defect == "crash":
        down = layers[1].mlp.down_proj
        down.forward = lambda x: x @ down.weight  # [.., 128] @ [64, 128]: torch raises
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join([*DEFECTS, *shared.FAILURES])} or reimpl")


class _LayerPicker:
    """``layers[i]`` of the model, or always layer ``at`` when one is chosen."""

    def __init__(self, layers, at):
        self.layers, self.at = layers, at

    def __getitem__(self, i):
        return self.layers[i if self.at is None else self.at]

    def __setitem__(self, i, value):
        self.layers[i if self.at is None else self.at] = value


def build_model(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256,
                intermediate: int | None = None, seed: int = 0, attn: str = "sdpa", dtype: str = "float32"):
    """transformers' LlamaForCausalLM from a config, with the weights every recipe shares."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = shared.config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                        intermediate=intermediate)
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=4096,
                         rms_norm_eps=cfg["eps"], rope_theta=cfg["rope_theta"], tie_word_embeddings=False)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config)
    state = {k: torch.from_numpy(v) for k, v in shared.weights(cfg, seed).items()}
    model.load_state_dict(state, strict=True)
    return model.to(getattr(torch, dtype)), cfg


def build(defect: str | None = None, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int = 256, intermediate: int | None = None, batch: int = 2, seq: int = 16, seed: int = 0,
          dtype: str = "float32", backward: bool = True, defect_layer: int | None = None, defect_step: int = 1,
          lr: float = 0.0, attn: str | None = None):
    """``defect_step=K`` injects the defect just before step K (counted from 1): steps before it are clean.
    ``lr`` > 0 makes each step a training step (plain SGD), so steps differ from each other. ``attn``:
    transformers' attention implementation, "sdpa" (the default) or "eager" (its operations spelled out)."""
    attn = attn or ("eager" if defect == "reimpl" else "sdpa")
    model, cfg = build_model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                             intermediate=intermediate, seed=seed, attn=attn, dtype=dtype)
    if defect_step <= 1:
        inject(model, defect, defect_layer)
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if lr > 0 else None
    steps_taken = [0]

    def step():
        steps_taken[0] += 1
        if defect_step > 1 and steps_taken[0] == defect_step:
            inject(model, defect, defect_layer)
        loss = train_step()
        if optimizer is not None:
            optimizer.step()
        return loss

    def train_step():
        if backward:
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
        else:
            with torch.no_grad():
                loss = model(input_ids=input_ids).logits.float().mean()
        return loss

    return {"model": model, "step": step, "meta": {"recipe": "torch_llama", "defect": defect}}
