"""A model compiled with ``torch.compile`` is traced like any other: layerdiff's hooks run as Python
(``torch.compiler.disable``), so the compiled code breaks its graph at each traced module and compiles each one's own
code. Before, dynamo traced into the hooks and the run stopped inside them ("NameError: ___tuple_iterator_getitem").
With operations asked for (``ops=True``), the operations that compiled graphs run are not recorded one by one.

Real model: transformers' Llama of ``recipes/torch_llama.py``, compiled with the ``aot_eager`` backend (dynamo and
AOTAutograd, which is what met the hooks, without the C++ compiler's minutes).
"""
from __future__ import annotations

import pytest

from conftest import align_files

torch = pytest.importorskip("torch")

import layerdiff  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced and compiled


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    # two compiles, not three: the defect is named in the run that also asks for operations (each compile of the
    # Llama took 8 to 12 s of the suite)
    for name, defect, compiled, ops in (("eager", None, False, False), ("compiled", None, True, False),
                                        ("compiled_ops_eps", "eps", True, True)):
        built = torch_llama.build(defect)
        model = built["model"]
        if compiled:  # as users do: the compiled module (its modules are under _orig_mod.) is what is called
            torch._dynamo.reset()
            model = torch.compile(model, backend="aot_eager")
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with layerdiff.trace(model, root / f"{name}.h5", ops=ops):
            model(input_ids=ids, labels=ids).loss.backward()
    return root


def test_a_compiled_model_is_traced_and_aligned_with_its_eager_run(traces):
    report = align_files(traces / "eager.h5", traces / "compiled.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    calls = [r for r in report["records"] if r["kind"] == "call" and r["phase"] == "forward"]
    assert sum((r.get("path_b") or "").startswith("_orig_mod.model.layers.1.") for r in calls) > 5  # compiled code


def test_a_defect_in_a_compiled_model_traced_with_operations_is_named(traces):
    """With ``ops=True`` the operations a compiled graph runs are not recorded one by one (dynamo traced into the
    interceptor and stopped: "TypeError: unhashable type: 'slice'"); its modules still are: they agree up to the
    defect, which is named with its differing hyper-parameter."""
    report = align_files(traces / "eager.h5", traces / "compiled_ops_eps.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.post_attention_layernorm", origin["description"]
    assert origin["hparam_diff"]["eps"], origin["hparam_diff"]
    calls = {r["path"]: r for r in report["records"] if r["kind"] == "call" and r["phase"] == "forward"}
    for path in ("model.layers.0", "model.layers.1.self_attn"):  # before it: every tensor within tolerance
        assert calls[path]["tensors"] and all(t["passed"] for t in calls[path]["tensors"]), calls[path]["tensors"]
    # a compiled program's own call back into Python (a float made a tensor) is not an operation of the model
    assert not [r for r in report["records"] if r["kind"] == "op"], "operations recorded from compiled graphs"
