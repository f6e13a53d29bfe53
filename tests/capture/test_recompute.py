"""Activation checkpointing (``capture.recompute``, ``compare.recompute``): transformers' gradient checkpointing,
reentrant and not, traced with every operation recorded. The calls backward recomputes take the numbers of the
calls they replay and are kept apart, so a checkpointed run aligns with a plain one record for record and step for
step; a recomputation that does not reproduce its forward (dropout's random state not restored) is named where
it departs. Real transformers Llama built from a config."""
from __future__ import annotations

import json
from html import escape

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.report.html import report_html  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

pytestmark = [pytest.mark.torch]


def llama(checkpoint: dict | None, dropout: float = 0.0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, attention_dropout=dropout, use_cache=False)
    model = LlamaForCausalLM(config)
    if checkpoint is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint)
    return model.train()


def trace_steps(model, path, steps: int = 2, ops: bool = True):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    with layerdiff.trace(model, path, ops=ops):
        for _ in range(steps):
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("recompute") / "plain.h5"
    trace_steps(llama(None), path)
    return path


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_run_aligns_with_a_plain_one_record_for_record(plain, tmp_path, reentrant):
    path = tmp_path / "checkpointed.h5"
    trace_steps(llama({"use_reentrant": reentrant}), path)
    with open_trace(plain) as a, open_trace(path) as b:
        assert b.end.steps == a.end.steps == 2  # a recomputation opens no step
        keys = [sorted((r.kind, r.phase, r.path, r.call, r.step) for r in t.records) for t in (a, b)]
        assert keys[0] == keys[1]
        calls = [r for r in b.recomputed if r.kind == "call"]
        # each decoder layer's children, once a step (HF checkpoints the layer's forward: its own hooks stay out);
        # reentrant: the layers too, whose own code backward runs again (their operations' backward runs there)
        expected = {(r.path, r.call) for r in a.records if r.kind == "call" and r.phase == "forward"
                    and r.path.startswith("model.layers.") and r.path.count(".") > (1 if reentrant else 2)}
        assert {(r.path, r.call) for r in calls} == expected
        assert all(r.phase == "forward" for r in b.recomputed)
        b_recomputed_ops = [r for r in b.recomputed if r.kind == "op"]
        forward_ops = [sorted((o.path, o.call, o.index, o.name) for o in t.ops if o.phase == "forward")
                       for t in (a, b)]
        assert forward_ops[0] == forward_ops[1]
        # reentrant: the backward of the operations inside recomputed calls runs through the recomputed graph,
        # the decoder layers' own operations (residual additions) included
        backward_ops = [sorted((o.path, o.call, o.index, o.name) for o in t.ops if o.phase == "backward")
                        for t in (a, b)]
        assert ("model.layers.1", 0, 1, "Tensor.add") in backward_ops[0]
        assert backward_ops[0] == backward_ops[1]
    code, out, err = run_cli("show", path)
    assert code == 0 and f"recomputed in backward (activation checkpointing): {len(calls)} module calls, " \
        f"{len(b_recomputed_ops)} operations" in " ".join(out.split()), out + err
    report = layerdiff.align(plain, path).data
    assert report["verdict"] == "aligned" and not report["only_a"] and not report["only_b"]
    assert report["recompute"]["a"] is None
    assert report["recompute"]["b"] == {"calls": len(calls), "compared": len(calls), "differ": []}


def test_a_defect_inside_a_checkpointed_layer_is_still_its_origin(plain, tmp_path):
    model = llama({"use_reentrant": True})
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    trace_steps(model, tmp_path / "b.h5", steps=1, ops=False)
    report = layerdiff.align(plain, tmp_path / "b.h5")
    assert report.data["forward"]["first_divergence"]["module"] == "model.layers.1.mlp.act_fn"


