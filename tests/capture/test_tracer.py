"""What the torch tracer records, and that tracing never changes the model's results."""
import math
import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.tracefile.tensors import as_float, summarize  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402
from layerdiff.errors import LayerdiffError  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

pytestmark = [pytest.mark.torch]


def calls(reader, path, phase="forward"):
    return [r for r in reader.records if r.kind == "call" and r.phase == phase and r.path == path]


def tensor(reader, rec, role, key):
    entry = next(t for t in rec.tensors if t.role == role and t.key == key)
    return as_float(reader.tensor(entry), entry.dtype)


class AddInPlace(nn.Module):
    """Modifies its own intermediate and output in place (the pattern register_full_backward_hook rejects)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        y += x
        y.relu_()
        return y


def _inplace_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), AddInPlace(), nn.Linear(4, 2))


def test_inplace_ops_trace_and_gradients_are_unchanged(tmp_path):
    x = torch.randn(3, 4, requires_grad=True)
    weights = torch.arange(6.0).reshape(3, 2)
    ref = _inplace_model()
    (ref(x) * weights).sum().backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()] + [x.grad.clone()]
    x.grad = None
    model = _inplace_model()
    with layerdiff.trace(model, tmp_path / "t.h5"):
        out = model(x)
        (out * weights).sum().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, got))
    with open_trace(tmp_path / "t.h5") as r:
        assert r.end.status == "complete"
        # the input recorded for "2" is the value before the in-place add/relu inside it
        fwd = calls(r, "2")[0]
        back = calls(r, "2", "backward")[0]
        assert {t.role for t in back.tensors} == {"grad_output", "grad_input"}
        out_rec = tensor(r, calls(r, "3")[0], "output", "out")
        assert np.array_equal(out_rec, out.detach().numpy())
        assert np.array_equal(tensor(r, fwd, "input", "args.0"), tensor(r, calls(r, "1")[0], "output", "out"))


class _Triple(nn.Module):
    def forward(self, x):
        return x * 3


class _Wrapper(nn.Module):
    """Returns its child's output itself."""

    def __init__(self):
        super().__init__()
        self.inner = _Triple()

    def forward(self, x):
        return self.inner(x)


class _Caller(nn.Module):
    """Modifies a call's output in place after it returned; calls a module that hands its input back; uses values
    both through calls and beside them."""

    def __init__(self):
        super().__init__()
        self.a, self.ident, self.wrap = _Triple(), nn.Identity(), _Wrapper()

    def forward(self, x):
        y = self.a(x)
        y.mul_(2)
        z = self.ident(y)
        return self.wrap(z) + z + y


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5, inplace=True)

    def forward(self, x):
        h = x * 2
        return self.drop(h) + h


def test_each_call_records_the_gradient_of_the_value_it_returned(tmp_path):
    """grad_output is the gradient w.r.t. the value a call returned, however its caller goes on: modified in place
    after it (``a``: twice the gradient of the modified value), handed back from the call's input (``ident``), the
    output of a child returned as it is (``wrap`` and ``wrap.inner``)."""
    weights = torch.arange(6.0).reshape(3, 2)
    model = _Caller()
    x = torch.randn(3, 2, requires_grad=True)
    with layerdiff.trace(model, tmp_path / "t.h5"):
        (model(x) * weights).sum().backward()
    assert torch.equal(x.grad, 3 * 2 * 5 * weights)
    # ``ident``'s value is used twice (4x), ``y`` once more beside it (5x in all), ``a``'s before it was doubled
    expected = {"a": 10 * weights, "ident": 4 * weights, "wrap": weights, "wrap.inner": weights}
    with open_trace(tmp_path / "t.h5") as r:
        for path, grad in expected.items():
            (back,) = calls(r, path, "backward")
            assert np.array_equal(tensor(r, back, "grad_output", "out"), grad.numpy()), path
        (ident,) = calls(r, "ident", "backward")
        assert np.array_equal(tensor(r, ident, "grad_input", "args.0"), (4 * weights).numpy())

    # a call that works in place hands its input back as it came (dropout, in eval): its value's gradient is that of
    # the caller's use of what it returned, not of the other uses of the same tensor
    skip = _Skip().eval()
    with layerdiff.trace(skip, tmp_path / "s.h5"):
        (skip(x) * weights).sum().backward()
    with open_trace(tmp_path / "s.h5") as r:
        (back,) = calls(r, "drop", "backward")
        assert np.array_equal(tensor(r, back, "grad_output", "out"), weights.numpy())


