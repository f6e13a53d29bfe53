"""Operation kinds, framework-neutral (``ops`` tracing): which kinds are the same operation, which one side may
add or leave out (casts, views, copies), which fused operation stands for a sequence on the other side, and the
argument names frameworks spell differently. PyTorch, PaddlePaddle and MindSpore share this table: Paddle's
``concat``, ``multiply``, ``astype`` and MindSpore's ``BatchMatMul``, ``ReduceMean`` are the kinds below."""

RULES = {
    "description": "operations inside modules: equivalent kinds, pass-through kinds, fused operations",
    "ops": {
        "same": {
            "div": ["true_divide", "divide", "truediv"],
            "mul": ["multiply"],
            "sub": ["subtract"],
            "matmul": ["bmm", "mm", "einsum", "batchmatmul", "batch_matmul"],
            "mean": ["reducemean", "reduce_mean"],
            "sum": ["reducesum", "reduce_sum"],
            "amax": ["reducemax"],
            "amin": ["reducemin"],
            "unsqueeze": ["expand_dims"],
            "clamp": ["clip"],
            "getitem": ["stridedslice", "strided_slice", "slice"],
            "cat": ["concat", "concatenate"],
            "neg": ["negative"],
            "transpose": ["swapaxes", "swapdims"],
            "reshape": ["view", "view_as", "reshape_as"],
            "to": ["float", "half", "bfloat16", "double", "type", "type_as", "cast", "astype"],
            "softmax": ["_softmax"],
            "scaled_dot_product_attention": ["sdpa", "flash_attention"],
        },
        "arguments": {"axis": "dim", "keep_dims": "keepdim", "keepdims": "keepdim", "perm": "dims"},
        "pass_through": ["to", "contiguous", "clone", "detach", "reshape", "expand", "expand_as", "flatten",
                         "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "t", "T", "mT", "data",
                         "dropout", "alias"],
        "fused": [
            {"op": "scaled_dot_product_attention", "ends": ["matmul"], "longest": 16},
            {"op": "rms_norm", "ends": ["mul"], "longest": 10},
            {"op": "layer_norm", "ends": ["add", "mul"], "longest": 10},
            {"op": "silu", "ends": ["mul"], "longest": 3, "holds": ["sigmoid"]},
            {"op": "gelu", "ends": ["mul"], "longest": 10, "holds": ["erf", "tanh", "sigmoid"]},
            {"op": "cross_entropy", "ends": ["nll_loss"], "longest": 4},
            {"op": "linear", "ends": ["add", "matmul"], "longest": 3},
            # GQA's repeated key/value heads: Paddle's repeat_interleave against HF's expand + reshape
            {"op": "repeat_interleave", "ends": ["reshape"], "longest": 3},
            {"op": "swiglu", "ends": ["mul"], "longest": 4},
            # Megatron's attention scores: baddbmm(..., alpha=scale) against a matmul and its scaling
            {"op": "baddbmm", "ends": ["mul", "div", "matmul"], "longest": 4},
        ],
    },
}
