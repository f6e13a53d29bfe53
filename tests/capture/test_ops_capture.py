"""Operations inside modules, captured in PyTorch (``trace(ops=...)``, ``--ops``, ``--ops-in``): what each record
holds, that the model computes exactly what it computes untraced, that every tensor model code hands on has a
recorded producer, and the windows. Real transformers Llama (built from a config) running the model code of
``recipes/torch_llama_ops.py``."""
from __future__ import annotations

import gc
import inspect
import re

import conftest
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama_ops as recipe  # noqa: E402
from layerdiff.tracefile.layout import FORMAT_VERSION  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

pytestmark = [pytest.mark.torch]
RECIPE = inspect.getsourcefile(recipe)


def marked_line(marker: str) -> str:
    """``FILE:LINE`` of the recipe line that carries ``# <marker>`` (never a literal line number)."""
    return f"{RECIPE}:{conftest.marked_line(RECIPE, marker)}"


def traced(path, *, ops=True, **build):
    built = recipe.build(**build)
    with layerdiff.trace(built["model"], path, ops=ops):
        loss = built["step"]()
    return built, loss


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A trace with every operation recorded, and its reader's records and operations."""
    path = tmp_path_factory.mktemp("ops") / "ops.h5"
    traced(path)
    with open_trace(path) as reader:
        return path, reader.records, reader.ops, reader.meta


