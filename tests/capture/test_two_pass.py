"""Two-pass tracing for models too big to dump: statistics for everything, then full tensors for one window of
blocks, then bisect inside the window."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")

import layerdiff  # noqa: E402
from conftest import run_cli  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

pytestmark = [pytest.mark.torch]

REF = ["torch_llama", "--arg", "layers=8"]
CAND = REF + ["--arg", "defect=eps", "--arg", "defect_layer=5"]


@pytest.mark.slow
def test_two_pass_recipe_on_a_model_whose_full_trace_is_over_10x_its_stats_trace(tmp_path):
    def trace(name, target, *extra):
        code, out, err = run_cli("trace", *target, "-o", tmp_path / name, "-q", *extra)
        assert code == 0, err
        return os.stat(tmp_path / name).st_blocks * 512  # on disk: a finished trace's unused reserve is a hole

    stats = trace("a_stats.h5", REF, "--mode", "stats")
    trace("b_stats.h5", CAND, "--mode", "stats")
    full = trace("a_full.h5", REF)
    assert full > 10 * stats, (full, stats)
    # pass 1: statistics name the suspect block, and the report prints the next two commands
    code, out, _ = run_cli("align", tmp_path / "a_stats.h5", tmp_path / "b_stats.h5", "--json", tmp_path / "s.json")
    assert code == 1
    suggestion = json.loads((tmp_path / "s.json").read_text())["next_pass"]
    assert suggestion == {"block": "model.layers.5", "layers": "5:6", "container": "model.layers"}
    assert "layerdiff trace torch_llama --arg layers=8 --layers 5:6 -o a_window.h5" in out
    assert "layerdiff bisect a_window.h5 torch_llama --arg layers=8 --arg defect=eps --arg defect_layer=5" in out
    # pass 2: full tensors of that block only
    window = trace("a_window.h5", REF, "--layers", suggestion["layers"])
    assert window < full / 4, (window, full)
    code, out, err = run_cli("bisect", tmp_path / "a_window.h5", *CAND[:1], *CAND[1:], "--workdir", tmp_path / "w",
                             "--json", tmp_path / "r.json", "-q")
    assert code == 1, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["forward"]["culprit"]["module"] == "model.layers.5.post_attention_layernorm"
    assert result["confirms"]["forward"] is True
    # the candidate's runs were traced with the reference's window too
    with open_trace(tmp_path / "w" / "replay.h5") as r:
        paths = {rec.path for rec in r.records if rec.kind == "call"}
    assert paths and all(p == "" or p.startswith("model.layers.5") for p in paths)


def test_layers_window_keeps_the_model_record_as_statistics(tmp_path):
    built = torch_llama.build(layers=4)
    with layerdiff.trace(built["model"], tmp_path / "w.h5", layers=(1, 3)):
        built["step"]()
    with open_trace(tmp_path / "w.h5") as r:
        calls = [rec for rec in r.records if rec.kind == "call"]
        assert r.meta["window"] == ["model.layers.1", "model.layers.2"]
        params = {rec.path for rec in r.records if rec.kind == "param"}
    assert {c.path.split(".")[2] for c in calls if c.path} == {"1", "2"}
    root = [c for c in calls if c.path == ""]
    assert root and all(t.offset is None for c in root for t in c.tensors)  # statistics only
    inner = [c for c in calls if c.path]
    assert all(t.offset is not None for c in inner for t in c.tensors)
    assert params and all(p.startswith(("model.layers.1.", "model.layers.2.")) for p in params)


@pytest.mark.slow
def test_bad_layers_window_is_one_line_and_writes_nothing(tmp_path):
    for spec, message in [("9:10", "the model has 2 numbered blocks"), ("x", "expected START:END"),
                          ("3:1", "0 <= START < END")]:
        code, _, err = run_cli("trace", "torch_llama", "-o", tmp_path / "w.h5", "--layers", spec)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert not (tmp_path / "w.h5").exists()
