"""Recipe: MindSpore Transformers (mindformers 2.0.0) legacy Llama, the real one or a faithful port (PyNative, fp32).

    layerdiff trace mindformers_llama -o mf.h5 [--arg impl=port|real] [--arg defect=eps] [--arg qkv_concat=True]
    layerdiff trace torch_llama -o ref.h5 && layerdiff align ref.h5 mf.h5

``impl="real"`` builds ``mindformers.models.llama.LlamaForCausalLM`` (CI cannot install it: mindformers 2.0.0 needs
``hyper-parallel``, which is not served); ``impl="port"`` builds the cells below, which a tracer cannot tell from it
(paths, class names, parameter names and layouts, call structure, shapes, the main hparams; the same primitives, so
logits and gradients are bit-identical); ``"auto"``: real if importable. Unlike HF: ``Linear`` computes on [b*s, in],
so ``w1.activation`` (the SiLU, a child of w1) sees [b*s, inter]; q/k enter ``apply_rotary_emb`` as [b, heads, s, hd];
``casual_mask`` [sic] is a cell, additive [b, 1, s, s] (-10000 above the diagonal and on pad-token keys);
``freqs_mgr`` returns (cos, sin [1, 1, s, hd], swap_mask [hd, hd]); the ``loss`` cell gets [b*s, vocab] logits,
returns shape [1], and its two children have custom bprops (traced in backward only). ``input_sliced_sig=True``: the
data pipeline shifts the labels (last one -100), activations span ``seq`` tokens like HF's; False, mindformers'
default: the model drops the last token (seq-1 positions everywhere). ``qkv_concat=True`` fuses ``w_qkv`` (rows
grouped per KV head: [its q heads; k; v]) and ``w_gate_hidden`` (rows interleaved: gate_0, up_0, gate_1, ...; the
SiLU is then ``feed_forward.activate``).
"""
from __future__ import annotations

import math
import os
import tempfile

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops import operations as P

try:
    from layerdiff.recipes import llama_shared as shared
    from layerdiff.recipes.mindspore_llama import SCALE_INPUT_GRAD  # the backward-only defect: identity forward, gradient x1.01
except ImportError:  # loaded as a file: layerdiff trace recipes/mindformers_llama.py:build
    import llama_shared as shared
    from mindspore_llama import SCALE_INPUT_GRAD

# defect -> (direction, origin in the HF reference's module names), as in torch_llama.DEFECTS
DEFECTS = {name: shared.DEFECTS[name] for name in ("eps", "act", "weight", "owncode", "backward")}
DEFECTS["rotary"] = ("forward", "model.rotary_emb")  # rope theta 10000 -> 20000 (a wrong config value)
# the same origins in mindformers' names (with qkv_concat: attention.w_qkv and feed_forward.activate)
ORIGINS = {"eps": "model.layers.1.ffn_norm", "act": "model.layers.0.feed_forward.w1.activation",
           "weight": "model.layers.1.attention.wk", "owncode": "model.layers.1.attention",
           "rotary": "model.freqs_mgr", "backward": "model.layers.0.feed_forward.w2"}
F32 = ms.float32
_MATMUL_T, _BMM, _BMM_T = P.MatMul(transpose_b=True), P.BatchMatMul(), P.BatchMatMul(transpose_b=True)
_UNUSED = ("batch_valid_length", "block_tables", "slot_mapping", "prefix_keys_values", "q_seq_lens", "kv_mask",
           "seq_chunk", "actual_seq_len")  # keywords LlamaModel passes (all None) to each decode layer


class _Cell(nn.Cell):
    def __init__(self, auto_prefix=True, **flags):  # flags: the real cell's scalar attributes (traced as hparams)
        super().__init__(auto_prefix)
        for key, value in flags.items():
            setattr(self, key, value)


def _param(shape, fill=0.0, name="weight"):
    return Parameter(Tensor(np.full(shape, fill, np.float32)), name=name)


