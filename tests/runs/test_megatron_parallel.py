"""Megatron-core runs as people launch them, on real CPU ranks (torchrun, gloo): tensor parallel with sequence
parallelism, pipeline parallel (one microbatch, and several through the 1F1B schedule with an uneven split), and
TP=2 x PP=2 on 4 ranks, each traced with the unchanged ``layerdiff.trace(model, PATH)`` in every rank and aligned,
with no flags, against transformers in one process and against Megatron at TP=1/PP=1; planted defects named at
their module, rank and direction (``recipes/megatron_parallel.py``)."""
from __future__ import annotations

import pytest

from layerdiff.runs.ranks import open_run
from layerdiff.tracefile.reader import open_trace

from conftest import align_files, launch, run_scripts, skip_unless_installed

skip_unless_installed("megatron.core")  # imported only by the processes the tests start

pytestmark = [pytest.mark.torch, pytest.mark.megatron, pytest.mark.slow]

REFERENCES = """
import sys
import layerdiff
from layerdiff.recipes import megatron_moe, megatron_parallel, torch_llama

out = sys.argv[1]
for name, recipe, kwargs, steps, *options in (
        ("hf", torch_llama, {"layers": 4}, 1), ("hf_train", torch_llama, {"layers": 4, "lr": 0.5}, 2),
        ("mg1", megatron_parallel, {}, 1), ("mg1_train", megatron_parallel, {"lr": 0.5}, 2),
        ("mixtral", megatron_moe, {"impl": "hf"}, 1), ("hf4", torch_llama, {"layers": 4, "batch": 4}, 1),
        ("mg1_ops", megatron_parallel, {}, 1, {"ops": True})):
    built = recipe.build(**kwargs)
    with layerdiff.trace(built["model"], f"{out}/{name}.h5", **(options[0] if options else {})):
        for _ in range(steps):
            built["step"]()
"""

RUNS = """
import importlib
import sys
import layerdiff

out = sys.argv[1]
for name, recipe, kwargs, steps, *options in RUNS:  # one job: the parallel state is made anew for each
    built = importlib.import_module(f"layerdiff.recipes.{recipe}").build(**kwargs)
    with layerdiff.trace(built["model"], f"{out}/{name}", **(options[0] if options else {})):
        for _ in range(steps):
            built["step"]()
"""
TWO_RANKS = [
    ("sp", "megatron_parallel", {"tp": 2, "sp": True}, 1),
    ("sp_train", "megatron_parallel", {"tp": 2, "sp": True, "lr": 0.5}, 2),
    ("sp_norm", "megatron_parallel", {"tp": 2, "sp": True, "lr": 0.5, "defect": "sp_norm"}, 2),
    ("sp_reduce_scatter", "megatron_parallel", {"tp": 2, "sp": True, "defect": "reduce_scatter"}, 1),
    ("pp", "megatron_parallel", {"pp": 2}, 1),
    ("pp_micro", "megatron_parallel", {"pp": 2, "microbatches": 2, "first_stage_layers": 3}, 1),
    ("pp_offset", "megatron_parallel", {"pp": 2, "microbatches": 2, "first_stage_layers": 3, "defect": "offset"}, 1),
    ("pp_backward", "megatron_parallel", {"pp": 2, "microbatches": 2, "defect": "stage_backward"}, 1),
    ("moe_dp", "megatron_moe", {"dp": 2}, 1),  # data parallel, every rank all 4 experts
    ("moe_ep", "megatron_moe", {"dp": 2, "ep": 2}, 1),  # expert parallel: 2 experts a rank
    ("moe_ep_expert", "megatron_moe", {"dp": 2, "ep": 2, "defect": "expert_rank"}, 1),
    ("tp_ops", "megatron_parallel", {"tp": 2}, 1, {"ops": True}),  # operations recorded in every rank
    # virtual pipeline: 2 model chunks a rank (4 stages), Megatron's interleaved schedule, the list traced
    ("vpp", "megatron_parallel", {"pp": 2, "vpp": 2, "microbatches": 2, "batch": 4}, 1),
    ("vpp_offset", "megatron_parallel", {"pp": 2, "vpp": 2, "microbatches": 2, "batch": 4, "defect": "offset"}, 1),
    ("vpp_backward", "megatron_parallel", {"pp": 2, "vpp": 2, "microbatches": 2, "batch": 4,
                                           "defect": "stage_backward"}, 1),
]
FOUR_RANKS = [
    ("tp_pp", "megatron_parallel", {"tp": 2, "pp": 2, "microbatches": 2}, 1),
    ("tp_pp_backward", "megatron_parallel", {"tp": 2, "pp": 2, "microbatches": 2, "defect": "stage_backward"}, 1),
    ("tp_dp", "megatron_parallel", {"tp": 2, "dp": 2}, 1),  # each data-parallel replica: 2 tensor-parallel ranks
    ("tp_sp_dp_train", "megatron_parallel", {"tp": 2, "sp": True, "dp": 2, "lr": 0.5}, 2),
    ("tp_sp_dp_norm", "megatron_parallel", {"tp": 2, "sp": True, "dp": 2, "lr": 0.5, "defect": "sp_norm"}, 2),
    # 4 sequences: 2 a data-parallel rank, 1 a microbatch
    ("tp_sp_dp_micro", "megatron_parallel", {"tp": 2, "sp": True, "dp": 2, "batch": 4, "microbatches": 2}, 1),
    ("pp_dp_micro", "megatron_parallel", {"pp": 2, "dp": 2, "batch": 4, "microbatches": 2}, 1),
    ("pp_dp_micro_backward", "megatron_parallel", {"pp": 2, "dp": 2, "batch": 4, "microbatches": 2,
                                                   "defect": "stage_backward"}, 1),
]


