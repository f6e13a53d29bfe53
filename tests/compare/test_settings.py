"""Run settings that break parity (seeds, deterministic switches, versions, environment, flags) are compared
between the two traces and shown by align, with the runs' own notes."""
from __future__ import annotations

import json
import textwrap

import pytest

from layerdiff.compare.settings import differing_settings, settings_report
from layerdiff.tracefile.reader import open_trace


def _meta(**kw):
    base = {"framework": "torch", "framework_version": "2.13.0", "seed": 0, "deterministic_algorithms": False,
            "num_threads": 2, "env": {}, "user": {}}
    return {**base, **kw}


def test_only_what_differs_is_listed_with_why():
    diffs = differing_settings(_meta(), _meta(deterministic_algorithms=True, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}))
    assert [(d.key, d.a, d.b) for d in diffs] == [("deterministic_algorithms", False, True),
                                                  ("CUBLAS_WORKSPACE_CONFIG", None, ":4096:8")]
    assert all(d.why for d in diffs)
    assert differing_settings(_meta(), _meta()) == []


def test_keys_of_one_framework_only_are_not_compared_across_frameworks():
    paddle = {"framework": "paddle", "framework_version": "3.3.1", "seed": 0, "flags": {"FLAGS_cudnn_deterministic": True},
              "env": {"FLAGS_x": "1"}}
    assert differing_settings(_meta(), paddle) == []  # torch's switches have no Paddle counterpart


def test_a_seed_is_listed_only_where_it_may_explain_a_difference():
    """Two runs that load the same weights and draw no random numbers in their forward (a recipe traced twice
    from the CLI: unseeded, its weights from a generator of its own) differ in nothing a seed decides."""
    a, b = _meta(seed=2647923664511157433, rng_drawn=False), _meta(seed=8529134891320403105, rng_drawn=False)
    assert differing_settings(a, b, same_weights=True) == []
    assert [d.key for d in differing_settings(a, b)] == ["seed"]  # other weights: its initialization may
    assert [d.key for d in differing_settings(a, {**b, "rng_drawn": True}, same_weights=True)] == ["seed"]
    assert [d.key for d in differing_settings(_meta(seed=1), _meta(seed=2), same_weights=True)] == ["seed"]  # unknown


def test_across_frameworks_only_what_means_the_same_in_both_is_compared():
    """A port's versions, seeds and random states are each its framework's own (the weights are transferred): the
    demo's Paddle candidate listed all three against torch, and its devices as Place(cpu) against cpu."""
    torch = _meta(devices=["cpu"], seed=8638558908101672717, rng_state="95d8", training=True, num_threads=2)
    paddle = {"framework": "paddle", "framework_version": "3.3.1", "seed": 4174675697016615, "devices": ["Place(cpu)"],
              "training": True, "num_threads": 1}
    assert differing_settings(torch, paddle) == []  # its thread count too: other kernels split their work
    assert [d.key for d in differing_settings(torch, {**paddle, "training": False})] == ["training"]
    mindspore = {"framework": "mindspore", "framework_version": "2.10.0", "seed": None, "devices": ["gpu"],
                 "training": True, "num_threads": 2}
    assert [d.key for d in differing_settings(torch, mindspore)] == ["devices"]  # a CPU run against a GPU one
    assert differing_settings({**torch, "devices": ["cuda:0"]}, {**paddle, "devices": ["Place(gpu:0)"]}) == []
    # within one framework a seed against none is a difference (one run unseeded)
    assert [d.key for d in differing_settings({**mindspore, "seed": 1}, mindspore)] == ["seed"]


def test_the_random_state_is_listed_where_a_run_trains_with_the_same_seed():
    a, b = _meta(rng_state="95d8", training=True), _meta(rng_state="9168", training=True)
    assert [d.key for d in differing_settings(a, b)] == ["rng_state"]
    assert differing_settings({**a, "training": False}, {**b, "training": False}) == []  # no dropout draws from it
    assert [d.key for d in differing_settings(a, {**b, "seed": 1})] == ["seed"]  # the seeds say it already


def test_the_random_state_is_not_listed_where_neither_forward_drew_random_numbers():
    a, b = _meta(rng_state="95d8", training=True), _meta(rng_state="9168", training=True)
    assert differing_settings({**a, "rng_drawn": False}, {**b, "rng_drawn": False}) == []
    for drawn in (True, None):  # one run drew (dropout), or a trace too old to say
        assert [d.key for d in differing_settings({**a, "rng_drawn": False}, {**b, "rng_drawn": drawn})] == \
            ["rng_state"]