class Linear(_Cell):  # mindformers.modules.layers.Linear: weight [out, in], a 2-D matmul inside
    def __init__(self, in_channels, out_channels, activation=None):
        super().__init__(in_channels=in_channels, out_channels=out_channels, has_bias=False, transpose_b=True,
                         expert_num=1, activation_flag=activation is not None)
        self.weight = _param((out_channels, in_channels))
        self.activation = activation() if activation else None

    def construct(self, x, group_list=None):
        out_shape = x.shape[:-1] + (self.out_channels,)
        x = _MATMUL_T(x.reshape(-1, self.in_channels), self.weight)
        return (self.activation(x) if self.activation_flag else x).reshape(out_shape)


class LlamaSiLU(_Cell):
    def __init__(self):
        super().__init__(self_define=False)
        self.silu = P._inner_ops.SiLU()  # pylint: disable=protected-access

    def construct(self, x):
        return self.silu(x)


class LlamaEmbedding(_Cell):
    def __init__(self, vocab_table_size, embedding_size):
        super().__init__(vocab_table_size=vocab_table_size, embedding_size=embedding_size)
        self.embedding_weight = _param((vocab_table_size, embedding_size), name="embedding_weight")

    def construct(self, input_ids):
        return ops.gather(self.embedding_weight, input_ids, 0)


class LlamaRMSNorm(_Cell):  # the self-defined path (fused_rms_norm=False)
    def __init__(self, dim, eps=1e-6):
        super().__init__(eps=eps, self_define=True)
        self.weight = _param((dim,), 1.0)

    def construct(self, x):
        return x * P.Rsqrt()(P.ReduceMean(keep_dims=True)(P.Square()(x), -1) + self.eps) * self.weight


