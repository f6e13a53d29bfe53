"""Distributed checkpoint folders (``.metadata`` + ``*.distcp``): Megatron-core's torch_dist format, saved for real
by megatron-core under torchrun at tensor-parallel size 2, and plain ``torch.distributed.checkpoint`` folders;
read without unpickling anything but PyTorch's metadata classes."""
from __future__ import annotations

import pickle
import subprocess

import numpy as np
import pytest

from conftest import align_files, launch, run_cli, run_scripts

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from layerdiff.checkpoints import compare_files, megatron_args, open_checkpoint  # noqa: E402
from layerdiff.checkpoints import safetensors_io  # noqa: E402
from layerdiff.errors import LayerdiffError  # noqa: E402

pytestmark = [pytest.mark.torch]


def _save(folder, state):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving on one rank"
        dcp.save(state, checkpoint_id=str(folder))
    return folder


@pytest.fixture
def plain(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(16, 8, generator=g),
             "decoder.layers.mlp.weight": torch.randn(3, 4, 8, generator=g),  # Megatron's stacked layers
             "decoder.final_norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
             "step": torch.tensor(7),
             "optimizer.state.exp_avg.embed.weight": torch.zeros(16, 8),
             "extra": {"note": 1}}
    return _save(tmp_path / "ck", state), state


def test_tensors_are_read_one_by_one_with_stacked_layers_split_and_optimizer_state_left_out(plain, tmp_path):
    folder, state = plain
    ck = open_checkpoint(folder)
    assert ck.format == "torch_dist"
    assert ck.names() == ["embed.weight", "decoder.layers.0.mlp.weight", "decoder.layers.1.mlp.weight",
                          "decoder.layers.2.mlp.weight", "decoder.final_norm.weight", "step"]
    assert ck.info("decoder.final_norm.weight") == ("bfloat16", [8])
    for layer in range(3):
        values, dtype = ck.load(f"decoder.layers.{layer}.mlp.weight")
        assert dtype == "float32" and np.array_equal(values, state["decoder.layers.mlp.weight"][layer].numpy())
    bits, _ = ck.load("decoder.final_norm.weight")
    assert np.array_equal(bits, state["decoder.final_norm.weight"].view(torch.int16).numpy().view(np.uint16))
    assert ck.load("step")[0] == 7
    assert "left out: 1 optimizer / RNG tensors, 1 non-tensor entries" in ck.notes[0]

    same = {n: ck.load(n) for n in ck.names()}
    same["decoder.layers.1.mlp.weight"] = (same["decoder.layers.1.mlp.weight"][0] * np.float32(1.5), "float32")
    safetensors_io.save(tmp_path / "same.safetensors", same, {})
    report = compare_files(folder, tmp_path / "same.safetensors")
    assert [n for n, e in report.items() if n != "__summary__" and e["status"] != "identical"] == [
        "decoder.layers.1.mlp.weight"]


