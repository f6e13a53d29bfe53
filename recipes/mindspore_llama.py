"""Recipe: the torch_llama decoder ported to MindSpore (PyNative), with the same weights, inputs and module paths.

    layerdiff trace mindspore_llama -o ms.h5
    layerdiff trace torch_llama -o ref.h5
    layerdiff align ref.h5 ms.h5

Cell paths follow Hugging Face's LlamaForCausalLM ("model.layers.0.self_attn.q_proj", ...), so a trace of this
recipe lines up with one of ``torch_llama`` module by module. Numerics follow HF Llama in fp32 (RMSNorm with rsqrt,
rotate_half RoPE, GQA, causal softmax attention, SwiGLU MLP, shifted mean cross-entropy). ``DEFECTS`` injects the
same bugs at the same paths as ``torch_llama.DEFECTS``.
"""
from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import nn, ops

try:
    from layerdiff.recipes import llama_shared as shared
except ImportError:  # loaded as a file: layerdiff trace recipes/mindspore_llama.py:build
    import llama_shared as shared

ms.set_context(mode=ms.PYNATIVE_MODE)

# defect -> (direction, module path where it originates); same names and paths as torch_llama.DEFECTS
DEFECTS = shared.DEFECTS  # defect -> (direction, module path where it originates)
CODE_DEFECTS = shared.CODE_DEFECTS  # defects in this file's code, each on the line marked ``# defect: NAME``

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


