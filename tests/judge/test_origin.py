"""The aligner names the module where an injected defect originates, and stays quiet on clean pairs."""
import pytest

pytest.importorskip("torch")

from layerdiff.compare.spec import Comparison  # noqa: E402
from layerdiff.compare.tolerance import TolerancePolicy  # noqa: E402
from layerdiff.recipes.torch_llama import DEFECTS  # noqa: E402

pytestmark = [pytest.mark.torch]

FORWARD_DEFECTS = [d for d, (direction, _) in DEFECTS.items() if direction == "forward"]


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_injected_defect_is_named_at_its_origin(recipe_trace, align_paths, defect):
    direction, module = DEFECTS[defect]
    report = align_paths(recipe_trace(), recipe_trace(defect))
    assert report["verdict"] == "divergent"
    assert report[direction]["first_divergence"]["module"] == module
    if direction == "backward":  # a backward-only bug leaves forward alone
        assert report["forward"]["status"] == "aligned"
        assert report["forward"]["first_divergence"] is None
        assert report["backward"]["first_divergence"]["where"] == "module"
    else:  # and a forward bug's backward divergence is attributed to it, not to a downstream module
        back = report["backward"]["first_divergence"]
        assert back["module"] == module and back["where"] == "forward"


def test_norm_eps_defect_shows_the_hyperparameter_difference(recipe_trace, align_paths):
    origin = align_paths(recipe_trace(), recipe_trace("eps"))["forward"]["first_divergence"]
    assert origin["hparam_diff"]["eps"] == [1e-6, 1e-5]
    assert origin["where"] == "module"
    assert origin["chain"] == ["<root>", "model", "model.layers.1", "model.layers.1.post_attention_layernorm"]


def test_swapped_activation_shows_the_type_difference(recipe_trace, align_paths):
    origin = align_paths(recipe_trace(), recipe_trace("act"))["forward"]["first_divergence"]
    assert origin["hparam_diff"]["type"] == ["SiLUActivation", "GELU"] or origin["hparam_diff"]["type"][1] == "GELU"


def test_own_code_defect_names_the_children_around_it(recipe_trace, align_paths):
    origin = align_paths(recipe_trace(), recipe_trace("owncode"))["forward"]["first_divergence"]
    assert origin["where"] == "own_code"
    assert origin["between"] == ["model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"]
    assert origin["description"] == "model.layers.1.self_attn, own code between v_proj and o_proj"
    assert "scaling" in origin["hparam_diff"]
    # the first tensor over tolerance is o_proj's output, downstream of the real origin
    report = align_paths(recipe_trace(), recipe_trace("owncode"))
    assert report["forward"]["first_over_tolerance"]["module"] == "model.layers.1.self_attn.o_proj"


def test_own_code_after_last_child(recipe_trace, align_paths):
    origin = align_paths(recipe_trace(), recipe_trace("residual"))["forward"]["first_divergence"]
    assert origin["description"] == "model.layers.1, own code after mlp"
    assert origin["between"] == ["model.layers.1.mlp", None]


def test_perturbed_weight_reports_the_parameter(recipe_trace, align_paths):
    report = align_paths(recipe_trace(), recipe_trace("weight"))
    origin = report["forward"]["first_divergence"]
    assert [p["name"] for p in origin["param_diffs"]] == ["model.layers.1.self_attn.k_proj.weight"]
    assert report["params"]["differ"] == ["model.layers.1.self_attn.k_proj.weight"]


def test_nan_origin_is_reported_for_the_candidate_only(recipe_trace, align_paths):
    report = align_paths(recipe_trace(), recipe_trace("nan"))
    assert report["first_nonfinite"]["a"] is None
    nan = report["first_nonfinite"]["b"]
    assert (nan["module"], nan["phase"], nan["nan"]) == ("model.layers.1.mlp.gate_proj", "forward", 1)