def test_a_recomputation_that_does_not_restore_the_random_state_is_named_where_it_departs(tmp_path):
    """Attention dropout, checkpointed with and without its random state restored: the forward passes agree, the
    backward does not, and B's recomputation departs at the last layer's attention (recomputed first), whose
    inputs are the forward's."""
    for name, restore in (("a", True), ("b", False)):
        trace_steps(llama({"use_reentrant": False, "preserve_rng_state": restore}, dropout=0.2),
                    tmp_path / f"{name}.h5", steps=1, ops=False)
    code, out, err = run_cli("align", tmp_path / "a.h5", tmp_path / "b.h5", "--json", tmp_path / "r.json")
    assert code == 1, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["forward"]["status"] == "aligned" and report["backward"]["status"] == "divergent"
    assert report["recompute"]["a"]["differ"] == []
    differ = report["recompute"]["b"]["differ"]
    departs = [d for d in differ if d["inputs_agree"]]
    last = "model.layers.1.self_attn"
    assert departs and departs[0]["path"] == last and departs[0]["basis"] == "data" and departs[0]["max_abs"] > 0
    assert all(d["path"] == last or d["path"].startswith("model.layers.0.") for d in departs)
    text = " ".join(out.split())  # the terminal wraps long lines
    assert "recomputation (A, activation checkpointing): 24 of 24 recomputed calls compared, each reproduced its " \
           "forward" in text
    assert f"recomputation (B, activation checkpointing): {len(differ)} of 24 recomputed calls differ from the " \
           f"forward they replay" in text and f"departs at {last} call 0 at step 0" in text
    assert f"run B's recomputation (activation checkpointing) departs from its forward at {last}" in text
    page = report_html(report)
    assert f"<p class='bad'>recomputation (B, activation checkpointing): {len(differ)} of 24" in page
    assert "<b class='bad'>" + escape(f"run B's recomputation (activation checkpointing) departs from its forward "
                                      f"at {last}") in page


def test_torchs_checkpoint_wrapper_is_left_out_of_the_names(plain, tmp_path):
    """torch's ``checkpoint_wrapper`` (torchtitan's and FSDP recipes' activation checkpointing) puts each layer
    under ``_checkpoint_wrapped_module``: the wrapper is left out and its child named as the plain run names it,
    parameters too, so nothing needs mapping."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = llama(None)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    trace_steps(model, tmp_path / "wrapped.h5")
    with open_trace(plain) as a, open_trace(tmp_path / "wrapped.h5") as b:
        assert sorted((r.kind, r.phase, r.path, r.call, r.type) for r in a.records) == \
            sorted((r.kind, r.phase, r.path, r.call, r.type) for r in b.records)
        assert sorted((o.path, o.call, o.index, o.phase) for o in a.ops) == \
            sorted((o.path, o.call, o.index, o.phase) for o in b.ops)
        assert {r.path for r in b.recomputed if r.kind == "call"} >= {"model.layers.0", "model.layers.1"}
    report = layerdiff.align(plain, tmp_path / "wrapped.h5").data
    assert report["verdict"] == "aligned" and not report["mapping"] and not report["only_b"]
    assert report["recompute"]["b"]["differ"] == []


TARGET = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(defect=None, checkpoint="none"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    model = LlamaForCausalLM(config).train()
    if checkpoint != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint == "reentrant"})
    if defect == "act":
        model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return {"model": model, "step": step}
'''


def test_bisect_replays_a_checkpointed_candidate_and_confirms_the_origin(tmp_path):
    """A reference without checkpointing, a candidate with it (reentrant: backward runs through the recomputed
    calls, which are forced the reference's values as the calls they replay are)."""
    target = tmp_path / "checkpointed_llama.py"
    target.write_text(TARGET)
    code, out, err = run_cli("trace", target, "-o", tmp_path / "ref.h5")
    assert code == 0, out + err
    result = layerdiff.bisect(tmp_path / "ref.h5", str(target), args=["defect=act", "checkpoint=reentrant"],
                              workdir=tmp_path / "bisect")
    assert result["verdict"] == "own_error"
    assert [s["module"] for s in result["forward"]["segments"]] == ["model.layers.1.mlp.act_fn"]
    assert result["forward"]["culprit"]["module"] == "model.layers.1.mlp.act_fn"
    assert [s["module"] for s in result["backward"]["segments"]] == ["model.layers.1.mlp.act_fn"]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recomputations_out_of_order_replay_the_calls_given_their_tensors(tmp_path, reentrant):
    """Two microbatches of one step whose backward runs in the order their forward did (F0 F1 B0 B1, a 1F1B
    schedule's order): each recomputation replays the calls of its own microbatch (found by the tensors it was
    given), not the latest calls of its modules (microbatch 1's: every recomputed output then 'differed')."""
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    for name, checkpoint in (("plain", None), ("checkpointed", {"use_reentrant": reentrant})):
        model = llama(checkpoint)
        with layerdiff.trace(model, tmp_path / f"{name}.h5") as tracer, tracer.step():
            losses = [model(input_ids=half, labels=half).loss / 2 for half in ids.split(2)]
            for loss in losses:
                loss.backward()
    with open_trace(tmp_path / "plain.h5") as a, open_trace(tmp_path / "checkpointed.h5") as b:
        keys = [sorted((r.kind, r.phase, r.path, r.call, r.micro) for r in t.records if r.kind == "call")
                for t in (a, b)]
        assert keys[0] == keys[1]
        assert {r.micro for r in b.recomputed} == {0, 1}
    report = layerdiff.align(tmp_path / "plain.h5", tmp_path / "checkpointed.h5").data
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    check = report["recompute"]["b"]
    assert check["calls"] == check["compared"] == 2 * 24 and check["differ"] == []


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)

    def forward(self, x, mask):
        return x + self.down(self.act(self.up(x))) * mask