class _Doubler(nn.Module):
    """Writes its input in place and hands it back, though nothing says it works in place (no ``inplace``); or hands
    it back as it came."""

    def forward(self, x, write: bool):
        return x.mul_(2) if write else x


class _DoubledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.doubler = _Doubler()

    def forward(self, x, weights):
        first = self.doubler(x * 1.0, True)  # its inputs tapped: the write is seen after the call
        kept = x * 1.0
        second = self.doubler(kept, False)  # its inputs reach it as they came, and it hands one back
        return (first * weights).sum() + (second * 3 * weights).sum() + (kept * 5 * weights).sum()


def test_a_module_that_writes_its_input_records_the_gradient_of_what_it_returned(tmp_path):
    """A module seen writing its input in place has its later calls' inputs left untapped (a tap's alias would hide
    the write): each call's grad_output is still that of the caller's use of the value it returned, the first
    (inputs tapped, the write seen only after it) and the next (inputs as given; it hands one back, whose autograd
    node is the caller's: ``kept``'s gradient is 8x, the call's value's 3x)."""
    weights = torch.arange(6.0).reshape(3, 2)
    model = _DoubledTwice()
    x = torch.randn(3, 2, requires_grad=True)
    with layerdiff.trace(model, tmp_path / "t.h5"):
        model(x, weights).backward()
    assert torch.equal(x.grad, 2 * weights + 3 * weights + 5 * weights)
    with open_trace(tmp_path / "t.h5") as r:
        assert any("doubler modifies its input in place" in w for w in r.end.warnings), r.end.warnings
        first, second = sorted(calls(r, "doubler", "backward"), key=lambda record: record.call)
        assert np.array_equal(tensor(r, first, "grad_output", "out"), weights.numpy())
        assert np.array_equal(tensor(r, second, "grad_output", "out"), (3 * weights).numpy())
        assert {t.role for t in first.tensors} == {"grad_output", "grad_input"}  # its inputs were tapped
        assert {t.role for t in second.tensors} == {"grad_output"}  # they were not


def test_module_called_twice_gives_two_records(tmp_path):
    lin = nn.Linear(3, 3)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    model = Twice()
    x = torch.randn(2, 3)
    with layerdiff.trace(model, tmp_path / "t.h5"):
        model(x).sum().backward()
    with open_trace(tmp_path / "t.h5") as r:
        first, second = calls(r, "lin")
        assert (first.call, second.call) == (0, 1)
        assert np.array_equal(tensor(r, first, "input", "args.0"), x.numpy())
        assert np.array_equal(tensor(r, second, "input", "args.0"), tensor(r, first, "output", "out"))
        assert sorted(b.call for b in calls(r, "lin", "backward")) == [0, 1]
        assert first.parent == ("", 0)
        grads = [p for p in r.records if p.kind == "param_grad" and p.path == "lin.weight"]
        assert len(grads) == 1  # accumulated once per backward


def test_nested_and_non_tensor_outputs_and_keyword_inputs(tmp_path):
    class Mixed(nn.Module):
        def forward(self, x, *, scale=2.0, mask=None, note="hi"):
            return {"y": x * scale, "parts": (x + 1, None, 3), "name": note}, mask

    model = Mixed()
    x, mask = torch.randn(2, 2), torch.ones(2, dtype=torch.bool)
    with layerdiff.trace(model, tmp_path / "t.h5"):
        model(x, scale=3.0, mask=mask)
    with open_trace(tmp_path / "t.h5") as r:
        rec = calls(r, "")[0]
        keys = {(t.role, t.key) for t in rec.tensors}
        assert keys == {("input", "args.0"), ("input", "kwargs.mask"), ("output", "out.0.y"),
                        ("output", "out.0.parts.0"), ("output", "out.1")}
        assert rec.scalars["kwargs.scale"] == 3.0
        assert rec.scalars["out.0.parts.2"] == 3 and rec.scalars["out.0.name"] == "hi"
        assert next(t for t in rec.tensors if t.key == "kwargs.mask").dtype == "bool"


def test_forward_only_under_no_grad_records_no_backward(tmp_path):
    built = torch_llama.build(backward=False)
    model = built["model"].eval()
    with layerdiff.trace(model, tmp_path / "t.h5"):
        built["step"]()
    with open_trace(tmp_path / "t.h5") as r:
        phases = {rec.phase for rec in r.records if rec.kind == "call"}
        assert phases == {"forward"}
        assert not [rec for rec in r.records if rec.kind == "param_grad"]


