"""PaddlePaddle's own layouts and class names: ``nn.Linear`` keeps its weight as [in, out] (PyTorch: [out, in]), and
its module list is ``LayerList``. Acts on traces, checkpoints and models whose framework is "paddle"."""

RULES = {
    "description": "PaddlePaddle layouts ([in, out] Linear weights) and class names",
    "families": {"list": ["^layerlist$"]},
    "transposed": [{"framework": "paddle", "family": "linear", "params": ["weight"]}],
}
