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