def test_backward_off_still_leaves_training_intact(tmp_path):
    built = torch_llama.build()
    with layerdiff.trace(built["model"], tmp_path / "t.h5", backward=False):
        built["step"]()
    assert built["model"].lm_head.weight.grad is not None
    with open_trace(tmp_path / "t.h5") as r:
        assert not [rec for rec in r.records if rec.phase == "backward"]


def test_inputs_without_grad_give_grad_output_only(tmp_path):
    built = torch_llama.build()
    with layerdiff.trace(built["model"], tmp_path / "t.h5"):
        built["step"]()
    with open_trace(tmp_path / "t.h5") as r:
        emb = calls(r, "model.embed_tokens", "backward")[0]
        assert [t.role for t in emb.tensors] == ["grad_output"]
        q = calls(r, "model.layers.0.self_attn.q_proj", "backward")[0]
        assert sorted(t.role for t in q.tensors) == ["grad_input", "grad_output"]
        assert [t.dtype for t in calls(r, "")[0].tensors if t.key == "kwargs.input_ids"] == ["int64"]


def _step_grads(tmp_path=None):
    built = torch_llama.build()
    if tmp_path is None:
        loss = built["step"]()
    else:
        with layerdiff.trace(built["model"], tmp_path):
            loss = built["step"]()
    return loss, {n: p.grad for n, p in built["model"].named_parameters()}


def test_tracing_keeps_forward_exact_and_gradients_to_rounding(tmp_path):
    """Forward results are bit-identical. The gradient taps add autograd nodes, which can change the order in
    which a tensor's gradient contributions are summed: fp32 rounding (~1 ulp), and the same in every traced
    run, so two traced runs stay bit-identical to each other."""
    loss_plain, plain = _step_grads()
    loss_a, traced_a = _step_grads(tmp_path / "a.h5")
    loss_b, traced_b = _step_grads(tmp_path / "b.h5")
    assert torch.equal(loss_plain, loss_a) and torch.equal(loss_a, loss_b)
    for name in plain:
        assert torch.equal(traced_a[name], traced_b[name]), name
        assert torch.allclose(plain[name], traced_a[name], rtol=1e-5, atol=1e-7), name


