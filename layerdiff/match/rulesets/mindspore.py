"""MindSpore's own class names: ``nn.Dense`` is a linear layer (weight [out, in], as PyTorch's), ``CellList`` and
``SequentialCell`` are module lists."""

RULES = {
    "description": "MindSpore class names",
    "families": {"linear": ["^dense$"], "list": ["^(celllist|sequentialcell)$"]},
}
