"""Runs spread over ranks, really run on 2 CPU ranks (gloo): PyTorch tensor parallelism (DTensor,
``parallelize_module``) and data parallelism (DDP, FSDP2); each against a single-process torch run of the same model,
and data-parallel ranks against each other. More ranks and dimensions: ``test_torch_parallel.py``; other stacks'
launchers: ``test_ranks_other_stacks.py``."""
from __future__ import annotations

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")

from layerdiff.tracefile.reader import open_trace  # noqa: E402

from conftest import align_files, launch, run_cli  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

# _EXIT: torch 2.13's teardown of a gloo rank aborts now and then after the script has finished and closed every
# file ("terminate called without an active exception", SIGABRT: about one suite run in five at this stop, none in
# 22 launches alone or two at a time). Each script ends with os._exit(0), after its last statement: an error of the
# script itself still raises before it and fails the launch; torch's own exit is not what these tests are about.
TORCH_SCRIPT = """
import contextlib
import os
import sys
import torch
import torch.distributed as dist
import layerdiff
from layerdiff.recipes import torch_llama_tp, torch_llama_dp

out = sys.argv[1]
dist.init_process_group("gloo")
for recipe, prefix in ((torch_llama_tp, "tp"), (torch_llama_dp, "dp")):
    for defect in [None, *recipe.DEFECTS]:
        built = recipe.build(defect)
        with layerdiff.trace(built["model"], f"{out}/{prefix}_{defect or 'clean'}"):
            built["step"]()
built = torch_llama_tp.build(None)
with layerdiff.trace(built["model"], f"{out}/tp_stats", mode="stats"):
    built["step"]()
for wrap in ("ddp", "fsdp"):  # each rank its own share of the batch, two SGD steps
    for defect, mode in ((None, "full"), ("eps", "full"), ("backward", "full"), (None, "stats")):
        built = torch_llama_dp.build(defect, wrap=wrap, split=True, lr=0.1)
        with layerdiff.trace(built["model"], f"{out}/{wrap}_split_{defect or 'clean'}_{mode}", mode=mode):
            built["step"]()
            built["step"]()
for defect in (None, "act"):  # FSDP's mixed precision: weights gathered in bfloat16 for computing
    built = torch_llama_dp.build(defect, wrap="fsdp", split=True, lr=0.1, param_dtype="bfloat16")
    with layerdiff.trace(built["model"], f"{out}/fsdp_bf16_{defect or 'clean'}"):
        built["step"]()
        built["step"]()
for wrap in ("ddp", "fsdp"):  # each rank its share of 8 sequences, in 2 microbatches of 2 (gradient accumulation)
    built = torch_llama_dp.build(None, wrap=wrap, split=True, batch=4, lr=0.1)
    replica, ids = built["model"], built["input_ids"]
    optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
    with layerdiff.trace(replica, f"{out}/{wrap}_accumulated") as tracer:
        for _ in range(2):
            optimizer.zero_grad()
            with tracer.step():
                for i in range(2):
                    if wrap == "fsdp":
                        replica.set_requires_gradient_sync(i == 1)
                    with replica.no_sync() if wrap == "ddp" and i == 0 else contextlib.nullcontext():
                        (replica(input_ids=ids[2 * i:2 * i + 2], labels=ids[2 * i:2 * i + 2]).loss / 2).backward()
            optimizer.step()
built = torch_llama_dp.build(None, split=True, lr=0.1)
with layerdiff.trace(built["model"].module, f"{out}/inside_ddp"):  # the model inside the wrapper that runs it
    built["step"]()
    built["step"]()
for defect in (None, "backward"):  # FSDP1: FullyShardedDataParallel units, use_orig_params
    built = torch_llama_dp.build(defect, wrap="fsdp1", split=True, lr=0.1)
    with layerdiff.trace(built["model"], f"{out}/fsdp1_{defect or 'clean'}"):
        built["step"]()
        built["step"]()
built = torch_llama_dp.build(None, wrap="fsdp", split=True, lr=0.1, ac=True)  # FSDP2 + activation checkpointing
with layerdiff.trace(built["model"], f"{out}/fsdp_ac"):
    built["step"]()
    built["step"]()
built = torch_llama_dp.build(None, wrap="fsdp", split=True)  # operations recorded under FSDP2
with layerdiff.trace(built["model"], f"{out}/fsdp_ops", ops=True):
    built["step"]()
dist.destroy_process_group()
os._exit(0)  # every file is written and closed: see _EXIT above the scripts
"""

