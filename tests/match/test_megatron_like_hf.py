"""transformers' models into Megatron-core GPTModels configured as the same architecture
(``recipes/megatron_like_hf.py``), with ``transfer_weights`` and no map, and back: Qwen3's query-key norms
(``q_norm``/``k_norm``, Megatron's ``q_layernorm``/``k_layernorm``) and Mixtral's router (transformers names it
``gate``; a checkpoint names no types, so it is known by its place beside the experts). Each pair computes the same
logits and the weights come back bit for bit. One subprocess (Megatron's process group is its own).

Found by ``tools/sweep_megatron.py``: both failed to transfer before.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_scripts

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.torch]

pytest.importorskip("megatron.core")

SCRIPT = """
import json, sys
import numpy as np, torch
from transformers import AutoConfig, AutoModelForCausalLM
from layerdiff.checkpoints.transfer import neutral_state, transfer_weights
from layerdiff.recipes import megatron_like_hf

SIZES = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=64, max_position_embeddings=64)
out = {}
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
for model_type, options in (("qwen3", {"qk_layernorm": True}), ("mixtral", {"num_local_experts": 4})):
    megatron_options = {k: v for k, v in options.items() if k != "num_local_experts"}
    config = AutoConfig.for_model(model_type, **SIZES, **{k: v for k, v in options.items() if k not in megatron_options})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    mg = megatron_like_hf.build(config, ids.shape, **megatron_options)
    moved = transfer_weights(hf, mg)
    back = AutoModelForCausalLM.from_config(config)
    transfer_weights(mg, back)
    before, after = neutral_state(hf), neutral_state(back)
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - megatron_like_hf.logits(mg, ids)).abs().max().item()
    out[model_type] = {"moved": moved, "logits_max_abs": diff, "names": sorted(n for n, _ in mg.named_parameters()),
                       "same": sorted(before) == sorted(after) and all(np.array_equal(before[n][0], after[n][0])
                                                                       for n in before)}
json.dump(out, open(f"{sys.argv[1]}/out.json", "w"))
"""


@pytest.fixture(scope="module")
def crossed(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_like_hf")
    run_scripts(root, {"cross": SCRIPT}, timeout=600)
    return json.loads((root / "out.json").read_text())


@pytest.mark.parametrize("model_type, megatron_only", [
    ("qwen3", "decoder.layers.1.self_attention.k_layernorm.weight"),
    ("mixtral", "decoder.layers.1.mlp.router.weight")])
def test_weights_cross_into_megatron_and_back_with_no_map(crossed, model_type, megatron_only):
    result = crossed[model_type]
    assert megatron_only in result["names"]
    assert result["moved"] == len(result["names"])
    assert result["logits_max_abs"] < 1e-5
    assert result["same"]