def _torchrun(ranks: int) -> list[str]:
    return ["torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_parallel")
    run_scripts(root, {"references": REFERENCES}, timeout=900)
    launch(root, "two_ranks", f"RUNS = {TWO_RANKS!r}\n" + RUNS, _torchrun(2))
    launch(root, "four_ranks", f"RUNS = {FOUR_RANKS!r}\n" + RUNS, _torchrun(4))
    return root


@pytest.mark.parametrize("run,reference", [("sp", "hf"), ("pp", "hf"), ("pp_micro", "hf"), ("tp_pp", "hf"),
                                           ("sp_train", "hf_train"), ("sp", "mg1"), ("pp_micro", "mg1"),
                                           ("tp_pp", "mg1"), ("sp_train", "mg1_train"), ("tp_dp", "hf"),
                                           ("tp_dp", "mg1"), ("tp_sp_dp_train", "hf_train"),
                                           ("tp_sp_dp_train", "mg1_train"), ("tp_sp_dp_micro", "hf4"),
                                           ("pp_dp_micro", "hf4"), ("vpp", "hf4")])
def test_each_layout_aligns_with_one_process_without_flags(runs, run, reference):
    report = align_files(runs / f"{reference}.h5", runs / run)
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    compared = [t for r in report["records"] for t in r["tensors"]]
    assert len(compared) > 250 and all(t["passed"] for t in compared)
    grads = [r for r in report["records"] if r["kind"] == "param_grad"]
    params = 39 if reference.startswith("hf") else 27  # Megatron fuses q, k, v and gate, up
    assert len(grads) == params * (2 if run.endswith("_train") else 1)  # every parameter's gradient, every stage's


