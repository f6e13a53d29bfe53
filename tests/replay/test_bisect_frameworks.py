"""layerdiff bisect across frameworks: a reference traced in one framework replayed into a candidate in another,
for every pair, through the real CLI. Each framework runs in a process of its own (the bisects into one framework
together)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import run_cli, run_cli_each, skip_unless_installed
from layerdiff.recipes.llama_shared import DEFECTS, FAILURES

skip_unless_installed("torch", "mindspore", "paddle")  # each runs in processes of its own

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.paddle, pytest.mark.mindspore]

# (reference framework, candidate framework, defect or None): every defect replayed into another framework once,
# a backward defect and a NaN into each (the NaN test reads both); each candidate given a defect in a layer and in a
# module's own code, from a torch reference and (into mindspore) from a paddle one; a crash in each non-torch
# framework, and one clean pair the other way round (no false alarm)
INTO = {("torch", "paddle"): ("act", "eps", "residual", "fp16", "backward", "nan", "crash"),
        ("torch", "mindspore"): ("weight", "crash"),
        ("paddle", "mindspore"): ("backward", "owncode", "nan")}
CASES = [(ref, cand, defect) for (ref, cand), defects in INTO.items() for defect in defects] + [
    ("mindspore", "paddle", None)]
assert {defect for *_, defect in CASES} >= set(DEFECTS)
ORIGINS = {**DEFECTS, **FAILURES}


@pytest.fixture(scope="module")
def bisected(tmp_path_factory):
    """{case: (exit code, result JSON, stderr, work dir)}. The bisects into one framework run in one interpreter
    (``conftest.run_cli_each``: the framework imported once for them), the two frameworks' at the same time."""
    root = tmp_path_factory.mktemp("bisect_frameworks")
    with ThreadPoolExecutor(2) as pool:
        refs = list(pool.map(lambda fw: run_cli_each(["trace", f"{fw}_llama", "-o", root / f"ref_{fw}.h5", "-q"])[0],
                             ("torch", "paddle", "mindspore")))
        assert all(code == 0 for code, _, _ in refs), refs

        def name(case):
            ref, cand, defect = case
            return f"{ref}_{cand}_{defect}"

        def bisect(case):
            ref, cand, defect = case
            return ["bisect", root / f"ref_{ref}.h5", f"{cand}_llama", "--workdir", root / name(case),
                    "--json", root / f"{name(case)}.json", "-q"] + (["--arg", f"defect={defect}"] if defect else [])

        groups = [[case for case in CASES if case[1] == framework] for framework in ("paddle", "mindspore")]
        assert sum(map(len, groups)) == len(CASES)
        done = pool.map(lambda group: run_cli_each(*map(bisect, group)), groups)
        results = {}
        for group, ran in zip(groups, done):
            for case, (code, _, err) in zip(group, ran):
                result = json.loads((root / f"{name(case)}.json").read_text()) if code in (0, 1) else None
                results[case] = (code, result, err, root / name(case))
        return results


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_replay_names_the_origin_across_frameworks(bisected, case):
    code, result, err, _ = bisected[case]
    assert result is not None, err[-2000:]
    ref, cand, defect = case
    assert result["a"]["framework"] == ref
    if defect is None:
        assert code == 0 and result["verdict"] == "clean", result["forward"]["segments"][:2]
        assert result["forcing"]["forced_tensors"] > 100 and not result["forcing"]["not_forced"]
        return
    direction, module = ORIGINS[defect]
    culprit = result[direction]["culprit"]
    assert code == 1 and culprit is not None and culprit["module"] == module, result[direction]["segments"][:3]
    assert {s["module"] for p in ("forward", "backward") for s in result[p]["segments"]} <= {module}
    if direction == "backward":
        assert result["forward"]["segments"] == []
    if defect == "crash":
        assert culprit["where"] == "raised"
    elif result["align"][direction]["where"] != "forward":
        assert result["confirms"][direction] is True


@pytest.mark.parametrize("framework", ["paddle", "mindspore"])
def test_crashed_run_leaves_a_readable_partial_trace(bisected, framework):
    _, result, _, work = bisected[("torch", framework, "crash")]
    failure = result["align"]["forward"]
    assert failure["where"] == "raised" and failure["module"] == "model.layers.1.mlp.down_proj"
    code, out, err = run_cli("show", work / "free.h5", "--records")
    assert code == 0, err
    assert "model.layers.0.mlp.down_proj" in out  # what ran before the error is in the trace
    code, out, _ = run_cli("align", work.parent / "ref_torch.h5", work / "free.h5", "-q")
    assert code == 1 and "model.layers.1.mlp.down_proj raised in run B" in out


@pytest.mark.parametrize("framework", ["paddle", "mindspore"])
def test_nan_is_traced_to_the_module_that_made_it(bisected, framework):
    _, result, _, work = next(found for (_, cand, defect), found in bisected.items()
                              if cand == framework and defect == "nan")
    assert result["forward"]["culprit"]["module"] == "model.layers.1.mlp.gate_proj"
    code, out, _ = run_cli("show", work / "free.h5", "--nan")
    assert code == 0 and "forward NaN/Inf origin: model.layers.1.mlp.gate_proj" in out
