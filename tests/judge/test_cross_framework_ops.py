"""The first diverging operation across frameworks: transformers (PyTorch) against Paddle and MindSpore ports,
with the operations of one decoder block recorded on both sides (``--ops-in``).

- against the Paddle and MindSpore recipes (``recipes/paddle_llama.py``, ``recipes/mindspore_llama.py``): the
  clean pairs align operation by operation, and each own-code defect
  (a wrong constant, a helper-function mistake, a hand-written norm, an operation in the wrong dtype, a
  backward-only defect) is named at the line that carries its ``# defect: NAME`` marker, computed from the
  source here, never written as a literal;
- against PaddleFormers' own Qwen2 (``recipes/paddleformers_qwen2.py``, the real library): the clean pair aligns
  with PaddleFormers' own lines, and a port's replacement of one of its helpers is named at the port's line;
- Paddle's and MindSpore's functions are what they were after a trace that raised.

The runs are traced by the CLI in processes of their own (one framework per process: a port's runs share one);
``align`` runs in its own too.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Callable

import conftest
import pytest

def installed(*modules: str) -> bool:
    """Checked without importing: this process imports no framework (MindSpore must come before Paddle)."""
    return all(importlib.util.find_spec(m) is not None for m in modules)


pytestmark = [pytest.mark.torch, pytest.mark.slow,
              pytest.mark.skipif(not installed("torch", "transformers"), reason="needs torch and transformers")]
PORTS = [pytest.param("paddle_llama", marks=[pytest.mark.paddle, pytest.mark.skipif(
              not installed("paddle"), reason="needs PaddlePaddle")]),
          pytest.param("mindspore_llama", marks=[pytest.mark.mindspore, pytest.mark.skipif(
              not installed("mindspore"), reason="needs MindSpore")])]

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
BLOCK = r"model\.layers\.1(\.|$)"
BOTH_BLOCKS = r"model\.layers\.[01](\.|$)"


def marked(recipe: str, marker: str) -> str:
    """``FILE:LINE`` of the recipe line ending in ``# <marker>``."""
    path = RECIPES / f"{recipe}.py"
    return f"{path.name}:{conftest.marked_line(path, marker)}"


def trace(root: Path, name: str, target: str, *args: str, window: str = BLOCK) -> Path:
    """One run of the CLI's ``trace``, recording the operations inside ``window``, in a process of its own."""
    return trace_all(root, {name: (target, *args)}, window)[name]


def trace_all(root: Path, runs: dict[str, tuple[str, ...]], window: str = BLOCK) -> dict[str, Path]:
    """``trace`` of each {name: (target, *args)}, all in one process (``conftest.run_cli_runs``: a framework's
    import is seconds, MindSpore's alone ~5 s, once per run before)."""
    outs = {name: root / f"{name}.h5" for name in runs}
    code, _, err = conftest.run_cli_runs(*(["trace", target, *args, "-o", outs[name], "--ops-in", window, "--mode",
                                            "stats"] for name, (target, *args) in runs.items()))
    assert code == 0, err[-2000:]
    return outs


def align(root: Path, a: Path, b: Path) -> dict:
    report = root / f"{a.stem}-{b.stem}.json"
    code, _, err = conftest.run_cli("align", a, b, "--json", report)
    assert code in (0, 1), err[-2000:]
    return json.loads(report.read_text())


def named_lines(origin: dict) -> set[str]:
    """Every ``file:line`` the origin names in B (the paired operation's, or an operation only B runs)."""
    op = origin.get("op") or {}
    sources = [op.get("source_b")] + [entry[2] for entry in op.get("only_b") or []]
    return {Path(s).name for s in sources if s}