def test_the_block_table_shows_where_nan_spreads_not_zeros(recipe_trace, align_paths):
    """A NaN in one run only: the tensor's other metrics are over the values finite in both (0 and cosine 1 at
    the origin), so the block table says how many elements are NaN or infinite in one run only, and the origin's
    metrics say what they are over."""
    from rich.console import Console

    from layerdiff.report.terminal import render

    report = align_paths(recipe_trace(), recipe_trace("nan"))
    rows = {row["module"]: row for row in report["growth"]}
    origin = rows["model.layers.1.mlp.gate_proj"]
    assert origin["origin"] and origin["nonfinite"] == 1 and origin["max_abs"] == 0
    assert rows["model.layers.0"]["nonfinite"] == 0 and rows["model.layers.1.mlp.down_proj"]["nonfinite"] > 1
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "model.layers.1.mlp.gate_proj" in line and "<- origin" in line)
    assert row.split()[2:] == ["NaN/Inf", "x1", "-", "-", "<-", "origin"], row
    assert "(over the values finite in both)" in text


@pytest.mark.parametrize("variant", [None, "reimpl"])
def test_clean_pairs_raise_no_alarm(recipe_trace, align_paths, variant):
    """Same model twice, and an honest fp32 reimplementation (eager attention, RMSNorm by division)."""
    a = recipe_trace()
    b = recipe_trace(variant) if variant else recipe_trace(seed=0, batch=2)  # a second, separate run
    assert a != b
    report = align_paths(a, b)
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    assert report["forward"]["status"] == report["backward"]["status"] == "aligned"
    assert report["forward"]["first_divergence"] is None and report["backward"]["first_divergence"] is None
    if variant == "reimpl":  # the reimplementation really does differ, just within fp32 tolerance
        rows = [t for r in report["records"] for t in r["tensors"]]
        assert any(not t["metrics"]["identical"] for t in rows)


def test_fp32_tolerance_sits_between_honest_noise_and_a_1e4_defect(recipe_trace, align_paths):
    """Margins, measured: the reimplementation's worst relative error vs the 1e-4 weight defect's."""
    def worst(report):
        return max(t["metrics"]["max_abs"] / t["metrics"]["ref_max_abs"] for r in report["records"]
                   for t in r["tensors"] if t["metrics"].get("ref_max_abs"))

    noise = worst(align_paths(recipe_trace(), recipe_trace("reimpl")))
    defect = worst(align_paths(recipe_trace(), recipe_trace("weight")))
    rtol = TolerancePolicy().for_tensor("x", "float32", "float32").rtol
    assert noise * 4 < rtol < defect / 4


def test_stats_mode_traces_align_on_statistics(recipe_trace, align_paths):
    clean = align_paths(recipe_trace(mode="stats"), recipe_trace(seed=0, mode="stats", batch=2))
    assert clean["basis"] == "stats" and clean["verdict"] == "aligned"
    report = align_paths(recipe_trace(mode="stats"), recipe_trace("eps", mode="stats"))
    assert report["basis"] == "stats"
    assert report["forward"]["first_divergence"]["module"] == DEFECTS["eps"][1]
    assert all(t["metrics"]["cosine"] is None for r in report["records"] for t in r["tensors"])


def test_bf16_run_judged_with_bf16_tolerance(recipe_trace, align_paths):
    """fp32 reference vs the same model in bf16: large raw differences, but within bf16 defaults."""
    report = align_paths(recipe_trace(), recipe_trace(dtype="bfloat16"))
    row = next(r for r in report["records"] if r["path"] == "model.layers.0.self_attn.q_proj"
               and r["phase"] == "forward")
    out = next(t for t in row["tensors"] if t["role"] == "output")
    assert out["dtype_b"] == "bfloat16" and out["tolerance"]["cos"] == 0.9999
    assert 0 < out["metrics"]["max_abs"] and out["passed"]


def test_per_module_tolerance_rule_silences_only_that_module(recipe_trace, align_paths):
    loose = TolerancePolicy(rules=[(r"post_attention_layernorm$", {"atol": 1.0, "cos": 0.9})])
    report = align_paths(recipe_trace(), recipe_trace("eps"), Comparison(policy=loose))
    origin = report["forward"]["first_divergence"]
    assert origin is not None and origin["module"] != DEFECTS["eps"][1]


