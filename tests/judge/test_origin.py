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
