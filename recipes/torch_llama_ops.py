"""Recipe: transformers' Llama whose layers run the model code written in this file, for tracing the operations
inside modules (``layerdiff trace ... --ops``).

    layerdiff trace torch_llama_ops -o ref.h5 --ops
    layerdiff trace torch_llama_ops --arg defect=helper -o bad.h5 --ops
    layerdiff align ref.h5 bad.h5          # names the operation and this file's line

The model is ``LlamaForCausalLM`` built from a config with the shared weights (``torch_llama.build_model``); its
decoder layers, attention, MLP and norms run the ``forward`` methods below, written as a port would write them
(HF's code, spelled out). ``defect`` plants one bug in that code, each marked ``# defect: NAME`` on the line that
holds it: what ``layerdiff align`` must name. ``attn`` picks eager or SDPA attention; ``variant`` makes a run that
differs from the plain one without a bug: ``casts`` inserts a cast and a ``contiguous``, ``swapped`` computes two
independent things in the other order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes.torch_llama import build_model
except ImportError:  # loaded as a file: layerdiff trace recipes/torch_llama_ops.py:build
    import llama_shared as shared
    from torch_llama import build_model

# defect -> the direction where it shows first (a NaN: where it is born)
DEFECTS = {"constant": "forward", "dtype": "forward", "helper": "forward", "norm": "forward",
           "residual": "forward", "function": "backward", "nan": "forward", "nan_backward": "backward"}
VARIANTS = ("plain", "casts", "swapped")


class HandRMSNorm(LlamaRMSNorm):
    """RMSNorm written by hand (HF's arithmetic)."""

    defect: str | None = None

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.bfloat16 if self.defect == "dtype" else torch.float32)  # defect: dtype
        dims = (-2, -1) if self.defect == "norm" else -1
        variance = hidden_states.pow(2).mean(dims, keepdim=True)  # defect: norm
        eps = -1.0 if self.defect == "nan" else self.variance_epsilon
        hidden_states = hidden_states * torch.rsqrt(variance + eps)  # defect: nan
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x, defect=None):
    """Rotates half the hidden dims of the input (a helper function, not a module)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    if defect == "helper":
        return torch.cat((x2, -x1), dim=-1)  # defect: helper
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, k, cos, sin, defect=None, swapped=False):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if swapped:  # the same two results, k's first
        k_embed = (k * cos) + (rotate_half(k, defect) * sin)
        q_embed = (q * cos) + (rotate_half(q, defect) * sin)
        return q_embed, k_embed
    q_embed = (q * cos) + (rotate_half(q, defect) * sin)
    k_embed = (k * cos) + (rotate_half(k, defect) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep: int):
    batch, heads, length, dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, heads, n_rep, length, dim)
    return hidden_states.reshape(batch, heads * n_rep, length, dim)


class OpsAttention(LlamaAttention):
    """Llama attention, eager or SDPA (``attn``), the rotary embedding applied by the helpers above."""

    defect: str | None = None
    variant: str = "plain"
    attn: str = "eager"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, key, cos, sin, self.defect, swapped=self.variant == "swapped")
        key = repeat_kv(key, self.num_key_value_groups)
        value = repeat_kv(value, self.num_key_value_groups)
        scaling = self.scaling
        if self.attn == "sdpa":
            mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
            causal = mask is None and query.shape[2] > 1
            output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling * 1.01 if self.defect == "constant" else scaling)  # defect: constant (sdpa)
            output = output.transpose(1, 2)
        else:
            weights = torch.matmul(query, key.transpose(2, 3)) * (scaling * 1.01 if self.defect == "constant" else scaling)  # defect: constant (eager)
            if attention_mask is not None:
                weights = weights + attention_mask[:, :, :, : key.shape[-2]]
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
            output = torch.matmul(weights, value).transpose(1, 2)
        if self.variant == "casts":
            output = output.contiguous().to(torch.float32)
        output = output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(output), None


class SiLUFunction(torch.autograd.Function):
    """SiLU with its backward written by hand; ``grad_scale`` other than 1 is a wrong backward."""

    @staticmethod
    def forward(ctx, x, grad_scale):
        ctx.save_for_backward(x)
        ctx.grad_scale = grad_scale
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s)) * ctx.grad_scale, None


class OpsMLP(LlamaMLP):
    defect: str | None = None

    def forward(self, x):
        gate = self.gate_proj(x)
        if self.defect == "nan_backward":
            gate = (gate * (gate > 0)).pow(0.5)  # defect: nan_backward
        act = SiLUFunction.apply(gate, 1.01 if self.defect == "function" else 1.0)  # defect: function
        return self.down_proj(act * self.up_proj(x))


class OpsDecoderLayer(LlamaDecoderLayer):
    defect: str | None = None

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.defect == "residual":
            residual = hidden_states  # the normalized input taken for the residual
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states  # defect: residual
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


def install(model, *, defect: str | None = None, defect_layer: int = 1, attn: str = "eager",
            variant: str = "plain"):
    """The model's layers run this file's code (each module's class becomes the subclass above; weights stay)."""
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    for i, layer in enumerate(model.model.layers):
        planted = defect if i == defect_layer else None
        layer.__class__ = OpsDecoderLayer
        layer.defect = planted
        layer.self_attn.__class__ = OpsAttention
        layer.self_attn.defect, layer.self_attn.attn, layer.self_attn.variant = planted, attn, variant
        layer.mlp.__class__ = OpsMLP
        layer.mlp.defect = planted
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.__class__ = HandRMSNorm
            norm.defect = planted if norm is layer.input_layernorm else None
    model.model.norm.__class__ = HandRMSNorm
    return model


def build(defect: str | None = None, *, attn: str = "eager", variant: str = "plain", layers: int = 2,
          hidden: int = 64, batch: int = 2, seq: int = 16, seed: int = 0, defect_layer: int = 1):
    model, cfg = build_model(layers=layers, hidden=hidden, seed=seed, attn=attn)
    install(model, defect=defect, defect_layer=defect_layer, attn=attn, variant=variant)
    input_ids = torch.from_numpy(shared.input_ids(cfg, batch, seq, seed))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss

    return {"model": model, "step": step, "meta": {"recipe": "torch_llama_ops", "defect": defect, "attn": attn,
                                                   "variant": variant}}