def op_rows(report: dict) -> list[dict]:
    return [r for r in report["records"] if r["kind"] == "op"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cross_ops")
    return root, trace(root, "hf", "torch_llama", "--arg", "attn=eager")


DEFECTS = ["constant", "helper", "norm", "dtype", "function"]


@pytest.fixture(scope="module")
def port_traces(hf_llama) -> Callable[[str], dict[str | None, Path]]:
    """The port's clean trace (None) and one per own-code defect, made at the first test that asks for them."""
    root, _ = hf_llama
    made: dict[str, dict[str | None, Path]] = {}

    def of(port: str) -> dict[str | None, Path]:
        if port not in made:
            runs = {port: (port,), **{f"{port}-{d}": (port, "--arg", f"defect={d}") for d in DEFECTS}}
            outs = trace_all(root, runs)
            made[port] = {None: outs[port], **{d: outs[f"{port}-{d}"] for d in DEFECTS}}
        return made[port]

    return of


@pytest.mark.parametrize("port", PORTS)
def test_a_port_aligns_with_transformers_operation_by_operation(hf_llama, port_traces, port):
    root, reference = hf_llama
    report = align(root, reference, port_traces(port)[None])
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    rows = op_rows(report)
    pairs = {(r["op"]["kind"], r["op_b"]["kind"]) for r in rows}
    # names differ, the operations are the same: Tensor.__mul__ is Tensor.mul, paddle.concat is torch.cat
    assert {("mul", "mul"), ("softmax", "softmax"), ("rsqrt", "rsqrt"), ("matmul", "matmul")} <= pairs
    assert ("cat", "concat") in pairs or ("cat", "cat") in pairs
    line = marked(port, "defect: constant")  # the clean run's line, where the defect would be
    assert any(Path(r["op_b"]["source"]).name == line for r in rows if r["op_b"].get("source"))
    backward = [r for r in rows if r["phase"] == "backward"]
    assert len(backward) >= 20 and all(t["passed"] for r in backward for t in r["tensors"])


@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("port", PORTS)
def test_an_own_code_defect_in_a_port_is_named_at_its_line(hf_llama, port_traces, port, defect):
    from layerdiff.recipes import llama_shared

    root, reference = hf_llama
    report = align(root, reference, port_traces(port)[defect])
    phase = llama_shared.CODE_DEFECTS[defect]
    origin = report[phase]["first_divergence"]
    assert origin is not None and origin["where"] in ("op", "op_input"), origin
    assert origin["phase"] == phase
    assert marked(port, f"defect: {defect}") in named_lines(origin), origin["description"]
    if defect == "constant":  # the argument that differs, A's against B's
        assert origin["op"]["args_diff"] == {"args.1": [0.25, pytest.approx(0.25 * 1.01)]}
    if defect == "norm":
        assert list(origin["op"]["args_diff"].values()) == [[-1, [-2, -1]]]
    if defect == "dtype":
        assert "float16" in origin["description"]  # bfloat16 in Paddle, float16 in MindSpore
    if defect == "function":  # forward agrees; the step only the port has changes the gradient
        assert report["forward"]["status"] == "aligned"


@pytest.fixture(scope="module")
def hf_qwen2(tmp_path_factory) -> tuple[Path, Path]:
    if not installed("paddle", "paddleformers"):
        pytest.skip("needs PaddlePaddle and PaddleFormers")
    root = tmp_path_factory.mktemp("cross_ops_qwen2")
    return root, trace(root, "hf-qwen2", "torch_qwen2", window=BOTH_BLOCKS)


@pytest.mark.paddle
def test_paddleformers_qwen2_aligns_with_transformers_operation_by_operation(hf_qwen2):
    root, reference = hf_qwen2
    report = align(root, reference, trace(root, "pf", "paddleformers_qwen2", window=BOTH_BLOCKS))
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    rows = op_rows(report)
    files = {Path(r["op_b"]["source"].rpartition(":")[0]).name for r in rows if r["op_b"].get("source")}
    assert {"modeling.py", "eager_attention.py"} <= files  # PaddleFormers' own code, named by its lines
    assert any(r["op"]["kind"] == "softmax" and r["op_b"]["kind"] == "softmax" for r in rows)


@pytest.mark.paddle
def test_a_wrong_constant_is_named_at_paddleformers_own_line(hf_qwen2):
    """The port sets the attention's scaling wrong; PaddleFormers' own code applies it: its line is named."""
    root, reference = hf_qwen2
    report = align(root, reference, trace(root, "pf-constant", "paddleformers_qwen2", "--arg", "defect=constant",
                                          window=BOTH_BLOCKS))
    origin = report["forward"]["first_divergence"]
    spec = importlib.util.find_spec("paddleformers")  # found, not imported: this process imports no framework
    source = Path(spec.origin).parent / "nn" / "attention" / "eager_attention.py"
    line = next(i + 1 for i, text in enumerate(source.read_text().splitlines())
                if "attn_weights = paddle.matmul(query, key.transpose" in text and text.rstrip().endswith("* scaling"))
    assert f"eager_attention.py:{line}" in named_lines(origin), origin["description"]
    assert origin["module"] == "model.layers.1.self_attn" and origin["where"] == "op"
    assert [a for a, b in origin["op"]["args_diff"].values()] == [pytest.approx(0.25)]


@pytest.mark.paddle
def test_a_port_of_a_paddleformers_helper_is_named_at_the_ports_line(hf_qwen2):
    root, reference = hf_qwen2
    report = align(root, reference, trace(root, "pf-helper", "paddleformers_qwen2", "--arg", "defect=helper",
                                          window=BOTH_BLOCKS))
    origin = report["forward"]["first_divergence"]  # the helper serves every layer: the first one shows it
    assert origin["module"] == "model.layers.0.self_attn", origin["description"]
    assert marked("paddleformers_qwen2", "defect: helper") in named_lines(origin), origin["description"]


RESTORED = {
    "paddle_llama": r"""
import paddle, paddle.nn.functional as F
from layerdiff.recipes import paddle_llama as recipe

def functions():
    return [paddle.matmul, F.softmax, vars(paddle.Tensor)["__mul__"], vars(paddle.Tensor)["reshape"],
            vars(paddle.autograd.PyLayer).get("apply")]

def break_down_proj(model):
    model.model.layers[1].mlp.down_proj.forward = broken
""",
    "mindspore_llama": r"""
import mindspore as ms
from mindspore import mint, nn, ops
from mindspore.ops import Primitive
from layerdiff.recipes import mindspore_llama as recipe

def functions():
    return [ops.matmul, mint.matmul, vars(ms.Tensor).get("__mul__"), vars(ms.Tensor).get("reshape"),
            vars(Primitive)["__call__"], vars(nn.Cell)["__call__"]]

def break_down_proj(model):
    down = model.model.layers[1].mlp.down_proj
    object.__setattr__(down, "construct", broken)
""",
}
RAISE = r"""
import layerdiff

def broken(x):
    raise RuntimeError("a failing port")

before = functions()
built = recipe.build()
break_down_proj(built["model"])
try:
    with layerdiff.trace(built["model"], "{path}", ops=True):
        built["step"]()
except RuntimeError as exc:
    assert "a failing port" in str(exc), exc
else:
    raise SystemExit("the step did not raise")
after = functions()
assert all(x is y for x, y in zip(before, after)), (before, after)
print("restored")
"""


@pytest.mark.parametrize("port", PORTS)
def test_the_frameworks_functions_are_restored_after_a_trace_that_raised(tmp_path, port):
    script = RESTORED[port] + RAISE.replace("{path}", str(tmp_path / "t.h5"))
    done = conftest.run_python(script)
    assert done.returncode == 0 and "restored" in done.stdout, done.stderr[-2000:]
