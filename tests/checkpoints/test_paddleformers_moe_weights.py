"""Mixture-of-experts weights between transformers and PaddleFormers, with no map: transformers 5 keeps each
projection of all experts in one 3-D tensor, PaddleFormers a linear per expert in Paddle's [in, out] layout, and
ERNIE 4.5's router (PaddleFormers' ``TopKGate``) as [hidden, experts]. Real models of both libraries, built from
configs; each framework in a process of its own.

- Qwen2-MoE: transformers -> PaddleFormers, the two compute the same logits (the fused gate-and-up tensor is split
  the way transformers uses it), and PaddleFormers -> transformers gives back every tensor bit for bit;
- ERNIE 4.5 MoE: the router's weight crosses transposed, and the round trip is bit for bit (PaddleFormers' model
  does not run on a CPU: its expert dispatch is a GPU kernel).

Found by ``tools/sweep_paddleformers.py``: both failed to import before.
"""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from conftest import run_python

pytestmark = [pytest.mark.torch, pytest.mark.paddle, pytest.mark.slow, pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "paddle", "paddleformers")),
    reason="needs torch, transformers, PaddlePaddle and PaddleFormers")]

TYPES = ("qwen2_moe", "ernie4_5_moe")
SIZES = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
             moe_num_experts=4, num_experts_per_tok=2, moe_k=2, max_position_embeddings=64)

OUT = r"""
import json, sys
import numpy as np, torch
from transformers import AutoConfig, AutoModelForCausalLM
from layerdiff.checkpoints.transfer import export_weights
root, sizes = sys.argv[1], json.loads(sys.argv[2])
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
np.save(f"{root}/ids.npy", ids.numpy())
for model_type in sys.argv[3:]:
    config = AutoConfig.for_model(model_type, **{k: v for k, v in sizes.items()})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with open(f"{root}/{model_type}.json", "w") as f:
        json.dump(config.to_dict(), f, default=str)
    export_weights(model, f"{root}/{model_type}.safetensors")
    with torch.no_grad():
        np.save(f"{root}/{model_type}.logits.npy", model(input_ids=ids, use_cache=False).logits.numpy())
"""

PORT = r"""
import importlib, json, sys
import huggingface_hub
if not hasattr(huggingface_hub, "repo_type_and_id_from_hf_id"):  # gone in huggingface_hub 2; imported by PF 1.0
    huggingface_hub.repo_type_and_id_from_hf_id = None
import numpy as np, paddle
from paddleformers.transformers.auto.configuration import CONFIG_MAPPING
from layerdiff.checkpoints.transfer import export_weights, import_weights, read_weights
root = sys.argv[1]
for model_type in sys.argv[2:]:
    # PaddleFormers' ERNIE 4.5 MoE adds a multi-token-prediction block by default; transformers' has none
    extra = {"num_nextn_predict_layers": 0} if model_type == "ernie4_5_moe" else {}
    with open(f"{root}/{model_type}.json") as f:
        config = CONFIG_MAPPING[model_type].from_dict({**json.load(f), **extra})
    config._attn_implementation = "eager"
    module = importlib.import_module(f"paddleformers.transformers.{model_type}")
    model = next(getattr(module, n) for n in dir(module) if n.endswith("ForCausalLM"))(config)
    model.eval()
    import_weights(model, f"{root}/{model_type}.safetensors")
    export_weights(model, f"{root}/{model_type}.back.safetensors")
    if model_type == "ernie4_5_moe":  # the router as PaddleFormers keeps it: [hidden, experts]
        sent = read_weights(f"{root}/{model_type}.safetensors")["model.layers.1.mlp.gate.weight"][0]
        np.save(f"{root}/{model_type}.gate.npy", model.model.layers[1].mlp.gate.weight.numpy())
    else:
        ids = paddle.to_tensor(np.load(f"{root}/ids.npy"))
        with paddle.no_grad():
            logits = model(input_ids=ids, use_cache=False, return_dict=True).logits
        np.save(f"{root}/{model_type}.logits_pf.npy", logits.numpy())
"""

BACK = r"""
import json, sys
import numpy as np
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from layerdiff.checkpoints.transfer import export_weights, import_weights
root = sys.argv[1]
for model_type in sys.argv[2:]:
    with open(f"{root}/{model_type}.json") as f:
        config = CONFIG_MAPPING[model_type].from_dict(json.load(f))
    model = AutoModelForCausalLM.from_config(config)
    import_weights(model, f"{root}/{model_type}.back.safetensors")
    export_weights(model, f"{root}/{model_type}.again.safetensors")
"""


def _run(code: str, *args) -> None:
    done = run_python(code, *args)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def crossed(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_weights")
    _run(OUT, root, json.dumps(SIZES), *TYPES)
    _run(PORT, root, *TYPES)
    _run(BACK, root, *TYPES)
    return root


@pytest.mark.parametrize("model_type", TYPES)
def test_moe_weights_go_to_paddleformers_and_back_bit_for_bit(crossed, model_type):
    from layerdiff.checkpoints.transfer import read_weights

    sent = read_weights(crossed / f"{model_type}.safetensors")
    again = read_weights(crossed / f"{model_type}.again.safetensors")
    assert sorted(sent) == sorted(again)
    for name, (array, dtype) in sent.items():
        assert again[name][1] == dtype and np.array_equal(again[name][0], array), name
    if model_type == "qwen2_moe":  # stacked in transformers, one linear each in PaddleFormers
        assert sent["model.layers.0.mlp.experts.gate_up_proj"][0].shape == (4, 64, 32)
        back = read_weights(crossed / f"{model_type}.back.safetensors")
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in back


def test_qwen2_moe_computes_the_same_logits_in_paddleformers(crossed):
    ours = np.load(crossed / "qwen2_moe.logits.npy")
    theirs = np.load(crossed / "qwen2_moe.logits_pf.npy")
    assert np.abs(ours - theirs).max() <= 1e-5, np.abs(ours - theirs).max()


def test_ernie_routers_weight_crosses_transposed(crossed):
    from layerdiff.checkpoints.transfer import read_weights

    sent = read_weights(crossed / "ernie4_5_moe.safetensors")["model.layers.1.mlp.gate.weight"][0]
    assert sent.shape == (4, 32)
    assert np.array_equal(np.load(crossed / "ernie4_5_moe.gate.npy"), sent.T)
