"""Hugging Face architectures of every kind, built from configs (nothing downloaded): tied weights (GPT-2, T5),
cross-attention (T5), an encoder (BERT), vision (ViT), mixture of experts (Mixtral). Each is traced clean and with
one perturbed module; align names that module. T5 also covers the two failures of one-sided evidence: a mask given
to one run only, and a gradient defect in one user of a tied weight."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402

from conftest import align_files, run_cli  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _ids(vocab, shape, seed):
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _lm(cls, cfg):
    model = cls(cfg)
    ids = _ids(cfg.vocab_size, (2, 12), 1)
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _t5(cfg, mask=False):
    model = transformers.T5ForConditionalGeneration(cfg)
    ids, labels = _ids(cfg.vocab_size, (2, 10), 1), _ids(cfg.vocab_size, (2, 6), 2)
    attention = torch.ones(2, 10, dtype=torch.long)
    attention[1, 7:] = 0
    extra = {"attention_mask": attention} if mask else {}
    return model, lambda: model(input_ids=ids, labels=labels, **extra).loss


def _vit(cfg):
    model = transformers.ViTForImageClassification(cfg)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2])
    return model, lambda: model(pixel_values=pixels, labels=labels).loss


def _bert(cfg):
    model = transformers.BertForMaskedLM(cfg)
    ids = _ids(cfg.vocab_size, (2, 12), 1)
    return model, lambda: model(input_ids=ids, labels=ids).loss


T5 = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
          relative_attention_num_buckets=8, dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0)
MODELS = {
    "gpt2": (lambda: _lm(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), "transformer.h.1.mlp.c_fc"),
    "bert": (lambda: _bert(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), "bert.encoder.layer.1.attention.self.key"),
    "vit": (lambda: _vit(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, image_size=32,
        patch_size=8, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "vit.layers.1.mlp.fc1"),
    "mixtral": (lambda: _lm(transformers.MixtralForCausalLM, transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2)), "model.layers.1.mlp.experts"),
    "t5": (lambda: _t5(transformers.T5Config(**T5)), "decoder.block.1.layer.1.EncDecAttention.k"),
}


def _trace(path, make, defect_path=None, seed=0):
    torch.manual_seed(seed)
    model, loss = make()
    model.eval()  # dropout off; gradients still recorded
    if defect_path:
        module = model.get_submodule(defect_path)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.mul_(1 + 1e-3)
    with layerdiff.trace(model, path):
        loss().backward()
    return path


@pytest.mark.parametrize("arch", list(MODELS))
def test_architecture_aligns_clean_and_names_a_perturbed_module(tmp_path, arch):
    make, defect_path = MODELS[arch]
    ref = _trace(tmp_path / "a.h5", make)
    assert align_files(ref, _trace(tmp_path / "b.h5", make))["verdict"] == "aligned"
    report = align_files(ref, _trace(tmp_path / "bad.h5", make, defect_path))
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == defect_path, origin["description"]
    assert origin["param_diffs"], "the perturbed weight is shown at the origin"


def _t5_with_embedding_grad_defect():
    model, loss = _t5(transformers.T5Config(**T5))
    embed = model.encoder.embed_tokens  # shares its weight with model.shared, decoder.embed_tokens and lm_head

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight):
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.01

    embed.forward = lambda ids: torch.nn.functional.embedding(ids, ScaleGrad.apply(embed.weight))
    return model, loss


def test_tied_weight_is_recorded_under_every_owner_and_a_gradient_defect_in_one_user_is_named(tmp_path):
    ref = _trace(tmp_path / "a.h5", lambda: _t5(transformers.T5Config(**T5)))
    from layerdiff.tracefile.reader import open_trace

    with open_trace(ref) as reader:
        owners = {r.path for r in reader.records if r.kind == "param" and r.tied}
        uses = {r.module for r in reader.records if r.kind == "param_grad_use"}
    assert owners == {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    assert uses == {"encoder.embed_tokens", "decoder.embed_tokens", "lm_head"}  # model.shared itself never runs
    bad = _trace(tmp_path / "bad.h5", _t5_with_embedding_grad_defect)
    report = align_files(ref, bad)
    assert report["forward"]["status"] == "aligned"
    assert report["backward"]["first_divergence"]["module"] == "encoder.embed_tokens"
    assert report["params"]["grad_uses_differ"] == ["encoder.embed_tokens (call 0)"]


def test_mask_given_to_one_run_only_is_a_difference_of_the_inputs(tmp_path):
    ref = _trace(tmp_path / "a.h5", lambda: _t5(transformers.T5Config(**T5)))
    masked = _trace(tmp_path / "b.h5", lambda: _t5(transformers.T5Config(**T5), mask=True))
    origin = align_files(ref, masked)["forward"]["first_divergence"]
    assert origin["module"] == "" and origin["where"] == "inputs"
    assert origin["tensor"]["key"] == "kwargs.attention_mask" and "run B only" in origin["tensor"]["reason"]


T5_TARGET = """
import sys
sys.path[:0] = PATHS  # this test file's folder and the conftest's it imports
import torch, transformers
import test_hf_models as t

def build(variant="clean"):
    torch.manual_seed(0)
    make = {"clean": lambda: t._t5(transformers.T5Config(**t.T5)),
            "mask": lambda: t._t5(transformers.T5Config(**t.T5), mask=True),
            "embgrad": t._t5_with_embedding_grad_defect}[variant]
    model, loss = make()
    model.eval()
    return model, lambda: loss().backward()
"""


def test_bisect_is_not_fooled_by_one_sided_inputs_or_tied_weights(tmp_path):
    from pathlib import Path

    target = tmp_path / "t5_target.py"
    here = Path(__file__).resolve().parent
    target.write_text(T5_TARGET.replace("PATHS", repr([str(here), str(here.parent)])))
    tests_dir = str(here)
    code, _, err = run_cli("trace", f"{target}:build", "-o", tmp_path / "ref.h5", "-q", cwd=tests_dir)
    assert code == 0, err
    code, out, err = run_cli("bisect", tmp_path / "ref.h5", f"{target}:build", "--arg", "variant=mask", "-q",
                             "--workdir", tmp_path / "w1", cwd=tests_dir)
    assert code == 1 and "forward <root>: the runs were given different inputs" in out, out + err
    code, out, err = run_cli("bisect", tmp_path / "ref.h5", f"{target}:build", "--arg", "variant=embgrad", "-q",
                             "--workdir", tmp_path / "w2", cwd=tests_dir)
    assert code == 1 and "forward no own error; backward weight gradient of encoder.embed_tokens" in out, out + err
