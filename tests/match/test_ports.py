"""Real ports aligned with no flags: Megatron-core GPTModel (fused QKV and gated MLP, [s, b, h] activations,
rotary angles) and a MindSpore Transformers Llama (wq/wk/wv, w1/w2/w3, SiLU inside w1, shifted labels) against
transformers' Llama; each pair first shows logits parity, then every injected defect is named at its origin in
the reference's names. Traces are made in subprocesses, one per framework, side by side."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import align_files, run_cli, run_scripts, skip_unless_installed

from layerdiff.tracefile.reader import open_trace

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.mindspore]

skip_unless_installed("megatron.core", "mindspore")  # imported only by the processes the tests start

MEGATRON_DEFECTS = ["eps", "weight", "qkv_part", "fc1_part", "rotary", "owncode", "backward"]
MINDFORMERS_DEFECTS = ["eps", "act", "weight", "owncode", "rotary", "backward"]

TORCH_SCRIPT = """
import json, sys
import numpy as np, torch
import layerdiff
from layerdiff.recipes import megatron_llama as mg, torch_llama as hf, llama_shared as shared

out = sys.argv[1]
def trace(recipe, name, defect=None, mode="full", ops=False, **kw):
    built = recipe.build(defect, **kw)
    with layerdiff.trace(built["model"], f"{out}/{name}.h5", mode=mode, ops=ops):
        built["step"]()

trace(hf, "hf")
trace(hf, "hf_eager", "reimpl")  # eager attention: layers get an additive float mask (Megatron: boolean)
trace(hf, "hf_stats", mode="stats")
trace(mg, "mg_stats", mode="stats")
trace(mg, "mg_stats_eps", "eps", mode="stats")
for d in ["eps", "weight"]:
    trace(hf, f"hf_{d}", d)
trace(mg, "mg")
trace(hf, "hf_ops", ops=True)
trace(hf, "hf_ops_eager", ops=True, attn="eager")
trace(mg, "mg_ops", ops=True)
trace(mg, "mg_ops_owncode", "owncode", ops=True)
scaled = mg.build(None)  # the attention's softmax scale x1.1: arithmetic that Megatron runs in core_attention
scaled["model"].decoder.layers[1].self_attention.core_attention.softmax_scale *= 1.1
with layerdiff.trace(scaled["model"], f"{out}/mg_ops_scale.h5", ops=True):
    scaled["step"]()
gelu = mg.build(None)  # a port whose MLP activation is set wrong: gelu for silu
gelu["model"].decoder.layers[0].mlp.config.activation_func = torch.nn.functional.gelu
with layerdiff.trace(gelu["model"], f"{out}/mg_ops_gelu.h5", ops=True):
    gelu["step"]()
for d in mg.DEFECTS:
    trace(mg, f"mg_{d}", d)
trace(mg, "mg_recompute_full", recompute="full")  # activation recomputation: Megatron's CheckpointFunction
trace(mg, "mg_recompute_selective", recompute="selective")
trace(mg, "mg_recompute_eps", "eps", recompute="full")
trace(mg, "mg_ops_recompute", ops=True, recompute="full")

cfg = shared.config()
ids = torch.from_numpy(shared.input_ids(cfg, 2, 16, 0))
with torch.no_grad():
    hf_logits = hf.build_model()[0](input_ids=ids).logits.numpy()
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    mg.reserve_attention_buffer(2 * cfg["heads"] * 16 * 16)
    mg_logits = mg.build_model()[0](ids, torch.arange(16)[None].expand(2, -1), mask).numpy()
np.save(f"{out}/hf_logits.npy", hf_logits)

