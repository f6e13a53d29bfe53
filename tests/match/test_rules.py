"""The framework-free pieces behind real ports: rule sets, fused tensors, per-tensor layouts, module matching from
evidence, parameter plans. No framework is imported here."""
from __future__ import annotations

import numpy as np
import pytest

from builders import Trace

from layerdiff.match import fusion, modules, paramplan
from layerdiff.match.layouts import TokenOrder, relate_shapes
from layerdiff.match.mapping import match_modules
from layerdiff.match.rename import RenameRules
from layerdiff.match.operands import Operand, combine_stats
from layerdiff.match.rules import builtin, ruleset
from layerdiff.tracefile.tensors import summarize
from layerdiff.errors import LayerdiffError

RULES = builtin()


# ---------------------------------------------------------------------------------------------- fused tensors
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_split_and_merge_are_inverses(groups):
    rng = np.random.default_rng(0)
    fused = rng.standard_normal((4 * groups + 2 * groups, 3)).astype(np.float32)
    parts = fusion.split(fused, 0, [4 * groups, groups, groups], groups)
    assert [p.shape for p in parts] == [(4 * groups, 3), (groups, 3), (groups, 3)]
    assert np.array_equal(fusion.merge(parts, 0, groups), fused)


def test_megatron_qkv_groups_interleave_heads():
    # 2 query groups, 2 q heads of 1 row each per group: rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    fused = np.arange(8)[:, None]
    q, k, v = fusion.split(fused, 0, [4, 2, 2], 2)
    assert q.ravel().tolist() == [0, 1, 4, 5] and k.ravel().tolist() == [2, 6] and v.ravel().tolist() == [3, 7]
    with pytest.raises(ValueError, match="add up"):
        fusion.split(fused, 0, [4, 2, 1], 1)


def test_group_count_from_hparams_and_from_the_weights():
    assert fusion.group_candidates(["num_query_groups"], [{}, {"num_query_groups": 2}], [64, 32, 32]) == [2, 1]
    assert fusion.group_candidates(["min_part/head_dim"], [{"head_dim": 16}], [64, 32, 32]) == [2, 1]
    assert fusion.group_candidates(["x"], [{"x": 3}], [64, 32, 32]) == [1]  # 3 does not divide the parts
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 4)) for n in (8, 4, 4)]
    fused = fusion.merge(parts, 0, 4)
    assert fusion.infer_groups(fused, parts) == 4
    defective = [parts[0], parts[1] * 1.01, parts[2]]  # one part differs: the others still decide
    assert fusion.infer_groups(fused, defective) == 4
    assert fusion.infer_groups(fused, [rng.standard_normal(p.shape) for p in parts]) is None


# ---------------------------------------------------------------------------------------------- layouts
def test_sequence_first_activations_are_permuted_and_back():
    a = np.random.default_rng(0).standard_normal((2, 16, 8))
    relation = relate_shapes((2, 16, 8), (16, 2, 8))
    assert relation.kind == "permute" and "reordered" in relation.note()
    b = a.transpose(1, 0, 2).copy()
    va, vb = relation.views(a, b)
    assert np.array_equal(va, vb) and np.array_equal(relation.to_b(a), b)
    # batch size equal to sequence length: the shapes cannot tell; the declared hint decides
    square = np.random.default_rng(1).standard_normal((4, 4, 8))
    assert relate_shapes((4, 4, 8), (4, 4, 8)).kind == "same"
    hinted = relate_shapes((4, 4, 8), (4, 4, 8), swap_leading=True)
    assert np.array_equal(*hinted.views(square, square.transpose(1, 0, 2).copy()))


