"""Operations inside a real Mixture-of-Experts block (transformers' Qwen2-MoE, whose experts run
``transformers.integrations.moe``'s grouped-matmul code), recorded with ``ops=True``.

Two things went wrong there before:
- That code allocates a permutation with ``torch.empty_like`` and then fills it. The allocated bytes are whatever the
  memory held, so they differ from run to run; compared, they made ``torch.empty_like`` "the first operation whose
  inputs agree and whose output does not". A defect planted in layer 1 was named at ``empty_like`` in layer 0. Now
  a tensor allocated and not yet written is marked ``undefined`` in the trace and left out of the comparison.
- A port that runs one more operation after the last one both runs share (a scale applied to a module's output)
  was named only as "own code after experts". Now that operation is named with its line.
"""
from __future__ import annotations

import pytest

from conftest import align_files, marked_line

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced
EXPERTS = "model.layers.1.mlp.experts"


def _build(scaled: bool):
    config = transformers.AutoConfig.for_model(
        "qwen2_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if scaled:  # a port that scales the experts' output of layer 1
        experts = model.model.layers[1].mlp.experts
        forward = experts.forward
        experts.forward = lambda *args, **kwargs: forward(*args, **kwargs) * 1.01  # defect: scaled
    return model


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    for name, scaled in (("a", False), ("b", False), ("scaled", True)):
        model = _build(scaled)
        with layerdiff.trace(model, root / f"{name}.h5", ops=True):
            model(input_ids=ids, labels=ids).loss.backward()
    return root


def test_allocated_and_unwritten_tensors_are_marked_undefined(traces):
    with open_trace(traces / "a.h5") as trace:
        forward = [op for op in trace.ops if op.phase == "forward"]
    undefined = {(op.name, t.role, t.key) for op in forward for t in op.tensors if t.undefined}
    assert undefined == {("torch.empty_like", "output", "out"), ("Tensor.__setitem__", "input", "args.0")}
    written = [op for op in forward if op.name == "Tensor.__setitem__" and any(t.undefined for t in op.tensors)]
    assert written and all(not t.undefined for op in written for t in op.tensors if t.role == "output")


def test_a_clean_pair_leaves_them_out(traces):
    report = align_files(traces / "a.h5", traces / "b.h5")
    assert report["verdict"] == "aligned"
    allocations = [r for r in report["records"] if r["kind"] == "op" and r["op"]["name"] == "torch.empty_like"]
    assert allocations and all([t["role"] for t in r["tensors"]] == ["input"] for r in allocations)


def test_an_operation_only_one_port_runs_at_the_end_of_a_module_is_named(traces):
    report = align_files(traces / "a.h5", traces / "scaled.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == EXPERTS and origin["where"] == "op", origin["description"]
    op = origin["op"]
    assert op["name_b"] == "Tensor.mul" and op["source_b"] == f"{__file__}:{marked_line(__file__, 'defect: scaled')}"
    assert op["only_b"] and op["only_b"][0][1] == "Tensor.mul" and op["index"] is None


def test_the_operation_only_one_port_runs_is_shown_among_the_modules_operations(traces):
    import io

    from rich.console import Console

    from layerdiff.report import html, terminal

    report = align_files(traces / "a.h5", traces / "scaled.h5")
    out = io.StringIO()
    terminal.render(report, Console(file=out, width=200))
    shown = [line for line in out.getvalue().splitlines() if "Tensor.mul" in line and "<- origin" in line]
    assert shown and f"{marked_line(__file__, 'defect: scaled')}" in shown[0], out.getvalue()
    assert "B only" not in shown[0] and "experts.forward = lambda" in shown[0]  # B's line of code, read from the file
    page = html.report_html(report)
    origin_row = page[page.index("is-origin-op"):].split("</tr>")[0]
    assert "Tensor.mul" in origin_row and f"{__file__.rpartition('/')[2]}:{marked_line(__file__, 'defect: scaled')}" in origin_row