class LlamaRMSNorm(nn.Cell):
    defect = None  # own-code defects (``shared.CODE_DEFECTS``), planted by ``_inject``

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = ms.Parameter(ms.Tensor(np.ones(hidden, np.float32)), name="weight")
        self.variance_epsilon = eps

    def construct(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.astype(ms.float32)
        dims = (-2, -1) if self.defect == "norm" else -1
        variance = ops.mean(ops.pow(hidden_states, 2), dims, keep_dims=True)  # defect: norm
        hidden_states = hidden_states * ops.rsqrt(variance + self.variance_epsilon)
        hidden_states = hidden_states.astype(ms.float16 if self.defect == "dtype" else dtype)  # defect: dtype
        return self.weight * hidden_states.astype(dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LlamaRotaryEmbedding(nn.Cell):
    def __init__(self, head_dim, theta):
        super().__init__()
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        self.inv_freq = ms.Tensor((1.0 / (np.float32(theta) ** exponent)).astype(np.float32))
        self.attention_scaling = 1.0

    def construct(self, x, position_ids):
        # HF computes these under torch.no_grad(): constants for autograd
        inv = self.inv_freq.reshape(1, -1, 1)
        freqs = ops.matmul(inv, position_ids.astype(ms.float32).reshape(position_ids.shape[0], 1, -1))
        emb = ops.cat((freqs.swapaxes(1, 2), freqs.swapaxes(1, 2)), -1)
        cos = ops.stop_gradient(ops.cos(emb) * self.attention_scaling).astype(x.dtype)
        sin = ops.stop_gradient(ops.sin(emb) * self.attention_scaling).astype(x.dtype)
        return cos, sin


def _rotate_half(x, defect=None):
    half = x.shape[-1] // 2
    if defect == "helper":
        return ops.cat((x[..., half:], -x[..., :half]), -1)  # defect: helper
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def _repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return ops.broadcast_to(x.reshape(b, h, 1, s, d), (b, h, n_rep, s, d)).reshape(b, h * n_rep, s, d)


class LlamaAttention(nn.Cell):
    defect = None

    def __init__(self, cfg, layer_idx):
        super().__init__()
        hidden = cfg["hidden"]
        self.layer_idx = layer_idx
        self.head_dim = hidden // cfg["heads"]
        self.num_heads = cfg["heads"]
        self.num_key_value_heads = cfg["kv_heads"]
        self.num_key_value_groups = cfg["heads"] // cfg["kv_heads"]
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        self.q_proj = nn.Dense(hidden, cfg["heads"] * self.head_dim, has_bias=False)
        self.k_proj = nn.Dense(hidden, cfg["kv_heads"] * self.head_dim, has_bias=False)
        self.v_proj = nn.Dense(hidden, cfg["kv_heads"] * self.head_dim, has_bias=False)
        self.o_proj = nn.Dense(cfg["heads"] * self.head_dim, hidden, has_bias=False)

    def construct(self, hidden_states, position_embeddings, position_ids=None):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).reshape(b, s, -1, self.head_dim).swapaxes(1, 2)
        k = self.k_proj(hidden_states).reshape(b, s, -1, self.head_dim).swapaxes(1, 2)
        v = self.v_proj(hidden_states).reshape(b, s, -1, self.head_dim).swapaxes(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.expand_dims(1), sin.expand_dims(1)
        q = q * cos + _rotate_half(q, self.defect) * sin
        k = k * cos + _rotate_half(k, self.defect) * sin
        k = _repeat_kv(k, self.num_key_value_groups)
        v = _repeat_kv(v, self.num_key_value_groups)
        scaling = self.scaling * 1.01 if self.defect == "constant" else self.scaling
        scores = ops.matmul(q, k.swapaxes(2, 3)) * scaling  # defect: constant
        mask = ms.Tensor(np.triu(np.ones((s, s), dtype=np.bool_), 1))
        scores = ops.masked_fill(scores, mask, float("-inf"))
        probs = ops.softmax(scores.astype(ms.float32), -1).astype(q.dtype)
        out = ops.matmul(probs, v).swapaxes(1, 2).reshape(b, s, -1)
        return self.o_proj(out), None


class LlamaMLP(nn.Cell):
    defect = None

    def __init__(self, cfg):
        super().__init__()
        self.hidden_size = cfg["hidden"]
        self.intermediate_size = cfg["intermediate"]
        self.gate_proj = nn.Dense(cfg["hidden"], cfg["intermediate"], has_bias=False)
        self.up_proj = nn.Dense(cfg["hidden"], cfg["intermediate"], has_bias=False)
        self.down_proj = nn.Dense(cfg["intermediate"], cfg["hidden"], has_bias=False)
        self.act_fn = nn.SiLU()

    def construct(self, x):
        gate = self.act_fn(self.gate_proj(x))
        if self.defect == "function":
            gate = SCALE_INPUT_GRAD(gate)  # defect: function
        return self.down_proj(gate * self.up_proj(x))


class LlamaDecoderLayer(nn.Cell):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.hidden_size = cfg["hidden"]
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg["hidden"], cfg["eps"])
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden"], cfg["eps"])

    def construct(self, hidden_states, position_embeddings=None, position_ids=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                          position_ids=position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Cell):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.CellList([LlamaDecoderLayer(cfg, i) for i in range(cfg["layers"])])
        self.norm = LlamaRMSNorm(cfg["hidden"], cfg["eps"])
        self.rotary_emb = LlamaRotaryEmbedding(cfg["hidden"] // cfg["heads"], cfg["rope_theta"])

    def construct(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        position_ids = ms.Tensor(np.arange(input_ids.shape[1], dtype=np.int64)[None])
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, position_ids=position_ids)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Cell):
    def __init__(self, cfg):
        super().__init__()
        self.vocab_size = cfg["vocab"]
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Dense(cfg["hidden"], cfg["vocab"], has_bias=False)

    def construct(self, input_ids, labels=None):
        logits = self.lm_head(self.model(input_ids=input_ids))
        loss = None
        if labels is not None:  # HF ForCausalLMLoss: mean CE of logits[:, :-1] vs labels[:, 1:], in fp32
            shifted = logits[:, :-1].astype(ms.float32).reshape(-1, self.vocab_size)
            target = labels[:, 1:].reshape(-1, 1).astype(ms.int64)
            logp = ops.log_softmax(shifted, -1)
            loss = -ops.gather_elements(logp, 1, target).mean()
        return loss, logits


# -- defects ---------------------------------------------------------------------------------------------------
class ScaleInputGrad(nn.Cell):
    """Identity forward; backward scales the gradient by 1.01 (a custom bprop)."""

    def construct(self, x):
        return ops.identity(x)

    def bprop(self, x, out, dout):
        return (dout * 1.01,)


SCALE_INPUT_GRAD = ScaleInputGrad()  # not an attribute of any model cell: adds no module path


class _WrongInputGradDense(nn.Dense):
    """A Dense whose backward scales the gradient w.r.t. its input by 1.01: a backward-only bug."""

    def construct(self, x):
        return ops.matmul(SCALE_INPUT_GRAD(x), self.weight.swapaxes(0, 1))


def _inject(model, defect):
    layers = model.model.layers
    if defect in shared.CODE_DEFECTS:
        layer = layers[shared.CODE_DEFECT_LAYER]
        layer.input_layernorm.defect = layer.self_attn.defect = layer.mlp.defect = defect
    elif defect == "eps":
        layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    elif defect == "act":
        layers[0].mlp.act_fn = nn.GELU(approximate=False)
    elif defect == "weight":
        k = layers[1].self_attn.k_proj.weight
        k.set_data(k * (1 + 1e-4))
    elif defect == "owncode":
        layers[1].self_attn.scaling *= 1.25
    elif defect == "residual":
        layer = layers[1]
        construct = layer.construct
        object.__setattr__(layer, "construct", lambda *a, **k: construct(*a, **k) * (1 + 1e-3))
    elif defect == "backward":
        mlp = layers[0].mlp
        down = _WrongInputGradDense(mlp.down_proj.in_channels, mlp.down_proj.out_channels, has_bias=False)
        down.weight.set_data(mlp.down_proj.weight.value())
        mlp.down_proj = down
    elif defect == "fp16":
        up = layers[1].mlp.up_proj
        object.__setattr__(up, "construct", lambda x: ops.matmul(
            x.astype(ms.float16).astype(ms.float32), up.weight.swapaxes(0, 1)).astype(ms.float16).astype(ms.float32))
    elif defect == "nan":
        gate = layers[1].mlp.gate_proj

        def forward_with_nan(x):
            out = ops.matmul(x, gate.weight.swapaxes(0, 1))
            mask = np.zeros(out.shape, dtype=np.bool_)
            mask[0, 0, 0] = True
            return ops.masked_fill(out, ms.Tensor(mask), float("nan"))

        object.__setattr__(gate, "construct", forward_with_nan)
    elif defect == "crash":
        down = layers[1].mlp.down_proj
        object.__setattr__(down, "construct", lambda x: ops.matmul(x, down.weight))  # [.., 128] @ [64, 128]
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}; choose from "
                         f"{', '.join([*DEFECTS, *shared.CODE_DEFECTS, *shared.FAILURES])}")


