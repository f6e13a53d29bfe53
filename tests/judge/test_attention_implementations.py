"""Eager attention against SDPA, with every operation recorded, across Hugging Face architectures: a fused operation
on one side against its steps on the other, and the families' own code (GQA, query/key/value biases, partial rotary
embeddings, parallel residuals, a norm with 1 added to its weight, mixture of experts, cross-attention). Clean
pairs align, with no false alarm.

Real models built from configs (nothing downloaded), in eval mode (no dropout: the two attentions are the same
computation).
"""
from __future__ import annotations

import pytest

from conftest import align_files

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # real models traced

DECODER = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHITECTURES = {  # model type -> what it adds to the config
    "llama": {}, "qwen2": {}, "gemma": {"head_dim": 8}, "gpt_neox": {}, "phi": {},
    "mixtral": {"num_local_experts": 4}, "bart": None}


def _model(arch: str, attn: str):
    torch.manual_seed(0)
    if arch == "bart":
        config = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64)
        return transformers.BartForConditionalGeneration._from_config(config, attn_implementation=attn).eval()
    config = transformers.AutoConfig.for_model(arch, **DECODER, **ARCHITECTURES[arch])
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_eager_against_sdpa_with_operations_recorded_is_aligned(tmp_path, arch):
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    for attn in ("eager", "sdpa"):
        model = _model(arch, attn)
        with layerdiff.trace(model, tmp_path / f"{attn}.h5", ops=True):
            model(input_ids=ids, labels=ids).loss.backward()
    report = align_files(tmp_path / "eager.h5", tmp_path / "sdpa.h5")
    assert report["verdict"] == "aligned", (report["forward"]["first_divergence"],
                                            report["backward"]["first_divergence"])
    ops = [r for r in report["records"] if r["kind"] == "op" and r["phase"] == "forward"]
    assert len(ops) > 50  # operations were recorded and paired in both