class _Stack(torch.nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.blocks, self.checkpointed = torch.nn.ModuleList([_Masked() for _ in range(2)]), checkpointed

    def forward(self, x, mask):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, mask, use_reentrant=True) if self.checkpointed else block(x, mask)
        return x.square().mean()


def test_a_tensor_every_microbatch_shares_does_not_decide_which_call_is_replayed(tmp_path):
    """Megatron's way: each checkpointed layer given its microbatch's hidden states and the one attention mask
    every microbatch shares, backward in forward order (F0 F1 B0 B1). The call given the most of the same tensors
    is the one replayed (the mask alone matched both microbatches' calls: the latest was taken, the other
    microbatch's)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    mask = torch.ones(8)
    for name, checkpointed in (("plain", False), ("checkpointed", True)):
        torch.manual_seed(0)
        model = _Stack(checkpointed)
        with layerdiff.trace(model, tmp_path / f"{name}.h5") as tracer, tracer.step():
            losses = [model(half, mask) for half in x.split(2)]
            for loss in losses:
                loss.backward()
    report = layerdiff.align(tmp_path / "plain.h5", tmp_path / "checkpointed.h5").data
    assert report["verdict"] == "aligned", (report["forward"], report["backward"])
    assert report["recompute"]["b"]["calls"] == 2 * 2 * 4 and report["recompute"]["b"]["differ"] == []


def test_a_tensor_freed_since_its_call_does_not_decide_which_call_is_replayed():
    """A recomputation makes new tensors, and one may take the bytes (so the identity) of a tensor that another
    microbatch's call was given and that was freed since (reentrant checkpointing keeps no intermediate). It
    counted for that call: microbatch 0's MLP replayed microbatch 1's, and their gradients swapped (CI saw it
    once in a whole run; it hangs on where the allocator puts a tensor). Here that reuse is made certain."""
    from layerdiff.adapters.torch_adapter import identify
    from layerdiff.capture.recompute import StepCalls

    calls = StepCalls()
    kept = [torch.randn(2, 8) for _ in range(2)]  # each microbatch's hidden states, kept by its checkpoint
    freed = torch.randn(2, 8)  # microbatch 1's attention output, freed after its forward
    freed_identity = identify(freed)
    for micro, mlp_input in ((0, torch.randn(2, 8)), (1, freed)):
        calls.add("layer", micro, 0, micro, None, ())
        calls.add("layer.attn", micro, 1, micro, ("layer", micro), [(identify(kept[micro]), kept[micro])])
        calls.add("layer.mlp", micro, 1, micro, ("layer", micro), [(identify(mlp_input), mlp_input)])
    del freed, mlp_input
    def same(tensor, identity):  # as the trace session tells it (``TraceSession._same``)
        return tensor is not None and identify(tensor) == identity

    root = calls.replay_root("layer.attn", [identify(kept[0])], same)
    assert root is not None and root[:2] == (0, 0)
    # the recomputed attention output took the freed tensor's bytes: its identity is the one recorded
    root = calls.replay_root("layer.mlp", [freed_identity], same)
    assert root is not None and root[:2] == (0, 0)


def test_damaged_bytes_of_a_recomputed_call_are_named_and_judged_by_their_statistics(plain, tmp_path):
    """A recomputed call's stored output damaged after writing (bit rot): align checks the recomputation by the
    statistics the index keeps and names the damage, so "aligned" is not trusted (exit 3), without a traceback."""
    import h5py

    path = tmp_path / "checkpointed.h5"
    trace_steps(llama({"use_reentrant": True}), path)
    with open_trace(path) as trace:
        call, entry = next((r, t) for r in trace.recomputed if r.kind == "call" for t in r.tensors
                           if t.role == "output" and t.offset is not None)
    with h5py.File(path, "r+") as f:
        f["data"][entry.offset + 8] ^= 0xFF
    code, out, err = run_cli("align", plain, path, "--json", tmp_path / "r.json")
    assert code == 3 and "Traceback" not in err, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    check = report["recompute"]["b"]
    assert check["compared"] == check["calls"] == 52 and check["differ"] == []  # 2 steps x (24 + 2 layers)
    assert len(check["damaged"]) == 1 and "do not match their checksum" in check["damaged"][0]
    assert report["b"]["damage"] == check["damaged"] and report["verdict"] == "aligned"
    assert any("is damaged" in p for p in report["trust"]["problems"]), report["trust"]
    # a run of ranks is checked file by file, and keeps each file's damage
    from types import SimpleNamespace

    from layerdiff.compare.recompute import recompute_check

    with open_trace(path) as trace:
        assert recompute_check(SimpleNamespace(files=[trace]))["damaged"] == check["damaged"]


class _ScaledGradAdd(torch.autograd.Function):
    """``a + b`` whose backward scales the gradient of ``b`` by ``scale`` (other than 1: a wrong backward)."""

    @staticmethod
    def forward(ctx, a, b, scale):
        ctx.scale = scale
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return grad, grad * ctx.scale, None


def _checkpointed_blocks(scale: float):
    """Two blocks whose forward transformers checkpoints (``GradientCheckpointingLayer``: the forward, not the
    call), each adding its MLP's output to its input in its own code."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
            self.scale = 1.0

        def forward(self, x):
            h = self.down(self.act(self.up(x)))
            return _ScaledGradAdd.apply(x, h, self.scale)  # the block's own code

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Block(), Block()).train()
    blocks[1].scale = scale
    for block in blocks:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=True)
    return blocks