def test_several_steps_with_optimizer(tmp_path):
    built = torch_llama.build()
    model = built["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with layerdiff.trace(model, tmp_path / "t.h5"):
        for _ in range(3):
            built["step"]()
            opt.step()
    with open_trace(tmp_path / "t.h5") as r:
        assert r.end.steps == 3
        assert [c.step for c in calls(r, "lm_head")] == [0, 1, 2]
        assert [c.call for c in calls(r, "lm_head")] == [0, 1, 2]
        values = [p for p in r.records if p.kind == "param" and p.path == "lm_head.weight"]
        assert len(values) == 3  # recorded again after each optimizer update
        assert [v.step for v in values] == [0, 1, 2]
        first, second = (as_float(r.tensor(v.tensors[0]), "float32") for v in values[:2])
        assert not np.array_equal(first, second)
        assert len([p for p in r.records if p.kind == "param_grad" and p.path == "lm_head.weight"]) == 3


def test_parameters_recorded_once_when_unchanged(tmp_path):
    built = torch_llama.build(backward=False)
    with layerdiff.trace(built["model"], tmp_path / "t.h5"):
        for _ in range(3):
            built["step"]()
    with open_trace(tmp_path / "t.h5") as r:
        assert len([p for p in r.records if p.kind == "param" and p.path == "lm_head.weight"]) == 1


def test_full_mode_data_round_trips_bit_exactly(tmp_path):
    built = torch_llama.build(backward=False)
    model = built["model"]
    ids = torch.randint(0, 256, (2, 8))
    with layerdiff.trace(model, tmp_path / "t.h5"):
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    with open_trace(tmp_path / "t.h5") as r:
        root = calls(r, "")[0]
        assert np.array_equal(tensor(r, root, "output", "out.logits"), logits.numpy())
        assert np.array_equal(tensor(r, root, "input", "kwargs.input_ids"), ids.numpy())
        w = next(p for p in r.records if p.kind == "param" and p.path == "lm_head.weight")
        assert np.array_equal(r.tensor(w.tensors[0]), model.lm_head.weight.detach().numpy())


def test_bfloat16_tensors_are_stored_exactly(tmp_path):
    built = torch_llama.build(dtype="bfloat16", backward=False)
    with layerdiff.trace(built["model"], tmp_path / "t.h5"):
        built["step"]()
    w = built["model"].lm_head.weight.detach()
    with open_trace(tmp_path / "t.h5") as r:
        entry = next(p for p in r.records if p.kind == "param" and p.path == "lm_head.weight").tensors[0]
        assert entry.dtype == "bfloat16"
        assert np.array_equal(as_float(r.tensor(entry), "bfloat16"), w.float().numpy())
        assert entry.stats["max"] == pytest.approx(w.float().max().item())


def test_stats_mode_keeps_statistics_not_data(tmp_path):
    built = torch_llama.build(backward=False)
    with layerdiff.trace(built["model"], tmp_path / "t.h5", mode="stats"):
        built["step"]()
    w = built["model"].lm_head.weight.detach().numpy()
    with open_trace(tmp_path / "t.h5") as r:
        assert r.mode == "stats"
        assert all(t.offset is None for rec in r.records for t in rec.tensors)
        stats = next(p for p in r.records if p.path == "lm_head.weight").tensors[0].stats
        assert stats["min"] == pytest.approx(w.min()) and stats["max"] == pytest.approx(w.max())
        assert stats["mean"] == pytest.approx(w.mean(dtype=np.float64), rel=1e-6)
        assert stats["l2"] == pytest.approx(math.sqrt((w.astype(np.float64) ** 2).sum()), rel=1e-5)


class BiasBeside(nn.Module):
    """Returns its output and the bias for the caller to add, as Megatron's linears do (``skip_bias_add``)."""

    def __init__(self, bias_size=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(bias_size) + 3)

    def forward(self, x):
        return x @ self.weight.T, self.bias


@pytest.mark.parametrize("mode", ["stats", "full"])
def test_a_bias_returned_beside_the_output_has_their_sum_summarized_in_statistics_traces(tmp_path, mode):
    """The statistics of output + bias do not follow from the two's: a statistics trace records them beside
    (``output_plus_bias``), for a run whose module returns the sum to be compared with; a full trace holds the
    values, and a tensor beside the output that is not a bias of its last size gets nothing."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"fits": BiasBeside(), "other": BiasBeside(bias_size=5)})
    x = torch.randn(2, 6, 3, requires_grad=True)

    def step():
        out, bias = model["fits"](x)
        model["other"](x)
        (out + bias).sum().backward()

    with layerdiff.trace(model, tmp_path / "t.h5", mode=mode):
        step()
    with open_trace(tmp_path / "t.h5") as r:
        fits, other = calls(r, "fits")[0], calls(r, "other")[0]
        assert not [t for t in other.tensors if t.role == "output_plus_bias"]
        summed = [t for t in fits.tensors if t.role == "output_plus_bias"]
        if mode == "full":
            assert not summed
            return
        assert [t.key for t in summed] == ["out.0"] and summed[0].shape == [2, 6, 4]
        expected = summarize((x @ model["fits"].weight.T + model["fits"].bias).detach().numpy(), "float32")
        assert summed[0].stats["l2"] == pytest.approx(expected["l2"], rel=1e-6)
        assert summed[0].stats["min"] == pytest.approx(expected["min"], rel=1e-6)
        out = next(t for t in fits.tensors if t.role == "output" and t.key == "out.0")
        assert out.stats["min"] != pytest.approx(expected["min"], rel=1e-3)  # the bias (about 3) moved it


def test_summary_counts_nan_and_inf():
    x = np.array([1.0, np.nan, -np.inf, 2.0, np.nan], dtype=np.float32)
    s = summarize(x, "float32")
    assert (s["nan"], s["inf"], s["min"], s["max"], s["mean"]) == (2, 1, 1.0, 2.0, 1.5)


def test_hyper_parameters_and_metadata(tmp_path):
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-5), nn.Dropout(p=0.25))
    with layerdiff.trace(model, tmp_path / "t.h5", meta={"note": "x"}):
        model(torch.randn(2, 4))
    with open_trace(tmp_path / "t.h5") as r:
        assert calls(r, "1")[0].hparams["eps"] == 1e-5
        assert calls(r, "2")[0].hparams["p"] == 0.25
        assert calls(r, "0")[0].hparams["in_features"] == 4
        m = r.meta
        assert m["framework"] == "torch" and m["framework_version"] == torch.__version__
        assert m["seed"] == 1234 and m["deterministic_algorithms"] is False
        assert m["layerdiff_version"] == layerdiff.__version__ and m["user"] == {"note": "x"}
        assert "argv" in m and "tf32_matmul" in m and m["param_dtypes"] == ["float32"]


def test_include_and_exclude_filters(tmp_path):
    built = torch_llama.build()
    with layerdiff.trace(built["model"], tmp_path / "t.h5", include=[r"layers\.1"], exclude=[r"mlp"]):
        built["step"]()
    with open_trace(tmp_path / "t.h5") as r:
        paths = {rec.path for rec in r.records if rec.kind == "call"}
        assert "model.layers.1.self_attn.q_proj" in paths and "" in paths  # the root is always traced
        assert not any("layers.0" in p or "mlp" in p for p in paths)


def test_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "t.h5"
    path.write_bytes(b"precious")
    model = nn.Linear(2, 2)
    with pytest.raises(LayerdiffError, match="exists"):
        layerdiff.trace(model, path).__enter__()
    assert path.read_bytes() == b"precious"
    with layerdiff.trace(model, path, overwrite=True):
        model(torch.ones(1, 2))
    with open_trace(path) as r:
        assert len(calls(r, "")) == 1


@pytest.mark.slow
def test_trace_memory_does_not_grow_with_trace_length(tmp_path):
    """Past the write-behind buffers (8 MB data, 1 MB index) the tracer's peak heap stays flat."""
    built = torch_llama.build()

    def peak(steps, name):
        tracemalloc.start()  # no time-based flushes: the buffer's fill level must not depend on machine speed
        with layerdiff.trace(built["model"], tmp_path / name, flush_interval=1e9) as tracer:
            for _ in range(steps):
                built["step"]()
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top, tracer.session.writer.tensor_bytes

    (short, short_bytes), (long, long_bytes) = peak(10, "short.h5"), peak(30, "long.h5")
    assert long_bytes > 2.5 * short_bytes
    assert long - short < 0.1 * (long_bytes - short_bytes), (short, long)


def test_collectives_are_wrapped_only_while_a_trace_is_open(tmp_path):
    """torch.distributed's writing collectives are wrapped while a trace is open (a tensor they write is summarized
    anew) and restored after, also when two traces close in another order than they opened."""
    import torch.distributed as dist

    original = dist.all_reduce
    first = layerdiff.trace(torch.nn.Linear(2, 2), tmp_path / "first.h5")
    second = layerdiff.trace(torch.nn.Linear(2, 2), tmp_path / "second.h5")
    first.__enter__()
    assert dist.all_reduce is not original
    second.__enter__()
    first.__exit__(None, None, None)
    assert dist.all_reduce is not original  # the second trace is still open
    second.__exit__(None, None, None)
    assert dist.all_reduce is original and dist.broadcast.__module__ == "torch.distributed.distributed_c10d"


def test_a_list_of_modules_is_traced_into_one_trace(tmp_path):
    """``layerdiff.trace([a, b], path)``: the parts' modules and parameters under their own names, a module they
    share hooked once; outside a pipeline schedule (which says each part's stage) the trace warns that the parts'
    calls are not told apart. An empty list is one clear error, and replay refuses a list."""
    shared = nn.Linear(4, 4)
    first, second = nn.Sequential(shared, nn.ReLU()), nn.Sequential(nn.Linear(4, 4), shared)
    x = torch.randn(2, 4)
    with layerdiff.trace([first, second], tmp_path / "parts.h5"):
        second(first(x)).sum().backward()
    with open_trace(tmp_path / "parts.h5") as reader:
        assert reader.meta["model_parts"] == 2 and reader.meta["num_parameters"] == 2 * (4 * 4 + 4)
        forward = sorted((r.begin, r.path) for r in reader.records if r.kind == "call" and r.phase == "forward")
        # the shared Linear is hooked once, under the first part's name: in the second part it is called as "0" too
        assert [path for _, path in forward] == ["", "0", "1", "", "0", "0"], forward
        assert {r.path for r in reader.records if r.kind == "param"} == {"0.weight", "0.bias", "1.weight", "1.bias"}
        assert any("not told apart by stage" in w for w in reader.end.warnings), reader.end.warnings
    with pytest.raises(LayerdiffError, match="list of model parts is empty"):
        layerdiff.trace([], tmp_path / "none.h5")
    with pytest.raises(LayerdiffError, match="replay drives one module"):
        layerdiff.trace([first, second], tmp_path / "replayed.h5", forcer=object())