class FreqsMgr(_Cell):  # cos/sin of [freqs, freqs] per position (numpy fp32), sliced to the sequence
    def __init__(self, head_dim, seq_length, theta=10000.0):
        super().__init__(head_dim=head_dim, is_dynamic=False, seq_pipe=False)
        freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2)[: head_dim // 2].astype(np.float32) / head_dim))
        emb = np.outer(np.arange(0, seq_length, 1).astype(np.float32), freqs)
        emb = np.concatenate((emb, emb), axis=-1)
        zero, eye = np.zeros((head_dim // 2, head_dim // 2), np.float32), np.identity(head_dim // 2, np.float32)
        self.freqs_cos, self.freqs_sin = Tensor(np.cos(emb), F32), Tensor(np.sin(emb), F32)
        self.swap_mask = Tensor(np.block([[zero, eye], [-eye, zero]]), F32)  # unused with use_rope_slice

    def construct(self, seq_length=None, seq_chunk=None):
        cos, sin = (t[:seq_length].reshape(-1, 1, seq_length, self.head_dim) for t in (self.freqs_cos, self.freqs_sin))
        return cos, sin, self.swap_mask


class LowerTriangularMaskWithDynamic(_Cell):
    def __init__(self, seq_length, pad_token_id=0):
        super().__init__(seq_length=seq_length, pad_token_id=pad_token_id, use_flash_attention=False, is_dynamic=False)
        self.lower_triangle_mask = Tensor(np.tril(np.ones((seq_length, seq_length), np.int8)), F32)

    def construct(self, tokens=None, masks=None, seq_chunk=None):
        bs, seq_len = tokens.shape
        keep = ops.not_equal(tokens, self.pad_token_id).astype(F32).reshape(bs, 1, seq_len)
        keep = keep * self.lower_triangle_mask.expand_dims(0)
        return (Tensor([1.0], F32) - keep).expand_dims(1) * Tensor([-10000.0], F32)


class RotaryEmbedding(_Cell):  # use_rope_slice=True: rotate_half by slicing, not by the swap_mask matmul
    def __init__(self, head_dim):
        super().__init__(False, head_dim=head_dim, half_head_dim=head_dim // 2, use_rope_slice=True)

    def construct(self, xq, xk, freqs_cis):
        cos, sin, _ = freqs_cis
        half = self.half_head_dim
        return tuple(x * cos + P.Concat(-1)((-x[..., half:], x[..., :half])) * sin for x in (xq, xk))


class LLamaAttention(_Cell):
    def __init__(self, seq_length, dim, n_heads, n_kv_heads, qkv_concat=False):
        hd = dim // n_heads
        super().__init__(seq_length=seq_length, hidden_size=dim, n_head=n_heads, head_dim=hd, n_kv_head=n_kv_heads,
                         n_rep=n_heads // n_kv_heads, kv_dim=n_kv_heads * hd, qkv_concat=qkv_concat, use_past=False,
                         use_flash_attention=False)
        if qkv_concat:
            self.w_qkv = Linear(dim, dim + 2 * self.kv_dim)
            self.split_qkv = ops.auto_generate.SplitWithSize()
        else:
            self.wq, self.wk, self.wv = Linear(dim, dim), Linear(dim, self.kv_dim), Linear(dim, self.kv_dim)
        self.wo = Linear(dim, dim)
        self.inv_norm_factor = Tensor(1.0 / math.sqrt(hd), F32)
        self.apply_rotary_emb = RotaryEmbedding(hd)

    def construct(self, x, freqs_cis, mask=None, batch_valid_length=None, block_tables=None, slot_mapping=None,
                  prefix_keys_values=None, q_seq_lens=None, kv_mask=None, seq_chunk=None, actual_seq_len=None):
        bs, seq_len, _ = x.shape
        if self.qkv_concat:  # [b, s, kv groups, (n_rep + 2) * hd] -> the q, k, v of each group
            qkv = self.w_qkv(x).reshape(bs, seq_len, self.n_kv_head, (self.n_rep + 2) * self.head_dim)
            qkv = self.split_qkv(qkv, (self.head_dim * self.n_rep, self.head_dim, self.head_dim), 3)
            # 3-D first, as mindformers does: in MindSpore 2.10 PyNative a Transpose applied straight to a
            # SplitWithSize output (a strided view) gets a wrong gradient
            query, key, value = (t.reshape(bs, seq_len, -1) for t in qkv)
        else:
            query, key, value = self.wq(x), self.wk(x), self.wv(x)  # [b, s, heads * hd]
        query, key, value = (t.reshape(bs, seq_len, -1, self.head_dim).transpose(0, 2, 1, 3)
                             for t in (query, key, value))  # [b, heads, s, hd]
        query, key = self.apply_rotary_emb(query, key, freqs_cis)
        key, value = self._repeat_kv(key), self._repeat_kv(value)
        score = mask + _BMM_T(query, key) * self.inv_norm_factor
        context = _BMM(P.Softmax()(score), value).transpose(0, 2, 1, 3)  # [b, s, heads, hd]
        return self.wo(context.reshape(bs, seq_len, self.hidden_size))

    def _repeat_kv(self, x):  # KV head i serves query heads i*n_rep .. (i+1)*n_rep-1, like HF's repeat_kv
        bs, n_kv_head, seq_len, head_dim = x.shape
        x = P.Tile()(x.reshape(bs, n_kv_head, 1, seq_len * head_dim), (1, 1, self.n_rep, 1))
        return x.reshape(bs, n_kv_head * self.n_rep, seq_len, head_dim)


class LlamaFeedForward(_Cell):
    def __init__(self, dim, intermediate_size, ffn_concat=False):
        super().__init__(dim=dim, hidden_dim=intermediate_size, expert_num=1, ffn_concat=ffn_concat)
        if ffn_concat:
            self.w_gate_hidden, self.activate = Linear(dim, 2 * intermediate_size), LlamaSiLU()
            self.split = ops.auto_generate.SplitWithSize()
            self.w2 = Linear(intermediate_size, dim)
        else:  # the activation lives inside w1 (Linear.activation): w1 returns silu(x @ w1^T)
            self.w1 = Linear(dim, intermediate_size, activation=LlamaSiLU)
            self.w2, self.w3 = Linear(intermediate_size, dim), Linear(dim, intermediate_size)

    def construct(self, x):
        if self.ffn_concat:  # rows interleaved: [b, s, inter, 2] -> gate [..., 0], up [..., 1]
            bs, seq_len, _ = x.shape
            gate, hidden = self.split(self.w_gate_hidden(x).reshape(bs, seq_len, self.hidden_dim, 2), (1, 1), 3)
            gate, hidden = self.activate(gate.reshape(bs, seq_len, -1)), hidden.reshape(bs, seq_len, -1)
        else:
            gate, hidden = self.w1(x), self.w3(x)
        return self.w2(hidden * gate)


class LLamaDecodeLayer(_Cell):
    def __init__(self, cfg, seq_length, layer_id, qkv_concat=False):
        super().__init__(layer_id=layer_id, hidden_size=cfg["hidden"], n_head=cfg["heads"], n_kv_head=cfg["kv_heads"],
                         head_dim=cfg["hidden"] // cfg["heads"], use_past=False)
        self.ffn_norm = LlamaRMSNorm(cfg["hidden"], cfg["eps"])
        self.attention_norm = LlamaRMSNorm(cfg["hidden"], cfg["eps"])
        self.attention = LLamaAttention(seq_length, cfg["hidden"], cfg["heads"], cfg["kv_heads"], qkv_concat)
        self.feed_forward = LlamaFeedForward(cfg["hidden"], cfg["intermediate"], qkv_concat)

    def construct(self, x, freqs_cis, mask=None, batch_valid_length=None, block_tables=None, slot_mapping=None,
                  prefix_keys_values=None, q_seq_lens=None, kv_mask=None, seq_chunk=None, actual_seq_len=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, batch_valid_length, block_tables,
                               slot_mapping, prefix_keys_values, q_seq_lens, actual_seq_len=actual_seq_len)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(_Cell):
    def __init__(self, cfg, seq_length, qkv_concat=False, pad_token_id=0):
        super().__init__(hidden_size=cfg["hidden"], num_layers=cfg["layers"], n_head=cfg["heads"],
                         head_dim=cfg["hidden"] // cfg["heads"], pad_token_id=pad_token_id, use_past=False)
        self.freqs_mgr = FreqsMgr(self.head_dim, seq_length, cfg["rope_theta"])
        self.casual_mask = LowerTriangularMaskWithDynamic(seq_length, pad_token_id)
        self.tok_embeddings = LlamaEmbedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.CellList([LLamaDecodeLayer(cfg, seq_length, i, qkv_concat) for i in range(cfg["layers"])])
        self.norm_out = LlamaRMSNorm(cfg["hidden"], cfg["eps"])

    def construct(self, tokens, input_embeds=None, batch_valid_length=None, batch_index=None, zactivate_len=None,
                  block_tables=None, slot_mapping=None, prefix_keys_values=None, attention_mask=None,
                  position_ids=None, q_seq_lens=None, seq_range=None, actual_seq_len=None):
        mask = self.casual_mask(tokens)  # mask, rotary tables, embedding: mindformers' order
        freqs_cis = self.freqs_mgr(tokens.shape[1], seq_chunk=None)
        h = self.tok_embeddings(tokens)
        for i in range(self.num_layers):
            h = self.layers[i](h, freqs_cis, mask, **dict.fromkeys(_UNUSED))
        return self.norm_out(h)


class _LogSoftmax(nn.Cell):
    def construct(self, logits, label):
        logit_sub = logits - P.ReduceMax(keep_dims=True)(logits, 1)
        log_softmax = logit_sub - P.Log()(P.ReduceSum(keep_dims=True)(P.Exp()(logit_sub), -1))
        return log_softmax, P.OneHot()(label, logits.shape[-1], Tensor(1.0, F32), Tensor(0.0, F32))

    def bprop(self, logits, label, _, dout):  # passes _NLLLoss's gradient (softmax - onehot) through
        return dout[0], ops.zeros_like(label)


class _NLLLoss(nn.Cell):
    def construct(self, log_softmax_result, one_hot_label):
        return P.ReduceSum()(-(log_softmax_result * one_hot_label), -1)

    def bprop(self, log_softmax_result, one_hot_label, _, dout):
        return (P.Exp()(log_softmax_result) - one_hot_label) * dout.expand_dims(-1), ops.zeros_like(one_hot_label)


class CrossEntropyLoss(_Cell):  # sum(token loss * input_mask) / (sum(input_mask) + 1e-8): shape [1]
    def __init__(self):
        super().__init__(calculate_per_token_loss=False, seq_pipe=False)
        self._log_softmax, self._nllloss = _LogSoftmax(), _NLLLoss()

    def construct(self, logits, label, input_mask):
        loss_reduce = self._nllloss(*self._log_softmax(logits, label))
        input_mask = ops.depend(input_mask.reshape(-1), loss_reduce)
        return P.ReduceSum()(loss_reduce * input_mask) / (P.ReduceSum()(input_mask) + Tensor([1e-8], F32))


class LlamaForCausalLM(_Cell):
    """Training: returns the loss; eval (set_train(False)): (logits [b, s, vocab], tokens, input_mask)."""

    def __init__(self, cfg, seq_length, qkv_concat=False, input_sliced_sig=True, pad_token_id=0):
        super().__init__(vocab_size=cfg["vocab"], ignore_token_id=-100, pad_token_id=pad_token_id, use_past=False,
                         input_sliced_sig=input_sliced_sig)
        self.model = LlamaModel(cfg, seq_length, qkv_concat, pad_token_id)
        self.lm_head = Linear(cfg["hidden"], cfg["vocab"])
        self.loss = CrossEntropyLoss()

    def construct(self, input_ids, labels=None):
        shift = self.training and not (self.input_sliced_sig and labels is not None)  # the model shifts itself
        tokens = input_ids[:, :-1] if shift else input_ids
        logits = self.lm_head(self.model(tokens, *([None] * 12)))
        input_mask = ops.not_equal(tokens, self.pad_token_id).astype(F32)
        if labels is not None:
            labels = labels[:, 1:] if shift else labels
            input_mask = input_mask * ops.not_equal(labels, self.ignore_token_id).astype(F32)
        if not self.training:
            return logits, tokens, input_mask
        labels = input_ids[:, 1:] if labels is None else labels
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), input_mask.reshape(-1))


_HF_TO_MF = [("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"), ("model.norm.", "model.norm_out."),
             (".self_attn.q_proj.", ".attention.wq."), (".self_attn.k_proj.", ".attention.wk."),
             (".self_attn.v_proj.", ".attention.wv."), (".self_attn.o_proj.", ".attention.wo."),
             (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.down_proj.", ".feed_forward.w2."),
             (".mlp.up_proj.", ".feed_forward.w3."), (".input_layernorm.", ".attention_norm."),
             (".post_attention_layernorm.", ".ffn_norm.")]


def hf_to_mindformers(state: dict, cfg: dict, qkv_concat: bool = False) -> dict:
    """HF names/layouts -> mindformers' (Linear weights stay [out, in]); fused like its qkv/ffn_concat_hf2mg."""
    out = {}
    for name, value in state.items():
        for old, new in _HF_TO_MF:
            name = name.replace(old, new)
        out[name] = value
    for i in range(cfg["layers"] if qkv_concat else 0):
        p, hidden = f"model.layers.{i}.", cfg["hidden"]
        q, k, v = (out.pop(f"{p}attention.{n}.weight").reshape(cfg["kv_heads"], -1, hidden) for n in ("wq", "wk", "wv"))
        out[p + "attention.w_qkv.weight"] = np.concatenate([q, k, v], 1).reshape(-1, hidden)
        gate, up = out.pop(p + "feed_forward.w1.weight"), out.pop(p + "feed_forward.w3.weight")
        out[p + "feed_forward.w_gate_hidden.weight"] = np.stack([gate, up], 1).reshape(-1, hidden)
    return out


def _real_model(cfg, seq_length, qkv_concat, input_sliced_sig, pad_token_id):
    os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(tempfile.gettempdir(), "mindformers_output"))  # its logs
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM as RealLlama
    return RealLlama(LlamaConfig(
        seq_length=seq_length, hidden_size=cfg["hidden"], num_layers=cfg["layers"], num_heads=cfg["heads"],
        n_kv_heads=cfg["kv_heads"], vocab_size=cfg["vocab"], intermediate_size=cfg["intermediate"],
        rms_norm_eps=cfg["eps"], theta=cfg["rope_theta"], compute_dtype="float32", layernorm_compute_type="float32",
        softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32", use_rope_slice=True,
        fused_rms_norm=False, use_flash_attention=False, qkv_concat=qkv_concat, input_sliced_sig=input_sliced_sig,
        pad_token_id=pad_token_id))




def _inject(model, defect):
    """Works on the port and on the real model alike (same attribute names); "rotary" is applied to the config."""
    layers = model.model.layers
    if defect == "eps":
        layers[1].ffn_norm.eps = 1e-5
    elif defect == "act":
        ffn = layers[0].feed_forward
        if ffn.ffn_concat:
            ffn.activate = nn.GELU(approximate=False)
        else:
            ffn.w1.activation = nn.GELU(approximate=False)
    elif defect == "weight":  # k's rows only: in w_qkv, rows n_rep*hd .. (n_rep+1)*hd of each KV group
        attn = layers[1].attention
        if attn.qkv_concat:
            w = attn.w_qkv.weight.asnumpy().reshape(attn.n_kv_head, -1, attn.hidden_size)
            w[:, attn.n_rep * attn.head_dim:(attn.n_rep + 1) * attn.head_dim] *= np.float32(1 + 1e-4)
            attn.w_qkv.weight.set_data(Tensor(w.reshape(-1, attn.hidden_size)))
        else:
            attn.wk.weight.set_data(attn.wk.weight * (1 + 1e-4))
    elif defect == "owncode":  # the score scaling: a tensor attribute used by the attention's own code
        layers[1].attention.inv_norm_factor = layers[1].attention.inv_norm_factor * 1.25
    elif defect == "backward":  # forward unchanged; the gradient w.r.t. w2's input x1.01
        w2 = layers[0].feed_forward.w2
        construct = w2.construct
        object.__setattr__(w2, "construct", lambda x, group_list=None: construct(SCALE_INPUT_GRAD(x), group_list))
    elif defect not in (None, "rotary"):
        raise ValueError(f"unknown defect {defect!r}; choose from {', '.join(DEFECTS)}")


def mindformers_available() -> bool:
    try:
        import mindformers  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    except ImportError:
        return False
    return True


def build(defect=None, *, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, intermediate=None, batch=2, seq=16,
          seed=0, impl="auto", qkv_concat=False, input_sliced_sig=True, pad_token_id=0, backward=True):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    impl = ("real" if mindformers_available() else "port") if impl == "auto" else impl
    cfg = shared.config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                        intermediate=intermediate)
    if defect == "rotary":
        cfg["rope_theta"] = 20000.0
    seq_length = seq if input_sliced_sig or not backward else seq - 1  # tokens the model sees (mask, rope tables)
    model = {"real": _real_model, "port": LlamaForCausalLM}[impl](cfg, seq_length, qkv_concat, input_sliced_sig,
                                                                    pad_token_id)
    params = dict(model.parameters_and_names())
    state = hf_to_mindformers(shared.weights(cfg, seed), cfg, qkv_concat)
    if set(params) != set(state):
        raise RuntimeError(f"parameter names differ: {sorted(set(params) ^ set(state))}")
    for name, value in state.items():
        params[name].set_data(Tensor(value))
    _inject(model, defect)
    model.set_train(backward)
    ids = shared.input_ids(cfg, batch, seq, seed)
    input_ids = Tensor(ids)
    # input_sliced_sig: labels shifted by the data pipeline, last position ignored (= HF's loss with labels=input_ids)
    labels = Tensor(np.concatenate([ids[:, 1:], np.full((batch, 1), -100)], 1) if input_sliced_sig else ids)
    weights = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda x, y: model(x, y), None, weights)
    grads = {}

    def step():
        if not backward:
            return model(input_ids)[0].mean()
        loss, values = grad_fn(input_ids, labels)
        grads.update(zip([p.name for p in weights], values))
        return loss

    return {"model": model, "step": step, "grads": grads,
            "meta": {"recipe": "mindformers_llama", "impl": impl, "defect": defect, "qkv_concat": qkv_concat,
                     "input_sliced_sig": input_sliced_sig}}


def logits(impl="port", batch=2, seq=16, **kwargs) -> np.ndarray:
    """The model's logits on the shared input ids, [batch, seq, vocab] (parity checks against HF)."""
    built = build(None, impl=impl, batch=batch, seq=seq, backward=False, **kwargs)
    ids = Tensor(shared.input_ids(shared.config(**{k: v for k, v in kwargs.items() if k in shared.DEFAULT_CONFIG}),
                                  batch, seq, kwargs.get("seed", 0)))
    return built["model"](ids)[0].asnumpy().reshape(batch, seq, -1)