def test_the_footer_counts_the_parameters_gradients_that_differ(recipe_trace, align_paths):
    """A backward defect leaves every parameter's value alike: the footer said 'parameters: 0 of 21 differ' and
    nothing of the gradients that do."""
    from rich.console import Console

    from layerdiff.report.terminal import render

    report = align_paths(recipe_trace(), recipe_trace("backward"))
    params = report["params"]
    assert not params["differ"] and params["grads_differ"]
    console = Console(record=True, width=200)
    render(report, console)
    assert (f"parameters: 0 of {params['compared']} differ; their gradients: {len(params['grads_differ'])} of "
            f"{params['grads_compared']} differ") in console.export_text()


def _starcoder2_stats_trace(path, weight_scale: float = 1.0, residual_shift: float = 0.0, ops: bool = False) -> None:
    """A tiny transformers StarCoder 2 (LayerNorm, linear biases made nonzero) traced in stats mode: its second
    layer's attention output weight scaled by ``weight_scale``; ``residual_shift`` added to what that layer's own
    code hands its second norm (a hook on the norm's input: the layer's own code, as the trace sees it)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    import layerdiff

    config = AutoConfig.for_model("starcoder2", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[1]
    with torch.no_grad():
        noise = torch.Generator().manual_seed(2)
        for p in model.parameters():
            if p.dim() == 1:  # biases of 0.1: the scaled weight's share of the projection's output is small
                p.add_(0.1 * torch.randn(p.shape, generator=noise))
        layer.self_attn.o_proj.weight.mul_(weight_scale)
    if residual_shift:
        layer.post_attention_layernorm.register_forward_pre_hook(lambda module, args: (args[0] + residual_shift,))
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with layerdiff.trace(model, path, mode="stats", ops=ops):
        F.cross_entropy(model(input_ids=ids).logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()


@pytest.mark.parametrize("ops", [False, True])
def test_a_weight_whose_output_moved_within_tolerance_is_the_origin_not_the_code_after_it(tmp_path, align_paths,
                                                                                          ops):
    """In a statistics trace a weight scaled by 1 + 1e-3 beside a larger bias moved its Linear's min/max/mean/RMS by
    2.7e-5 of their magnitude, under fp32's tolerance, and the decoder layer's residual add after it went over:
    the layer's own code was named, while the parameters' comparison named the weight (found in the Megatron sweep,
    StarCoder 2); with operations recorded, the residual add. A weight scaled by 1 + 3e-5, which differs but moves
    its output by less than a tenth of the tolerance, leaves a defect in that code named there."""
    _starcoder2_stats_trace(tmp_path / "a.h5", ops=ops)
    _starcoder2_stats_trace(tmp_path / "b.h5", weight_scale=1 + 1e-3, ops=ops)
    report = align_paths(tmp_path / "a.h5", tmp_path / "b.h5")
    origin = report["forward"]["first_divergence"]
    out = next(t for r in report["records"] if r["path"] == "model.layers.1.self_attn.o_proj"
               and r["phase"] == "forward" for t in r["tensors"] if t["role"] == "output")
    assert out["passed"]  # within tolerance: what made the rule necessary
    assert report["forward"]["first_over_tolerance"]["module"] == "model.layers.1.post_attention_layernorm"
    assert origin["module"] == "model.layers.1.self_attn.o_proj" and origin["where"] == "module"
    assert [p["name"] for p in origin["param_diffs"]] == ["model.layers.1.self_attn.o_proj.weight"]
    carried = "Tensor.add at modeling_starcoder2.py" if ops else \
        "own code between self_attn and post_attention_layernorm"
    assert carried in origin["tensor"]["reason"] and origin["tensor"]["reason"].endswith("carried it over tolerance")
    assert origin["tensor"]["within_tolerance"] is True
    if ops:
        return
    from rich.console import Console

    from layerdiff.report.terminal import render

    console = Console(record=True, width=400)
    render(report, console)
    text = console.export_text()
    assert "inputs agree; output out: moved" in text and "output out differs" not in text
    _starcoder2_stats_trace(tmp_path / "c.h5", weight_scale=1 + 3e-5, residual_shift=1e-3)
    report = align_paths(tmp_path / "a.h5", tmp_path / "c.h5")
    assert report["params"]["differ"] == ["model.layers.1.self_attn.o_proj.weight"]
    origin = report["forward"]["first_divergence"]
    assert origin["description"] == "model.layers.1, own code between self_attn and post_attention_layernorm"
