"""``layerdiff bisect`` with operations recorded: a reference traced with ``--ops``/``--ops-in`` makes the candidate's
runs record the same operations, and replay names the culprit at its operation and line, confirming align's
operation-level origin. transformers' Llama with the model code of ``recipes/torch_llama_ops.py``."""
from __future__ import annotations

import inspect

import conftest
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama_ops as recipe  # noqa: E402

pytestmark = [pytest.mark.torch]
RECIPE = inspect.getsourcefile(recipe)


def marked(marker: str) -> str:
    """``FILE:LINE`` of the recipe line ending in ``# <marker>``."""
    return f"{RECIPE}:{conftest.marked_line(RECIPE, marker)}"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("bisect_ops")
    paths = {}
    for name, ops in (("window", [r"^model\.layers\.1\.self_attn$"]), ("whole", True)):
        built = recipe.build()
        paths[name] = root / f"{name}.h5"
        with layerdiff.trace(built["model"], paths[name], ops=ops):
            built["step"]()
    return paths


def test_replay_names_a_helper_mistake_at_its_line_inside_the_window(references, tmp_path):
    result = layerdiff.bisect(references["window"], "torch_llama_ops", args=["defect=helper"], workdir=tmp_path)
    culprit = result["forward"]["culprit"]
    assert culprit["where"] == "op_input" and culprit["module"] == "model.layers.1.self_attn", culprit
    assert culprit["op"]["source_b"] == marked("defect: helper")
    assert result["confirms"]["forward"] is True
    assert [s["where"] for s in result["forward"]["segments"]] == ["op_input"]  # what follows in it inherits


def test_replay_names_a_wrong_backward_at_its_operation(references, tmp_path):
    result = layerdiff.bisect(references["whole"], "torch_llama_ops", args=["defect=function"], workdir=tmp_path)
    assert result["forward"]["segments"] == []
    culprit = result["backward"]["culprit"]
    assert culprit["where"] == "op" and culprit["op"]["name"] == "SiLUFunction.apply", culprit
    assert culprit["op"]["source_b"] == marked("defect: function")
    assert result["confirms"]["backward"] is True