def test_hostile_or_damaged_distributed_checkpoints_are_one_line_and_exit_2(plain, tmp_path):
    folder, _ = plain
    metadata = (folder / ".metadata").read_bytes()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(marker)],))

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    code, out, err = run_cli("weights", "diff", folder, folder)
    assert code == 2 and "refused" in err and "subprocess.call" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()

    def refused(match):
        with pytest.raises(LayerdiffError, match=match) as exc:
            ck = open_checkpoint(folder)
            [ck.load(name) for name in ck.names()]
        assert "\n" not in str(exc.value)

    (folder / ".metadata").write_bytes(metadata[: len(metadata) // 2])
    refused("not readable checkpoint metadata")
    outside = pickle.loads(metadata)  # a chunk said to live outside the folder
    for info in outside.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(outside))
    refused("outside the folder")
    (folder / ".metadata").write_bytes(metadata)
    chunk = next(folder.glob("*.distcp"))
    chunk.write_bytes(chunk.read_bytes()[:100])
    refused("truncated")


MEGATRON_SAVE = """
import argparse, os, sys
import torch


def main():
    out = sys.argv[1]
    from layerdiff.recipes import megatron_llama
    from megatron.core import dist_checkpointing
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing calls these unconditionally; CPU build here
    torch.cuda.current_device = lambda: "cpu"
    for defect in (None, "weight"):
        model = megatron_llama.build(defect, tp=2)["model"]
        folder = f"{out}/{defect or 'clean'}/iter_0000005"
        os.makedirs(folder, exist_ok=True)
        state = {"args": argparse.Namespace(tensor_model_parallel_size=2, num_layers=2, hidden_size=64),
                 "iteration": 5, "checkpoint_version": 3.0, "model": model.sharded_state_dict()}
        dist_checkpointing.save(state, folder)  # as Megatron-LM's save_checkpoint, format torch_dist
        if torch.distributed.get_rank() == 0:
            with open(f"{out}/{defect or 'clean'}/latest_checkpointed_iteration.txt", "w") as f:
                f.write("5")


if __name__ == "__main__":  # dist_checkpointing starts a multiprocessing manager
    main()
"""


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_torch_dist_checkpoint_at_tp2_compares_with_hf_weights_and_loads_into_hf(tmp_path, recipe_trace):
    pytest.importorskip("megatron.core")
    from layerdiff.recipes import llama_shared

    launch(tmp_path, "save", MEGATRON_SAVE, ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    hf = llama_shared.weights(llama_shared.config())
    safetensors_io.save(tmp_path / "hf.safetensors", {k: (v, "float32") for k, v in hf.items()}, {})

    # both ranks' shards joined, fc1 as [gate; up], stacked layers split, norms under Megatron's TE-style names
    code, out, err = run_cli("weights", "diff", tmp_path / "hf.safetensors", tmp_path / "clean", "-o",
                             tmp_path / "clean.json")
    assert code == 0, out + err
    assert f"{len(hf)} compared: {len(hf)} identical" in out
    code, out, err = run_cli("weights", "diff", tmp_path / "hf.safetensors", tmp_path / "weight" / "iter_0000005",
                             "-o", tmp_path / "weight.json")
    assert code == 1, out + err
    import json

    report = json.loads((tmp_path / "weight.json").read_text())
    summary = report.pop("__summary__")
    assert summary["format_b"] == "torch_dist" and not summary["missing_in_b"] and not summary["extra_in_b"]
    assert [n for n, e in report.items() if e["status"] != "identical"] == ["model.layers.1.self_attn.o_proj.weight"]
    assert report["model.layers.0.input_layernorm.weight"]["b_name"] == \
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert megatron_args(tmp_path / "clean")["tensor_model_parallel_size"] == 2

    # the Megatron checkpoint loaded into the HF model: the clean one traces as HF does, the other one is named
    for name in ("clean", "weight"):
        code, _, err = run_cli("trace", "torch_llama", "--weights", tmp_path / name, "-o", tmp_path / f"{name}.h5",
                               "-q")
        assert code == 0, err
    assert align_files(recipe_trace(), tmp_path / "clean.h5")["verdict"] == "aligned"
    report = align_files(recipe_trace(), tmp_path / "weight.h5")
    assert report["forward"]["first_divergence"]["module"] == "model.layers.1.self_attn.o_proj"


MOE_SAVE = """
import sys
import torch
import torch.nn.functional as F


def main():
    out = sys.argv[1]
    from layerdiff.recipes import megatron_llama
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import MixtralConfig, MixtralForCausalLM

    megatron_llama.init_cpu_megatron(1)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    hidden, ffn, heads, layers, experts = 32, 64, 4, 2, 4
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_router_topk=2, normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False, cuda_graph_scope=[])
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(sd, f"{out}/moe.pt")
    dist_checkpointing.save(model.sharded_state_dict(), f"{out}/moe_dist")

    # the same weights in transformers' Mixtral (converted as Megatron-Bridge does), saved in the Hub's format
    hf = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, num_local_experts=experts, num_experts_per_tok=2, tie_word_embeddings=False))
    state = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
             "model.norm.weight": sd["decoder.final_layernorm.weight"], "lm_head.weight": sd["output_layer.weight"]}
    for i in range(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        state[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        state[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        qkv = sd[m + "self_attention.linear_qkv.weight"].reshape(heads, 3, hidden // heads, hidden)
        for j, name in enumerate("qkv"):
            state[h + f"self_attn.{name}_proj.weight"] = qkv[:, j].reshape(hidden, hidden).contiguous()
        state[h + "mlp.gate.weight"] = sd[m + "mlp.router.weight"]
        local = m + "mlp.experts.local_experts."
        state[h + "mlp.experts.gate_up_proj"] = torch.stack([sd[f"{local}{e}.linear_fc1.weight"] for e in range(experts)])
        state[h + "mlp.experts.down_proj"] = torch.stack([sd[f"{local}{e}.linear_fc2.weight"] for e in range(experts)])
    hf.load_state_dict(state, strict=True)
    hf.save_pretrained(f"{out}/mixtral")

    with torch.no_grad():  # expert 2 of layer 1: its up rows (Mixtral's w3) scaled
        model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc1.weight[ffn:] *= 1.001
    dist_checkpointing.save(model.sharded_state_dict(), f"{out}/moe_dist_up")


if __name__ == "__main__":
    main()
"""


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_moe_torch_dist_checkpoint_against_its_state_dict_and_hf_mixtral(tmp_path):
    pytest.importorskip("megatron.core")
    for folder in ("moe_dist", "moe_dist_up"):
        (tmp_path / folder).mkdir()
    run_scripts(tmp_path, {"moe": MOE_SAVE}, timeout=600)
    names = open_checkpoint(tmp_path / "moe_dist").names()
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in names
    assert "decoder.layers.0.mlp.router.weight" in names
    report = compare_files(tmp_path / "moe.pt", tmp_path / "moe_dist")  # the model's own state dict
    summary = report.pop("__summary__")
    assert not summary["missing_in_b"] and not summary["extra_in_b"], summary
    assert summary["identical"] == summary["compared"] == len(report) == len(names)

    # Mixtral as the Hub stores it (block_sparse_moe.experts.N.w1/w2/w3, gate = router) against Megatron's
    report = compare_files(tmp_path / "mixtral", tmp_path / "moe_dist_up")
    summary = report.pop("__summary__")
    assert not summary["missing_in_b"] and not summary["extra_in_b"], summary
    assert [n for n, e in report.items() if e["status"] != "identical"] == [
        "model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert report["model.layers.1.block_sparse_moe.experts.2.w3.weight"]["b_name"] == \
        "part 2 of 2 of decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight (gate_up)"
    assert report["model.layers.0.block_sparse_moe.gate.weight"]["b_name"] == "decoder.layers.0.mlp.router.weight"

    # loaded into transformers' Mixtral, whose experts are 3-D parameters (gate_up_proj [experts, 2 x ffn, hidden]):
    # from the Hub folder and from Megatron's checkpoint, bit-exactly
    from transformers import MixtralForCausalLM

    from layerdiff.checkpoints.transfer import import_weights

    reference = MixtralForCausalLM.from_pretrained(tmp_path / "mixtral", local_files_only=True).state_dict()
    for source in ("mixtral", "moe_dist"):
        torch.manual_seed(1)
        model = MixtralForCausalLM(MixtralForCausalLM.config_class.from_pretrained(tmp_path / "mixtral"))
        assert import_weights(model, tmp_path / source) == len(reference)
        assert all(torch.equal(value, reference[name]) for name, value in model.state_dict().items()), source


def test_loading_weights_refuses_checkpoints_in_other_layouts(plain, tmp_path):
    from layerdiff.checkpoints import torch_layout_state

    folder, state = plain
    loaded = torch_layout_state(folder)
    assert np.array_equal(loaded["decoder.layers.2.mlp.weight"][0], state["decoder.layers.mlp.weight"][2].numpy())
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    with pytest.raises(LayerdiffError, match="not from a npz checkpoint.*weights export"):
        torch_layout_state(tmp_path / "w.npz")
