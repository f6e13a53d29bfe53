"""The Paddle adapter and recipe, with real Paddle: traces align with the torch recipe's, defects are named.

Paddle and torch run in separate subprocesses (started together, one per framework, writing every trace the
tests need in one go); the aligner runs here, importing neither.
"""
from __future__ import annotations

import json

import pytest

from layerdiff.tracefile.reader import open_trace

from conftest import align_files, run_scripts, skip_unless_installed

# torch: the torch recipe's trace is the reference for the port (made in a subprocess)
skip_unless_installed("paddle", "torch")

pytestmark = [pytest.mark.slow, pytest.mark.paddle, pytest.mark.torch]

# the defect names and origins of the paddle recipe, read without importing paddle in this process
DEFECTS = {
    "eps": ("forward", "model.layers.1.post_attention_layernorm"),
    "act": ("forward", "model.layers.0.mlp.act_fn"),
    "weight": ("forward", "model.layers.1.self_attn.k_proj"),
    "owncode": ("forward", "model.layers.1.self_attn"),
    "residual": ("forward", "model.layers.1"),
    "backward": ("backward", "model.layers.0.mlp.down_proj"),
    "fp16": ("forward", "model.layers.1.mlp.up_proj"),
    "nan": ("forward", "model.layers.1.mlp.gate_proj"),
}

PADDLE_SCRIPT = r'''
import json, sys
from pathlib import Path

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

import layerdiff
from layerdiff.recipes import llama_shared, paddle_llama

out = Path(sys.argv[1])
results = {"defects": {d: list(v) for d, v in paddle_llama.DEFECTS.items()}}

# -- the recipe: clean twice, then every defect ----------------------------------------------------------
for name, defect in [("clean", None), ("clean2", None)] + [(d, d) for d in paddle_llama.DEFECTS]:
    built = paddle_llama.build(defect)
    with layerdiff.trace(built["model"], out / f"paddle_{name}.h5"):
        built["step"]()

# -- tracing must not change results, also with in-place ops on layer outputs and inputs -----------------
class AddOneInPlace(nn.Layer):
    inplace = True  # modifies its input: never input-tapped

    def forward(self, x):
        x.add_(paddle.ones_like(x))
        return x


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.Silu()
        self.bump = AddOneInPlace()
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        h.scale_(2.0)        # in place on a layer's output
        h = self.bump(h)
        F.relu_(h)           # and again
        return self.out(self.act(h))


class Sneaky(nn.Layer):
    def forward(self, x):  # modifies its input in place without saying so
        x.scale_(3.0)
        return x * 0.5


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.head, self.sneaky = Block(), Block(), nn.Linear(8, 3), Sneaky()

    def forward(self, x):
        h = self.b1(x)
        h.add_(paddle.full_like(h, 0.5))  # in place on a sublayer's output, in the parent
        y = self.sneaky(h)                # the caller must see h changed
        return self.head(self.b2(h + y))


def run(model, x0):
    model.clear_gradients(set_to_zero=False)
    x = paddle.to_tensor(x0, stop_gradient=False)
    y = model(x)
    (y * y).sum().backward()
    return y.numpy(), x.grad.numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}

paddle.seed(0)
net = Net()
x0 = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
y_plain, gx_plain, gp_plain = run(net, x0)
with layerdiff.trace(net, out / "paddle_inplace.h5"):
    y_traced, gx_traced, gp_traced = run(net, x0)
    y_again, gx_again, _ = run(net, x0)  # second call: Sneaky no longer input-tapped
y_after, _, _ = run(net, x0)  # hooks removed: plain again
results["inplace"] = {
    "forward_identical": bool(np.array_equal(y_plain, y_traced)),
    "forward_identical_after": bool(np.array_equal(y_plain, y_after)),
    "forward_identical_again": bool(np.array_equal(y_plain, y_again) and np.array_equal(gx_plain, gx_again)),
    "grad_x_max_rel": float(np.abs(gx_plain - gx_traced).max() / np.abs(gx_plain).max()),
    "grad_param_max_rel": max(float(np.abs(gp_plain[n] - gp_traced[n]).max() / max(np.abs(gp_plain[n]).max(), 1e-30))
                              for n in gp_plain),
    "lin_out": np.asarray(net.b1.lin(paddle.to_tensor(x0))).tolist(),
}

# -- a forward that draws dropout masks from the random generators: its trace says so -------------------------
dropping = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
with layerdiff.trace(dropping, out / "paddle_dropout.h5"):
    dropping(paddle.randn([4, 8])).sum().backward()  # the input's draw is outside the model's call: not counted

# -- a layer that raises is recorded as the failure --------------------------------------------------------
class Boom(nn.Layer):
    def forward(self, x):
        raise ValueError("boom: forward refused")

boom = nn.Sequential(nn.Linear(4, 8), Boom(), nn.Linear(8, 2))
try:
    with layerdiff.trace(boom, out / "paddle_raised.h5"):
        boom(paddle.randn([3, 4]))
except ValueError as exc:
    results["raised"] = str(exc)

# -- parameters are recorded at each step where an optimizer changed them ------------------------------------
built = paddle_llama.build(None, layers=1)
opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=built["model"].parameters())
with layerdiff.trace(built["model"], out / "paddle_steps.h5"):
    for _ in range(2):
        built["step"]()
        opt.step()
    ids = paddle.to_tensor(llama_shared.input_ids(llama_shared.config(layers=1)))
    with paddle.no_grad():  # forward-only steps: no gradient, so values are not recorded again
        for _ in range(2):
            built["model"](ids)
results["num_params"] = len(built["model"].parameters())

# -- activation checkpointing: Paddle's recompute, reentrant and not, against the same net without it ----------
from paddle.distributed.fleet.utils import recompute


class Residual(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Checkpointed(nn.Layer):
    def __init__(self, how):
        super().__init__()
        self.blocks, self.head, self.how = nn.LayerList([Residual() for _ in range(2)]), nn.Linear(16, 4), how

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.how is None else recompute(block, x, use_reentrant=self.how == "reentrant")
        return self.head(x)


for how in (None, "reentrant", "non_reentrant"):
    paddle.seed(0)
    net = Checkpointed(how)
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32), stop_gradient=False)
    with layerdiff.trace(net, out / f"paddle_recompute_{how or 'plain'}.h5"):
        net(x).mean().backward()

results["torch_imported"] = "torch" in sys.modules
(out / "paddle_results.json").write_text(json.dumps(results))
'''

