"""A left-padded batch: the values a model computes at padded positions are never used, and implementations differ
there by design (a query whose keys are all masked gets a uniform average from eager attention, something else
from SDPA). Where both runs' root call was given the same ``attention_mask`` with zeros, tensors that lead with
[batch, seq] are compared at the positions it keeps. Before, eager against SDPA was "divergent" at the first
attention's own code; ``all_positions=True`` (``--all-positions``) still shows that. A defect at the kept positions
is still named.

Real models: transformers' Llama built from a config, eval mode, a batch of two sequences, the second left-padded.
"""
from __future__ import annotations

import pytest

from conftest import align_files, run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402
from layerdiff.compare.spec import Comparison  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced


def _step(attn: str, eps: float | None = None):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn).eval()
    if eps is not None:
        model.model.layers[1].post_attention_layernorm.variance_epsilon = eps
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5], ids[1, :5] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5] = -100  # the first real token would be predicted from a padded position: left out, as collators do
    return model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("padding")
    for name, attn, eps, ops in (("eager", "eager", None, False), ("sdpa", "sdpa", None, False),
                                 ("sdpa_eps", "sdpa", 1e-2, False), ("eager_ops", "eager", None, True),
                                 ("sdpa_ops", "sdpa", None, True)):
        model, step = _step(attn, eps)
        with layerdiff.trace(model, root / f"{name}.h5", ops=ops):
            step()
    return root


@pytest.mark.parametrize("ops", ["", "_ops"])
def test_eager_against_sdpa_on_a_left_padded_batch_is_aligned(traces, ops):
    report = align_files(traces / f"eager{ops}.h5", traces / f"sdpa{ops}.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    attention = next(t for r in report["records"] if r["kind"] == "call" and r["phase"] == "forward"
                     and r["path"] == "model.layers.0.self_attn" for t in r["tensors"] if t["key"] == "out.0")
    assert "5 of 24 positions left out: padding" in attention["metrics"]["note"]


def test_all_positions_compares_the_padding_too(traces):
    report = align_files(traces / "eager.h5", traces / "sdpa.h5", Comparison.of(all_positions=True))
    assert report["verdict"] == "divergent"
    assert report["forward"]["first_divergence"]["module"] == "model.layers.0.self_attn"
    code, out, err = run_cli("align", traces / "eager.h5", traces / "sdpa.h5", "-q", "--all-positions")
    assert code == 1, out + err


def test_a_defect_at_the_kept_positions_is_named(traces):
    report = align_files(traces / "eager.h5", traces / "sdpa_eps.h5")
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.post_attention_layernorm", origin["description"]