def test_pipeline_stages_join_into_one_model_under_global_layer_numbers(runs):
    with open_run(runs / "pp_micro") as run:
        assert [reader.meta["parallel"]["pp_rank"] for reader in run.readers] == [0, 1]
        assert run.readers[1].meta["parallel"]["global_paths"] == {"decoder.layers.0": "decoder.layers.3"}
        forward = [r for r in run.records if r.kind == "call" and r.phase == "forward"]
        layers = {r.path for r in forward if r.path.count(".") == 2 and r.path.startswith("decoder.layers.")}
        assert layers == {f"decoder.layers.{i}" for i in range(4)}
        assert {r.ranks_held[0] for r in forward if r.path == "decoder.layers.3"} == {1}
        root = next(r for r in forward if r.path == "")
        assert [t.role for t in root.tensors].count("input") == 3  # stage 0's inputs ...
        assert [t.shape for t in root.tensors if t.role == "output"] == [[1, 16, 256]]  # ... the last stage's logits
        assert {r.step for r in forward} == {0} and {r.micro for r in forward} == {0, 1}  # one step, 2 microbatches


@pytest.mark.parametrize("run,reference,direction,module,ranks", [
    ("sp_norm", "hf_train", "backward", "model.norm", [0, 1]),
    ("sp_reduce_scatter", "hf", "forward", "model.layers.1.self_attn.o_proj", [0, 1]),
    ("pp_offset", "hf", "forward", "model.layers.3.input_layernorm", [1]),
    ("pp_backward", "hf", "backward", "model.layers.3.mlp.down_proj", [1]),
    ("tp_pp_backward", "hf", "backward", "model.layers.3.mlp.down_proj", [2, 3]),
    ("tp_sp_dp_norm", "hf_train", "backward", "model.norm", None),  # a sum over every rank: none singled out
    ("pp_dp_micro_backward", "hf4", "backward", "model.layers.3.mlp.down_proj", [2, 3]),
])
def test_a_planted_defect_is_named_at_its_module_rank_and_direction(runs, run, reference, direction, module, ranks):
    from layerdiff.recipes.megatron_parallel import DEFECTS

    report = align_files(runs / f"{reference}.h5", runs / run)
    origin = report[direction]["first_divergence"]
    assert origin["module"] == module == DEFECTS[_defect(run)][1]
    assert origin["phase"] == direction and origin["ranks"] == ranks, origin
    if direction == "backward":
        assert "inherited" not in origin["description"], origin["description"]


def test_virtual_pipeline_chunks_read_as_stages(runs):
    """Megatron's virtual pipeline (interleaved schedule): each rank traces its list of model chunks, chunk v of
    rank r being stage v x 2 + r, each naming its layers from 0. The chunks' records carry their stage and their
    own global layer names; a loader that offsets each chunk's layers as if there were no virtual stages (a real
    interleaving bug) is named at the first layer it misplaces, on rank 1; a stage's wrong backward on the rank
    (not the stage) that ran it."""
    with open_trace(runs / "vpp" / "rank0.h5") as reader:
        layout = reader.meta["parallel"]
        assert (layout["pp"], layout["pp_rank"], layout["pp_stages"]) == (4, 0, [0, 2])
        assert layout["stage_paths"]["2"] == {"decoder.layers.0": "decoder.layers.2"}
        assert {r.stage for r in reader.records if r.kind == "param_grad"} == {0, 2}
    with open_run(runs / "vpp") as run:
        assert [reader.meta["parallel"]["pp_rank"] for reader in run.readers] == [0, 2, 1, 3]
    for run, direction, module in (("vpp_offset", "forward", "model.layers.1.input_layernorm"),
                                   ("vpp_backward", "backward", "model.layers.3.mlp.down_proj")):
        origin = align_files(runs / "hf4.h5", runs / run)[direction]["first_divergence"]
        assert (origin["module"], origin["ranks"]) == (module, [1]), origin


def _defect(run: str) -> str:
    return {"sp_norm": "sp_norm", "sp_reduce_scatter": "reduce_scatter", "pp_offset": "offset",
            "pp_backward": "stage_backward", "tp_pp_backward": "stage_backward", "tp_sp_dp_norm": "sp_norm",
            "pp_dp_micro_backward": "stage_backward"}[run]


