"""PaddlePaddle's own layouts and class names: ``nn.Linear`` keeps its weight as [in, out] (PyTorch: [out, in]), and
its module list is ``LayerList``; PaddleFormers' MoE router (``nn.moe.TopKGate``, ERNIE 4.5's) keeps its weight as
[hidden, experts] where transformers' router keeps [experts, hidden]. Acts on traces, checkpoints and models whose
framework is "paddle"."""

RULES = {
    "description": "PaddlePaddle layouts ([in, out] Linear weights) and class names",
    "families": {"list": ["^layerlist$"], "topk_gate": ["^topkgate$"]},
    "transposed": [{"framework": "paddle", "family": "linear", "params": ["weight"]},
                   {"framework": "paddle", "family": "topk_gate", "params": ["weight"]}],
}
