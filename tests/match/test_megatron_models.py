"""transformers' models against Megatron-core GPTModels, in one subprocess.

A mixture-of-experts port: transformers' Mixtral against a GPTModel with MoE layers, same weights. The routers hand
on their choice differently (top-k scores and indices vs dense probabilities and a routing map; Megatron flattens
tokens sequence-first), and the pair still aligns with no flags; a router defect is named at the router, an expert
defect at the MoE block, with every operation recorded too (the routers' operations differ: transformers takes the
top-k of probabilities, Megatron of logits). And GPTModels configured from transformers configs
(``recipes/megatron_like_hf.py``): the weights go there and back with no map."""
from __future__ import annotations

import json

import pytest

from conftest import align_files, run_scripts, skip_unless_installed

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.torch]

skip_unless_installed("megatron.core")  # imported only by the processes the tests start

# GPTModels configured from transformers configs (recipes/megatron_like_hf.py), weights moved with no map
LIKE_HF = """
import json, sys
import numpy as np, torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
import layerdiff
from layerdiff.checkpoints.transfer import neutral_state, transfer_weights
from layerdiff.recipes import megatron_like_hf

SIZES = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=64, max_position_embeddings=64)
out = {}
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def step(logits):
    F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()


# hf traced as {prefix}_hf.h5; Megatron ports of it as {prefix}_clean.h5 and, planted, {prefix}_{defect}.h5
def trace_ports(hf, config, options, prefix, defect, plant, ops=False, mode="full"):
    with layerdiff.trace(hf, f"{sys.argv[1]}/{prefix}_hf.h5", ops=ops, mode=mode):
        step(hf(input_ids=ids).logits)
    hf.zero_grad(set_to_none=True)
    for name in ("clean", defect):
        mg = megatron_like_hf.build(config, ids.shape, **options)
        transfer_weights(hf, mg)
        if name == defect:
            with torch.no_grad():
                plant(mg)
        with layerdiff.trace(mg, f"{sys.argv[1]}/{prefix}_{name}.h5", ops=ops, mode=mode):
            step(megatron_like_hf.logits(mg, ids))
    return mg

for model_type, options in (("qwen3", {"qk_layernorm": True}), ("mixtral", {"num_local_experts": 4}),
                            ("qwen2_moe", {"add_qkv_bias": True, "num_experts": 4, "moe_intermediate_size": 32,
                                           "shared_expert_intermediate_size": 32}), ("phi3", {"pad_token_id": 0})):
    megatron_options = {k: v for k, v in options.items() if k in ("qk_layernorm", "add_qkv_bias")}
    hf_options = {k: v for k, v in options.items() if k not in megatron_options}
    config = AutoConfig.for_model(model_type, **SIZES, **hf_options)
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
    if model_type == "qwen2_moe":  # traced: Megatron's shared expert applies its gate inside itself
        trace_ports(hf, config, megatron_options, "qwen2_moe", "gate",
                    lambda mg: mg.decoder.layers[1].mlp.shared_experts.gate_weight.mul_(1.01))
# Phi-3 keeps q, k and v back to back in one qkv_proj, Megatron per query group in linear_qkv (above: the weights
# laid out anew each way); traced, the two align part by part, and a defect in the key rows is named there
from layerdiff.checkpoints.compare import compare_files
from safetensors.torch import save_file

for mode in ("full", "stats"):
    with layerdiff.trace(hf, f"{sys.argv[1]}/phi3_hf{'_stats' * (mode == 'stats')}.h5", mode=mode):
        step(hf(input_ids=ids).logits)
    hf.zero_grad(set_to_none=True)
mg = megatron_like_hf.build(config, ids.shape)
transfer_weights(hf, mg)
with layerdiff.trace(mg, f"{sys.argv[1]}/phi3_clean_stats.h5", mode="stats"):
    step(megatron_like_hf.logits(mg, ids))
for name in ("clean", "key"):
    mg = megatron_like_hf.build(config, ids.shape)
    transfer_weights(hf, mg)
    if name == "key":  # layer 1's first query group's key head: rows 16..23 of linear_qkv (2 query heads of 8 first)
        with torch.no_grad():
            mg.decoder.layers[1].self_attention.linear_qkv.weight[16:24].mul_(1.01)
    with layerdiff.trace(mg, f"{sys.argv[1]}/phi3_{name}.h5"):
        step(megatron_like_hf.logits(mg, ids))
save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, f"{sys.argv[1]}/phi3_hf.safetensors")
save_file({k: v.contiguous() for k, v in mg.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k},
          f"{sys.argv[1]}/phi3_mg.safetensors")
# two checkpoints say nothing of their heads: their values tell the layout (the Megatron one holds the key defect)
diffed = compare_files(f"{sys.argv[1]}/phi3_hf.safetensors", f"{sys.argv[1]}/phi3_mg.safetensors")
out["phi3"]["diff"] = {name: entry.get("status") for name, entry in diffed.items() if name != "__summary__"}
out["phi3"]["diff_b_names"] = {name: entry.get("b_name") for name, entry in diffed.items() if name != "__summary__"}
# StarCoder 2 and GPT-NeoX: LayerNorm, linear biases (made nonzero: a bias lost or left unadded shows), an MLP that is
# not gated (c_fc, dense_h_to_4h), GPT-NeoX's query_key_value per head and its rotary over a quarter of each head;
# Megatron's linears, attention and MLP return their bias beside their output for the caller to add
LAYER_NORM = {"normalization": "LayerNorm", "add_bias_linear": True, "gated_linear_unit": False}
for model_type, hf_options, megatron_options in (
        ("starcoder2", {}, LAYER_NORM),
        ("gpt_neox", {"use_parallel_residual": False}, {**LAYER_NORM, "num_query_groups": 4}),
        ("gpt2", {}, {**LAYER_NORM, "num_query_groups": 4, "position_embedding_type": "learned_absolute"})):
    config = AutoConfig.for_model(model_type, **SIZES, **hf_options)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = megatron_like_hf.vectors_moved(AutoModelForCausalLM.from_config(config).eval())
    mg = megatron_like_hf.build(config, ids.shape, **megatron_options)
    moved = transfer_weights(hf, mg)
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - megatron_like_hf.logits(mg, ids)).abs().max().item()
    out[model_type] = {"moved": moved, "logits_max_abs": diff, "names": sorted(n for n, _ in mg.named_parameters())}
    if model_type == "starcoder2":
        trace_ports(hf, config, megatron_options, "sc2", "fc1_bias",
                    lambda mg: mg.decoder.layers[1].mlp.linear_fc1.bias.add_(0.01))
        trace_ports(hf, config, megatron_options, "sc2_stats", "fc1", mode="stats",
                    plant=lambda mg: mg.decoder.layers[1].mlp.linear_fc1.weight.mul_(1.01))
    if model_type == "gpt2":  # every operation recorded: c_attn's [q; k; v] is split in another layout there
        mg = trace_ports(hf, config, megatron_options, "gpt2", "proj",
                         lambda mg: mg.decoder.layers[1].self_attention.linear_proj.weight.mul_(1 + 1e-3), ops=True)
        # as checkpoints (no types: Conv1D's [in, out] is told by shapes, and by values where square)
        save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
                  f"{sys.argv[1]}/gpt2_hf.safetensors")
        save_file({k: v.contiguous() for k, v in mg.state_dict().items()
                   if torch.is_tensor(v) and "_extra_state" not in k and k != "output_layer.weight"},
                  f"{sys.argv[1]}/gpt2_mg.safetensors")
        diffed = compare_files(f"{sys.argv[1]}/gpt2_hf.safetensors", f"{sys.argv[1]}/gpt2_mg.safetensors")
        out["gpt2"]["diff"] = {n: e.get("status") for n, e in diffed.items() if n != "__summary__"}
json.dump(out, open(f"{sys.argv[1]}/like_hf.json", "w"))
"""