def test_a_norm_gradient_never_all_reduced_under_sequence_parallelism(runs):
    """Megatron-LM #1446: each TP rank keeps its partial sum of the final norm's weight gradient; the report says
    the copies add up to the reference's (an all-reduce is missing), and that the replicas differ after the
    update."""
    report = align_files(runs / "hf_train.h5", runs / "sp_norm")
    backward, forward = report["backward"]["first_divergence"], report["forward"]["first_divergence"]
    assert backward["step"] == 0 and "all-reduce" in backward["hint"]
    assert forward["module"] == "model.norm" and forward["step"] == 1 and forward["ranks"] == [0, 1]
    assert "model.norm.weight" in report["params"]["differ"]
    step2 = next(r for r in report["records"] if r["kind"] == "param" and r["path"] == "model.norm.weight"
                 and r["step"] == 1)
    copies = step2["tensors"][0]["metrics"]["ranks"]
    assert copies["how"] == "copies" and copies["0"]["max_abs"] != copies["1"]["max_abs"]  # the replicas differ


@pytest.mark.parametrize("run,reference", [("moe_ep", "mixtral.h5"), ("moe_dp", "mixtral.h5"), ("moe_ep", "moe_dp")])
def test_expert_parallel_ranks_align_with_mixtral_and_with_data_parallel(runs, run, reference):
    """EP=2 over 2 data-parallel ranks: each rank holds 2 of the 4 experts (global indices from Megatron's
    ``local_expert_indices``) and runs them on both ranks' tokens; every rank runs its own sequence."""
    report = align_files(runs / reference, runs / run)
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    assert report["params"]["grads_compared"] == report["params"]["compared"] > 0
    if reference == "moe_dp":  # expert by expert: global expert 3 is rank 1's second
        experts = {r["path"] for r in report["records"] if ".local_experts." in r["path"]}
        assert {f"decoder.layers.1.mlp.experts.local_experts.{e}" for e in range(4)} <= experts


