"""Hugging Face / PyTorch naming: the canonical tokens other ecosystems' names are mapped onto."""

RULES = {
    "description": "Hugging Face transformers module names",
    "names": {
        "q": ["q_proj", "query", "q_lin", "query_proj"],
        "k": ["k_proj", "key", "k_lin", "key_proj"],
        "v": ["v_proj", "value", "v_lin", "value_proj"],
        "o": ["o_proj", "out_proj", "out_lin", "attn.c_proj", "self_attn.c_proj", "attention.dense"],
        "qkv": ["qkv_proj", "query_key_value", "wqkv", "c_attn"],
        "gate": ["gate_proj"],
        "up": ["up_proj", "c_fc", "dense_h_to_4h", "fc1", "fc_in"],  # an MLP that is not gated: its first linear
        "down": ["down_proj", "mlp.c_proj", "dense_4h_to_h", "fc2", "fc_out"],
        "gate_up": ["gate_up_proj"],
        "q_norm": ["q_norm"],  # Qwen3, OLMo 2, Gemma 3: a norm over each query head (and key head) before rotary
        "k_norm": ["k_norm"],
        "attn_norm": ["input_layernorm", "ln_1", "self_attn_layer_norm"],
        "mlp_norm": ["post_attention_layernorm", "ln_2"],
        "final_norm": ["norm", "ln_f", "final_norm", "final_layer_norm"],
        "embed": ["embed_tokens", "wte", "embed_in"],
        "pos_embed": ["wpe", "embed_positions"],  # learned absolute positions (GPT-2, OPT)
        "lm_head": ["lm_head", "embed_out"],
        "attn": ["self_attn", "attn"],
        "mlp": ["mlp"],
        "rotary": ["rotary_emb"],
        "act": ["act_fn", "act", "activation", "activation_func", "act_func", "activate", "activation_fn"],
    },
    "families": {"linear": ["^Conv1D$"]},  # transformers' Conv1D (GPT-2): a linear, not torch's Conv1d
    "fused": [
        # Phi-3, GPT-2 and friends: [q; k; v] and [gate; up] back to back
        {"name": "qkv", "module": "^(qkv_proj|wqkv|c_attn)$", "parts": ["q", "k", "v"]},
        {"name": "gate_up", "module": "^gate_up_proj$", "parts": ["gate", "up"]},
        # GPT-NeoX: per head [q_h; k_h; v_h]
        {"name": "qkv", "module": "^query_key_value$", "parts": ["q", "k", "v"],
         "groups": ["num_attention_heads", "num_heads"]},
    ],
    "rotary": [
        {"name": "rotary", "angles": ["rotary_pos_emb", "rotary:out"],
         "cos": ["position_embeddings.0", "freqs_cis.0", "rotary:out.0"],
         "sin": ["position_embeddings.1", "freqs_cis.1", "rotary:out.1"]},
    ],
    "masks": [{"keys": ["attention_mask", "mask", "attn_mask"], "bool_masked": False}],
    # transformers' Conv1D (GPT-2's linears) stores its weight [in, out]; torch's own Conv1d is another class
    "transposed": [{"framework": "torch", "type": "Conv1D", "params": ["weight"]}],
}
