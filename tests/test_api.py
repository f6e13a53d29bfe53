"""The Python API (``layerdiff.align``, ``layerdiff.rethreshold``, ``Report``) gives what the CLI gives on the
same traces: the same JSON report, verdict, origins and exit code."""
from __future__ import annotations

import json

import pytest

import layerdiff
from layerdiff.errors import LayerdiffError

from conftest import run_cli

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _without_timing(data: dict) -> dict:
    """The report minus what depends on the moment (durations, progress)."""
    return {k: v for k, v in data.items() if k not in ("seconds", "timing", "elapsed")}


@pytest.mark.parametrize("defect", ["reimpl", "eps", "backward"])  # reimpl: an honest rewrite, aligned
def test_align_equals_the_cli_json(recipe_trace, tmp_path, defect):
    a, b = recipe_trace(), recipe_trace(defect)
    report = layerdiff.align(a, b)
    code, out, err = run_cli("align", a, b, "--json", tmp_path / "r.json", "-q")
    cli = json.loads((tmp_path / "r.json").read_text())
    assert code == report.exit_code, out + err
    assert _without_timing(json.loads(report.to_json())) == _without_timing(cli)
    assert report.verdict == cli["verdict"]
    assert report.forward == cli["forward"]["first_divergence"]
    assert report.backward == cli["backward"]["first_divergence"]
    assert report.records and report.mapping == cli.get("mapping", [])
    if defect != "reimpl":
        from layerdiff.recipes.torch_llama import DEFECTS

        direction, module = DEFECTS[defect]
        assert report.origin(direction)["module"] == module
        assert module in repr(report) and module in report.summary()
    else:
        assert report.exit_code == 0 and "aligned" in repr(report)


def test_rethreshold_equals_the_report_command(recipe_trace, tmp_path):
    report = layerdiff.align(recipe_trace(), recipe_trace("eps"))
    assert report.verdict == "divergent"
    loose = report.rethreshold(atol=1.0, rtol=1.0, cos=0.0)
    assert loose.verdict == "aligned" and loose.exit_code == 0 and report.verdict == "divergent"  # not mutated
    report.to_json(tmp_path / "r.json")
    code, _, err = run_cli("report", tmp_path / "r.json", "--atol", "1", "--rtol", "1", "--cos", "0",
                           "--json", tmp_path / "loose.json", "-q")
    assert code == 0, err
    assert _without_timing(json.loads((tmp_path / "loose.json").read_text())) == \
        _without_timing(json.loads(loose.to_json()))
    assert layerdiff.rethreshold(tmp_path / "r.json").verdict == "divergent"  # a path works too


def test_bad_options_and_files_are_one_error(recipe_trace, tmp_path):
    with pytest.raises(LayerdiffError, match="bad tolerance"):
        layerdiff.align(recipe_trace(), recipe_trace(), atol=-1)
    with pytest.raises(LayerdiffError, match="no such file|does not exist|not found"):
        layerdiff.align(recipe_trace(), tmp_path / "missing.h5")
    report = layerdiff.align(recipe_trace(), recipe_trace("eps"))
    report.to_json(tmp_path / "r.json")
    with pytest.raises(LayerdiffError, match="exists"):
        report.to_json(tmp_path / "r.json")  # never over a file unless asked
    report.to_json(tmp_path / "r.json", overwrite=True)


def test_bisect_equals_the_cli_json(recipe_trace, tmp_path):
    result = layerdiff.bisect(recipe_trace(), "torch_llama", args=["defect=eps"], workdir=tmp_path / "api")
    code, out, err = run_cli("bisect", recipe_trace(), "torch_llama", "--arg", "defect=eps", "--workdir",
                             tmp_path / "cli", "--json", tmp_path / "b.json", "-q")
    cli = json.loads((tmp_path / "b.json").read_text())
    assert code == 1, err
    assert result["verdict"] == cli["verdict"] and result["forward"]["culprit"]["module"] == \
        cli["forward"]["culprit"]["module"] == "model.layers.1.post_attention_layernorm"
    assert [s["module"] for s in result["forward"]["segments"]] == [s["module"] for s in cli["forward"]["segments"]]
    with pytest.raises(LayerdiffError, match="--blocks goes with --search"):
        layerdiff.bisect(recipe_trace(), "torch_llama", blocks="model.layers")