def test_an_expert_perturbed_on_one_expert_parallel_rank(runs):
    with open_run(runs / "moe_ep") as run:
        assert run.readers[1].meta["parallel"]["global_paths"]["decoder.layers.1.mlp.experts.local_experts.1"] == \
            "decoder.layers.1.mlp.experts.local_experts.3"
    origin = align_files(runs / "moe_dp", runs / "moe_ep_expert")["forward"]["first_divergence"]
    assert origin["module"] == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1" and origin["ranks"] == [1]
    origin = align_files(runs / "mixtral.h5", runs / "moe_ep_expert")["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.mlp"  # HF runs every expert in one call: its MoE block


def test_tensor_and_data_parallel_ranks_join_replica_by_replica(runs):
    """TP=2 x DP=2: each data-parallel replica's tensor-parallel shards are joined first, then the replicas
    along the batch axis (each ran its own share of the batch), the parameters' gradients as DDP's mean; a
    tensor's ranks are named down to the tensor-parallel rank; the replicas of a shard are its data-parallel
    counterparts."""
    with open_run(runs / "tp_dp") as run:
        root = next(r for r in run.records if r.kind == "call" and r.phase == "forward" and r.path == "")
        ids = next(t for t in root.tensors if t.role == "input" and t.dtype.startswith("int"))
        assert ids.shape == [2, 16] and ids.merge.how == "concat" and ids.merge.ranks == (0, 2)
        assert [[p.merge.rank_of(i) for i in range(len(p.parts))] for p in ids.parts] == [[0, 1], [2, 3]]
        qkv = next(r for r in run.records if r.kind == "param_grad" and r.path.endswith("0.self_attention.linear_qkv"
                                                                                      ".weight"))
        assert qkv.tensors[0].merge.how == "sum" and qkv.tensors[0].merge.scale == 0.5
        assert run.replica_groups() == [[0, 2], [1, 3]] and run.peer_groups() == [[0, 1], [2, 3]]
    origin = align_files(runs / "hf_train.h5", runs / "tp_sp_dp_norm")["forward"]["first_divergence"]
    assert origin["module"] == "model.norm" and origin["step"] == 1 and origin["ranks"] == [0, 1, 2, 3]


def test_data_parallel_microbatches_join_rank_by_rank(runs):
    """DP=2 with 2 microbatches: rank 0 ran sequences 0 and 1 (one a microbatch), rank 1 sequences 2 and 3; each
    rank's microbatches are joined first, then the ranks, so the batch reads in the reference's order."""
    from layerdiff.match.microbatches import Joined

    with open_run(runs / "pp_dp_micro") as run:
        joined = Joined(run)
        root = next(r for r in joined.records if r.kind == "call" and r.phase == "forward" and r.path == "")
        ids = next(t for t in root.tensors if t.role == "input" and t.dtype.startswith("int"))
        assert ids.shape == [4, 16] and [ids.merge.rank_of(i) for i in range(len(ids.parts))] == [0, 1]
        assert [p.merge.ranks for p in ids.parts] == [(0, 0), (1, 1)]  # each rank's two microbatches
        from layerdiff.recipes import llama_shared

        expected = llama_shared.input_ids(llama_shared.config(layers=4), 4, 16, 0)
        assert (joined.tensor(ids) == expected).all()
    report = align_files(runs / "hf4.h5", runs / "pp_dp_micro")
    out = next(t for r in report["records"] if r["path"] == "model.layers.2" and r["phase"] == "forward"
               for t in r["tensors"] if t["role"] == "output")
    # layer 2 is on the second stage (ranks 2 and 3): each rank's part, and each microbatch over both ranks
    assert set(out["metrics"]["ranks"]) == {"2", "3", "how", "run"}
    assert set(out["metrics"]["microbatches"]) == {"0", "1", "how", "run"}


def test_ranks_against_their_replicas(runs):
    """``layerdiff align RUN``: each rank against the first of its pipeline stage; the replicas of the norm whose
    gradient was never all-reduced differ after the update; a run of stages alone has no replica to compare."""
    from conftest import run_cli

    code, out, err = run_cli("align", runs / "sp_train", "-q")
    assert code == 0 and "all 2 ranks agree" in out, out + err
    code, out, err = run_cli("align", runs / "sp_norm")
    assert code == 1 and "parameters differ: decoder.final_layernorm.weight" in out, out + err
    code, out, err = run_cli("align", runs / "tp_pp")
    assert code == 0 and "rank 3: agrees with rank 2" in out, out + err
    code, out, err = run_cli("align", runs / "tp_sp_dp_train", "-q")
    assert code == 0 and "all 4 ranks agree" in out, out + err
    code, out, err = run_cli("align", runs / "tp_sp_dp_norm")  # TP peers of each replica: the norm's copies
    assert code == 1 and "rank 1: differs: parameters only; parameters differ: decoder.final_layernorm.weight" \
        in out and "rank 2: agrees with rank 0" in out, out + err
    code, out, err = run_cli("align", runs / "pp")
    assert code == 2 and "no two hold the same layers" in err and "Traceback" not in err, err


def test_operations_recorded_in_tensor_parallel_ranks_leave_the_module_records_intact(runs):
    """The embedding's own code makes a partial sum (an operation's output) that ``all_reduce`` then completes in
    place, without the in-place counter seeing it: the module's output was taken over from the partial sum, and
    TP=2 with operations recorded was "divergent" at embedding.word_embeddings (a reduction missing)."""
    with open_trace(runs / "tp_ops" / "rank0.h5") as rank:  # a joined run holds no operations (not joined)
        assert len(rank.ops) > 100
    report = align_files(runs / "mg1_ops.h5", runs / "tp_ops")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    embedding = [t for r in report["records"] if r["path"] == "embedding.word_embeddings" and r["phase"] == "forward"
                 for t in r["tensors"] if t["role"] == "output"]
    assert embedding and all(t["passed"] for t in embedding)
    recorded = [r["ops"] for r in report["records"] if r.get("ops") and r["ops"]["a"]]  # each call says B holds none
    assert recorded and all(summary.get("not_in_run") == ["b"] for summary in recorded), recorded[:2]
