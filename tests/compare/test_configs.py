"""``layerdiff config diff``: a Megatron-LM launch script, a MindSpore Transformers YAML and a Hugging Face
config.json describing the same Llama agree with each other; one planted difference in each (eps, rotary base,
bias) is found and nothing else is reported."""
from __future__ import annotations

import json

import pytest

from layerdiff.compare.configs import diff_configs, read_config
from layerdiff.errors import LayerdiffError

MEGATRON = r"""#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
NUM_LAYERS=32
ROTARY_BASE=10000
GPT_MODEL_ARGS=(
    --use-mcore-models
    --num-layers ${NUM_LAYERS}
    --hidden-size 4096
    --ffn-hidden-size 11008
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --rotary-base ${ROTARY_BASE}
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    --vocab-size 32000
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8
    --lr 1e-4 --bf16
)
torchrun --nproc_per_node 8 pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} \
    --tensor-model-parallel-size 2
"""

MINDFORMERS = """
seed: 0
output_dir: './output'
run_mode: 'train'
model:
  model_config:
    model_type: llama
    use_legacy: False
    num_layers: 32
    hidden_size: 4096
    intermediate_size: 11008
    num_heads: 32
    use_gqa: True
    n_kv_heads: 8
    vocab_size: 32000
    seq_length: 4096
    max_position_embeddings: 4096
    position_embedding_type: rope
    rotary_base: 10000
    normalization: RMSNorm
    rms_norm_eps: 1e-5
    hidden_act: silu
    gated_linear_unit: True
    add_bias_linear: False
    untie_embeddings_and_output_weights: True
    init_method_std: 0.02
    attention_dropout: 0.0
    hidden_dropout: 0.0
    compute_dtype: bfloat16
    param_init_type: float32
parallel_config:
  data_parallel: 1
  model_parallel: 2
"""

# Megatron-LM's YAML (``--yaml-cfg``): the model's hyper-parameters in ``language_model``, named as TransformerConfig
# names them, the rest of the arguments at the top level, null for "not set"
MEGATRON_YAML = """
language_model:
  num_layers: 32
  hidden_size: 4096
  ffn_hidden_size: 11008
  num_attention_heads: 32
  num_query_groups: 8
  kv_channels: null
  layernorm_epsilon: 1.e-5
  add_bias_linear: False
  add_qkv_bias: False
  gated_linear_unit: True
  activation_func: swiglu
  normalization: RMSNorm
  attention_dropout: 0.0
  hidden_dropout: 0.0
  init_method_std: 0.02
  num_moe_experts: null
model_parallel:
  tensor_model_parallel_size: 2
  bf16: True
micro_batch_size: 1
group_query_attention: True
untie_embeddings_and_output_weights: True
position_embedding_type: rope
rotary_base: 10000
max_position_embeddings: 4096
seq_length: 4096
vocab_size: 32000
lr: 1.0e-4
"""

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096,
      "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
      "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": 32000, "initializer_range": 0.02,
      "attention_dropout": 0.0, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
      "pretraining_tp": 1, "use_cache": True, "rope_scaling": None}


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def configs(tmp_path):
    return {"megatron": _write(tmp_path, "pretrain_llama.sh", MEGATRON),
            "mindformers": _write(tmp_path, "llama.yaml", MINDFORMERS),
            "megatron_yaml": _write(tmp_path, "gpt_config.yaml", MEGATRON_YAML),
            "hf": _write(tmp_path, "config.json", json.dumps(HF))}


PAIRS = [("megatron", "mindformers"), ("megatron", "hf"), ("mindformers", "hf"), ("megatron_yaml", "megatron"),
         ("megatron_yaml", "mindformers"), ("megatron_yaml", "hf")]


@pytest.mark.parametrize("a,b", PAIRS)
def test_the_same_model_in_three_formats_agrees(configs, a, b):
    report = diff_configs(read_config(configs[a]), read_config(configs[b]))
    assert report["differ"] == [], report["differ"]
    assert report["compared"] >= 16  # layers, sizes, heads, groups, eps, rope, bias, activation, tying, ...