# weights through the rules: HF -> Megatron (as the recipe's own Megatron-Bridge-style converter) -> HF, bit-exact
from layerdiff.checkpoints.transfer import neutral_state, transfer_weights
from layerdiff.checkpoints import safetensors_io
hf_model, megatron = hf.build_model()[0], mg.build_model(seed=3)[0]  # another seed: different weights to overwrite
transfer_weights(hf_model, megatron)
expected = mg.hf_to_megatron(shared.weights(cfg), cfg)
got = {k: v[0] for k, v in neutral_state(megatron).items()}
back = hf.build_model(seed=5)[0]
transfer_weights(megatron, back)
round_trip = neutral_state(back)
exact = {"to_megatron": all(np.array_equal(expected[k], got[k]) for k in expected) and set(expected) == set(got),
         "round_trip": all(np.array_equal(round_trip[k][0], v) for k, v in shared.weights(cfg).items())}
safetensors_io.save(f"{out}/hf.safetensors", {k: (v, "float32") for k, v in shared.weights(cfg).items()}, {})
expected["decoder.layers.1.self_attention.linear_qkv.weight"][32:48] *= np.float32(1 + 1e-3)  # group 0's K head
torch.save({k: torch.from_numpy(v) for k, v in expected.items()}, f"{out}/mg.pt")
json.dump({"megatron_logits_max_abs": float(np.abs(hf_logits - mg_logits).max()),
           "logits_max_abs": float(np.abs(hf_logits).max()), "weights_exact": exact}, open(f"{out}/torch.json", "w"))
"""

MINDSPORE_SCRIPT = """
import json, sys
import numpy as np
import mindspore as ms
import layerdiff
from layerdiff.recipes import mindformers_llama as mf

out = sys.argv[1]
def trace(name, defect=None, ops=False, **kw):
    built = mf.build(defect, impl="port", **kw)
    with layerdiff.trace(built["model"], f"{out}/{name}.h5", ops=ops):
        built["step"]()

trace("mf")
for d in mf.DEFECTS:
    trace(f"mf_{d}", d)
