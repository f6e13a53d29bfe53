"""torch's own parallelism on real CPU ranks (gloo) beyond one dimension: FSDP2 with tensor parallelism and HSDP
on 4 ranks, and ``torch.distributed.pipelining`` (alone, and with FSDP2 replicas), each against one process."""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from layerdiff.tracefile.reader import open_trace  # noqa: E402

from conftest import align_files, launch, run_cli  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

# Each script ends with os._exit(0) after its last statement: see _EXIT in tests/runs/test_distributed.py.


FSDP_TP_SCRIPT = """
import os
import sys
import torch.distributed as dist
import layerdiff
from layerdiff.recipes import torch_llama_dp

dist.init_process_group("gloo")
for defect, mode in ((None, "full"), ("eps", "full"), ("backward", "full"), (None, "stats")):
    built = torch_llama_dp.build(defect, wrap="fsdp", tp=2, split=True, lr=0.1)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/fsdp_tp_{defect or 'clean'}_{mode}", mode=mode):
        built["step"]()
        built["step"]()
built = torch_llama_dp.build(None, wrap="fsdp", tp=2, split=True)  # gradient accumulation: 2 microbatches
with layerdiff.trace(built["model"], f"{sys.argv[1]}/fsdp_tp_accumulated_stats", mode="stats") as tracer:
    with tracer.step():
        for half in built["input_ids"].split(1):
            (built["model"](input_ids=half, labels=half).loss / 2).backward()
for defect, mode in ((None, "full"), (None, "stats"), ("weight", "full")):  # HSDP: 2 replicas, each sharding
    built = torch_llama_dp.build(defect, wrap="hsdp", split=True, lr=0.1)  # over 2 ranks; each rank its share
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/hsdp_{defect or mode}", mode=mode):
        built["step"]()
        built["step"]()
from layerdiff.recipes import torch_llama_pp  # pipelining x FSDP2 (2 stages x 2 replicas), torchtitan's 2-D layout

for defect, mode in ((None, "stats"), ("eps", "full")):
    built = torch_llama_pp.build(defect, dp=2, batch=4, microbatches=2, schedule="1f1b", lr=0.1)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/pp_dp_{defect or 'clean'}_{mode}", mode=mode):
        built["step"]()
        built["step"]()
for defect, mode in ((None, "stats"), ("eps", "full")):  # pipelining x tensor parallelism: 2 stages x 2 TP ranks
    built = torch_llama_pp.build(defect, tp=2, batch=4, schedule="1f1b", lr=0.1)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/pp_tp_{defect or 'clean'}_{mode}", mode=mode):
        for _ in range(2 if mode == "stats" else 1):
            built["step"]()
built = torch_llama_pp.build(None, dp=2, batch=4, layers=4, stages_per_rank=2, schedule="interleaved1f1b", lr=0.1)
with layerdiff.trace(built["model"], f"{sys.argv[1]}/vpp_dp_clean_stats", mode="stats"):  # 2 stages a rank
    built["step"]()
    built["step"]()
dist.destroy_process_group()
os._exit(0)  # every file is written and closed: see _EXIT above the scripts
"""