@pytest.mark.torch
def test_dropout_drawn_from_another_random_state_is_explained(tmp_path):
    """Two traces of GPT-2 in training mode (dropout 0.1) in one process, the second after the first consumed the
    generator: the same seed, other masks. Before, nothing in the report said why its first dropout differed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import layerdiff
    from conftest import align_files

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2,
                                                                 n_positions=32))
    ids = torch.arange(16).reshape(2, 8)
    for name in ("a", "b"):
        with layerdiff.trace(model, tmp_path / f"{name}.h5"):
            model(input_ids=ids, labels=ids).loss.backward()
    report = align_files(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report["verdict"] == "divergent"
    assert [d["key"] for d in report["settings"]["differ"]] == ["rng_state"]
    for name in ("a", "b"):
        with open_trace(tmp_path / f"{name}.h5") as trace:
            assert trace.end.rng_drawn is True  # its dropout drew the masks


@pytest.mark.torch
def test_another_random_state_is_not_blamed_where_the_forward_draws_no_random_numbers(tmp_path):
    """A transformers Llama built from a config trains with attention dropout 0: its forward draws nothing, so two
    runs whose generators were consumed differently are the same run, and the report says nothing of it (the demo
    listed the random state first, a false lead)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import layerdiff
    from conftest import align_files

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.arange(16).reshape(2, 8)
    states = []
    for name in ("a", "b"):
        torch.rand(3)  # the generator consumed between the runs, as another order of initialization would
        states.append(torch.get_rng_state())
        model.zero_grad(set_to_none=True)
        with layerdiff.trace(model, tmp_path / f"{name}.h5"):
            model(input_ids=ids, labels=ids).loss.backward()
        assert torch.equal(torch.get_rng_state(), states[-1])  # nothing drew from it while the trace was open
    assert model.training and not torch.equal(states[0], states[1])
    report = align_files(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    assert report["settings"]["differ"] == []
    for name in ("a", "b"):
        with open_trace(tmp_path / f"{name}.h5") as trace:
            assert trace.meta["rng_state"] and trace.end.rng_drawn is False


def test_notes_are_carried():
    report = settings_report(_meta(user={"run": "baseline"}), _meta(user={"run": "port"}))
    assert report["notes"] == {"a": {"run": "baseline"}, "b": {"run": "port"}} and report["differ"] == []


TARGET = """
import torch
from layerdiff.recipes import torch_llama

def build(seed: int = 0, deterministic: bool = False):
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(deterministic)
    return torch_llama.build()
"""


@pytest.mark.torch
@pytest.mark.slow
def test_runs_differing_only_in_a_seed_and_a_deterministic_switch(tmp_path):
    pytest.importorskip("torch")
    from conftest import run_cli

    (tmp_path / "target.py").write_text(textwrap.dedent(TARGET))
    for name, args in (("a", []), ("b", ["--arg", "seed=1", "--arg", "deterministic=True"])):
        code, _, err = run_cli("trace", tmp_path / "target.py:build", "-o", tmp_path / f"{name}.h5", "-q", *args)
        assert code == 0, err
    code, out, err = run_cli("align", tmp_path / "a.h5", tmp_path / "b.h5", "--json", tmp_path / "r.json")
    assert code == 0, out + err  # the numbers agree: this model uses no randomness in its step
    assert "run settings that differ" in out
    assert "deterministic_algorithms: False (A) vs True (B)" in out
    # the seeds differ, but the weights (a generator of the recipe's own) are the same and the forward draws no
    # random numbers: the seed explains nothing here, and is not offered as a lead
    assert "seed: 0 (A) vs 1 (B)" not in out
    differ = json.loads((tmp_path / "r.json").read_text())["settings"]["differ"]
    assert {d["key"] for d in differ} == {"deterministic_algorithms"}


CONFIG_TARGET = """
import torch
import transformers

def build(eps: float = 1e-6):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=eps)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.arange(16).reshape(2, 8)
    return model, lambda: model(input_ids=ids, labels=ids).loss.backward()
"""


@pytest.mark.torch
@pytest.mark.slow
def test_the_models_own_configs_are_compared_next_to_the_origin(tmp_path):
    pytest.importorskip("transformers")
    from conftest import run_cli

    (tmp_path / "target.py").write_text(textwrap.dedent(CONFIG_TARGET))
    for name, eps in (("a", "1e-6"), ("b", "1e-5")):
        code, _, err = run_cli("trace", tmp_path / "target.py:build", "-o", tmp_path / f"{name}.h5", "-q",
                               "--arg", f"eps={eps}")
        assert code == 0, err
    code, out, err = run_cli("align", tmp_path / "a.h5", tmp_path / "b.h5", "--json", tmp_path / "r.json")
    assert code == 1, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [d["key"] for d in report["config_diff"]] == ["norm_epsilon"]
    assert "the models' own configs differ: norm_epsilon 1e-06 (A) vs 1e-05 (B)" in out
