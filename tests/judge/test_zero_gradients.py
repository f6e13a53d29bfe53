"""Gradients that are zero in exact arithmetic are rounding noise in each run: no false alarm.

A key projection's bias gets no gradient (softmax ignores a shift shared by every key), so each run's is ~1e-12 of
noise, at any angle to the other run's. Before, BERT and OPT traced with eager attention against the same model with
SDPA were "divergent" in backward at ``...key``/``k_proj``: its bias gradient's cosine 0.28 (BERT), 0.0065 (OPT).
Now the cosine is no evidence between tensors within ``atol`` of zero, and a real difference there is still named.

Real models: transformers' BERT and OPT built from configs, with operations recorded (``ops=True``).
"""
from __future__ import annotations

import pytest

from conftest import align_files

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
KEY = {"bert": "bert.encoder.layer.1.attention.self.key", "opt": "model.decoder.layers.1.self_attn.k_proj"}


def _model(arch: str, attn: str):
    torch.manual_seed(0)
    if arch == "bert":
        config = transformers.BertConfig(**SMALL, intermediate_size=64)
        model = transformers.BertForMaskedLM(config)
    else:
        config = transformers.OPTConfig(**SMALL, ffn_dim=64, word_embed_proj_dim=32)
        model = transformers.OPTForCausalLM(config)
    model.config._attn_implementation = attn
    return model.eval()  # no dropout: the two attentions are the same computation


def _trace(path, arch: str, attn: str, shift_key_bias: bool = False):
    model = _model(arch, attn)
    if shift_key_bias:
        with torch.no_grad():
            model.get_submodule(KEY[arch]).bias.add_(1e-3)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with layerdiff.trace(model, path, ops=True):
        model(input_ids=ids, labels=ids).loss.backward()
    return path


@pytest.fixture(scope="module", params=["bert", "opt"])
def traces(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"zero_{request.param}")
    arch = request.param
    return arch, {name: _trace(root / f"{name}.h5", arch, attn, shift)
                  for name, attn, shift in (("eager", "eager", False), ("sdpa", "sdpa", False),
                                            ("sdpa_shifted", "sdpa", True))}


def test_eager_against_sdpa_attention_is_aligned(traces):
    arch, paths = traces
    report = align_files(paths["eager"], paths["sdpa"])
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    key_bias = [t for r in report["records"] for t in r.get("tensors", ())
                if r.get("kind") == "param_grad" and r.get("path") == f"{KEY[arch]}.bias"]
    assert key_bias and all(t["passed"] for t in key_bias), [t["reason"] for t in key_bias]
    assert max(t["metrics"]["ref_max_abs"] for t in key_bias) < 1e-8  # it is noise: what the rule is about


def test_a_changed_key_bias_is_still_named(traces):
    arch, paths = traces
    report = align_files(paths["eager"], paths["sdpa_shifted"])
    assert report["verdict"] == "divergent"
    assert report["params"]["differ"] == [f"{KEY[arch]}.bias"], report["params"]
