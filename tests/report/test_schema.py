"""The declared shapes (core/schema.py) against what layerdiff really writes, without any framework: traces made
by the framework-neutral session from numpy arrays, aligned by the core."""
import json
import math
import typing

import numpy as np
import pytest

import layerdiff
from layerdiff import schema
from layerdiff.report.jsonio import report_problem
from layerdiff.capture.session import TraceSession
from layerdiff.tracefile.writer import TraceWriter
from layerdiff.tracefile.reader import open_trace

from conftest import NumpyTensors


def _run(path, scale: float):
    """A two-layer MLP step (forward, backward, parameter values and gradients); ``scale`` != 1 puts a defect
    in the second layer's output."""
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 8), (8, 8)))
    h = x @ w1
    y = (h @ w2 * scale).astype(np.float32)
    gy = np.ones_like(y)
    gh = gy @ w2.T
    writer = TraceWriter(path, {"framework": "numpy", "model_class": "toy.MLP", "mode": "full"})
    session = TraceSession(writer, NumpyTensors())
    for name, module, w in (("fc1.weight", "fc1", w1), ("fc2.weight", "fc2", w2)):
        session.param("param", name, module, w, "Linear")
    root = session.begin_call("", "MLP", {}, [("args.0", x)], {})
    frames = {}
    for name, inp, out in (("fc1", x, h), ("fc2", h, y)):
        frames[name] = session.begin_call(name, "Linear", {"in_features": 8}, [("args.0", inp)], {})
        session.end_call(frames[name], [("out", out)], {})
    session.end_call(root, [("out", y)], {})
    for name, grad_out, grad_in, weight_grad in (("fc2", gy, gh, h.T @ gy), ("fc1", gh, gh @ w1.T, x.T @ gh)):
        frames[name].tapped_inputs = True  # the adapters' gradient tap: both sides in one backward record
        session.grad_outputs(frames[name], [("out", grad_out)])
        session.grad_inputs(frames[name], [("args.0", grad_in)])
        session.param("param_grad", f"{name}.weight", name, weight_grad.astype(np.float32), "Linear")
    session.close()
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema")
    return layerdiff.align(_run(d / "a.h5", 1.0), _run(d / "b.h5", 1.5)).data


def _declared(schema_type) -> set:
    return set(typing.get_type_hints(schema_type))


def test_a_real_report_has_the_declared_shape(report):
    assert report["forward"]["first_divergence"]["module"] == "fc2"  # the defect is found, so rows are real
    assert schema.problem(report, schema.Report) is None
    assert report_problem(schema.loads(schema.dumps(report))) is None  # what `layerdiff report` reads back


def test_every_key_a_report_holds_is_declared(report):
    """The declarations document the whole report: a key added to the code but not to the schema fails here."""
    assert set(report) <= _declared(schema.Report)
    for side in ("a", "b"):
        assert set(report[side]) <= _declared(schema.RunSummary), set(report[side]) - _declared(schema.RunSummary)
    for row in report["records"]:
        assert set(row) <= _declared(schema.Row), set(row) - _declared(schema.Row)
        for t in row["tensors"]:
            assert set(t) <= _declared(schema.TensorResult), set(t) - _declared(schema.TensorResult)
            assert set(t["metrics"]) <= _declared(schema.Metrics), set(t["metrics"]) - _declared(schema.Metrics)
    for phase in ("forward", "backward"):
        assert set(report[phase]) <= _declared(schema.PhaseResult)
    origin = report["forward"]["first_divergence"]
    assert set(origin) <= _declared(schema.Origin), set(origin) - _declared(schema.Origin)


def test_trace_records_have_the_declared_shape(tmp_path):
    """Every line the writer writes decodes into its typed record, and every key it writes is a declared field
    (the reader skips undeclared keys: one the writer adds but the declaration lacks would be lost), but the line's
    own checksum, which the reader checks before decoding it."""
    import h5py
    import msgspec

    from layerdiff.tracefile import records

    path = _run(tmp_path / "t.h5", 1.0)
    with open_trace(path) as reader:
        assert {r.kind for r in reader.records} == {"call", "param", "param_grad"}
    with h5py.File(path, "r", locking=False) as f:
        lines = [line for line in bytes(f["index"][:]).rstrip(b"\0").split(b"\n") if line]
    for line in lines:
        record = records.decode_line(line)
        assert record is not None, line
        written = json.loads(line)
        declared = set(msgspec.structs.asdict(record)) | {"kind", "checksum"}
        assert set(written) <= declared, set(written) - declared
        for entry in written.get("tensors", ()):
            assert set(entry) <= set(records.TensorEntry.__struct_fields__), entry
            assert set(entry["stats"]) <= set(records.Stats.__annotations__), entry["stats"]


@pytest.mark.parametrize("change, message", [
    (lambda r: r["records"][1]["tensors"][0]["metrics"].__setitem__("max_abs", "big"),
     "records[1].tensors[0].metrics.max_abs is not a number or null"),
    (lambda r: r["records"][1].__setitem__("phase", "sideways"), "records[1].phase is not 'forward' or 'backward' or null"),
    (lambda r: r["records"][1].__setitem__("parent", ["", "0"]), "records[1].parent is not [path, call] or [] or null"),
    (lambda r: r["records"][1]["tensors"][0].pop("role"), "records[1].tensors[0] has no role"),
    (lambda r: r["a"].__setitem__("complete", "yes"), "a.complete is not true or false"),
    (lambda r: r.__setitem__("report_version", True), "report_version is not an integer"),
])
def test_a_problem_names_its_place(report, change, message):
    broken = schema.loads(schema.dumps(report))
    change(broken)
    assert report_problem(broken) == message


def test_json_keeps_non_finite_numbers_and_stays_standard():
    value = {"max_abs": math.inf, "low": -math.inf, "cosine": math.nan, "rows": [1.5, (2, "inf")]}
    text = schema.dumps(value)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = schema.loads(text)
    assert back["max_abs"] == math.inf and back["low"] == -math.inf and math.isnan(back["cosine"])
    assert back["rows"] == [1.5, [2, math.inf]]  # a tuple comes back a list; the string "inf" is read as a number


def test_json_text_reads_back_the_values_whichever_encoder_wrote_it():
    """orjson writes reports; what it refuses (integers beyond 64 bits, keys that are not strings) goes to json.
    Either way the text is standard, indented JSON that reads back the same values."""
    common = {"path": "model.layers.0.mlp", "note": "µ-scale ✓", "max_abs": 1e-06, "numel": 2**40,
              "rows": [{"cosine": 0.999999, "ok": True, "why": None}], "neg": -0.0}
    for value in (common, {**common, "huge": 2**70}, {**common, 3: "int key"}):
        text = schema.dumps(value)
        assert text.startswith("{\n ") and "\n" in text.strip()  # indented, one value per line
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
        expected = {str(k): v for k, v in value.items()}
        assert schema.loads(text) == expected
    with pytest.raises(TypeError):
        schema.dumps({"x": object()})  # unknown types fail as they always did