def test_flattened_tokens_of_a_sequence_first_run_are_reordered():
    # an MoE router flattens its input: HF's [b * s, h] is batch-major, Megatron's [s * b, h] sequence-major
    batch, seq, hidden = 2, 8, 4
    hf = np.random.default_rng(0).standard_normal((batch, seq, hidden))
    megatron = hf.transpose(1, 0, 2).copy()
    flat_hf, flat_megatron = hf.reshape(-1, hidden), megatron.reshape(-1, hidden)
    assert relate_shapes(flat_hf.shape, flat_megatron.shape, True).kind == "same"  # shapes alone cannot tell
    for order, (a, b) in ((TokenOrder("b", batch, seq), (flat_hf, flat_megatron)),
                          (TokenOrder("a", batch, seq), (flat_megatron, flat_hf)),  # Megatron as the reference
                          (TokenOrder("b", batch, seq), (flat_hf, megatron)),  # one side flattened only
                          (TokenOrder("b", batch, seq), (hf, flat_megatron))):
        relation = relate_shapes(a.shape, b.shape, order)
        assert relation.kind == "permute", (order, a.shape, b.shape)
        va, vb = relation.views(a, b)
        assert np.array_equal(va, vb) and np.array_equal(relation.to_b(a), b)
    # tensors that do not lead with the step's tokens are left alone
    assert relate_shapes((4, 16), (4, 16), TokenOrder("b", batch, seq)).kind == "same"
    assert relate_shapes((16, 3), (16, 4), TokenOrder("b", batch, seq)).kind != "permute"


def test_rotary_table_broadcasts_and_flattened_tokens_reshape():
    angles = np.random.default_rng(0).standard_normal((16, 1, 1, 8))
    relation = relate_shapes((2, 16, 8), (16, 1, 1, 8))
    assert relation.kind == "broadcast"
    per_batch = np.broadcast_to(angles.reshape(1, 16, 8), (2, 16, 8))
    assert np.array_equal(*relation.views(per_batch, angles)) and np.array_equal(relation.to_b(per_batch), angles)
    assert relate_shapes((32, 64), (2, 16, 64)).kind == "reshape"
    assert relate_shapes((2, 16, 64), (2, 16, 32)).kind == "mismatch"


# ---------------------------------------------------------------------------------------------- rule sets
def test_builtin_tokens_and_families():
    assert {RULES.token(n) for n in ("wq", "q_proj", "query")} == {"q"}
    assert RULES.token("linear_qkv") == "qkv" and RULES.token("w3") == "up" and RULES.token("ffn_norm") == "mlp_norm"
    assert RULES.family("ColumnParallelLinear") == RULES.family("Linear") == "linear"
    assert RULES.family("TransformerLayer") == RULES.family("LlamaDecoderLayer") == "layer"
    assert RULES.fused_rule("linear_qkv").parts == ("q", "k", "v")
    assert RULES.is_sequence_first("megatron.core.models.gpt.gpt_model.GPTModel")
    assert RULES.bool_mask_means_masked("megatron.core.models.gpt.gpt_model.GPTModel")
    assert not RULES.bool_mask_means_masked("transformers.models.llama.modeling_llama.LlamaForCausalLM")


def test_user_rule_file_adds_names_and_fused_modules(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[names]\nq = ["my_query"]\n\n[[fused]]\nname = "kv"\nmodule = "^kv_proj$"\n'
                    'parts = ["k", "v"]\ngroups = ["n_heads", 2]\n')
    rules = ruleset([path])
    assert rules.token("my_query") == "q" and rules.token("wq") == "q"  # built-in names stay
    rule = rules.fused_rule("kv_proj")
    assert rule.name == "kv" and rule.groups == ("n_heads", 2) and str(path) in rule.source


