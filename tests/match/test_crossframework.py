"""Every framework pair through the real CLI, each framework in its own process: the paddle-mindspore pair
(torch-paddle and torch-mindspore are in test_paddle.py / test_mindspore.py), and weight round-trips."""
import numpy as np
import pytest

from layerdiff.checkpoints import safetensors_io
from layerdiff.recipes.llama_shared import DEFECTS  # every port's (no framework imported here)

from conftest import run_cli, run_cli_runs, run_python, skip_unless_installed

skip_unless_installed("torch", "mindspore", "paddle")  # each runs in processes of its own

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.paddle, pytest.mark.mindspore]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("xfw")
    jobs = {"pd": ("paddle_llama", None), "ms": ("mindspore_llama", None), "ms_eps": ("mindspore_llama", "eps"),
            "ms_backward": ("mindspore_llama", "backward"), "pd_owncode": ("paddle_llama", "owncode"),
            "ms_act": ("mindspore_llama", "act"), "pd_weight": ("paddle_llama", "weight"),
            "pd_backward": ("paddle_llama", "backward")}
    for framework in ("paddle", "mindspore"):  # one process for each framework's runs (its import once)
        code, _, err = run_cli_runs(*(["trace", recipe, "-o", d / f"{name}.h5", "-q"] +
                                      (["--arg", f"defect={defect}"] if defect else [])
                                      for name, (recipe, defect) in jobs.items() if recipe.startswith(framework)))
        assert code == 0, err[-2000:]
    return d


def test_paddle_and_mindspore_clean_traces_align(traces):
    code, out, err = run_cli("align", traces / "pd.h5", traces / "ms.h5", "-q")
    assert code == 0, out + err
    assert out.startswith("aligned: forward aligned; backward aligned")


@pytest.mark.parametrize("a, b, defect", [("pd", "ms_eps", "eps"), ("pd", "ms_act", "act"),
                                          ("ms", "pd_weight", "weight"), ("ms", "pd_owncode", "owncode"),
                                          ("pd", "ms_backward", "backward"), ("ms", "pd_backward", "backward")])
def test_defects_named_across_paddle_and_mindspore(traces, a, b, defect, tmp_path):
    code, _, err = run_cli("align", traces / f"{a}.h5", traces / f"{b}.h5", "--json", tmp_path / "r.json", "-q")
    assert code == 1, err
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    direction, module = DEFECTS[defect]
    assert report[direction]["first_divergence"]["module"] == module
    if direction == "backward":  # PyLayer / custom bprop defects leave forward aligned
        assert report["forward"]["status"] == "aligned"


@pytest.mark.parametrize("via", ["paddle_llama", "mindspore_llama"])
def test_weights_round_trip_bit_exactly_through_another_framework(tmp_path, via):
    """torch -> {paddle, mindspore} -> torch: the neutral files before and after are identical."""
    code, _, err = run_cli("weights", "export", "torch_llama", "-o", tmp_path / "torch.safetensors", "--arg", "seed=21")
    assert code == 0, err
    # the other framework loads them (Linear transposed for paddle, embedding_table for mindspore), traces
    # with them, and exports them again
    code, _, err = run_cli("trace", via, "-o", tmp_path / "t.h5", "-q", "--weights", tmp_path / "torch.safetensors")
    assert code == 0, err
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
              f"from layerdiff.recipes import {via} as r\n"
              "from layerdiff.checkpoints.transfer import import_weights, export_weights\n"
              "m = r.build(seed=5)['model']\n"
              f"import_weights(m, {str(tmp_path / 'torch.safetensors')!r})\n"
              f"export_weights(m, {str(tmp_path / 'back.safetensors')!r})\n")
    proc = run_python(script)
    assert proc.returncode == 0, proc.stderr
    before, _ = safetensors_io.load(tmp_path / "torch.safetensors")
    after, meta = safetensors_io.load(tmp_path / "back.safetensors")
    assert meta["source_framework"] == via.split("_")[0]
    assert sorted(before) == sorted(after) and len(before) == 21
    for name, (array, dtype) in before.items():
        assert after[name][1] == dtype and np.array_equal(after[name][0], array), name  # max diff 0.0
    # and torch takes the round-tripped file back
    code, _, err = run_cli("trace", "torch_llama", "-o", tmp_path / "back.h5", "-q", "--weights",
                           tmp_path / "back.safetensors")
    assert code == 0, err


@pytest.mark.parametrize("framework, defect", [("paddle", "owncode"), ("mindspore", "backward")])
def test_demo_with_a_ported_candidate(framework, defect):
    code, out, err = run_cli("demo", "--framework", framework, "--defect", defect)
    assert code == 0, out + err
    assert f"traced candidate ({framework})" in out and ": correct" in out
    assert "confirmed, not inherited" in out  # the bisect replay agrees
    if defect == "owncode":  # the origin is the attention's own code: the demo steps into its operations
        stepped = " ".join(out[out.index("inside model.layers.1.self_attn, operation by operation"):].split())
        assert "scaled_dot_product_attention" in stepped and f"B {framework}_llama.py:" in stepped
