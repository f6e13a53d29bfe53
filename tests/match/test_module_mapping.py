"""Module matching from evidence on synthetic traces (``builders.Recorder``): two runs of one small model whose
modules are named differently are matched by their weights, types, output sizes and place, with no map and no
framework; a rename map does the same by hand."""
from __future__ import annotations

import numpy as np
import pytest

from builders import Recorder

from layerdiff.compare.spec import Comparison
from layerdiff.errors import LayerdiffError
from layerdiff.judge.evaluate import align

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 8)).astype(np.float32)
WEIGHTS = [RNG.standard_normal((8, 8)).astype(np.float32) / 4 for _ in range(4)]
HF_NAMES = ("model", "layers", "self_attn", "mlp")
GPT_NAMES = ("transformer", "h", "attn", "ffn")


def run(names: tuple[str, str, str, str], defect: tuple[int, str] | None = None,
        weights: list[np.ndarray] = WEIGHTS) -> Recorder:
    """Two blocks of (attention, mlp) with residuals, under ``names`` (root, block list, attention, mlp)."""
    root, blocks, attn, mlp = names
    rec = Recorder()
    kept = iter(weights)
    params = {(i, child): rec.param(f"{root}.{blocks}.{i}.{child}.weight", next(kept), kind)
              for i in range(2) for child, kind in ((attn, "Attention"), (mlp, "MLP"))}
    with rec.call("", "Model", X) as model_out, rec.call(root, "Decoder", X) as decoder_out:
        x = X
        for i in range(2):
            with rec.call(f"{root}.{blocks}.{i}", "Block", x) as block_out:
                for child, kind in ((attn, "Attention"), (mlp, "MLP")):
                    with rec.call(f"{root}.{blocks}.{i}.{child}", kind, x) as out:
                        y = np.tanh(x @ params[(i, child)]) * (1.01 if defect == (i, child) else 1.0)
                        out.append(y)
                    x = x + y
                block_out.append(x)
        decoder_out.append(x)
        model_out.append(x)
    return rec


def test_renamed_modules_are_matched_by_their_evidence_and_the_defect_named_in_both_names():
    report = align(run(HF_NAMES).trace, run(GPT_NAMES, defect=(1, "ffn")).trace)
    pairs = {m["a"]: m["b"] for m in report["mapping"]}
    assert pairs == {"model": "transformer", "model.layers.0": "transformer.h.0", "model.layers.1": "transformer.h.1",
                     "model.layers.0.self_attn": "transformer.h.0.attn", "model.layers.0.mlp": "transformer.h.0.ffn",
                     "model.layers.1.self_attn": "transformer.h.1.attn", "model.layers.1.mlp": "transformer.h.1.ffn"}
    weights_said = [m for m in report["mapping"] if m["a"].endswith(("attn", "mlp"))]
    assert all("same weights" in m["reason"] for m in weights_said), weights_said
    found = report["forward"]["first_divergence"]
    assert (found["module"], found["path_b"]) == ("model.layers.1.mlp", "transformer.h.1.ffn"), found


def test_without_evidence_matching_the_renamed_runs_are_refused_not_judged():
    with pytest.raises(LayerdiffError, match="share no module paths .* map names with --map"):
        align(run(HF_NAMES).trace, run(GPT_NAMES).trace, Comparison.of(auto_map=False))


def test_a_rename_map_pairs_what_evidence_matching_would():
    rename = Comparison.of(auto_map=False, map=[r"^transformer\.h\.=model.layers.", r"\.attn$=.self_attn",
                                               r"\.ffn$=.mlp", r"^transformer$=model"])
    report = align(run(HF_NAMES).trace, run(GPT_NAMES, defect=(0, "attn")).trace, rename)
    found = report["forward"]["first_divergence"]
    assert (found["module"], found["path_b"]) == ("model.layers.0.self_attn", "transformer.h.0.attn"), found


def test_different_weights_of_one_module_are_found_at_the_parameter():
    changed = list(WEIGHTS)
    changed[3] = changed[3] + 1e-2  # layer 1's mlp weight
    report = align(run(HF_NAMES).trace, run(GPT_NAMES, weights=changed).trace)
    found = report["forward"]["first_divergence"]
    assert found["module"] == "model.layers.1.mlp", found
    assert [p["name"] for p in found["param_diffs"]] == ["model.layers.1.mlp.weight"], found["param_diffs"]