SCRIPT = """
import json, sys
import torch
import layerdiff
from layerdiff.recipes import megatron_moe

out = sys.argv[1]
runs = {"hf": {"impl": "hf"}, "mg": {}, "router": {"defect": "router"}, "expert": {"defect": "expert"}}
for mode in ("full", "stats"):
    for name, kwargs in runs.items():
        built = megatron_moe.build(**kwargs)
        with layerdiff.trace(built["model"], f"{out}/{name}{'_stats' * (mode == 'stats')}.h5", mode=mode):
            built["step"]()
for name, kwargs in (("hf", {"impl": "hf"}), ("mg", {}), ("expert", {"defect": "expert"})):
    built = megatron_moe.build(**kwargs)
    with layerdiff.trace(built["model"], f"{out}/{name}_ops.h5", ops=True):
        built["step"]()
with torch.no_grad():
    diff = (megatron_moe.build(impl="hf")["logits"]() - megatron_moe.build()["logits"]()).abs().max().item()
json.dump({"logits_max_abs": diff}, open(f"{out}/parity.json", "w"))
""" + LIKE_HF


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    run_scripts(root, {"moe": SCRIPT}, timeout=600)
    return root


def test_mixtral_and_megatron_moe_agree_and_align_with_no_flags(moe):
    assert json.loads((moe / "parity.json").read_text())["logits_max_abs"] < 1e-6
    report = align_files(moe / "hf.h5", moe / "mg.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    router = next(r for r in report["records"] if r["path"] == "model.layers.0.mlp.gate" and r["phase"] == "forward")
    compared = {(t["role"], t["key"]): t for t in router["tensors"] if t.get("metrics")}
    # the flattened tokens reordered; the top-k scores and choices spread over the experts; all of it agrees
    assert set(compared) >= {("input", "args.0"), ("output", "out.1"), ("output", "out.2")}
    assert all(t["passed"] for t in compared.values())


@pytest.mark.parametrize("mode", ["", "_stats"])
@pytest.mark.parametrize("defect", ["router", "expert"])
def test_moe_defects_are_named_in_the_hf_names(moe, defect, mode):
    # in statistics traces too: the spread scores' statistics follow from the scores' (zeros for the rest)
    from layerdiff.recipes.megatron_moe import DEFECTS

    direction, origin = DEFECTS[defect]
    assert align_files(moe / f"hf{mode}.h5", moe / f"mg{mode}.h5")["verdict"] == "aligned"
    report = align_files(moe / f"hf{mode}.h5", moe / f"{defect}{mode}.h5")
    assert report[direction]["first_divergence"]["module"] == origin, report[direction]["first_divergence"]


def test_an_expert_defect_is_named_past_routers_whose_operations_differ(moe):
    """With operations recorded, layer 0's routers differ inside (top-k of probabilities against top-k of logits,
    then a softmax) and agree at their outputs: that is no origin for layer 1's expert defect."""
    assert align_files(moe / "hf_ops.h5", moe / "mg_ops.h5")["verdict"] == "aligned"
    report = align_files(moe / "hf_ops.h5", moe / "expert_ops.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"].startswith("model.layers.1.mlp"), origin["description"]


@pytest.mark.parametrize("model_type, megatron_only", [
    ("qwen3", "decoder.layers.1.self_attention.k_layernorm.weight"),
    ("mixtral", "decoder.layers.1.mlp.router.weight"),
    ("qwen2_moe", "decoder.layers.1.mlp.shared_experts.gate_weight")])
def test_weights_cross_into_megatron_and_back_with_no_map(moe, model_type, megatron_only):
    """Qwen3's query-key norms (Megatron's ``q_layernorm``/``k_layernorm``), Mixtral's router (a checkpoint names
    no types: its ``gate`` is known by its place beside the experts) and Qwen2-MoE's shared-expert gate (a linear
    of its own in transformers, Megatron's ``shared_experts.gate_weight``) cross with ``transfer_weights`` and no
    map, and back; the two compute the same logits. Found by ``tools/sweep_megatron.py``."""
    result = json.loads((moe / "like_hf.json").read_text())[model_type]
    assert megatron_only in result["names"]
    assert result["moved"] == len(result["names"])
    assert result["logits_max_abs"] < 1e-5
    assert result["same"]


def test_a_shared_expert_that_applies_its_gate_inside_aligns(moe):
    """Megatron's ``shared_experts`` applies the shared expert's sigmoid gate (its ``gate_weight``, transformers'
    ``shared_expert_gate``) to its own result; transformers gates ``shared_expert``'s result in the MoE block's
    code. The two modules' results are different tensors by design: their inputs are compared, their results and
    gradients are not (the MoE block compares what both hold), so the port aligns, and a defect in the gate is named
    at the MoE block, its weight compared with ``shared_expert_gate``'s and named. Before, every Qwen2-MoE port was
    reported divergent at layer 0's shared expert, and the gate's weight was compared with nothing. And a router
    that chooses every expert (top-k = experts) hands on its scores sorted: spread over the experts, as for any k."""
    report = align_files(moe / "qwen2_moe_hf.h5", moe / "qwen2_moe_clean.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    shared = next(r for r in report["records"] if r["path"] == "model.layers.0.mlp.shared_expert"
                  and r["phase"] == "forward")
    assert [t["role"] for t in shared["tensors"]] == ["input"] and all(t["passed"] for t in shared["tensors"])
    assert any(s.startswith("output:") and "mlp.shared_expert_gate" in s for s in shared["skipped"]), shared
    # Qwen2-MoE's default top-4 of these 4 experts: every expert chosen, the scores in transformers' sorted order
    router = next(r for r in report["records"] if r["path"] == "model.layers.0.mlp.gate" and r["phase"] == "forward")
    spread = {(t["key"], t.get("key_b")): t["passed"] for t in router["tensors"] if t["role"] == "output"}
    assert spread == {("out.1", "out.0"): True, ("out.2", "out.1"): True}  # scores to probabilities, choices to map
    gate = next(r for r in report["records"] if r["kind"] == "param"
                and r["path"] == "model.layers.0.mlp.shared_expert_gate.weight")
    assert gate["path_b"] == "decoder.layers.0.mlp.shared_experts.gate_weight"  # compared where it belongs
    report = align_files(moe / "qwen2_moe_hf.h5", moe / "qwen2_moe_gate.h5")
    assert report["forward"]["first_divergence"]["module"] == "model.layers.1.mlp", report["forward"]
    assert report["params"]["differ"] == ["model.layers.1.mlp.shared_expert_gate.weight"]
    # transformers' gate has no module of its own in Megatron: its work is the block's own code there
    assert [p["name"] for p in report["forward"]["first_divergence"]["param_diffs"]] == \
        ["model.layers.1.mlp.shared_expert_gate.weight"]


def test_parts_fused_in_another_layout_are_laid_out_anew(moe):
    """transformers' Phi-3 holds q, k and v back to back in one ``qkv_proj``; Megatron's ``linear_qkv`` holds them
    per query group. Before, the two were matched one to one and the weights copied as they were: they crossed and
    came back bit for bit, and the two models computed different logits (found by ``tools/sweep_megatron.py``).
    Now each transfer splits the parts in one layout and joins them in the other (the heads from the destination's
    attention): the logits agree. Traced, the two align, the fused outputs and weights compared part by part; a
    defect in one key head is named at ``qkv_proj``, in its k part. ``weights diff`` of the two checkpoints, which
    record no heads, lays one out anew under the heads that make its values show the other's: only the defect
    differs."""
    result = json.loads((moe / "like_hf.json").read_text())["phi3"]
    assert result["moved"] == len(result["names"]) and result["same"]
    assert result["logits_max_abs"] < 1e-5
    report = align_files(moe / "phi3_hf.h5", moe / "phi3_clean.h5")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    parts = {t["key"] for r in report["records"] if r["path"] == "model.layers.1.self_attn.qkv_proj"
             for t in r["tensors"]}
    assert {"out[q]", "out[k]", "out[v]"} <= parts, parts
    origin = align_files(moe / "phi3_hf.h5", moe / "phi3_key.h5")["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.self_attn.qkv_proj", origin
    assert origin["tensor"]["key"] in ("out[k]", "weight[k]"), origin["tensor"]["key"]
    # statistics do not depend on the order of the elements: compared as they are, and they agree
    report = align_files(moe / "phi3_hf_stats.h5", moe / "phi3_clean_stats.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    outputs = [t for r in report["records"] if r["path"] == "model.layers.1.self_attn.qkv_proj"
               for t in r["tensors"] if t["role"] == "output"]
    assert outputs and all(t["key"] == "out" and t["passed"] for t in outputs), outputs
    # two checkpoints, which record no heads: their values tell the layout, and only the key defect differs
    diff = result["diff"]
    assert {name for name, status in diff.items() if status != "identical"} == {
        "model.layers.1.self_attn.qkv_proj.weight"}, diff
    assert "another layout" in result["diff_b_names"]["model.layers.0.self_attn.qkv_proj.weight"]


def test_outputs_returned_beside_their_bias_are_compared_with_it_added(moe):
    """Megatron's linears (``skip_bias_add``), attention and MLP return ``(output, bias)`` where the model has linear
    biases: the caller adds the bias (with dropout and the residual). transformers' modules return the sum. Before,
    a StarCoder 2 port with every weight and bias equal was reported divergent at its first attention (the bias
    compared with transformers' attention weights), and each linear's output was compared without its bias (biases
    start at zero, so the sweep saw nothing); the MLP's ``c_fc``/``c_proj`` and GPT-NeoX's ``dense_h_to_4h``,
    ``dense_4h_to_h`` and ``final_layer_norm`` found no counterpart at all. Now the weights cross with no map, the
    two align with each output compared as output + bias, and a defect in the MLP's first bias is named there.
    Found by ``tools/sweep_megatron.py``."""
    results = json.loads((moe / "like_hf.json").read_text())
    for model_type in ("starcoder2", "gpt_neox", "gpt2"):
        result = results[model_type]
        assert result["moved"] == len(result["names"]), model_type
        assert result["logits_max_abs"] < 1e-5, model_type
    report = align_files(moe / "sc2_hf.h5", moe / "sc2_clean.h5")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    fc1 = [t for r in report["records"] if r["path"] == "model.layers.1.mlp.c_fc" and r["phase"] == "forward"
           for t in r["tensors"] if t["role"] == "output"]
    assert len(fc1) == 1 and fc1[0]["passed"] and "bias its module returned" in fc1[0]["metrics"]["note"], fc1
    origin = align_files(moe / "sc2_hf.h5", moe / "sc2_fc1_bias.h5")["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.mlp.c_fc", origin


def test_outputs_returned_beside_their_bias_are_compared_in_statistics_traces(moe):
    """In ``stats`` traces the sum's statistics do not follow from its terms': a statistics trace records them
    beside such an output. Before, every linear, attention and MLP output of a Megatron model with linear biases
    went uncompared in ``stats`` traces, against transformers and against Megatron alike, and a defect in
    ``linear_fc1``'s weight was named at the MLP around it. Now it is named at the linear; between two Megatron
    runs output and bias are compared as they are."""
    report = align_files(moe / "sc2_stats_hf.h5", moe / "sc2_stats_clean.h5")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    forward = {r["path"]: r for r in report["records"] if r["phase"] == "forward"}
    for path in ("model.layers.1.mlp.c_fc", "model.layers.1.self_attn", "model.layers.1.mlp"):
        outputs = [t for t in forward[path]["tensors"] if t["role"] == "output"]
        assert len(outputs) == 1 and outputs[0]["passed"] and outputs[0].get("metrics"), (path, outputs)
        assert "bias its module returned" in outputs[0]["metrics"]["note"], outputs
    origin = align_files(moe / "sc2_stats_hf.h5", moe / "sc2_stats_fc1.h5")["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.mlp.c_fc", origin
    report = align_files(moe / "sc2_stats_clean.h5", moe / "sc2_stats_fc1.h5")
    assert report["forward"]["first_divergence"]["module"] == "decoder.layers.1.mlp.linear_fc1"
    fc1 = next(r for r in report["records"] if r["path"] == "decoder.layers.1.mlp.linear_fc1"
               and r["phase"] == "forward")
    compared = {t["key"]: t["passed"] for t in fc1["tensors"] if t["role"] == "output" and t.get("metrics")}
    assert compared == {"out.0": False, "out.1": True}, fc1["tensors"]


def test_gpt2_crosses_into_megatron_and_its_split_qkv_is_not_an_origin(moe):
    """GPT-2: ``Conv1D`` stores [in, out], ``c_attn`` holds q, k and v back to back (Megatron per head), ``c_proj`` is
    the attention's output under ``attn`` and the MLP's under ``mlp``, ``wpe`` is Megatron's ``position_embeddings``,
    and its positions' [1, s, h], added to every sequence, gather the gradient of the whole batch (Megatron's are
    [b, s, h]: compared summed). With every operation recorded, the operation that splits the fused output takes it
    in another layout on each side: that input is left out with why, and a defect in the attention's output
    projection is named there, not at the split (before, at the split). ``weights diff`` of the two checkpoints
    (before: refused, the fused layout's heads not found in [in, out]; the square ``c_proj`` reported different)
    names only that weight. Found by ``tools/sweep_megatron.py``."""
    report = align_files(moe / "gpt2_hf.h5", moe / "gpt2_clean.h5")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    wpe = [t for r in report["records"] if r["path"] == "transformer.wpe" and r["phase"] == "backward"
           for t in r["tensors"]]
    assert wpe and all(t["passed"] for t in wpe) and "summed" in wpe[0]["metrics"]["note"], wpe
    skipped = [s for r in report["records"] if r.get("op") and r["path"] == "transformer.h.0.attn"
               for s in r.get("skipped", [])]
    assert any("fused in another layout" in s for s in skipped), skipped
    origin = align_files(moe / "gpt2_hf.h5", moe / "gpt2_proj.h5")["forward"]["first_divergence"]
    assert origin["module"] == "transformer.h.1.attn.c_proj", origin
    # the two checkpoints: every weight stored [in, out] is compared transposed (c_attn laid out anew per head, the
    # square c_proj by its values), and only the planted defect differs
    diff = json.loads((moe / "like_hf.json").read_text())["gpt2"]["diff"]
    assert len(diff) == 28 and {n for n, status in diff.items() if status != "identical"} == {
        "transformer.h.1.attn.c_proj.weight"}, diff
