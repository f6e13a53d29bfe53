"""Recipe: the small Llama-style decoder of ``torch_llama``, written in Paddle dygraph (a port, as a user makes one).

    layerdiff trace paddle_llama -o pd.h5
    layerdiff trace torch_llama -o pt.h5
    layerdiff align pt.h5 pd.h5

Module paths, weights (``llama_shared.weights``, Linear weights transposed to Paddle's [in, out]), inputs and
fp32 numerics follow transformers' LlamaForCausalLM, so a trace of this recipe aligns with one of
``torch_llama``. ``DEFECTS`` has the same names and origins as ``torch_llama.DEFECTS``.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

try:
    from layerdiff.recipes import llama_shared as shared
except ImportError:  # loaded as a file: layerdiff trace recipes/paddle_llama.py:build
    import llama_shared as shared

DEFECTS = shared.DEFECTS  # defect -> (direction, module path where it originates)
CODE_DEFECTS = shared.CODE_DEFECTS  # defects in this file's code, each on the line marked ``# defect: NAME``


class LlamaRMSNorm(nn.Layer):
    defect: str | None = None  # own-code defects (``shared.CODE_DEFECTS``), planted by ``_inject``

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.astype("float32")
        dims = [-2, -1] if self.defect == "norm" else -1
        variance = hidden_states.pow(2).mean(dims, keepdim=True)  # defect: norm
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        hidden_states = hidden_states.astype("bfloat16" if self.defect == "dtype" else input_dtype)  # defect: dtype
        return self.weight * hidden_states.astype(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LlamaRotaryEmbedding(nn.Layer):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.attention_scaling = 1.0

    @paddle.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids.unsqueeze(-1).astype("float32") * self.inv_freq
        emb = paddle.concat([freqs, freqs], axis=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


def rotate_half(x, defect=None):
    half = x.shape[-1] // 2
    if defect == "helper":
        return paddle.concat([x[..., half:], -x[..., :half]], axis=-1)  # defect: helper
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, defect=None):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q, defect) * sin, k * cos + rotate_half(k, defect) * sin


class LlamaAttention(nn.Layer):
    defect: str | None = None

    def __init__(self, cfg: dict, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg["hidden"] // cfg["heads"]
        self.num_heads, self.num_key_value_heads = cfg["heads"], cfg["kv_heads"]
        self.num_key_value_groups = cfg["heads"] // cfg["kv_heads"]
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        hidden, kv = cfg["hidden"], cfg["kv_heads"] * self.head_dim
        self.q_proj = nn.Linear(hidden, cfg["heads"] * self.head_dim, bias_attr=False)
        self.k_proj = nn.Linear(hidden, kv, bias_attr=False)
        self.v_proj = nn.Linear(hidden, kv, bias_attr=False)
        self.o_proj = nn.Linear(cfg["heads"] * self.head_dim, hidden, bias_attr=False)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None):
        bsz, seq = hidden_states.shape[0], hidden_states.shape[1]
        shape = [bsz, seq, -1, self.head_dim]
        q = self.q_proj(hidden_states).reshape(shape).transpose([0, 2, 1, 3])
        k = self.k_proj(hidden_states).reshape(shape).transpose([0, 2, 1, 3])
        v = self.v_proj(hidden_states).reshape(shape).transpose([0, 2, 1, 3])
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin, self.defect)
        if self.num_key_value_groups > 1:  # GQA: each kv head serves num_key_value_groups query heads
            k = paddle.repeat_interleave(k, self.num_key_value_groups, axis=1)
            v = paddle.repeat_interleave(v, self.num_key_value_groups, axis=1)
        scaling = self.scaling * 1.01 if self.defect == "constant" else self.scaling
        scores = paddle.matmul(q, k, transpose_y=True) * scaling  # defect: constant
        mask = paddle.triu(paddle.full([seq, seq], float("-inf"), dtype=scores.dtype), diagonal=1)
        probs = F.softmax(scores + mask, axis=-1)
        out = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([bsz, seq, -1])
        return self.o_proj(out), None


class _ScaleGrad(paddle.autograd.PyLayer):
    """Identity forward; its backward scales the gradient (``scale`` other than 1 is a wrong backward)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale


class LlamaMLP(nn.Layer):
    defect: str | None = None

    def __init__(self, cfg: dict):
        super().__init__()
        self.gate_proj = nn.Linear(cfg["hidden"], cfg["intermediate"], bias_attr=False)
        self.up_proj = nn.Linear(cfg["hidden"], cfg["intermediate"], bias_attr=False)
        self.down_proj = nn.Linear(cfg["intermediate"], cfg["hidden"], bias_attr=False)
        self.act_fn = nn.Silu()

    def forward(self, x):
        gate = self.act_fn(self.gate_proj(x))
        if self.defect == "function":
            gate = _ScaleGrad.apply(gate, 1.01)  # defect: function
        return self.down_proj(gate * self.up_proj(x))