def torchrun(tmp_path_factory, name: str, script: str, ranks: int):
    """A folder where ``script`` ran on ``ranks`` gloo ranks (torchrun) and wrote its traces."""
    root = tmp_path_factory.mktemp(name)
    launch(root, name, script, ["torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)])
    return root


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return torchrun(tmp_path_factory, "fsdp_tp", FSDP_TP_SCRIPT, 4)


def test_fsdp_with_tensor_parallelism_and_hsdp_join_as_one_process(four_ranks, recipe_trace):
    """torchtitan's layout on 4 ranks: a 2-D mesh, tensor parallelism (q/k/v, gate/up column-parallel, o/down
    row-parallel) inside each of 2 data-parallel replicas, FSDP2 sharding every piece again for storage
    (``_StridedShard`` where both split one axis), each replica its own share of the batch, two SGD steps. The
    weights join piece by piece, the activations by their layer's tensor-parallel piece and then along the
    batch, the gradients as the replicas' mean. Before, the run was 'given different inputs' (its 4 ranks read as
    4 tensor-parallel shards)."""
    from layerdiff.recipes.llama_shared import DEFECTS

    tmp_path = four_ranks
    with open_trace(tmp_path / "fsdp_tp_clean_full" / "rank3.h5") as reader:
        layout = reader.meta["parallel"]
        assert (layout["dp"], layout["dp_rank"], layout["tp"], layout["tp_rank"]) == (2, 1, 2, 1)
        q = next(r for r in reader.records if r.kind == "param" and r.path == "model.layers.0.self_attn.q_proj.weight")
        assert q.tensors[0].placement["placements"] == ["_S(0, 2)", "S(0)"] and q.tensors[0].shape == [16, 64]
    reference = {"batch": 4, "lr": 0.1, "steps": 2}
    for mode in ("full", "stats"):
        report = align_files(recipe_trace(mode=mode, **reference), tmp_path / f"fsdp_tp_clean_{mode}")
        assert report["verdict"] == "aligned", (mode, report["forward"], report["backward"])
        assert report["params"]["compared"] == 42 and not report["params"]["differ"]
    for defect in ("eps", "backward"):
        direction, module = DEFECTS[defect]
        origin = align_files(recipe_trace(**reference), tmp_path / f"fsdp_tp_{defect}_full")[direction]
        assert (origin["first_divergence"]["module"], origin["first_divergence"]["step"]) == (module, 0), defect
    # with gradient accumulation, stats: each rank's microbatches joined, then the replicas; a column-parallel
    # layer's input gradient (each TP rank's partial sum) keeps unknown statistics through both joins (it took
    # the first part's: 'NaN/Inf values differ')
    report = align_files(recipe_trace(mode="stats", batch=4), tmp_path / "fsdp_tp_accumulated_stats")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    code, out, err = run_cli("align", tmp_path / "fsdp_tp_clean_full", "-q")
    assert code == 0 and out.startswith("aligned: all 4 ranks agree"), out + err
    # HSDP (the same launch): weights placed R, S(0) on a 2 x 2 mesh, the first replica's shards joined
    for mode in ("full", "stats"):
        report = align_files(recipe_trace(mode=mode, batch=8, lr=0.1, steps=2), tmp_path / f"hsdp_{mode}")
        assert report["verdict"] == "aligned", (mode, report["forward"], report["backward"])
        assert report["params"]["compared"] == 42 and not report["params"]["differ"]
    # rank against rank: each shard's copies (ranks 1 and 3 hold the same one) must agree; rank 1's was changed
    code, out, err = run_cli("align", tmp_path / "hsdp_full", "-q")
    assert code == 0, out + err
    code, out, err = run_cli("align", tmp_path / "hsdp_weight")
    assert code == 1 and "rank 3: differs" in out and "model.layers.1.mlp.up_proj.weight" in out, out + err


PIPELINE_SCRIPT = """
import os
import sys
import layerdiff
from layerdiff.recipes import torch_llama_pp

for defect, schedule, mode in ((None, "gpipe", "full"), (None, "1f1b", "stats"), ("eps", "1f1b", "full"),
                               ("backward", "gpipe", "full")):
    built = torch_llama_pp.build(defect, batch=4, microbatches=4 if schedule == "1f1b" else 2, schedule=schedule,
                                 lr=0.1)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/pp_{defect or 'clean'}_{schedule}_{mode}", mode=mode):
        for _ in range(2):
            built["step"]()
with layerdiff.trace(built["model"].model, f"{sys.argv[1]}/pp_body"):  # a module inside the stage's
    built["step"]()
for defect in (None, "owncode"):  # operations recorded, joined over the stages and the microbatches
    built = torch_llama_pp.build(defect, batch=4, microbatches=2)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/pp_ops_{defect or 'clean'}", ops=True):
        built["step"]()
# two stages on each rank (4 layers, 4 stages): rank r runs stages r and r + 2, the model traced is their list
for defect, schedule, mode, ops in ((None, "interleaved1f1b", "stats", False), ("eps", "loopedbfs", "full", False),
                                    ("owncode", "interleaved1f1b", "full", True), (None, "zbv", "stats", False),
                                    (None, "dualpipev", "stats", False)):
    built = torch_llama_pp.build(defect, batch=4, layers=4, stages_per_rank=2, schedule=schedule, lr=0.1,
                                 defect_layer=2 if defect == "eps" else 3,
                                 microbatches=4 if schedule == "dualpipev" else 2)
    with layerdiff.trace(built["model"], f"{sys.argv[1]}/vpp_{defect or 'clean'}_{schedule}_{mode}", mode=mode,
                         ops=ops):
        for _ in range(1 if ops else 2):
            built["step"]()
os._exit(0)
"""


@pytest.fixture(scope="module")
def pipeline_ranks(tmp_path_factory):
    return torchrun(tmp_path_factory, "pipeline", PIPELINE_SCRIPT, 2)


def test_torch_pipeline_stages_join_as_one_process(pipeline_ranks, recipe_trace):
    """``torch.distributed.pipelining`` (torchtitan's pipeline parallelism), 2 stages on 2 ranks, GPipe over 2
    microbatches and 1F1B over 4, two SGD steps, against one process on the whole batch. Before, each
    microbatch read as a step of its own, the stages' shape inference on uninitialized placeholder tensors was
    recorded as the first, and no layout said the ranks were stages: 'the runs were given different inputs'.
    The gradients of each microbatch's own mean loss are 1/M of the step's once the schedule divides them
    (``scale_grads``): joined with that scale. With operations recorded, each stage's operations join over the
    microbatches, and an attention scaling planted on stage 1 is named at its operation and argument."""
    import layerdiff
    from layerdiff.recipes import torch_llama
    from layerdiff.recipes.llama_shared import DEFECTS

    tmp_path = pipeline_ranks
    with open_trace(tmp_path / "pp_clean_gpipe_full" / "rank1.h5") as reader:
        layout = reader.meta["parallel"]
        assert (layout["pp"], layout["pp_rank"], layout["microbatch_grad_scale"]) == (2, 1, 0.5)
        roots = [(r.step, r.micro) for r in reader.records if r.kind == "call" and r.path == "" and
                 r.phase == "forward"]
        assert roots == [(0, 0), (0, 1), (1, 0), (1, 1)]  # no call of the shape inference
    code, out, err = run_cli("show", tmp_path / "pp_clean_gpipe_full" / "rank1.h5")
    assert code == 0 and "'pp': 2, 'pp_rank': 1" in out, out + err  # the layout learned at the first step
    reference = {"batch": 4, "lr": 0.1, "steps": 2}
    for name, mode in (("pp_clean_gpipe_full", "full"), ("pp_clean_1f1b_stats", "stats")):
        report = align_files(recipe_trace(mode=mode, **reference), tmp_path / name)
        assert report["verdict"] == "aligned", (name, report["forward"], report["backward"])
        assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42
    head = next(r for r in report["records"] if r["path"] == "lm_head" and r["phase"] == "backward")
    grad = next(t for t in head["tensors"] if t["role"] == "grad_output")
    assert grad["metrics"]["note"] == "B: 4 microbatches joined on axis 0, x0.25", grad["metrics"]
    for defect, name in (("eps", "pp_eps_1f1b_full"), ("backward", "pp_backward_gpipe_full")):
        direction, module = DEFECTS[defect]
        origin = align_files(recipe_trace(**reference), tmp_path / name)[direction]["first_divergence"]
        assert (origin["module"], origin["step"]) == (module, 0), (defect, origin)
        assert align_files(recipe_trace(defect, **reference), tmp_path / name)["verdict"] == "aligned", defect
    # operations: each stage's, under the whole model's names, each joined over the microbatches
    built = torch_llama.build(None, batch=4)
    with layerdiff.trace(built["model"], tmp_path / "ops_reference.h5", ops=True, overwrite=True):
        built["step"]()
    report = align_files(tmp_path / "ops_reference.h5", tmp_path / "pp_ops_clean")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert len([r for r in report["records"] if r["kind"] == "op"]) > 100
    origin = align_files(tmp_path / "ops_reference.h5", tmp_path / "pp_ops_owncode")["forward"]["first_divergence"]
    assert origin["module"] == DEFECTS["owncode"][1] and origin["op"]["name"].endswith("scaled_dot_product_attention")
    assert origin["op"]["args_diff"] == {"kwargs.scale": [0.25, 0.3125]}, origin["op"]
    with open_trace(tmp_path / "pp_body" / "rank0.h5") as reader:  # not the stage's module: no layout, a warning
        assert "parallel" not in reader.meta
        assert any("trace each rank's PipelineStage.submod" in w for w in reader.end.warnings), reader.end.warnings


def test_interleaved_pipeline_stages_join_as_one_process(pipeline_ranks, recipe_trace, tmp_path):
    """Schedules that run several stages on one rank (interleaved 1F1B, looped BFS: torchtitan's ``model_parts``),
    4 stages on 2 ranks, the list of each rank's stage modules traced into one trace. Each record says its stage,
    each stage's microbatches are counted on their own, and the run reads as 4 stages: aligned with one process
    over two SGD steps; a defect in layer 2 (rank 0's second stage) is named there, and one planted in layer 3's
    attention scaling at its operation; a zero-bubble schedule's weight gradients, computed apart, are all compared.
    Before, the trace warned and the ranks were not joined."""
    import layerdiff
    from layerdiff.recipes import torch_llama
    from layerdiff.recipes.llama_shared import DEFECTS

    root = pipeline_ranks
    with open_trace(root / "vpp_clean_interleaved1f1b_stats" / "rank0.h5") as reader:
        layout = reader.meta["parallel"]
        assert (layout["pp"], layout["pp_rank"], layout["pp_stages"]) == (4, 0, [0, 2]), layout
        roots = [(r.stage, r.step, r.micro) for r in reader.records if r.kind == "call" and r.path == ""
                 and r.phase == "forward"]
        assert sorted(roots) == [(s, step, m) for s in (0, 2) for step in (0, 1) for m in (0, 1)], roots
        owners = {r.path: r.stage for r in reader.records if r.kind == "param"}
        assert owners["model.embed_tokens.weight"] == 0 and owners["model.layers.2.mlp.up_proj.weight"] == 2
    shown = layerdiff.show(root / "vpp_clean_interleaved1f1b_stats" / "rank0.h5")["meta"]
    assert shown["model_parts"] == 2 and shown["parallel"]["pp_stages"] == [0, 2], shown
    reference = {"batch": 4, "layers": 4, "lr": 0.1, "steps": 2}
    report = align_files(recipe_trace(mode="stats", **reference), root / "vpp_clean_interleaved1f1b_stats")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 78 and report["params"]["grads_compared"] == 78
    # zero bubble (the V: rank 0 runs stages 0 and 3): each weight's gradient is computed apart from its input's and
    # written into weight.grad where no accumulation hook sees it; each contribution is recorded as it arrives
    for schedule in ("zbv", "dualpipev"):  # DualPipeV: the V, each rank's forward and backward overlapped
        report = align_files(recipe_trace(mode="stats", **reference), root / f"vpp_clean_{schedule}_stats")
        assert report["verdict"] == "aligned", (schedule, report["forward"], report["backward"])
        assert report["params"]["grads_compared"] == 78 and not report["only_a"], (schedule, report["params"])
    origin = align_files(recipe_trace(**reference), root / "vpp_eps_loopedbfs_full")["forward"]["first_divergence"]
    assert (origin["module"], origin["step"]) == (DEFECTS["eps"][1].replace("layers.1", "layers.2"), 0), origin
    # bisect with the pipelined run as the reference: its microbatches' values, joined, forced into a candidate that
    # takes the whole batch (each microbatch's did not fit: 27 tensors were forced and 44 segments had own error)
    result = layerdiff.bisect(root / "vpp_eps_loopedbfs_full", "torch_llama", args=["batch=4", "layers=4"],
                              workdir=tmp_path / "bisect")
    assert [s["module"] for s in result["forward"]["segments"]] == ["model.layers.2.post_attention_layernorm"]
    assert not result["runs"]["replay"]["forcing"]["not_forced"], result["runs"]["replay"]["forcing"]
    built = torch_llama.build(None, batch=4, layers=4)
    with layerdiff.trace(built["model"], tmp_path / "ops_reference.h5", ops=True):
        built["step"]()
    report = align_files(tmp_path / "ops_reference.h5", root / "vpp_owncode_interleaved1f1b_full")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.3.self_attn", origin
    assert origin["op"]["name"].endswith("scaled_dot_product_attention"), origin["op"]
    assert origin["op"]["args_diff"] == {"kwargs.scale": [0.25, 0.3125]}, origin["op"]



def test_torch_pipeline_stages_with_fsdp_replicas_join_as_one_process(four_ranks, recipe_trace):
    """Pipelining x FSDP2 on a 2-D mesh (2 stages x 2 data-parallel replicas), 1F1B over 2 microbatches, each
    replica its own share: the stage's layout learned from its schedule keeps the data-parallel one FSDP gave; a
    later stage, which receives hidden states, takes its replica's share of the batch from the first stage's ranks
    (before, its activations were joined in the wrong order); FSDP's gradient of the step, reduced once after the
    last microbatch, is scaled as the schedule scales it."""
    from layerdiff.recipes.llama_shared import DEFECTS

    with open_trace(four_ranks / "pp_dp_clean_stats" / "rank3.h5") as reader:
        layout = reader.meta["parallel"]
        assert (layout["pp"], layout["pp_rank"], layout["dp"], layout["dp_rank"]) == (2, 1, 2, 1)
    reference = {"batch": 8, "lr": 0.1, "steps": 2}
    report = align_files(recipe_trace(mode="stats", **reference), four_ranks / "pp_dp_clean_stats")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42
    origin = align_files(recipe_trace(**reference), four_ranks / "pp_dp_eps_full")["forward"]["first_divergence"]
    assert (origin["module"], origin["step"]) == (DEFECTS["eps"][1], 0), origin
    # pipelining x tensor parallelism (2 stages x 2 TP ranks, 1F1B over 2 microbatches): a column-parallel layer's
    # input gradient is each TP rank's partial sum, whose statistics are unknown in a stats trace; joined over the
    # microbatches they stay unknown (they were taken as the first microbatch's: 'NaN/Inf values differ')
    report = align_files(recipe_trace(mode="stats", **reference | {"batch": 4}), four_ranks / "pp_tp_clean_stats")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 42 and report["params"]["grads_compared"] == 42
    origin = align_files(recipe_trace(batch=4, lr=0.1), four_ranks / "pp_tp_eps_full")["forward"]["first_divergence"]
    assert (origin["module"], origin["ranks"]) == (DEFECTS["eps"][1], [2, 3]), origin
    # interleaved 1F1B, 4 stages on each replica's 2 ranks: the data-parallel layout is read while FSDP holds its
    # weights sharded (at a step's first call they may be gathered already: the replicas read as one)
    report = align_files(recipe_trace(mode="stats", batch=8, layers=4, lr=0.1, steps=2),
                         four_ranks / "vpp_dp_clean_stats")
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["params"]["compared"] == 78 and report["params"]["grads_compared"] == 78