def _planted(tmp_path, kind):
    if kind == "hf":  # eps
        return _write(tmp_path, "planted.json", json.dumps({**HF, "rms_norm_eps": 1e-06})), "norm_epsilon"
    if kind == "megatron":  # rotary base, set through a shell variable
        return _write(tmp_path, "planted.sh", MEGATRON.replace("ROTARY_BASE=10000", "ROTARY_BASE=500000")), \
            "rotary_base"
    if kind == "megatron_yaml":  # eps, as TransformerConfig names it
        return _write(tmp_path, "planted_megatron.yaml", MEGATRON_YAML.replace("layernorm_epsilon: 1.e-5",
                                                                               "layernorm_epsilon: 1.e-6")), \
            "norm_epsilon"
    return _write(tmp_path, "planted.yaml", MINDFORMERS.replace("add_bias_linear: False", "add_bias_linear: True")), \
        "add_bias_linear"


@pytest.mark.parametrize("kind", ["hf", "megatron", "mindformers", "megatron_yaml"])
def test_one_planted_difference_is_found_and_nothing_else(configs, tmp_path, kind):
    planted, key = _planted(tmp_path, kind)
    for other in (k for k in configs if k != kind):
        report = diff_configs(read_config(configs[other]), read_config(planted))
        assert [d["key"] for d in report["differ"]] == [key], (other, report["differ"])


def test_inverted_and_combined_meanings():
    from layerdiff.compare.configs import _from_hf, _from_megatron

    megatron = _from_megatron("m", {"num-attention-heads": "8", "hidden-size": "512"})  # no flags: defaults
    assert megatron.values["add_bias_linear"] is True and megatron.values["activation"] == "gelu"
    assert megatron.values["tie_embeddings"] is True and megatron.values["normalization"] == "LayerNorm"
    assert megatron.values["num_query_groups"] == 8 and megatron.values["ffn_hidden_size"] == 2048
    hf = _from_hf("h", {"model_type": "gpt2", "n_layer": 12, "activation_function": "gelu_new",
                        "layer_norm_epsilon": 1e-5})
    assert hf.values["activation"] == "gelu" and hf.values["normalization"] == "LayerNorm"
    assert _from_hf("h", {"model_type": "qwen2", "hidden_act": "silu"}).values["add_qkv_bias"] is True


def test_cli_exit_codes_json_and_bad_input(configs, tmp_path):
    from conftest import run_cli

    code, out, err = run_cli("config", "diff", configs["megatron"], configs["hf"], "-q")
    assert code == 0 and out.startswith("same:"), out + err
    planted, _ = _planted(tmp_path, "hf")
    code, out, err = run_cli("config", "diff", configs["megatron"], planted, "--json", tmp_path / "c.json")
    assert code == 1, err
    assert "norm_epsilon" in out and "norm-epsilon" in out and "rms_norm_eps" in out
    assert json.loads((tmp_path / "c.json").read_text())["differ"][0]["b"] == 1e-06
    for bad in (tmp_path / "missing.json", _write(tmp_path, "list.json", "[1, 2]"),
                _write(tmp_path, "bad.yaml", "a: [1,"), _write(tmp_path, "notes.txt", "hello")):
        code, out, err = run_cli("config", "diff", configs["hf"], bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    with pytest.raises(LayerdiffError):
        read_config(tmp_path)


@pytest.mark.torch
def test_the_args_stored_in_a_megatron_checkpoint(configs, tmp_path):
    torch = pytest.importorskip("torch")
    import argparse

    from conftest import run_cli

    args = argparse.Namespace(  # what Megatron-LM's argparse stores for the launch script above
        num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, group_query_attention=True,
        num_query_groups=8, kv_channels=128, seq_length=4096, max_position_embeddings=4096,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm",
        norm_epsilon=1e-5, swiglu=True, squared_relu=False, openai_gelu=False, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=0.02, vocab_size=32000, padded_vocab_size=32000, qk_layernorm=False, lr=1e-4,
        tensor_model_parallel_size=2, micro_batch_size=1)
    folder = tmp_path / "ckpt" / "iter_0000010" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"args": args, "iteration": 10, "model": {}}, folder / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10\n")
    code, out, err = run_cli("config", "diff", tmp_path / "ckpt", configs["hf"], "-q")
    assert code == 0 and out.startswith("same:"), out + err
    args.norm_epsilon = 1e-6
    torch.save({"args": args, "iteration": 10, "model": {}}, folder / "model_optim_rng.pt")
    code, out, err = run_cli("config", "diff", folder / "model_optim_rng.pt", configs["mindformers"], "-q")
    assert code == 1 and out.startswith("differ: 1 of") and "norm_epsilon: 1e-06 vs 1e-05" in out, out + err