# its own launch: in the same process as the traces above, torch 2.13's teardown after the device mesh aborted
# one run in five ("terminate called without an active exception", every file written); each alone, none in 8
DTENSOR_SCRIPT = """
import os
import sys
import json, torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from layerdiff.adapters.torch_adapter import describe, fast_stats, framework_stats
full = (torch.arange(200_000) // 1000).repeat(2, 1).to(torch.bfloat16)  # column j holds j // 1000: exact in bf16
sharded = distribute_tensor(full, init_device_mesh("cpu", (2,)), [Shard(1)])  # 200K bf16 elements per rank
with open(f"{out}/dtensor_stats_{dist.get_rank()}.json", "w") as f:
    json.dump({"fast": fast_stats(sharded), "local": framework_stats(sharded.to_local()),
               "shape": describe(sharded)[1]}, f)
dist.destroy_process_group()
os._exit(0)  # every file is written and closed: see _EXIT above the scripts
"""



@pytest.fixture(scope="module")
def runs(tmp_path_factory, recipe_trace):
    root = tmp_path_factory.mktemp("ranks")
    launch(root, "torch_ranks", TORCH_SCRIPT, ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    # through torchrun itself: the other launches fork their ranks from a warm interpreter (``conftest.launch``)
    launch(root, "dtensor_stats", DTENSOR_SCRIPT, ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
           warm=False)
    return root




def test_every_rank_writes_its_own_trace_with_placements(runs):
    run = runs / "tp_clean"
    assert sorted(p.name for p in run.iterdir()) == ["rank0.h5", "rank1.h5"]
    for rank in (0, 1):
        with open_trace(run / f"rank{rank}.h5") as reader:
            assert reader.meta["distributed"]["rank"] == rank and reader.meta["distributed"]["world_size"] == 2
            weight = next(r for r in reader.records if r.kind == "param"
                          and r.path == "model.layers.0.self_attn.q_proj.weight").tensors[0]
            assert weight.shape == [32, 64] and weight.placement == {
                "placements": ["S(0)"], "mesh": [2], "coord": [rank], "global_shape": [64, 64]}


def test_tensor_parallel_run_aligns_with_one_process_forward_and_backward(runs, recipe_trace):
    report = align_files(recipe_trace(), runs / "tp_clean")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 21 and report["params"]["grads_compared"] == 21
    notes = " ".join(t["metrics"].get("note", "") for r in report["records"] for t in r["tensors"])
    assert "ranks' shards joined on axis 2" in notes and "partial sums added" in notes


def test_worker_processes_compare_a_run_of_ranks_as_one_process_does(runs, recipe_trace, monkeypatch):
    """Shards joined on the first axis and rank 0's copies are read from the rank files by worker processes."""
    from layerdiff.compare import tasks as compare_tasks
    from layerdiff.compare import workers as compare_workers
    from layerdiff.compare.spec import Comparison
    from layerdiff.compare.tasks import Workers

    serial = align_files(recipe_trace("eps"), runs / "tp_clean")
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # a small run: use workers all the same
    slices = []
    real_pairs = compare_workers.compare_pairs

    def counted(pairs, *args, **kwargs):
        slices.append(len(pairs))
        return real_pairs(pairs, *args, **kwargs)

    monkeypatch.setattr("layerdiff.compare.measure.compare_pairs", counted)
    parallel = align_files(recipe_trace("eps"), runs / "tp_clean", Comparison(workers=Workers(2)))
    assert slices and slices[0] > 100
    assert serial["verdict"] == parallel["verdict"] == "divergent"
    assert serial["forward"]["first_divergence"]["module"] == parallel["forward"]["first_divergence"]["module"]
    for x, y in zip(serial["records"], parallel["records"], strict=True):
        for tx, ty in zip(x["tensors"], y["tensors"], strict=True):
            assert tx["passed"] == ty["passed"]
            for key, value in tx["metrics"].items():
                if isinstance(value, float) and math.isfinite(value):
                    assert ty["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (x["path"], key)


@pytest.mark.parametrize("defect", ["shard", "eps", "no_reduce", "backward"])
def test_tensor_parallel_defects_named_with_their_ranks(runs, recipe_trace, defect):
    from layerdiff.recipes.torch_llama_tp import DEFECTS

    direction, module, ranks = DEFECTS[defect]
    origin = align_files(recipe_trace(), runs / f"tp_{defect}")[direction]["first_divergence"]
    assert origin["module"] == module and origin["ranks"] == ranks
    if defect == "shard":
        assert origin["description"] == "rank 1's shard of model.layers.1.mlp.up_proj"
    if defect == "no_reduce":
        assert "a reduction (all-reduce) is missing" in origin["hint"]


def test_statistics_traces_of_ranks(runs, recipe_trace):
    assert align_files(recipe_trace(mode="stats"), runs / "tp_stats")["verdict"] == "aligned"


def test_a_dtensors_statistics_are_its_local_shards(runs):
    """Taken where the shard lives (bf16, 200K elements per rank: the C kernel reads the shard in place), never by a
    collective over the whole: equal to torch's reductions of the local shard."""
    shards = [json.loads((runs / f"dtensor_stats_{rank}.json").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(shards):
        assert got["shape"] == [2, 100_000]
        fast, local = got["fast"], got["local"]
        assert fast is not None and fast["numel"] == local["numel"] == 200_000
        assert (fast["min"], fast["max"], fast["nan"], fast["inf"]) == (local["min"], local["max"], 0, 0)
        assert fast["mean"] == pytest.approx(local["mean"], rel=1e-6)
        assert fast["l2"] == pytest.approx(local["l2"], rel=1e-6)
        assert (got["fast"]["min"], got["fast"]["max"]) == (100 * rank, 100 * rank + 99)  # its own columns


def test_data_parallel_desync_is_named_with_its_rank(runs):
    code, out, err = run_cli("align", runs / "dp_clean", "-q")
    assert code == 0 and out.startswith("aligned: all 2 ranks agree with rank 0"), out + err
    code, out, err = run_cli("align", runs / "dp_weight", "--json", runs / "dp.json")
    assert code == 1, out + err
    result = json.loads((runs / "dp.json").read_text())
    first = result["first_divergence"]
    assert first["module"] == "model.layers.1.mlp.up_proj" and first["ranks"] == [1]
    assert "first desync (forward): model.layers.1.mlp.up_proj on rank(s) 1" in out


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_data_parallel_ranks_given_their_own_shares_join_as_one_process(runs, recipe_trace, wrap):
    """DistributedDataParallel and FSDP2 (``fully_shard``), each rank its own share of the batch, two SGD steps,
    against one process that took the whole batch: activations joined along the batch axis, the loss and the
    gradients as the ranks' mean, FSDP's weight shards by their placement. Before, FSDP's sharded weights made
    every activation of their layers a 'shard' (the embedding's output joined on the hidden axis: divergent at
    ``model.embed_tokens``), and under DDP each rank's own loss and gradients were compared as if they were the
    step's (divergent in backward)."""
    from layerdiff.recipes.llama_shared import DEFECTS

    reference = {"batch": 4, "lr": 0.1, "steps": 2}
    for mode in ("full", "stats"):
        report = align_files(recipe_trace(mode=mode, **reference), runs / f"{wrap}_split_clean_{mode}")
        assert report["verdict"] == "aligned", (mode, report["forward"], report["backward"])
        assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42  # 21 in 2 steps
    root = next(r for r in report["records"] if r["path"] == "" and r["phase"] == "forward")
    loss = next(t for t in root["tensors"] if t["key"] == "out.loss")
    assert loss["metrics"]["note"] == "B: 2 ranks' mean"
    # DDP's wrapper is left out: the names are one process's, nothing to map, nothing left unmatched
    assert report["mapping"] == [] and report["unmatched_modules"] == {"a": [], "b": []} and not report["only_b"]
    for defect in ("eps", "backward"):  # a port's bug on every rank, named as in one process
        direction, module = DEFECTS[defect]
        origin = align_files(recipe_trace(**reference), runs / f"{wrap}_split_{defect}_full")[direction]
        assert (origin["first_divergence"]["module"], origin["first_divergence"]["step"]) == (module, 0), defect
    code, out, err = run_cli("align", runs / f"{wrap}_split_clean_full")  # rank against rank 0: the weights
    assert code == 0 and "each data-parallel rank was given its own share of the batch" in out, out + err


def test_fsdp1_ranks_join_as_one_process_with_their_parameters_gathered(runs, recipe_trace):
    """FSDP1 (``FullyShardedDataParallel``, a unit per decoder layer, ``use_orig_params``), each rank its share,
    two SGD steps: its units are left out of the names and its ranks join as one process, forward and backward;
    its parameters, flat pieces of each rank's shard between calls, are read gathered whole before each step and
    its gradients before the optimizer steps. A backward-only defect is named as in one process (before: every
    module under ``_fsdp_wrapped_module`` names, the batch shards compared as a whole, the parameters as flat
    shards)."""
    from layerdiff.recipes.llama_shared import DEFECTS

    reference = recipe_trace(batch=4, lr=0.1, steps=2)
    report = align_files(reference, runs / "fsdp1_clean")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["mapping"] == [] and not report["only_a"] and not report["only_b"]
    assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42 and \
        not report["params"]["differ"]
    with open_trace(runs / "fsdp1_clean" / "rank1.h5") as reader:
        assert reader.meta["parallel"]["dp"] == 2 and reader.meta["parallel"]["dp_rank"] == 1
        assert reader.meta["model_class"].endswith("LlamaForCausalLM") and not reader.end.warnings
        q = next(r for r in reader.records if r.kind == "param" and r.path == "model.layers.0.self_attn.q_proj.weight")
        assert q.tensors[0].shape == [64, 64]  # gathered whole (a flat shard's piece between calls)
    direction, module = DEFECTS["backward"]
    origin = align_files(reference, runs / "fsdp1_backward")[direction]["first_divergence"]
    assert (origin["module"], origin["step"]) == (module, 0)


def test_fsdp_with_activation_checkpointing_joins_as_one_process(runs, recipe_trace):
    """torchtitan's order: each decoder layer in torch's ``checkpoint_wrapper``, then FSDP2; each rank its share,
    two SGD steps. The wrapper is left out of the names and each rank's recomputed calls kept apart: the ranks
    join as one process, weights and gradients compared, nothing to map."""
    report = align_files(recipe_trace(batch=4, lr=0.1, steps=2), runs / "fsdp_ac")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42
    assert report["mapping"] == [] and not report["only_a"] and not report["only_b"]
    with open_trace(runs / "fsdp_ac" / "rank1.h5") as reader:
        assert {r.path for r in reader.recomputed if r.kind == "call"} >= {"model.layers.0", "model.layers.1"}


def test_fsdp_mixed_precision_is_judged_at_the_precision_it_computes_in(runs, recipe_trace):
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)`` holds float32 weights and computes with bfloat16
    copies: against one float32 process, the float32 tensors computed from bfloat16 ones (the loss, the weights'
    gradients reduced in float32) were judged at float32's tolerance, 'divergent' at the loss and lm_head. The
    dtypes the layers' weights have when they compute are recorded as mixed precision, as autocast's are; a
    defect that bfloat16 can show is still named."""
    from layerdiff.recipes.llama_shared import DEFECTS

    reference = recipe_trace(batch=4, lr=0.1, steps=2)
    report = align_files(reference, runs / "fsdp_bf16_clean")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    differ = {d["key"]: d for d in report["settings"]["differ"]}
    assert differ["autocast_dtypes"]["b"] == ["bfloat16"] and differ["autocast_dtypes"]["a"] == []
    origin = align_files(reference, runs / "fsdp_bf16_act")["forward"]["first_divergence"]
    assert origin["module"] == DEFECTS["act"][1], origin


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_data_parallel_ranks_accumulating_microbatches_join_as_one_process(runs, recipe_trace, wrap):
    """Each rank its share of the batch, in two microbatches declared one step (``tracer.step()``; DDP's
    ``no_sync``, FSDP's ``set_requires_gradient_sync`` until the last), against one process on the whole batch:
    each rank's microbatches joined first, then the ranks."""
    report = align_files(recipe_trace(batch=8, lr=0.1, steps=2), runs / f"{wrap}_accumulated")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["grads_compared"] == 42


def test_a_model_traced_inside_its_ddp_wrapper_joins_as_the_wrapper_does(runs, recipe_trace):
    """The model traced, not the ``DistributedDataParallel`` that runs it (each rank its share, two SGD steps):
    its first call finds the wrapper, whose layout and gradients' placement hold for it. Before, the trace only
    warned, and the ranks' losses were joined as if each were the whole batch's ('divergent' at the loss, and all
    of backward)."""
    with open_trace(runs / "inside_ddp" / "rank1.h5") as reader:
        layout = reader.meta["parallel"]
        assert (layout["dp"], layout["dp_rank"], layout["grad_mean"]) == (2, 1, True) and "wrapped" not in layout
        assert not any("DistributedDataParallel" in w for w in reader.end.warnings)
    report = align_files(recipe_trace(batch=4, lr=0.1, steps=2), runs / "inside_ddp")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["grads_compared"] == 42


def test_operations_recorded_under_fsdp(runs):
    """FSDP2 frees each layer's gathered weights by resizing their storage to nothing: ``Tensor.numpy()`` on them
    (a weight that model code multiplies, RMSNorm's) forbade it, and the traced step crashed ("Trying to resize
    storage that is not resizable"). The operations FSDP runs in its hooks (its all-gather) are none of the
    model's, and a gathered weight is known as the parameter it stands for."""
    with open_trace(runs / "fsdp_ops" / "rank0.h5") as reader:
        forward = [op for op in reader.ops if op.phase == "forward"]
        producers = [p for op in forward for p in (op.producers or {}).values()]
        norm = next(op for op in forward if op.path == "model.layers.0.input_layernorm" and op.name == "Tensor.mul"
                    and any(p.kind == "param" for p in op.producers.values()))
    assert len(forward) > 100 and not [op.name for op in forward if "fsdp" in op.name]
    assert not [p for p in producers if p.kind == "unknown"]
    assert [p.name for p in norm.producers.values() if p.kind == "param"] == ["model.layers.0.input_layernorm.weight"]


DP3_SCRIPT = """
import sys
import layerdiff
from layerdiff.recipes import torch_llama_dp

for defect in ("weight", "input"):
    built = torch_llama_dp.build(defect)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/dp3_{defect}"):
        built["step"]()
"""


def test_ranks_are_compared_in_parallel_processes(tmp_path, monkeypatch):
    from layerdiff import api
    from layerdiff.compare import tasks as compare_tasks

    launch(tmp_path, "dp3", DP3_SCRIPT, ["torch.distributed.run", "--standalone", "--nproc-per-node", "3"])
    code, out, err = run_cli("align", tmp_path / "dp3_weight", "--json", tmp_path / "r.json")
    assert code == 1, out + err
    assert "rank 1: differs" in out and "rank 2: agrees with rank 0" in out
    # ranks 0 and 2 were given one batch, rank 1 another: replicas that lost step, not shares of a batch
    code, out, _ = run_cli("align", tmp_path / "dp3_input", "-q")
    assert code == 1 and "<root>: the runs were given different inputs on rank(s) 1" in out
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # a small run: to worker processes all the same
    sizes = []
    real_map = compare_tasks.LocalPool.map
    monkeypatch.setattr(compare_tasks.LocalPool, "map",
                        lambda self, *args, **kw: sizes.append(self.size) or real_map(self, *args, **kw))
    parallel = api.align(tmp_path / "dp3_weight", workers=2)
    assert sizes == [2]
    assert (tmp_path / "r.json").read_text() == parallel.to_json()  # two worker processes give what one gives
    assert parallel.data["first_divergence"]["ranks"] == [1]


def test_a_local_dask_cluster_gives_the_local_pools_reports_byte_for_byte(runs, recipe_trace, tmp_path, monkeypatch):
    """--scheduler local (a LocalCluster of processes started for the command): a data-parallel run's rank pairs
    and a tensor-parallel run's shards, read from the rank files by the cluster's workers."""
    pytest.importorskip("distributed")
    from layerdiff import api
    from layerdiff.compare import tasks as compare_tasks

    code, out, err = run_cli("align", runs / "dp_weight", "--scheduler", "local", "-q", "--json", tmp_path / "r.json")
    assert code == 1 and "on rank(s) 1" in out, out + err
    assert (tmp_path / "r.json").read_text() == api.align(runs / "dp_weight", workers=2).to_json()
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # a small run: the local pool compares its shards too
    local = api.align(recipe_trace("eps"), runs / "tp_clean", workers=2)
    environment = dict(os.environ)
    assert local.to_json() == api.align(recipe_trace("eps"), runs / "tp_clean", scheduler="local", workers=2).to_json()
    assert dict(os.environ) == environment  # Dask's nanny sets PYTHONHASHSEED here; layerdiff puts it back
    assert local.forward["module"] == "model.layers.1.post_attention_layernorm"


def test_ranks_of_a_tensor_parallel_run_agree_on_what_they_replicate(runs):
    code, out, err = run_cli("align", runs / "tp_clean", "-q")
    assert code == 0, out + err  # shards differ by design and are left out
    # the unreduced output has no placement; the first tensor known to be a replica that disagrees is named
    code, out, _ = run_cli("align", runs / "tp_no_reduce", "-q")
    assert code == 1 and "model.layers.0.mlp, own code before gate_proj on rank(s) 1" in out


def test_an_incomplete_run_is_one_line_exit_2(runs, recipe_trace, tmp_path):
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(runs / "tp_clean", broken)
    (broken / "rank1.h5").unlink()
    code, out, err = run_cli("align", recipe_trace(), broken)
    assert code == 2 and "incomplete run" in err and len(err.strip().splitlines()) == 1 and not out


def test_bisect_uses_a_multi_rank_reference(runs, tmp_path):
    code, out, err = run_cli("bisect", runs / "tp_clean", "torch_llama", "--arg", "defect=eps", "-q",
                             "--workdir", tmp_path / "w")
    assert code == 1 and out.startswith("own_error: forward model.layers.1.post_attention_layernorm"), out + err