def test_moved_parameters_go_by_the_name_where_they_belong(tmp_path):
    rules = ruleset()
    assert rules.param_home("decoder.layers.3.self_attention.linear_qkv.layer_norm_bias") == \
        "decoder.layers.3.input_layernorm.bias"
    assert rules.param_home("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.3.pre_mlp_layernorm.weight"
    assert rules.param_home("x.my_self_attention.linear_qkv.layer_norm_weight").startswith("x.my_self")  # at a dot
    both = ["l.input_layernorm.weight", "l.self_attention.linear_qkv.layer_norm_weight"]
    assert rules.param_homes(both) == {n: n for n in both}  # a model that keeps both is not fused: neither moves
    path = tmp_path / "mine.toml"
    path.write_text('[moved_params]\n"attn.qkv.norm_" = "attn_norm."\n')
    mine = ruleset([path])
    assert mine.param_home("blocks.0.attn.qkv.norm_scale") == "blocks.0.attn_norm.scale"
    assert mine.param_home("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight").endswith(
        "input_layernorm.weight")


@pytest.mark.parametrize("text, message", [
    ('[[fused]]\nmodule = "(unclosed"\nparts = ["k", "v"]\n', "bad regular expression"),
    ('[[fused]]\nmodule = "x"\nparts = ["k"]\n', "at least two parts"),
    ('[[fused]]\nmodule = "x"\nparts = ["k", "v"]\ngroups = [0]\n', "positive integers"),
    ('[aliases]\nq = ["x"]\n', "unknown section"),
    ('moved_params = ["attn.norm_"]\n', "maps a stored name piece"),
    ('[[masks]]\nkeys = ["m"]\nsequence_first = ["^x"]\n', "unknown key.*sequence_first.*before the first table"),
    ('[moved_params]\n"attn.norm_" = 3\n', "maps a stored name piece"),
    ('names = 3 = 4\n', "not valid TOML"),
])
def test_bad_rule_files_are_one_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(LayerdiffError, match=message) as err:
        ruleset([path])
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(LayerdiffError, match="no such rule file"):
        ruleset([tmp_path / "missing.toml"])


# ---------------------------------------------------------------------------------------------- matching
def _infos(layer_modules, prefix, with_values=True, seed=0):
    """Module infos of a two-layer model from (local name, type, rows) per layer, in execution order."""
    rng = np.random.default_rng(seed)
    params = []
    for layer in range(2):
        for name, _, rows in layer_modules:
            values = rng.standard_normal((rows, 8)).astype(np.float32)
            params.append((f"{prefix}.{layer}.{name}.weight", values.shape,
                           summarize(values, "float32") if with_values else None))
    infos = modules.from_params(params)
    types = {name: type_name for name, type_name, _ in layer_modules}
    for info in infos.values():
        info.type = types.get(info.local, info.type)
    return infos


HF = [("self_attn.q_proj", "Linear", 8), ("self_attn.k_proj", "Linear", 4), ("self_attn.v_proj", "Linear", 4)]
MF = [("attention.wq", "Linear", 8), ("attention.wk", "Linear", 4), ("attention.wv", "Linear", 4)]


def test_names_decide_between_same_shaped_modules_without_values():
    """The swap reported in the issue: wk/wv have the shapes of k_proj/v_proj; their names say which is which."""
    a = _infos([(n.split(".")[1], t, r) for n, t, r in HF], "model.layers", with_values=False)
    b = _infos([(n.split(".")[1], t, r) for n, t, r in MF], "model.layers", with_values=False, seed=5)
    pairs = {m.b[0]: m.a[0] for m in match_modules(a, b, RULES).matches}
    assert pairs["model.layers.0.wk"] == "model.layers.0.k_proj"
    assert pairs["model.layers.0.wv"] == "model.layers.0.v_proj"
    assert pairs["model.layers.1.wk"] == "model.layers.1.k_proj"  # never across layers


def test_weights_decide_when_names_say_nothing():
    """Unknown names, equal shapes, and B's order reversed: the value fingerprints still pair them right."""
    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    a = modules.from_params([(f"blocks.0.{n}.weight", w.shape, summarize(w, "float32")) for n, w in (("p1", w1), ("p2", w2))])
    b = modules.from_params([(f"blocks.0.{n}.weight", w.shape, summarize(w, "float32")) for n, w in (("x", w2), ("y", w1))])
    mapping = match_modules(a, b, RULES)
    pairs = {m.b[0]: m.a[0] for m in mapping.matches}
    assert pairs["blocks.0.x"] == "blocks.0.p2" and pairs["blocks.0.y"] == "blocks.0.p1"
    assert "same weights" in mapping.for_b("blocks.0.x").evidence
    used = [p for m in mapping.matches for p in m.a]
    assert len(used) == len(set(used)), "a module is never matched twice"


def test_fused_module_matches_its_parts_and_user_rules_override():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 8)).astype(np.float32) for n in (8, 4, 4))
    hf = modules.from_params([(f"m.attn.{n}_proj.weight", w.shape, summarize(w, "float32"))
                              for n, w in zip("qkv", (q, k, v))])
    fused = fusion.merge([q, k, v], 0, 2)
    mg = modules.from_params([("d.self_attention.linear_qkv.weight", fused.shape, summarize(fused, "float32"))])
    mapping = match_modules(hf, mg, RULES)
    match = mapping.for_b("d.self_attention.linear_qkv")
    assert match.a == ("m.attn.q_proj", "m.attn.k_proj", "m.attn.v_proj") and match.rule == "qkv"
    assert "same weights" in match.evidence and mapping.for_b("d.self_attention").a == ("m.attn",)
    # a --map rule fixes a pair; the inference fills in the rest around it
    forced = match_modules(hf, mg, RULES, RenameRules([(r"^d\.self_attention$", "m")]))
    assert forced.for_b("d.self_attention").a == ("m",)
    # weights: split back with the group count the values confirm
    plans, missing, used = paramplan.plan(mapping, {f"m.attn.{n}_proj.weight": w.shape for n, w in zip("qkv", (q, k, v))},
                                          {"d.self_attention.linear_qkv.weight": fused.shape}, "a")
    assert not missing and used == {"d.self_attention.linear_qkv.weight"}
    state = {"d.self_attention.linear_qkv.weight": fused}
    own = {f"m.attn.{n}_proj.weight": w for n, w in zip("qkv", (q, k, v))}
    for plan in plans:
        groups = paramplan.group_count(plan, RULES, [], load=state.__getitem__, own_load=own.__getitem__)
        assert groups == 2 and np.array_equal(paramplan.build(plan, state.__getitem__, groups), own[plan.name])


