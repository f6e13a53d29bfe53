"""Model-parallel runs read as one model, without a framework: pipeline stages joined under their global layer
names (rank files written by the real writer, with the facts Megatron's ranks record), a step's microbatches
joined along the batch axis, a tensor of several ranks and microbatches joined the one way that lines it up, and
flattened tokens of rank blocks related to a batch-first run's."""
from __future__ import annotations

import numpy as np
import pytest
from msgspec.structs import replace

from builders import Trace, call, param
from layerdiff.compare.per_rank import resolve
from layerdiff.match.joins import best_way, candidate_shapes, resolved_as, ways
from layerdiff.match.layouts import TokenOrder, relate_shapes
from layerdiff.match.microbatches import Joined, joined_pair
from layerdiff.runs.parallel import global_path
from layerdiff.runs.ranks import open_run
from layerdiff.tracefile.records import Merge, TensorEntry
from layerdiff.tracefile.writer import TraceWriter

IDS = np.arange(6, dtype=np.int64).reshape(1, 6)


def _tensor(writer, role, key, values):
    entry = writer.write_tensor(np.asarray(values, dtype=np.float32), "float32", store_data=True)
    return {**entry, "role": role, "key": key}


def _stage(run, rank, layout, calls):
    """A pipeline stage's trace: ``calls`` are (phase, path, parent, [(role, key, values)]) in completion order."""
    writer = TraceWriter(run / f"rank{rank}.h5", {"framework": "torch", "model_class": "GPTModel", "mode": "full",
                                                  "distributed": {"rank": rank, "world_size": 2}, "parallel": layout})
    for seq, (phase, path, parent, tensors) in enumerate(calls):
        written = [_tensor(writer, role, key, values) if values is not None  # None: the token ids
                   else {**writer.write_tensor(IDS, "int64", store_data=True), "role": role, "key": key}
                   for role, key, values in tensors]
        writer.write_record({"kind": "call", "phase": phase, "path": path, "call": 0, "step": 0, "type": "M",
                             "begin": seq, "end": seq, "parent": parent, "tensors": written})
    writer.close({"kind": "end", "status": "complete"})


def test_pipeline_stages_join_into_one_model(tmp_path):
    x, h1, h2 = np.ones((6, 1, 4)), np.full((6, 1, 4), 2.0), np.full((6, 1, 4), 3.0)
    run = tmp_path / "pp"
    run.mkdir()
    _stage(run, 0, {"pp": 2, "pp_rank": 0}, [
        ("forward", "decoder.layers.0", ["decoder", 0], [("input", "args.0", x), ("output", "out", h1)]),
        ("forward", "decoder", ["", 0], [("input", "kwargs.hidden_states", x), ("output", "out", h1)]),
        ("forward", "", None, [("input", "args.0", None), ("output", "out", h1)]),
        ("backward", "decoder.layers.0", ["decoder", 0], [("grad_output", "out", h1), ("grad_input", "args.0", x)]),
    ])
    _stage(run, 1, {"pp": 2, "pp_rank": 1, "global_paths": {"decoder.layers.0": "decoder.layers.1"}}, [
        ("forward", "decoder.layers.0", ["decoder", 0], [("input", "args.0", h1), ("output", "out", h2)]),
        ("forward", "decoder", ["", 0], [("output", "out", h2)]),
        ("forward", "", None, [("input", "args.0", None), ("output", "out", np.zeros((1, 6, 8)))]),
        ("backward", "decoder.layers.0", ["decoder", 0], [("grad_output", "out", h2), ("grad_input", "args.0", h1)]),
    ])
    with open_run(run) as merged:
        forward = [r for r in merged.records if r.phase == "forward"]
        assert [r.path for r in forward] == ["decoder.layers.0", "decoder.layers.1", "decoder", ""]
        assert [r.ranks_held for r in forward] == [[0], [1], None, None]
        decoder = forward[2]
        assert [t.role for t in decoder.tensors] == ["input", "output"]  # stage 0's input, the last stage's output
        assert merged.tensor(decoder.tensors[1]).max() == 3.0 and merged.tensor(decoder.tensors[0]).max() == 1.0
        assert forward[-1].tensors[-1].shape == [1, 6, 8]
        backward = [r.path for r in merged.records if r.phase == "backward"]
        assert backward == ["decoder.layers.1", "decoder.layers.0"]  # the last stage's backward runs first


def test_a_record_one_rank_lacks_is_missing_unless_the_layout_says_it_holds_it_apart(tmp_path):
    run = tmp_path / "ep"
    run.mkdir()
    for rank in range(2):
        expert = f"mlp.experts.local_experts.{rank}"
        _stage(run, rank, {"ep": 2, "ep_rank": rank, "own_modules": [expert]}, [
            ("forward", expert, None, [("input", "args.0", np.ones((3, 4)) * rank), ("output", "out", np.ones((3, 4)))])])
    with open_run(run) as merged:
        assert {r.path: (r.ranks_held, r.ranks_missing) for r in merged.records} == {
            "mlp.experts.local_experts.0": ([0], None), "mlp.experts.local_experts.1": ([1], None)}
    plain = tmp_path / "plain"
    plain.mkdir()
    for rank in range(2):
        _stage(plain, rank, None, [("forward", f"m{rank}", None, [("output", "out", np.ones(2))])])
    with open_run(plain) as merged:
        assert [r.ranks_missing for r in merged.records] == [[1], [0]]


