"""Megatron-core (GPTModel with the local or Transformer Engine layer spec), as Megatron-Bridge converts it.

``linear_qkv`` holds, for each query group, the group's query heads then its key head then its value head;
``linear_fc1`` of a gated MLP holds [gate; up]. Activations are sequence-first ([s, b, h]); attention masks are
boolean with True = masked.
"""

RULES = {
    "description": "Megatron-core names, fused QKV and gated-MLP layouts, [s, b, h] activations",
    "names": {
        "o": ["linear_proj"],
        "qkv": ["linear_qkv"],
        "gate_up": ["linear_fc1"],
        "down": ["linear_fc2"],
        "mlp_norm": ["pre_mlp_layernorm"],
        "q_norm": ["q_layernorm"],  # qk_layernorm (Qwen3's q_norm and k_norm)
        "k_norm": ["k_layernorm"],
        "final_norm": ["final_layernorm"],
        "embed": ["word_embeddings"],
        "pos_embed": ["position_embeddings"],
        "lm_head": ["output_layer"],
        "attn": ["self_attention"],
        "rotary": ["rotary_pos_emb"],
    },
    "families": {
        "linear": ["^(column|row)parallellinear$", "^te(column|row)?parallellinear$", "^telinear$"],
        "embedding": ["^vocabparallelembedding$"],
        "layer": ["^transformerlayer$"],
        "stack": ["^transformerblock$"],
        "core_attention": ["^(te)?dotproductattention$"],
    },
    "fused": [
        {"name": "qkv", "module": "^linear_qkv$", "parts": ["q", "k", "v"],
         "groups": ["num_query_groups_per_partition", "num_query_groups", "num_key_value_heads",
                    "min_part/hidden_size_per_attention_head", "min_part/head_dim", "min_part/kv_channels"]},
        # under tensor parallelism each rank holds [its gate rows; its up rows]
        {"name": "gate_up", "module": "^linear_fc1$", "parts": ["gate", "up"], "tp_shards": "every_part"},
    ],
    "masks": [{"keys": ["attention_mask"], "model_class": "^megatron\\.", "bool_masked": True}],
    "sequence_first": ["^megatron\\."],
    # with linear biases (``add_bias_linear``) its linears, attention and MLP return (output, bias): the bias is
    # added by the caller (with dropout and the residual), and what the module computes is output + bias
    "bias_beside_output": ["^megatron\\."],
    # Transformer Engine fuses each norm into the linear after it; Megatron's own checkpoints name the local
    # spec's norms this way too (its sharded_state_dict_keys_map)
    "moved_params": {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                     "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
                     # the shared expert's sigmoid gate ([1, hidden]): a parameter of SharedExpertMLP, where
                     # transformers' Qwen2-MoE keeps a linear of its own beside the shared expert
                     "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"},
}
