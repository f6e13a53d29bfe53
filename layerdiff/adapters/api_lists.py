"""The public APIs whose calls are operations (``ops`` tracing), one list per framework without a public hook for
every call: data, read by the framework's adapter (``capture/apis.py`` wraps them while a trace is open).

Names missing from the installed version are skipped. Comparisons that Python uses for its own bookkeeping
(``__eq__``, ``__hash__``, ``__bool__``) and calls that read facts (``shape``, ``numpy``) are no operations.
``*_KINDS`` name the kind where the framework's word means another operation (Paddle's ``transpose`` takes a
permutation: it is torch's ``permute``)."""
from __future__ import annotations

_MATH = """abs acos add add_n addmm amax amin any arange argmax argmin argsort asin atan atan2 baddbmm bmm
broadcast_to cast cat ceil chunk clip clamp clone concat cos cosh cross cumprod cumsum diag diagonal diff div divide
dot einsum erf exp expand expand_as flatten flip floor floor_divide fmax fmin full full_like gather gather_nd
greater_equal greater_than index_select isfinite isinf isnan kron lerp less_equal less_than linspace log log10
log1p log2 logical_and logical_not logical_or logsumexp masked_fill masked_select matmul max maximum mean median
min minimum mm mod mul multiply nan_to_num neg norm not_equal ones ones_like outer permute pow prod reciprocal
remainder repeat_interleave reshape roll round rsqrt scale scatter sign sin sinh slice sort split sqrt square
squeeze stack std strided_slice sub subtract sum swapaxes t take_along_axis tan tanh tensordot tile topk
transpose tril triu trunc unbind unsqueeze unstack var where zeros zeros_like""".split()

_OPERATORS = """__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
__rtruediv__ __itruediv__ __div__ __rdiv__ __floordiv__ __mod__ __pow__ __rpow__ __matmul__ __rmatmul__ __neg__
__abs__ __invert__ __and__ __or__ __lt__ __le__ __gt__ __ge__ __getitem__ __setitem__""".split()

_TENSOR_METHODS = """abs add add_ astype cast clip clamp clone concat contiguous cos cumsum detach div divide exp
exp_ expand expand_as flatten flip float gather half isnan log masked_fill matmul max mean min mul mul_ multiply
norm permute pow reshape repeat_interleave rsqrt scale scale_ sigmoid sin softmax split sqrt square squeeze
sub subtract sum swapaxes t tanh tile to transpose tril triu type_as unsqueeze unbind chunk var view view_as
argmax topk bfloat16""".split()

PADDLE = {
    "paddle": _MATH,
    "paddle.nn.functional": """cross_entropy dropout elu embedding gelu glu hardswish hardsigmoid layer_norm
        leaky_relu log_softmax mse_loss normalize one_hot pad relu relu6 rms_norm scaled_dot_product_attention
        sigmoid silu softmax softplus swiglu tanh""".split(),
    "paddle.incubate.nn.functional": "fused_rms_norm fused_rotary_position_embedding swiglu".split(),
    "paddle.Tensor": _OPERATORS + _TENSOR_METHODS,
}
PADDLE_KINDS = {"paddle.transpose": "permute", "paddle.Tensor.transpose": "permute",
                "paddle.nn.functional.swiglu": "swiglu", "paddle.incubate.nn.functional.fused_rms_norm": "rms_norm"}

MINDSPORE = {
    "mindspore.ops": _MATH + """expand_dims gather_d gelu log_softmax silu softmax sigmoid relu dropout
        cross_entropy layer_norm rms_norm select""".split(),
    "mindspore.mint": _MATH,
    "mindspore.mint.nn.functional": "softmax silu gelu dropout cross_entropy layer_norm relu sigmoid".split(),
    "mindspore.Tensor": _OPERATORS + _TENSOR_METHODS,
}
MINDSPORE_KINDS = {"mindspore.ops.transpose": "permute",
                   "mindspore.ops.expand_dims": "unsqueeze", "mindspore.ops.cast": "to", "mindspore.Tensor.astype": "to"}

# MindSpore Primitives called directly (``P.BatchMatMul()(x, y)``): the kind by the Primitive's class; others are
# the class name in lower case
PRIMITIVE_KINDS = {"BatchMatMul": "matmul", "MatMul": "matmul", "ReduceMean": "mean", "ReduceSum": "sum",
                   "ReduceMax": "amax", "ReduceMin": "amin", "Transpose": "permute", "Cast": "to",
                   "ExpandDims": "unsqueeze", "RealDiv": "div", "Div": "div", "Concat": "cat", "StridedSlice": "getitem",
                   "Sub": "sub", "Add": "add", "Mul": "mul", "Pow": "pow", "Rsqrt": "rsqrt", "Softmax": "softmax",
                   "Reshape": "reshape", "Neg": "neg", "Square": "square", "Sqrt": "sqrt", "Exp": "exp",
                   "SiLU": "silu", "Tile": "tile", "Gather": "gather", "Sigmoid": "sigmoid"}