class LlamaDecoderLayer(nn.Layer):
    def __init__(self, cfg: dict, layer_idx: int):
        super().__init__()
        self.hidden_size = cfg["hidden"]
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg["hidden"], eps=cfg["eps"])
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden"], eps=cfg["eps"])

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Layer):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.LayerList([LlamaDecoderLayer(cfg, i) for i in range(cfg["layers"])])
        self.norm = LlamaRMSNorm(cfg["hidden"], eps=cfg["eps"])
        self.rotary_emb = LlamaRotaryEmbedding(cfg["hidden"] // cfg["heads"], cfg["rope_theta"])

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        position_ids = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings,
                                  position_ids=position_ids)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Layer):
    def __init__(self, cfg: dict):
        super().__init__()
        self.model = LlamaModel(cfg)
        self.vocab_size = cfg["vocab"]
        self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias_attr=False)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.model(input_ids=input_ids))
        if labels is None:
            return None, logits
        # transformers' ForCausalLMLoss: fp32 logits, next-token targets, mean over the B*(S-1) positions
        shift_logits = logits.astype("float32")[:, :-1, :].reshape([-1, self.vocab_size])
        shift_labels = labels[:, 1:].reshape([-1])
        return F.cross_entropy(shift_logits, shift_labels, reduction="mean"), logits


class _WrongInputGrad(paddle.autograd.PyLayer):
    """A linear layer whose backward scales the gradient w.r.t. its input by 1.01: a backward-only bug."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return paddle.matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensor()
        grad_w = paddle.matmul(x.reshape([-1, x.shape[-1]]), grad.reshape([-1, grad.shape[-1]]), transpose_x=True)
        return paddle.matmul(grad, weight, transpose_y=True) * 1.01, grad_w


def _inject(model, defect):
    layers = model.model.layers
    if defect in shared.CODE_DEFECTS:
        layer = layers[shared.CODE_DEFECT_LAYER]
        layer.input_layernorm.defect = layer.self_attn.defect = layer.mlp.defect = defect
    elif defect == "eps":
        layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    elif defect == "act":
        layers[0].mlp.act_fn = nn.GELU()
    elif defect == "weight":
        k = layers[1].self_attn.k_proj
        with paddle.no_grad():
            k.weight.set_value(k.weight * (1 + 1e-4))
    elif defect == "owncode":
        layers[1].self_attn.scaling *= 1.25
    elif defect == "residual":
        forward = layers[1].forward
        layers[1].forward = lambda *a, **k: forward(*a, **k) * (1 + 1e-3)
    elif defect == "backward":
        down = layers[0].mlp.down_proj
        down.forward = lambda x: _WrongInputGrad.apply(x, down.weight)
    elif defect == "fp16":
        up = layers[1].mlp.up_proj
        up.forward = lambda x: paddle.matmul(x.astype("float16").astype("float32"), up.weight) \
            .astype("float16").astype("float32")
    elif defect == "nan":
        gate = layers[1].mlp.gate_proj

        def forward_with_nan(x):
            out = paddle.matmul(x, gate.weight)
            out[0, 0, 0] = float("nan")
            return out

        gate.forward = forward_with_nan
    elif defect == "crash":
        down = layers[1].mlp.down_proj
        down.forward = lambda x: paddle.matmul(x, down.weight, transpose_y=True)  # [.., 128] @ [64, 128]
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}; choose from "
                         f"{', '.join([*DEFECTS, *shared.CODE_DEFECTS, *shared.FAILURES])}")


def _is_linear_weight(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def build_model(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256,
                intermediate: int | None = None, seed: int = 0, dtype: str = "float32"):
    cfg = shared.config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                        intermediate=intermediate)
    model = LlamaForCausalLM(cfg)
    state = {name: np.ascontiguousarray(w.T) if _is_linear_weight(name) else w
             for name, w in shared.weights(cfg, seed).items()}
    own = model.state_dict()
    missing = set(own) - set(state) - {n for n in own if n.endswith("inv_freq")}
    if missing or set(state) - set(own):
        raise RuntimeError(f"weights do not fit the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(set(state) - set(own))}")
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    if dtype != "float32":
        model.to(dtype=dtype)
    return model, cfg


def build(defect: str | None = None, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int = 256, intermediate: int | None = None, batch: int = 2, seq: int = 16, seed: int = 0,
          dtype: str = "float32", backward: bool = True):
    model, cfg = build_model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                             intermediate=intermediate, seed=seed, dtype=dtype)
    _inject(model, defect)
    input_ids = paddle.to_tensor(shared.input_ids(cfg, batch, seq, seed))

    def step():
        if backward:
            model.clear_gradients(set_to_zero=False)
            loss, _ = model(input_ids=input_ids, labels=input_ids)
            loss.backward()
        else:
            with paddle.no_grad():
                _, logits = model(input_ids=input_ids)
                loss = logits.astype("float32").mean()
        return loss

    return {"model": model, "step": step, "meta": {"recipe": "paddle_llama", "defect": defect}}
