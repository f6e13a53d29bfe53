"""Operation kinds, framework-neutral (``ops`` tracing): which kinds are the same operation, which one side may
add or leave out (casts, views, copies), and which fused operation stands for a sequence on the other side."""

RULES = {
    "description": "operations inside modules: equivalent kinds, pass-through kinds, fused operations",
    "ops": {
        "same": {
            "div": ["true_divide", "divide", "truediv"],
            "mul": ["multiply"],
            "sub": ["subtract"],
            "matmul": ["bmm", "mm", "einsum"],
            "cat": ["concat", "concatenate"],
            "neg": ["negative"],
            "transpose": ["swapaxes", "swapdims"],
            "reshape": ["view", "view_as", "reshape_as"],
            "to": ["float", "half", "bfloat16", "double", "type", "type_as", "cast", "astype"],
            "softmax": ["_softmax"],
            "scaled_dot_product_attention": ["sdpa", "flash_attention"],
        },
        "pass_through": ["to", "contiguous", "clone", "detach", "reshape", "expand", "expand_as", "flatten",
                         "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "t", "T", "mT", "data",
                         "dropout", "alias"],
        "fused": [
            {"op": "scaled_dot_product_attention", "ends": ["matmul"], "longest": 16},
            {"op": "rms_norm", "ends": ["mul"], "longest": 10},
            {"op": "layer_norm", "ends": ["add", "mul"], "longest": 10},
            {"op": "silu", "ends": ["mul"], "longest": 3},
            {"op": "gelu", "ends": ["mul"], "longest": 10},
            {"op": "cross_entropy", "ends": ["nll_loss"], "longest": 4},
            {"op": "linear", "ends": ["add", "matmul"], "longest": 3},
        ],
    },
}