trace("mf_concat", qkv_concat=True)
trace("mf_ops", ops=True)
trace("mf_ops_owncode", "owncode", ops=True)  # its attention's score scaling
trace("mf_concat_weight", "weight", qkv_concat=True)
np.save(f"{out}/mf_logits.npy", mf.logits(impl="port"))
"""


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    root = tmp_path_factory.mktemp("ports")
    run_scripts(root, {"torch": TORCH_SCRIPT, "mindspore": MINDSPORE_SCRIPT}, timeout=600)
    return root


def _origin(report, phase):
    origin = report[phase]["first_divergence"]
    return origin and origin["module"]


def test_megatron_logits_match_hf(ports):
    parity = json.loads((ports / "torch.json").read_text())
    assert parity["megatron_logits_max_abs"] < 1e-5 * parity["logits_max_abs"]


def test_megatron_clean_pair_aligns_with_no_flags(ports):
    report = align_files(ports / "hf.h5", ports / "mg.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    fused = {}
    for m in report["mapping"]:
        if m.get("rule"):
            fused.setdefault(m["rule"], m)
    assert fused["qkv"]["a_parts"] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                       "model.layers.0.self_attn.v_proj"]
    assert fused["qkv"]["b"] == "decoder.layers.0.self_attention.linear_qkv" and "same weights" in fused["qkv"]["reason"]
    assert fused["gate_up"]["b"] == "decoder.layers.0.mlp.linear_fc1"
    rows = {(r["kind"], r["phase"], r["path"]): r for r in report["records"]}
    k_out = next(t for t in rows[("call", "forward", "model.layers.1.self_attn.k_proj")]["tensors"]
                 if t["role"] == "output")
    assert k_out["shape_a"] == [2, 16, 32] and k_out["shape_b"] == [16, 2, 32]  # one part, [s, b, h] -> [b, s, h]
    assert "k_proj part of B's linear_qkv out.0 (rule qkv, 2 groups, checked against the weights)" in k_out["metrics"]["note"]
    rotary = rows[("call", "forward", "model.rotary_emb")]["tensors"]
    assert {t["key"] for t in rotary} == {"out.0", "out.1"} and all(t["passed"] for t in rotary)
    grad_sum = next(t for t in rows[("call", "backward", "model.layers.0.self_attn.q_proj")]["tensors"]
                    if t["role"] == "grad_input")
    assert "sum over q_proj, k_proj, v_proj" in grad_sum["metrics"]["note"]
    assert report["params"]["compared"] == 21 and not report["params"]["differ"]


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_megatron_activation_recomputation_aligns_with_hf_and_replays_its_forward(ports, recompute):
    """Megatron recomputing every layer (``--recompute-granularity full``) or its core attention (``selective``)
    in backward, through its own ``CheckpointFunction``: the recomputed calls replay the forward's, so the pair
    aligns with HF as the plain pair does, and each recomputation reproduced its forward."""
    report = align_files(ports / "hf.h5", ports / f"mg_recompute_{recompute}.h5")
    plain = align_files(ports / "hf.h5", ports / "mg.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    assert len(report["records"]) == len(plain["records"]) and len(report["only_b"]) == len(plain["only_b"])
    check = report["recompute"]["b"]
    assert check["calls"] == check["compared"] > 0 and check["differ"] == []
    with open_trace(ports / f"mg_recompute_{recompute}.h5") as t:
        recomputed = {r.path for r in t.recomputed if r.kind == "call"}
    layers = {"decoder.layers.0", "decoder.layers.1"}
    attention = {f"{layer}.self_attention.core_attention" for layer in layers}
    assert layers <= recomputed if recompute == "full" else \
        attention <= recomputed and all(any(p.startswith(a) for a in attention) for p in recomputed)
    eps = align_files(ports / "hf.h5", ports / "mg_recompute_eps.h5")
    assert _origin(eps, "forward") == _origin(align_files(ports / "hf.h5", ports / "mg_eps.h5"), "forward")
    with open_trace(ports / "mg_ops.h5") as a, open_trace(ports / "mg_ops_recompute.h5") as b:
        assert sorted((o.path, o.call, o.index, o.phase, o.name) for o in a.ops) == \
            sorted((o.path, o.call, o.index, o.phase, o.name) for o in b.ops)


@pytest.mark.parametrize("defect", MEGATRON_DEFECTS)
def test_megatron_defects_named_in_hf_names(ports, defect):
    from layerdiff.recipes.megatron_llama import DEFECTS

    direction, origin = DEFECTS[defect]
    report = align_files(ports / "hf.h5", ports / f"mg_{defect}.h5")
    assert report["verdict"] == "divergent"
    assert _origin(report, direction) == origin
    if direction == "backward":
        assert report["forward"]["status"] == "aligned"
    if defect == "qkv_part":
        assert report["params"]["differ"] == ["model.layers.1.self_attn.k_proj.weight"]
    if defect == "owncode":
        assert report["forward"]["first_divergence"]["between"] == ["model.layers.1.self_attn",
                                                                    "model.layers.1.post_attention_layernorm"]


def test_the_retrace_hint_names_each_runs_own_module(ports):
    """Megatron names HF's ``model.rotary_emb`` ``rotary_pos_emb``: the hint that records the origin's operations
    gives each run the window of its own module (B's was A's, which matches none of Megatron's modules)."""
    import ast
    import re

    from layerdiff.report.ops_view import retrace_hint

    report = align_files(ports / "hf.h5", ports / "mg_rotary.h5")
    origin = report["forward"]["first_divergence"]
    assert (origin["module"], origin["path_b"]) == ("model.rotary_emb", "rotary_pos_emb")
    hint = " ".join(retrace_hint(report, origin))
    windows = [(side, ast.literal_eval(quoted)) for side, quoted in re.findall(r"([AB]) with ops=\[('.+?')\]", hint)]
    assert [side for side, _ in windows] == ["A", "B"], hint
    for (side, pattern), trace in zip(windows, ("hf.h5", "mg_rotary.h5")):
        with open_trace(ports / trace) as t:
            matched = {r.path for r in t.records if r.kind == "call" and re.search(pattern, r.path)}
        assert matched == {origin["module"] if side == "A" else origin["path_b"]}, (side, pattern, matched)


def test_megatron_operations_align_with_hf(ports):
    """Operations recorded in both: Megatron's [s, b, heads, d] against HF's [b, heads, s, d] (head_dim equal to
    the sequence length here: dimensions of one size keep their order), its [s, b, groups, heads * d] split of the
    fused QKV against HF's [b, s, hidden], and its chunk of a rotary input into halves against HF's two slices
    (whose input gradients are each one half's). Before, 100 of these tensors were compared flattened, or as
    gradients of another sum, and failed: a clean pair, and an origin named in the wrong layer."""
    report = align_files(ports / "hf_ops.h5", ports / "mg_ops.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    ops = [r for r in report["records"] if r["kind"] == "op"]
    assert len(ops) > 50 and all(t["passed"] for r in ops for t in r["tensors"]), \
        [(r["path"], r["op"]["name"], t["key"], t["reason"]) for r in ops for t in r["tensors"] if not t["passed"]]


def test_megatron_own_code_defect_is_named_at_its_line_with_operations(ports):
    from layerdiff.recipes import megatron_llama

    report = align_files(ports / "hf_ops.h5", ports / "mg_ops_owncode.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1", origin["description"]
    lines = Path(megatron_llama.__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "residual * (1 + 1e-3)" in text)
    assert any(source.endswith(f"megatron_llama.py:{line}") for _, _, source in origin["op"]["only_b"]), origin["op"]


def test_operations_inside_a_module_only_megatron_has_are_aligned_as_its_callers(ports):
    """Megatron computes the attention's scores, softmax and weighted sum in ``core_attention`` (and its
    ``scale_mask_softmax``), modules HF has none for; their operations are aligned as the attention's own. A softmax
    scale 1.1 times is named at HF's ``matmul(...) * scaling`` line against Megatron's ``baddbmm`` (its
    ``alpha``), scores [b, heads, s, s] against [b * heads, s, s]. Before, the origin was the attention's own code,
    with 27 of HF's operations left without a counterpart and nothing said of why."""
    import transformers.models.llama.modeling_llama

    lines = Path(transformers.models.llama.modeling_llama.__file__).read_text().splitlines()
    scaled = next(i for i, text in enumerate(lines, 1) if "torch.matmul(query, key_states.transpose(2, 3))" in text)
    report = align_files(ports / "hf_ops_eager.h5", ports / "mg_ops_scale.h5")
    origin = report["forward"]["first_divergence"]
    assert (origin["module"], origin["where"]) == ("model.layers.1.self_attn", "op"), origin["description"]
    op = origin["op"]
    assert (op["kind"], op["name_b"]) == ("mul", "torch.baddbmm"), op
    assert op["source"].endswith(f"modeling_llama.py:{scaled}") and "dot_product_attention.py:" in op["source_b"], op
    row = next(r for r in report["records"] if r["kind"] == "call" and r["path"] == "model.layers.1.self_attn"
               and r["phase"] == "forward")
    assert "decoder.layers.1.self_attention.core_attention" in row["ops"]["unmatched_inside"]["b"], row["ops"]
    # against SDPA, one fused operation: named at it, against Megatron's operations that end in the weighted sum
    origin = align_files(ports / "hf_ops.h5", ports / "mg_ops_scale.h5")["forward"]["first_divergence"]
    assert (origin["where"], origin["op"]["kind"]) == ("op", "scaled_dot_product_attention"), origin["description"]
    for clean in ("hf_ops.h5", "hf_ops_eager.h5"):
        report = align_files(ports / clean, ports / "mg_ops.h5")
        assert report["verdict"] == "aligned", (clean, report["forward"]["first_divergence"])


def test_an_activation_set_wrong_in_a_port_is_named_on_both_sides(ports):
    """HF's activation is a module (``SiLUActivation``) that Megatron has no counterpart for: its ``silu`` counts as
    the MLP's own operation. With Megatron's set to gelu, ``silu`` was taken for Megatron's ``gelu(gate) * up``
    spelled out (``[[ops.fused]]`` silu ends in a mul) and named against that mul; a spelled-out silu must hold a
    sigmoid (``holds``), so both activations are named, at the ``mul`` they feed."""
    import transformers.activations

    origin = align_files(ports / "hf_ops.h5", ports / "mg_ops_gelu.h5")["forward"]["first_divergence"]
    assert (origin["module"], origin["where"]) == ("model.layers.0.mlp", "op_input"), origin["description"]
    lines = Path(transformers.activations.__file__).read_text().splitlines()
    silu = [i for i, text in enumerate(lines, 1) if "return nn.functional.silu(input)" in text]
    assert [(name, source.rpartition(":")[2]) for _, name, source in origin["op"]["only_a"]] == \
        [("torch.nn.functional.silu", str(line)) for line in silu[:1]], origin["op"]
    assert any(name == "torch.nn.functional.gelu" and "megatron/core/transformer/mlp.py" in source
               for _, name, source in origin["op"]["only_b"]), origin["op"]


def test_additive_and_boolean_masks_are_compared_as_what_they_hide(ports):
    report = align_files(ports / "hf_eager.h5", ports / "mg.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    masks = [t for r in report["records"] for t in r["tensors"] if t["key"] == "kwargs.attention_mask"]
    assert len(masks) == 4 and all(t["metrics"]["identical"] for t in masks)  # 2 layers x (layer, attention)
    assert all(t["shape_a"] == [2, 1, 16, 16] and t["shape_b"] == [1, 1, 16, 16] for t in masks)


def test_megatron_statistics_traces_align_and_name_the_origin(ports):
    clean = align_files(ports / "hf_stats.h5", ports / "mg_stats.h5")
    assert clean["verdict"] == "aligned" and clean["basis"] == "stats"
    eps = align_files(ports / "hf_stats.h5", ports / "mg_stats_eps.h5")
    assert _origin(eps, "forward") == "model.layers.1.post_attention_layernorm"
    assert eps["next_pass"]["layers"] == "1:2"  # the window to trace in full mode, valid in both namings


def test_megatron_as_the_reference_names_its_own_modules(ports):
    eps = align_files(ports / "mg.h5", ports / "hf_eps.h5")
    assert _origin(eps, "forward") == "decoder.layers.1.pre_mlp_layernorm"
    assert eps["forward"]["first_divergence"]["hparam_diff"]["eps"] == [1e-6, 1e-5]
    weight = align_files(ports / "mg.h5", ports / "hf_weight.h5")  # torch_llama's weight defect: k_proj
    origin = weight["forward"]["first_divergence"]
    assert origin["module"] == "decoder.layers.1.self_attention.linear_qkv"
    assert origin["tensor"]["key"] == "out.0[k_proj]"  # the fused output, compared part by part
    assert align_files(ports / "mg.h5", ports / "hf.h5")["verdict"] == "aligned"


def test_megatron_mapping_is_printed_with_its_evidence(ports):
    code, out, err = run_cli("align", ports / "hf.h5", ports / "mg.h5")
    assert code == 0, err
    assert "decoder.layers.*.self_attention.linear_qkv -> model.layers.*.self_attn.q_proj + " \
           "model.layers.*.self_attn.k_proj + model.layers.*.self_attn.v_proj x2" in out.replace("\n", "")
    assert "fused qkv, same weights" in out


def test_weights_round_trip_hf_megatron_hf_bit_exactly_with_the_rules(ports):
    exact = json.loads((ports / "torch.json").read_text())["weights_exact"]
    assert exact == {"to_megatron": True, "round_trip": True}


def test_checkpoint_diff_reports_per_hf_parameter(ports):
    code, out, err = run_cli("weights", "diff", ports / "hf.safetensors", ports / "mg.pt", "-o", ports / "ck.json")
    assert code == 1, err
    report = json.loads((ports / "ck.json").read_text())
    summary = report.pop("__summary__")
    assert summary["compared"] == 21 and not summary["missing_in_b"] and not summary["extra_in_b"]
    differ = {name: e for name, e in report.items() if e["status"] != "identical"}
    assert list(differ) == ["model.layers.1.self_attn.k_proj.weight"]  # only the K part of the fused weight
    assert "part 2 of 3 of decoder.layers.1.self_attention.linear_qkv.weight" in differ[
        "model.layers.1.self_attn.k_proj.weight"]["b_name"]


def test_trace_loads_hf_weights_into_megatron(ports, tmp_path):
    # the weight defect scales linear_proj; loading the HF weights (names and layouts converted) undoes it
    code, _, err = run_cli("trace", "megatron_llama", "--arg", "defect=weight", "--weights", ports / "hf.safetensors",
                           "-o", tmp_path / "mg.h5", "-q")
    assert code == 0, err
    assert align_files(ports / "hf.h5", tmp_path / "mg.h5")["verdict"] == "aligned"


def test_bisect_replays_and_searches_megatron_through_the_mapping(ports, tmp_path):
    code, out, err = run_cli("bisect", ports / "hf.h5", "megatron_llama", "--arg", "defect=eps", "-q",
                             "--workdir", tmp_path / "replay")
    assert code == 1 and out.startswith("own_error: forward model.layers.1.post_attention_layernorm;"), out + err
    code, out, err = run_cli("bisect", ports / "hf.h5", "megatron_llama", "--arg", "defect=eps", "--search",
                             "--workdir", tmp_path / "search")
    assert code == 1 and "model.layers.1: block 1 is the first whose output does not recover" in out, out + err
    assert "--include '^decoder\\.layers\\.1(\\.|$)'" in out  # the next command, in the candidate's names


def test_bisect_replays_the_mindformers_port(ports, tmp_path):
    code, out, err = run_cli("bisect", ports / "hf.h5", "mindformers_llama", "--arg", "impl=port", "--arg",
                             "defect=act", "-q", "--workdir", tmp_path / "w")
    assert code == 1 and out.startswith("own_error: forward model.layers.0.mlp.act_fn;"), out + err


def test_mindformers_port_logits_match_hf(ports):
    hf, mf = np.load(ports / "hf_logits.npy"), np.load(ports / "mf_logits.npy")
    assert np.abs(hf - mf).max() < 1e-5 * np.abs(hf).max()


def test_mindformers_clean_pair_aligns_with_no_flags(ports):
    report = align_files(ports / "hf.h5", ports / "mf.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    mapping = {m["b"]: m["a"] for m in report["mapping"]}
    assert mapping["model.layers.0.attention.wk"] == "model.layers.0.self_attn.k_proj"
    assert mapping["model.layers.0.attention.wv"] == "model.layers.0.self_attn.v_proj"
    assert mapping["model.layers.0.feed_forward.w1.activation"] == "model.layers.0.mlp.act_fn"
    root = next(r for r in report["records"] if r["kind"] == "call" and r["phase"] == "forward" and not r["path"])
    labels = next(t for t in root["tensors"] if t["key"] == "kwargs.labels")
    assert labels["metrics"]["identical"] and "shifted" in labels["metrics"]["note"]


@pytest.mark.parametrize("defect", MINDFORMERS_DEFECTS)
def test_mindformers_defects_named_in_hf_names(ports, defect):
    from layerdiff.recipes.mindformers_llama import DEFECTS

    direction, origin = DEFECTS[defect]
    report = align_files(ports / "hf.h5", ports / f"mf_{defect}.h5")
    assert _origin(report, direction) == origin
    if defect == "act":
        assert report["forward"]["first_divergence"]["hparam_diff"]["type"] == ["SiLUActivation", "GELU"]


def test_mindformers_primitives_are_operations_and_its_score_scaling_is_named(ports):
    """MindSpore Transformers calls Primitive instances (``P.BatchMatMul(transpose_b=True)(q, k)``, ``P.Softmax()``,
    ``P.Tile()``), whose classes define ``__call__`` themselves: wrapping ``Primitive.__call__`` recorded none of
    them, and a wrong score scaling was named at a reshape. Now, against HF's eager attention, it is named at HF's
    ``matmul(...) * scaling`` against the port's ``* self.inv_norm_factor``: the batched matmul before it, whose
    output agrees, took the key untransposed (``transpose_b``), which is no divergence; against SDPA, at SDPA. A
    reshape is not paired with a reshape of inputs in unrelated layouts (HF's of SDPA's output was paired with the
    port's of its repeated key heads, and named)."""
    import transformers.models.llama.modeling_llama

    from layerdiff.recipes import mindformers_llama

    with open_trace(ports / "mf_ops_owncode.h5") as trace:
        names = {op.name for op in trace.ops}
    assert {"ops.BatchMatMul", "ops.Softmax", "ops.Tile"} <= names, sorted(names)
    hf_lines = Path(transformers.models.llama.modeling_llama.__file__).read_text().splitlines()
    scaled = next(i for i, text in enumerate(hf_lines, 1) if "torch.matmul(query, key_states.transpose(2, 3))" in text)
    port_lines = Path(mindformers_llama.__file__).read_text().splitlines()
    port = next(i for i, text in enumerate(port_lines, 1) if "* self.inv_norm_factor" in text)
    origin = align_files(ports / "hf_ops_eager.h5", ports / "mf_ops_owncode.h5")["forward"]["first_divergence"]
    assert (origin["module"], origin["where"]) == ("model.layers.1.self_attn", "op"), origin["description"]
    assert origin["op"]["source"].endswith(f"modeling_llama.py:{scaled}"), origin["op"]
    assert origin["op"]["source_b"].endswith(f"mindformers_llama.py:{port}"), origin["op"]
    origin = align_files(ports / "hf_ops.h5", ports / "mf_ops_owncode.h5")["forward"]["first_divergence"]
    assert (origin["where"], origin["op"]["kind"]) == ("op", "scaled_dot_product_attention"), origin["description"]
    for clean in ("hf_ops.h5", "hf_ops_eager.h5"):
        assert align_files(ports / clean, ports / "mf_ops.h5")["verdict"] == "aligned", clean


def test_mindformers_fused_qkv_and_interleaved_gate_up(ports):
    report = align_files(ports / "hf.h5", ports / "mf_concat.h5")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    fused = {m["b"]: m for m in report["mapping"] if m.get("rule")}
    assert fused["model.layers.0.attention.w_qkv"]["rule"] == "qkv"
    assert fused["model.layers.0.feed_forward.w_gate_hidden"]["rule"] == "gate_up"
    defect = align_files(ports / "hf.h5", ports / "mf_concat_weight.h5")
    assert _origin(defect, "forward") == "model.layers.1.self_attn.k_proj"


def test_real_mindformers_when_installed(tmp_path):
    """The port stands in for mindformers in CI (mindformers 2.0 needs a package the registry does not serve);
    where mindformers is installed, the real model must give the same trace structure and numbers."""
    pytest.importorskip("mindformers", reason="mindformers is not installable here (see docs/ports.md); the port stands in")
    script = """
import sys, layerdiff
from layerdiff.recipes import mindformers_llama as mf
for impl in ("real", "port"):
    built = mf.build(None, impl=impl)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/{impl}.h5"):
        built["step"]()
"""
    run_scripts(tmp_path, {"real": script})
    report = align_files(tmp_path / "port.h5", tmp_path / "real.h5")
    assert report["verdict"] == "aligned" and not report["mapping"]  # the same names: nothing to infer
    assert all(t["metrics"]["identical"] for r in report["records"] for t in r["tensors"])  # bit-identical
    # only the loss cell's custom-bprop children, whose backward records MindSpore nests differently per run
    assert {r["path"] for r in report["only_a"] + report["only_b"]} <= {"loss._nllloss", "loss._log_softmax"}