def test_a_wrong_backward_in_a_checkpointed_forwards_own_code_is_named(tmp_path):
    """Reentrant checkpointing of a layer's ``forward`` (transformers' way) keeps no graph of the forward pass:
    the backward of the layer's own operations runs only through the graph its recomputation builds, which is
    recorded as a call of the layer. Before, those operations had no backward records and the origin was the
    layer's call, not the operation."""
    import inspect

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for name, scale in (("a", 1.0), ("b", 1.5)):
        model = _checkpointed_blocks(scale)
        with layerdiff.trace(model, tmp_path / f"{name}.h5", ops=True):
            model(x).square().mean().backward()
    with open_trace(tmp_path / "b.h5") as b:
        assert {(r.path, r.call) for r in b.recomputed if r.kind == "call"} == \
            {(p, 0) for p in ("0", "1", "0.up", "0.act", "0.down", "1.up", "1.act", "1.down")}
    report = layerdiff.align(tmp_path / "a.h5", tmp_path / "b.h5").data
    assert report["forward"]["status"] == "aligned" and report["recompute"]["b"]["differ"] == []
    origin = report["backward"]["first_divergence"]
    lines, start = inspect.getsourcelines(_checkpointed_blocks)
    line = start + next(i for i, text in enumerate(lines) if "# the block's own code" in text)
    assert origin["module"] == "1" and origin["op"]["name"] == "_ScaledGradAdd.apply", origin
    assert origin["op"]["source_b"] == f"{__file__}:{line}"


def test_a_recomputation_stopped_early_is_no_failure_and_a_later_crash_is_still_named(tmp_path):
    """Non-reentrant checkpointing stops a recomputation once it has every tensor backward needs, by raising
    through the calls it is in (torch's "early stop"). Before, each such call was recorded as failing with
    ``_StopRecomputationError`` and the first became the run's failure: a later real crash was named there."""
    model = llama({"use_reentrant": False})
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with layerdiff.trace(model, tmp_path / "ok.h5") as tracer:
        model(input_ids=ids, labels=ids).loss.backward()
    assert tracer.failure is None
    with open_trace(tmp_path / "ok.h5") as trace:
        stopped = [r for r in trace.recomputed if r.kind == "call" and r.incomplete]
        assert stopped and not any(r.error for r in trace.recomputed)
        assert not any(r.error for r in trace.records)

    def broken(*args, **kwargs):
        raise RuntimeError("a real crash")

    with pytest.raises(RuntimeError, match="a real crash"):
        with layerdiff.trace(model, tmp_path / "crash.h5") as tracer:
            model(input_ids=ids, labels=ids).loss.backward()
            model.model.layers[1].mlp.act_fn.forward = broken
            model(input_ids=ids, labels=ids)
    assert tracer.failure["module"] == "model.layers.1.mlp.act_fn", tracer.failure
    code, out, err = run_cli("show", tmp_path / "crash.h5")
    assert "model.layers.1.mlp.act_fn" in out and "_StopRecomputationError" not in out + err, out + err