def _microbatched(trace: Trace, increments: bool) -> None:
    """Two microbatches of one step, each [s=3, b=1, h=2] through one module, and a gradient per microbatch."""
    for micro in range(2):
        ids = trace.put("input", "args.0", IDS[:, :3] + micro, dtype="int64")
        x = trace.put("output", "out", np.full((3, 1, 2), micro + 1.0))
        mask = trace.put("input", "args.1", np.ones((1, 1, 3, 3)))
        trace.records.append(call("layer", [mask, x], call_index=micro, parent=("", micro)))
        trace.records[-1] = _with_micro(trace.records[-1], micro)
        trace.records.append(_with_micro(call("", [ids], call_index=micro), micro))
        grad = trace.put("param_grad", "value", np.full(2, micro + 1.0 + (0 if increments else micro)))
        trace.records.append(replace(param("layer.weight", grad, grad=True, call_index=micro), increment=increments))


def _with_micro(rec, micro):
    return replace(rec, micro=micro)


@pytest.mark.parametrize("increments", [True, False])
def test_a_steps_microbatches_read_as_one_call_against_a_run_without_them(increments):
    trace = Trace()
    _microbatched(trace, increments)
    joined, other = joined_pair(trace, Trace())
    assert isinstance(joined, Joined) and not isinstance(other, Joined)
    layer = next(r for r in joined.records if r.path == "layer")
    mask, out = layer.tensors
    assert mask.merge.how == "replicate" and mask.shape == [1, 1, 3, 3]  # alike in every microbatch
    assert out.merge == Merge("concat", 1, over="microbatches") and out.shape == [3, 2, 2]  # the batch axis
    assert joined.tensor(out)[:, :, 0].tolist() == [[1.0, 2.0]] * 3
    assert layer.parent == ("", 0) and [r.call for r in joined.records if r.path == ""] == [0]
    grad = next(r for r in joined.records if r.kind == "param_grad")
    assert joined.tensor(grad.tensors[0]).tolist() == [3.0, 3.0]  # increments summed; else the last total
    assert joined_pair(trace, trace) == (trace, trace)  # runs alike: compared call by call


def _unresolved(shape, parts_shapes, how="ranks", over="ranks"):
    parts = tuple(TensorEntry(role="output", key="out", dtype="float32", shape=list(s), stats={"numel": 1})
                  for s in parts_shapes)
    return TensorEntry(role="output", key="out", dtype="float32", shape=list(shape), stats={"numel": 1},
                       merge=Merge(how, over=over), parts=parts)


def test_a_tensor_of_ranks_inside_microbatches_joins_the_one_way_that_lines_up():
    """A step's 2 microbatches ([1, 16, 128] each, joined on the batch axis) of 2 tensor-parallel ranks' logits."""
    ranks = _unresolved([1, 16, 128], [[1, 16, 128]] * 2)
    outer = TensorEntry(role="output", key="out", dtype="float32", shape=[2, 16, 128], stats={"numel": 1},
                        merge=Merge("concat", 0, over="microbatches"), parts=(ranks, ranks))
    resolved = resolve(outer, (2, 16, 256))
    assert resolved.shape == [2, 16, 256] and resolved.parts[0].merge.how == "concat" and resolved.parts[0].merge.dim == 2
    assert (2, 16, 256) in candidate_shapes(outer)


def test_parts_of_different_lengths_join_only_where_they_agree():
    """An expert's tokens from each rank: as many as were routed to it."""
    entry = _unresolved([5, 8], [[5, 8], [3, 8]])
    assert [w[0] for w in ways(entry)] == [("concat", 0)]
    assert resolved_as(entry, ways(entry)[0]).shape == [8, 8]


def test_equal_fits_are_not_guessed():
    entry = _unresolved([2, 2], [[2, 2], [2, 2]])
    fits = [w for w in ways(entry) if tuple(resolved_as(entry, w).shape) in ((4, 2), (2, 4))]
    assert best_way(entry, fits) is None


def test_flattened_tokens_of_rank_blocks_relate_to_batch_first_tokens():
    """Ranks that each ran 1 of 2 sequences (s = 3), flattened sequence-first and joined rank after rank, are in
    the batch-first run's order: no reordering; one rank of 2 sequences would be."""
    grouped = relate_shapes((6, 4), (6, 4), TokenOrder("b", batch=2, seq=3, groups=2))
    a, b = np.arange(24).reshape(6, 4), np.arange(24).reshape(6, 4)
    va, vb = grouped.views(a, b)
    assert np.array_equal(va, vb)
    plain = relate_shapes((6, 4), (6, 4), TokenOrder("b", batch=2, seq=3))
    va, vb = plain.views(a, b)
    assert not np.array_equal(va, vb)


def test_global_path_takes_the_longest_renamed_prefix():
    renames = {"decoder.layers.0": "decoder.layers.3",
               "decoder.layers.0.mlp.experts.local_experts.0": "decoder.layers.3.mlp.experts.local_experts.2"}
    assert global_path(renames, "decoder.layers.0.mlp.router") == "decoder.layers.3.mlp.router"
    assert global_path(renames, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1") == \
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1"
    assert global_path(renames, "decoder.layers.10") == "decoder.layers.10"