TORCH_SCRIPT = r'''
import sys
from pathlib import Path

import layerdiff
from layerdiff.recipes import torch_llama


built = torch_llama.build(None)
with layerdiff.trace(built["model"], Path(sys.argv[1]) / "torch_clean.h5"):
    built["step"]()
'''


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Both frameworks' traces, made by two subprocesses running side by side."""
    root = tmp_path_factory.mktemp("paddle_traces")
    run_scripts(root, {"paddle": PADDLE_SCRIPT, "torch": TORCH_SCRIPT})
    results = json.loads((root / "paddle_results.json").read_text())
    return root, results


_align = align_files


def _path(traces, name):
    return traces[0] / f"{name}.h5"


def test_recipe_defects_match_the_torch_recipe(traces):
    assert {d: tuple(v) for d, v in traces[1]["defects"].items()} == DEFECTS
    from layerdiff.recipes import torch_llama  # imports torch only, not paddle
    assert torch_llama.DEFECTS == DEFECTS


def _assert_clean(report):
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    assert report["forward"]["status"] == report["backward"]["status"] == "aligned"
    assert report["forward"]["first_divergence"] is None and report["backward"]["first_divergence"] is None
    assert not report["only_a"] and not report["only_b"]
    assert report["params"]["compared"] > 0 and report["params"]["grads_compared"] > 0
    assert report["params"]["differ"] == [] and report["params"]["grads_differ"] == []


def test_two_paddle_runs_align(traces):
    report = _align(_path(traces, "paddle_clean"), _path(traces, "paddle_clean2"))
    _assert_clean(report)
    rows = [t for r in report["records"] for t in r["tensors"]]
    assert rows and all(t["metrics"]["identical"] for t in rows)  # same process, same kernels: same bits


def test_a_paddle_trace_says_whether_its_forward_drew_random_numbers(traces):
    """Paddle's generators are fingerprinted as torch's are (``rng_state``), around each root call: its dropout
    drew (an unseeded run's seed then matters), the recipe's Llama drew nothing (its seed, different in each
    process, is no lead)."""
    with open_trace(_path(traces, "paddle_dropout")) as dropout, open_trace(_path(traces, "paddle_clean")) as clean:
        assert dropout.end.rng_drawn is True and clean.end.rng_drawn is False
        assert dropout.meta["rng_state"] and clean.meta["rng_state"]


def test_paddle_port_aligns_with_torch(traces):
    report = _align(_path(traces, "torch_clean"), _path(traces, "paddle_clean"))
    _assert_clean(report)
    phases = {r["phase"] for r in report["records"] if r.get("phase")}
    assert phases == {"forward", "backward"}
    paths = {r["path"] for r in report["records"]}
    assert {"", "model", "model.embed_tokens", "model.layers.1.self_attn.k_proj", "model.norm", "lm_head",
            "model.layers.0.mlp.act_fn"} <= paths
    assert report["params"]["compared"] == 21  # every weight, Linear ones compared transposed


@pytest.mark.parametrize("reference", ["paddle_clean", "torch_clean"])
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_paddle_defect_is_named_at_its_origin(traces, defect, reference):
    direction, module = DEFECTS[defect]
    report = _align(_path(traces, reference), _path(traces, f"paddle_{defect}"))
    assert report["verdict"] == "divergent"
    assert report[direction]["first_divergence"]["module"] == module
    if direction == "backward":
        assert report["forward"]["status"] == "aligned"
        assert report["forward"]["first_divergence"] is None
        assert report["backward"]["first_divergence"]["where"] == "module"
    else:
        back = report["backward"]["first_divergence"]
        assert back["module"] == module and back["where"] == "forward"