def test_tracing_operations_changes_nothing_the_model_computes(tmp_path):
    """Forward: the loss is bit for bit the untraced one. Backward: the gradients are bit for bit those of a
    module-level trace, which differ from the untraced ones only in the order autograd sums a tensor's uses."""
    plain = recipe.build()
    loss = plain["step"]()
    untraced = {n: p.grad.clone() for n, p in plain["model"].named_parameters()}
    modules, modules_loss = traced(tmp_path / "modules.h5", ops=False)
    built, traced_loss = traced(tmp_path / "ops.h5")
    assert torch.equal(loss, traced_loss) and torch.equal(loss, modules_loss)
    for (name, p), (_, q) in zip(built["model"].named_parameters(), modules["model"].named_parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert (p.grad - untraced[name]).abs().max() <= 1e-6 * untraced[name].abs().max(), name


def test_an_operation_record_holds_its_name_kind_arguments_line_and_tensors(whole):
    _, records, ops, meta = whole
    forward = [op for op in ops if op.phase == "forward"]
    scaled = [op for op in forward if op.path == "model.layers.0.self_attn" and op.source == marked_line(
        "defect: constant (eager)") and op.op == "mul"]
    assert len(scaled) == 1, [(op.name, op.source) for op in forward if op.path.endswith("self_attn")][:20]
    op = scaled[0]
    assert op.name == "Tensor.mul" and op.function == "OpsAttention.forward"
    head_dim = 64 // 4
    assert op.args == {"args.1": head_dim ** -0.5}  # the scaling, a non-tensor argument
    assert [t.role for t in op.tensors] == ["input", "output"] and op.tensors[0].shape == op.tensors[1].shape
    softmax = next(o for o in forward if o.path == "model.layers.0.self_attn" and o.op == "softmax")
    assert softmax.name == "torch.nn.functional.softmax"
    assert softmax.args["kwargs.dim"] == -1 and softmax.args["kwargs.dtype"] == "torch.float32"
    # the index orders a call's operations; each record knows its module call
    calls = {(r.path, r.call): r for r in records if r.kind == "call" and r.phase == "forward"}
    for (path, call), rec in calls.items():
        own = sorted(o.index for o in forward if (o.path, o.call) == (path, call))
        assert own == list(range(rec.ops or 0)), path
    assert meta["options"]["ops"] is True


def test_framework_modules_and_custom_functions_are_one_operation(whole):
    _, records, ops, _ = whole
    linear = [r for r in records if r.kind == "call" and r.type == "Linear"]
    assert linear and all(r.ops is None for r in linear)  # nn.Linear's own work is torch's
    assert not any(op.path.endswith("_proj") for op in ops)
    silu = [op for op in ops if op.phase == "forward" and op.name == "SiLUFunction.apply"]
    assert len(silu) == 2 and all(op.source == marked_line("defect: function") for op in silu)
    assert not any(op.function == "SiLUFunction.forward" for op in ops)  # what it runs inside is part of it
    assert all(op.args == {"args.1": 1.0} for op in silu)


def test_backward_records_the_gradients_of_each_operation(whole):
    _, _, ops, _ = whole
    forward = {(op.path, op.call, op.index): op for op in ops if op.phase == "forward"}
    backward = [op for op in ops if op.phase == "backward"]
    assert backward
    for op in backward:
        twin = forward[(op.path, op.call, op.index)]
        assert (op.name, op.source) == (twin.name, twin.source)
    silu = next(op for op in backward if op.name == "SiLUFunction.apply")
    roles = {(t.role, t.key) for t in silu.tensors}
    assert roles == {("grad_output", "out"), ("grad_input", "args.0")}


def test_every_tensor_model_code_hands_on_has_a_producer(whole):
    """Inputs of a child module call (in a call whose operations are recorded) and what a call returns: each has
    a recorded producer, never "unknown"."""
    _, records, ops, _ = whole
    calls = [r for r in records if r.kind == "call" and r.phase == "forward"]
    by_key = {(r.path, r.call): r for r in calls}
    checked = 0
    for rec in calls:
        parent = by_key.get(tuple(rec.parent)) if rec.parent else None
        for t in rec.tensors:
            handed_on = (t.role == "input" and parent is not None and parent.ops is not None) or \
                (t.role == "output" and rec.ops is not None)
            if not handed_on:
                continue
            producer = (rec.producers or {}).get(t.key)
            assert producer is not None and producer.kind != "unknown", (rec.path, t.role, t.key, producer)
            checked += 1
    assert checked > 40
    op_inputs = [(op, t) for op in ops if op.phase == "forward" for t in op.tensors if t.role == "input"]
    unknown = [(op.path, op.name, t.key) for op, t in op_inputs if (op.producers or {}).get(t.key) is None
               or op.producers[t.key].kind == "unknown"]
    assert not unknown, unknown[:5]


def test_producers_name_the_operation_the_parameter_and_the_input(whole):
    _, records, ops, _ = whole
    norm = [op for op in ops if op.phase == "forward" and op.path == "model.layers.0.input_layernorm"]
    kinds = [op.op for op in norm]
    assert kinds[:6] == ["to", "pow", "mean", "add", "rsqrt", "mul"], kinds
    assert norm[0].producers["args.0"].kind == "input"
    assert norm[1].producers["args.0"].kind == "op" and norm[1].producers["args.0"].index == 0
    weight = next(op for op in norm if any(p.kind == "param" for p in (op.producers or {}).values()))
    assert "model.layers.0.input_layernorm.weight" in {p.name for p in weight.producers.values()}
    layer = next(r for r in records if r.kind == "call" and r.path == "model.layers.0" and r.phase == "forward")
    out = layer.producers["out"]
    assert out.kind == "op" and next(op for op in ops if op.path == "model.layers.0" and op.index == out.index).op \
        == "add"


def test_a_window_records_operations_only_inside_the_matching_modules(tmp_path):
    path = tmp_path / "window.h5"
    traced(path, ops=[r"^model\.layers\.1\.self_attn$"])
    with open_trace(path) as reader:
        assert {op.path for op in reader.ops} == {"model.layers.1.self_attn"}
        recorded = {r.path for r in reader.records if r.kind == "call" and r.ops is not None}
        assert recorded == {"model.layers.1.self_attn"}
        assert reader.meta["options"]["ops"] == [r"^model\.layers\.1\.self_attn$"]


def test_every_trace_is_written_in_one_format_version_with_or_without_operations(tmp_path, whole):
    """Operations and checksums came into one format version (3): a trace without operations is written in it too
    (its checksums need it), and its op records are verified like every other line."""
    import h5py

    traced(tmp_path / "plain.h5", ops=False)
    with h5py.File(tmp_path / "plain.h5", "r") as f:
        assert f.attrs["format_version"] == FORMAT_VERSION == 3 and f.attrs["checksum"] == "xxh3_64"
    with h5py.File(whole[0], "r") as f:
        assert f.attrs["format_version"] == FORMAT_VERSION
    with open_trace(whole[0]) as reader:
        assert reader.ops and not reader.damage and reader.unverified == 0


def test_records_held_and_written_together_are_those_written_one_at_a_time(tmp_path, whole):
    """The writer holds the lines of records handed over (``held_records``), each encoded as it is handed: what the
    tracer changes afterwards (an operation lets go of its forward record's inputs, arguments and producers once it
    is written; entries shared between records) is not in them, so the index is the one written record by record
    (``write_behind=0``)."""
    built = recipe.build()
    with layerdiff.trace(built["model"], tmp_path / "each.h5", ops=True, write_behind=0) as tracer:
        built["step"]()
        assert tracer.session.writer.held_records == 0
    _, records, ops, meta = whole
    assert meta["options"]["write_behind"] > 0  # the fixture's trace held its records
    with open_trace(tmp_path / "each.h5") as each:
        assert each.records == records and each.ops == ops and len(ops) > 100


class _Product(torch.autograd.Function):
    """A custom function of two differentiable inputs: tapped, its input gradients collected together."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * b, grad * a


class _ProductModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _Product.apply(self.linear(x), x.tanh()).pow(2).sum()


def _garbage_of(step) -> list:
    """What ``step`` leaves that only the garbage collector would free (reference cycles)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_traced_step_leaves_no_reference_cycle(tmp_path):
    """With every operation recorded, forward and backward, a step's graph, frames and tensors are freed when its
    references go, not at the garbage collector's rare full pass. Before, torch's multi-gradient hook on a
    composite operation (the loss) and a frame that held itself kept each step's graph, and every call's inputs,
    until then: the benchmark toy's process grew from 500 to 900 MB over 35 steps, page-faulting. The gradients
    collected together for a custom function of two inputs are still autograd's."""
    built = recipe.build()
    with layerdiff.trace(built["model"], tmp_path / "llama.h5", ops=True):
        built["step"]()
        assert _garbage_of(built["step"]) == []
    torch.manual_seed(0)
    model, x = _ProductModel(), torch.randn(4, 8, requires_grad=True)
    with layerdiff.trace(model, tmp_path / "product.h5", ops=True, mode="full"):
        model(x).backward()
        assert _garbage_of(lambda: model(x).backward()) == []
    a, b = model.linear(x), x.tanh()
    grad = 2 * a * b
    with open_trace(tmp_path / "product.h5") as trace:
        backward = [op for op in trace.ops if op.phase == "backward" and op.name == "_Product.apply"]
        assert len(backward) == 2  # each step's
        for op in backward:
            got = {t.key: trace.tensor(t) for t in op.tensors if t.role == "grad_input"}
            assert got.keys() == {"args.0", "args.1"}
            assert torch.allclose(torch.from_numpy(got["args.0"]), (grad * b).detach(), rtol=1e-6)
            assert torch.allclose(torch.from_numpy(got["args.1"]), (grad * a).detach(), rtol=1e-6)


_ONE_NODE_OPS = {
    "mul": lambda a, b: ([("args.0", a), ("args.1", b)], a * b),
    "add": lambda a, b: ([("args.0", a), ("args.1", b)], a + b),
    "cat": lambda a, b: ([("args.0.0", a), ("args.0.1", b)], torch.cat([a, b], dim=-1)),
    "getitem": lambda a, b: ([("args.0", a)], a[..., :3]),
    "mean": lambda a, b: ([("args.0", a)], a.mean(-1, keepdim=True)),
    # one tensor passed twice (key and value): two edges to one node, told apart by their order
    "sdpa": lambda a, b: ([("args.0", a), ("args.1", b), ("args.2", b)],
                          torch.nn.functional.scaled_dot_product_attention(a, b, b)),
}


@pytest.mark.parametrize("name", sorted(_ONE_NODE_OPS))
def test_an_operation_of_one_autograd_node_reports_its_gradients_from_that_node(name):
    """Most operations are one node of the autograd graph: one hook on it reports the gradients w.r.t. the
    operation's inputs, matched to them through the node's edges. Inputs made by other operations, whose nodes'
    Python objects nobody else holds: matched by the id of an object already dropped, torch 2.11 (an H200's image)
    handed back another object at another address, and nine kinds of the toy's operations were taken for composite
    ones (tapped, at several times the cost)."""
    from layerdiff.adapters.torch_ops import gradients

    x = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()  # sdpa: 4-D, one node
    a, b = x.sin(), x.cos()
    inputs, out = _ONE_NODE_OPS[name](a, b)
    reported = []
    assert gradients().one_step(inputs, [("out", out)], lambda ins, outs: reported.append((ins, outs)))
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    a.retain_grad()
    b.retain_grad()
    (out * weight).sum().backward()
    want = {"a": a.grad, "b": b.grad}
    assert len(reported) == 1
    grad_inputs, grad_outputs = reported[0]
    assert [k for k, _ in grad_outputs] == ["out"] and torch.equal(grad_outputs[0][1], weight)
    by_input: dict = {}
    for key, grad in grad_inputs:
        tensor = next(t for k, t in inputs if k == key)
        by_input[id(tensor)] = by_input.get(id(tensor), 0) + grad
    assert by_input.keys() == {id(t) for _, t in inputs}
    for letter, tensor in (("a", a), ("b", b)):
        if id(tensor) in by_input:
            assert torch.allclose(by_input[id(tensor)], want[letter], atol=1e-6), letter


def test_trace_restores_what_it_wrapped(tmp_path):
    apply = torch.autograd.Function.__dict__["apply"]
    traced(tmp_path / "r.h5")
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.slow
def test_cli_ops_flags_show_and_bad_input(tmp_path, whole):
    code, out, err = run_cli("trace", "torch_llama_ops", "--ops-in", "no_such_module", "-o", tmp_path / "x.h5",
                             "-q")
    assert code == 2 and err.count("\n") == 1 and "--ops-in 'no_such_module' matches none" in err, err
    assert not (tmp_path / "x.h5").exists()
    code, out, err = run_cli("trace", "torch_llama_ops", "--ops-in", "(", "-o", tmp_path / "x.h5", "-q")
    assert code == 2 and "bad --ops-in regular expression" in err, err
    code, out, err = run_cli("show", whole[0], "--ops", r"layers\.0\.mlp$")
    assert code == 0 and "SiLUFunction.apply" in out and "OpsMLP.forward" in out, out + err
    assert "operations inside modules (--ops):" in out
    code, out, err = run_cli("trace", "torch_llama_ops", "--arg", "defect=nan", "--ops", "-o", tmp_path / "n.h5",
                             "-q")
    assert code == 0, err
    code, out, err = run_cli("show", tmp_path / "n.h5", "--nan")
    line = marked_line("defect: nan").rpartition("/")[2]
    assert code == 0 and f"born in torch.rsqrt at {line}" in " ".join(out.split()), out
    # the operations' listing says what each made: the NaN appears at that operation, none before it in its call
    from rich.console import Console

    from layerdiff.report.show_trace import op_table

    console = Console(record=True, width=300)
    with open_trace(tmp_path / "n.h5") as trace:
        born = min((op for op in trace.ops if op.phase == "forward" and op.source.endswith(line)
                    and any(t.role == "output" and t.stats.get("nan") for t in op.tensors)), key=lambda op: op.begin)
        console.print(op_table(trace.ops, "^" + re.escape(born.path) + "$"))
    rows = [r.split() for r in console.export_text().splitlines() if r.split()[:1] == [born.path]]
    counts = [int(r[-1]) for r in rows]
    assert counts[:born.index] == [0] * born.index and counts[born.index] > 0, rows
    assert rows[born.index][3] == "torch.rsqrt", rows