def test_weights_logs_and_config_diffs_equal_the_cli_json(recipe_trace, tmp_path):
    a, b = recipe_trace(), recipe_trace("weight")
    code, _, err = run_cli("weights", "diff", a, b, "-o", tmp_path / "w.json", "-q")
    assert code == 1, err
    assert _without_timing(json.loads(json.dumps(layerdiff.weights_diff(a, b), default=str))) == \
        _without_timing(json.loads((tmp_path / "w.json").read_text()))
    for name, drift in (("a.csv", 1.0), ("b.csv", 1.02)):
        (tmp_path / name).write_text("iteration,loss,lr\n" + "".join(
            f"{i},{(10 - i * 0.1) * (drift if i >= 3 else 1):.6f},1e-4\n" for i in range(1, 6)))
    code, _, err = run_cli("logs", "diff", tmp_path / "a.csv", tmp_path / "b.csv", "--json", tmp_path / "l.json", "-q")
    logs = layerdiff.logs_diff(tmp_path / "a.csv", tmp_path / "b.csv")
    cli = json.loads((tmp_path / "l.json").read_text())
    assert code == 1 and logs["verdict"] == cli["verdict"] == "different", err
    assert {k: v for k, v in json.loads(json.dumps(logs, default=str)).items() if k not in ("a", "b")} == \
        {k: v for k, v in cli.items() if k not in ("a", "b")}
    (tmp_path / "c1.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "rms_norm_eps": 1e-6}))
    (tmp_path / "c2.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "rms_norm_eps": 1e-5}))
    code, _, _ = run_cli("config", "diff", tmp_path / "c1.json", tmp_path / "c2.json", "--json", tmp_path / "c.json")
    assert code == 1 and layerdiff.config_diff(tmp_path / "c1.json", tmp_path / "c2.json") == \
        json.loads((tmp_path / "c.json").read_text())


def test_show_gives_what_the_cli_prints(recipe_trace):
    info = layerdiff.show(recipe_trace())
    code, out, err = run_cli("show", recipe_trace())
    assert code == 0, err
    assert info["status"] == "complete" and f"records: {info['records']} (" in out
    assert f"{info['tensors']} tensors" in out and info["meta"]["framework"] == "torch"
    assert [m["path"] for m in info["modules"][:3]] == ["", "model", "model.embed_tokens"]  # in call order
    assert info["modules"][0] == {"path": "", "type": "LlamaForCausalLM", "calls": 1}


def test_every_public_function_works_twice_in_one_process(recipe_trace, tmp_path):
    """A module named like a public function (``layerdiff/show.py``) replaced ``layerdiff.show`` on first use:
    the second call raised "'module' object is not callable". Each public function is called twice here."""
    from layerdiff.recipes import torch_llama

    a, b = recipe_trace(), recipe_trace("eps")
    (tmp_path / "a.csv").write_text("iteration,loss\n1,2.0\n2,1.5\n")
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    for attempt in range(2):
        built = torch_llama.build()
        with layerdiff.trace(built["model"], tmp_path / f"t{attempt}.h5"):
            built["step"]()
        report = layerdiff.align(a, b)
        assert report.forward["module"] == "model.layers.1.post_attention_layernorm"
        assert layerdiff.rethreshold(report, atol=1.0, cos=-1.0).verdict == "aligned"
        assert layerdiff.show(tmp_path / f"t{attempt}.h5")["status"] == "complete"
        assert layerdiff.weights_diff(a, b)["__summary__"]["different"] == 0
        assert layerdiff.logs_diff(tmp_path / "a.csv", tmp_path / "a.csv")["verdict"] == "identical"
        assert layerdiff.config_diff(tmp_path / "c.json", tmp_path / "c.json")["verdict"] == "same"
        result = layerdiff.bisect(a, "torch_llama", args=["defect=eps"], search=True, workdir=tmp_path / f"w{attempt}")
        assert result["block"] == "model.layers.1"
