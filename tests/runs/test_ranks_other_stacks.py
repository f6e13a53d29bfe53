"""Runs of ranks launched as the other stacks launch them: Megatron-core tensor parallelism (torchrun's ranks, forked
with its environment by ``conftest.launch``), PaddlePaddle auto-parallel tensor parallelism (``paddle.distributed.
launch`` itself) and MindSpore data parallelism (``msrun`` itself)."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from layerdiff.tracefile.reader import open_trace  # noqa: E402

from conftest import align_files, free_port, launch, run_cli  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

PADDLE_SCRIPT = """
import sys
import layerdiff
from layerdiff.recipes import paddle_llama_tp

out = sys.argv[1]
for defect in [None, *paddle_llama_tp.DEFECTS]:
    built = paddle_llama_tp.build(defect)
    with layerdiff.trace(built["model"], f"{out}/pd_{defect or 'clean'}"):
        built["step"]()
"""


@pytest.fixture(scope="module")
def paddle_runs(tmp_path_factory):
    pytest.importorskip("paddle")
    root = tmp_path_factory.mktemp("paddle_ranks")
    launch(root, "paddle_ranks", PADDLE_SCRIPT,
           ["paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(root / "logs")])
    return root


MEGATRON_SCRIPT = """
import sys
import layerdiff
from layerdiff.recipes import megatron_llama

for defect in (None, "eps", "qkv_part", "fc1_part", "backward"):
    built = megatron_llama.build(defect, tp=2)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/mg_{defect or 'clean'}"):
        built["step"]()
"""


@pytest.mark.megatron
def test_megatron_tensor_parallel_2_against_hf_and_against_itself_at_1(tmp_path, recipe_trace):
    pytest.importorskip("megatron.core")
    from layerdiff.recipes.megatron_llama import DEFECTS

    launch(tmp_path, "mg_tp", MEGATRON_SCRIPT, ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    code, _, err = run_cli("trace", "megatron_llama", "-o", tmp_path / "mg1.h5", "-q")
    assert code == 0, err
    hf = recipe_trace()
    for reference in (hf, tmp_path / "mg1.h5"):  # linear_fc1's shards hold [gate_r; up_r]: joined part by part
        report = align_files(reference, tmp_path / "mg_clean")
        assert report["verdict"] == "aligned", (reference, report["forward"], report["backward"])
    for defect in ("eps", "qkv_part", "fc1_part", "backward"):
        direction, origin = DEFECTS[defect]
        assert align_files(hf, tmp_path / f"mg_{defect}")[direction]["first_divergence"]["module"] == origin, defect
    code, out, err = run_cli("align", tmp_path / "mg_clean", "-q")
    assert code == 0 and "all 2 ranks agree" in out, out + err


@pytest.mark.paddle
def test_paddle_tensor_parallel_against_one_torch_process(paddle_runs, recipe_trace):
    from layerdiff.recipes.paddle_llama_tp import DEFECTS

    report = align_files(recipe_trace(), paddle_runs / "pd_clean")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    for defect, (direction, module, ranks) in DEFECTS.items():
        origin = align_files(recipe_trace(), paddle_runs / f"pd_{defect}")[direction]["first_divergence"]
        assert (origin["module"], origin["ranks"]) == (module, ranks), defect


MINDSPORE_SCRIPT = """
import sys
import layerdiff
from layerdiff.recipes import mindspore_llama_dp

for defect in (None, "weight"):
    built = mindspore_llama_dp.build(defect)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/ms_{defect or 'clean'}"):
        built["step"]()
"""


@pytest.mark.mindspore
def test_mindspore_data_parallel_ranks_under_msrun(tmp_path):
    pytest.importorskip("mindspore")
    launch(tmp_path, "ms_dp", MINDSPORE_SCRIPT,
           ["mindspore.parallel.cluster.run", "--worker_num=2", "--local_worker_num=2", "--join=True",
            f"--master_port={free_port()}", f"--log_dir={tmp_path / 'logs'}"])
    for rank in (0, 1):
        with open_trace(tmp_path / "ms_clean" / f"rank{rank}.h5") as reader:
            assert reader.meta["distributed"] == {**reader.meta["distributed"], "rank": rank, "world_size": 2}
    code, out, err = run_cli("align", tmp_path / "ms_clean", "-q")
    assert code == 0 and out.startswith("aligned: all 2 ranks agree with rank 0"), out + err
    code, out, err = run_cli("align", tmp_path / "ms_weight", "--json", tmp_path / "ms.json")
    first = json.loads((tmp_path / "ms.json").read_text())["first_divergence"]
    assert code == 1 and (first["module"], first["ranks"]) == ("model.layers.1.mlp.up_proj", [1]), out + err
