"""MindSpore Transformers (mindformers) legacy Llama names: wq/wk/wv/wo, w1 (gate), w3 (up), w2 (down),
attention_norm / ffn_norm; fused ``w_qkv`` and ``w_gate_hidden`` when qkv_concat / ffn concat are on."""

RULES = {
    "description": "MindSpore Transformers module names and fused layouts",
    "names": {
        "q": ["wq"],
        "k": ["wk"],
        "v": ["wv"],
        "o": ["wo"],
        "qkv": ["w_qkv"],
        "gate": ["w1"],
        "up": ["w3"],
        "down": ["w2"],
        "gate_up": ["w_gate_hidden"],
        "attn_norm": ["attention_norm"],
        "mlp_norm": ["ffn_norm"],
        "final_norm": ["norm_out"],
        "embed": ["tok_embeddings"],
        "attn": ["attention"],
        "mlp": ["feed_forward"],
        "rotary": ["freqs_mgr"],
    },
    "families": {
        "embedding": ["^llamaembedding$"],
        "layer": ["^llamadecodelayer$"],
        "rotary": ["^freqsmgr$"],
        "mask": ["mask"],
    },
    "fused": [
        # rows per KV head: [that group's query heads; k; v]
        {"name": "qkv", "module": "^w_qkv$", "parts": ["q", "k", "v"],
         "groups": ["n_kv_heads", "num_key_value_heads", "min_part/head_dim"]},
        # rows interleaved: gate_i, up_i, gate_i+1, ... (one group per intermediate feature)
        {"name": "gate_up", "module": "^w_gate_hidden$", "parts": ["gate", "up"], "groups": ["hidden_dim"]},
    ],
    # with input_sliced_sig the data pipeline hands the model labels already shifted by one (last one -100)
    "shifted_labels": ["mindformers"],
}