# ---------------------------------------------------------------------------------------------- operands
def test_merged_statistics_and_value_transforms():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(100), rng.standard_normal(50)
    merged = combine_stats([summarize(x, "float64"), summarize(y, "float64")])
    whole = summarize(np.concatenate([x, y]), "float64")
    assert merged["numel"] == 150 and abs(merged["l2"] - whole["l2"]) < 1e-9 and abs(merged["mean"] - whole["mean"]) < 1e-12

    trace = Trace()
    labels = trace.put("input", "labels", [[5, 6, 7]], "int64")
    shifted = Operand((labels,), op="shift_left").values(trace)
    assert shifted.tolist() == [[6, 7, -100]]
    additive = trace.put("input", "mask", [[0.0, -1e9]], "float32")
    keep = trace.put("input", "mask", [[True, False]], "bool")
    drop = trace.put("input", "mask", [[False, True]], "bool")
    a = Operand((additive,), op="masked").values(trace)
    b = Operand((keep,), op="masked").values(trace)
    c = Operand((drop,), op="masked", bool_masked=True).values(trace)
    assert a.tolist() == b.tolist() == c.tolist() == [[0.0, 1.0]]


def test_mindnlp_models_are_refused_with_what_to_do():
    from layerdiff.adapters import detect_framework

    model = type("LlamaForCausalLM", (), {"__module__": "mindnlp.transformers.models.llama.modeling_llama"})()
    with pytest.raises(LayerdiffError, match="mindnlp/mindtorch models .* not supported.*Trace the original"):
        detect_framework(model)