def build_model(*, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, intermediate=None, seed=0,
                dtype="float32"):
    cfg = shared.config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                        intermediate=intermediate)
    model = LlamaForCausalLM(cfg)
    params = dict(model.parameters_and_names())
    target = _DTYPES[dtype]
    for name, value in shared.weights(cfg, seed).items():
        ms_name = "model.embed_tokens.embedding_table" if name == "model.embed_tokens.weight" else name
        params[ms_name].set_dtype(target)
        params[ms_name].set_data(ms.Tensor(value).astype(target))
    if len(params) != len(shared.weights(cfg, seed)):
        raise RuntimeError(f"parameter count mismatch: {sorted(params)}")
    model.set_train(True)
    return model, cfg


def build(defect=None, *, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, intermediate=None, batch=2,
          seq=16, seed=0, dtype="float32", backward=True):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if dtype == "bfloat16" and ms.get_context("device_target") == "CPU":
        raise ValueError("MindSpore's CPU kernels have no bfloat16 Gather (embedding lookup): use dtype='float16' "
                         "or a GPU/Ascend device")
    model, cfg = build_model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                             intermediate=intermediate, seed=seed, dtype=dtype)
    _inject(model, defect)
    input_ids = ms.Tensor(shared.input_ids(cfg, batch, seq, seed))
    weights = model.trainable_params()

    def loss_fn(ids, labels):
        return model(input_ids=ids, labels=labels)[0]

    grad_fn = ms.value_and_grad(loss_fn, None, weights)
    state = {}

    def step():
        if backward:
            loss, grads = grad_fn(input_ids, input_ids)
            state["grads"] = dict(zip([p.name for p in weights], grads))
        else:
            loss = model(input_ids=input_ids)[1].astype(ms.float32).mean()
        return loss

    return {"model": model, "step": step, "grads": state,
            "meta": {"recipe": "mindspore_llama", "defect": defect}}