@pytest.mark.parametrize("reference", ["paddle_clean", "torch_clean"])
def test_paddle_eps_defect_shows_the_hyperparameter(traces, reference):
    origin = _align(_path(traces, reference), _path(traces, "paddle_eps"))["forward"]["first_divergence"]
    assert origin["hparam_diff"]["eps"] == [1e-6, 1e-5]
    assert origin["chain"] == ["<root>", "model", "model.layers.1", "model.layers.1.post_attention_layernorm"]


def test_paddle_owncode_defect_names_the_children_around_it(traces):
    origin = _align(_path(traces, "torch_clean"), _path(traces, "paddle_owncode"))["forward"]["first_divergence"]
    assert origin["where"] == "own_code"
    assert origin["between"] == ["model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"]


def test_paddle_nan_is_found(traces):
    report = _align(_path(traces, "torch_clean"), _path(traces, "paddle_nan"))
    nan = report["first_nonfinite"]["b"]
    assert report["first_nonfinite"]["a"] is None
    assert (nan["module"], nan["phase"]) == ("model.layers.1.mlp.gate_proj", "forward")


def test_tracing_keeps_results_with_in_place_ops(traces):
    res = traces[1]["inplace"]
    assert res["forward_identical"] and res["forward_identical_after"] and res["forward_identical_again"]
    assert res["grad_x_max_rel"] < 1e-6 and res["grad_param_max_rel"] < 1e-6
    with open_trace(_path(traces, "paddle_inplace")) as reader:
        assert reader.end.status == "complete"
        assert any("sneaky modifies its input in place" in w for w in reader.end.warnings)
        calls = [r for r in reader.records if r.kind == "call"]
        fwd = {(r.path, r.phase): r for r in calls}
        # the recorded output is what the layer returned, before the caller modified it in place
        out = next(t for t in fwd[("b1.lin", "forward")].tensors if t.role == "output")
        import numpy as np
        np.testing.assert_array_equal(reader.tensor(out), np.asarray(res["lin_out"], dtype=np.float32))
        back = fwd[("b1.lin", "backward")]
        assert {t.role for t in back.tensors} == {"grad_output", "grad_input"}
        bump = fwd[("b1.bump", "backward")]  # inplace=True: output side only
        assert {t.role for t in bump.tensors} == {"grad_output"}
        grads = {r.path for r in reader.records if r.kind == "param_grad"}
        assert "b1.lin.weight" in grads and "head.bias" in grads


def test_raising_layer_is_recorded(traces):
    assert "boom" in traces[1]["raised"]
    with open_trace(_path(traces, "paddle_raised")) as reader:
        assert reader.end.status == "error"
        assert reader.end.failure["module"] == "1"
        assert "ValueError" in reader.end.failure["error"]
        forward = {r.path: r for r in reader.records if r.kind == "call" and r.phase == "forward"}
        assert not forward["0"].incomplete and forward["1"].incomplete
        assert "2" not in forward


def test_parameters_recorded_when_changed(traces):
    n = traces[1]["num_params"]
    with open_trace(_path(traces, "paddle_steps")) as reader:
        values = [r for r in reader.records if r.kind == "param"]
        grads = [r for r in reader.records if r.kind == "param_grad"]
        # before step 0, and before step 1 and 2 (each follows a backward + update); not before step 3,
        # a forward-only step after a forward-only step
        assert len(values) == 3 * n
        assert sorted({r.call for r in values}) == [0, 1, 2]
        assert sorted({r.step for r in values}) == [0, 1, 2]
        assert len(grads) == 2 * n  # one accumulated gradient per parameter per backward


def test_paddle_trace_needs_no_torch(traces):
    assert traces[1]["torch_imported"] is False
    with open_trace(_path(traces, "paddle_clean")) as reader:
        meta = reader.meta
    assert meta["framework"] == "paddle" and meta["framework_version"].startswith(("3.", "2."))
    assert meta["model_class"].endswith("paddle_llama.LlamaForCausalLM")
    assert meta["param_dtypes"] == ["float32"] and meta["training"] is True
    assert meta["num_parameters"] > 0 and "seed" in meta


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant"])
def test_paddle_recompute_aligns_with_the_plain_net_and_replays_its_forward(traces, how):
    """Paddle's recompute (a ``PyLayer``'s backward, or its saved tensors' unpack hook) runs each block again in
    backward: those calls replay the forward's, so the run aligns with the plain one record for record."""
    plain, checkpointed = _path(traces, "paddle_recompute_plain"), _path(traces, f"paddle_recompute_{how}")
    with open_trace(plain) as a, open_trace(checkpointed) as b:
        assert a.end.steps == b.end.steps == 1
        assert sorted((r.kind, r.phase, r.path, r.call) for r in a.records) == \
            sorted((r.kind, r.phase, r.path, r.call) for r in b.records)
        assert {r.path for r in b.recomputed} == {f"blocks.{i}{child}" for i in range(2)
                                                  for child in ("", ".fc1", ".act", ".fc2")}
    report = _align(plain, checkpointed)
    assert report["verdict"] == "aligned" and not report["only_a"] and not report["only_b"]
    assert report["recompute"]["b"] == {"calls": 8, "compared": 8, "differ": []}
