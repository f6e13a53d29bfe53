"""Operations of two formulations paired on what really says they are one: equal statistics pair operations of
other kinds only where the values are floating, not all equal, and laid out in related shapes.

Found by ``tools/sweep_paddleformers.py``: PaddleFormers computes the rotary embedding over the whole batch (the
inverse frequencies expanded to it, ``@`` the positions, transposed), where transformers computes it once
(positions times frequencies, ``cat``). transformers' ``cat`` of one batch held the same values, in another order,
as the port's ``matmul`` over two, was paired with it, and compared flattened: a weight perturbed in the second
layer was reported as born in the rotary embedding. Here the port's formulation is written in torch (a port of
the model's code, run by transformers' own Llama), and the masks a port builds by assignment are a model of their
own.
"""
from __future__ import annotations

import types

import pytest

from conftest import align_files, run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402

pytestmark = [pytest.mark.torch]


def batch_rotary(self, x, position_ids):
    """PaddleFormers' rotary embedding (``LlamaRotaryEmbedding.forward``), written in torch: the inverse
    frequencies expanded to the batch, a matmul with the positions, transposed."""
    position_ids = position_ids.expand(x.shape[0], -1)  # the port's positions: one row per sequence
    inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    positions = position_ids[:, None, :].float()
    freqs = (inv_freq.float() @ positions.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def positions_times_frequencies(self, x, position_ids):
    """transformers' Gemma 3 rotary embedding (``Gemma3RotaryEmbedding.forward``), written for this Llama: the
    positions (integers made floats) times the inverse frequencies (floats made floats), no matmul."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _llama():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _traced(path, port: bool, perturbed: bool = False):
    model = _llama()
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    if port:
        rotary = model.model.rotary_emb
        rotary.forward = types.MethodType(batch_rotary, rotary)
    if perturbed:
        with torch.no_grad():
            model.model.layers[1].self_attn.q_proj.weight.mul_(1 + 1e-3)
    with layerdiff.trace(model, path, ops=True):
        model(input_ids=ids, labels=ids).loss.backward()
    return path


@pytest.fixture(scope="module")
def rotary_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rotary")
    return {name: _traced(root / f"{name}.h5", port, perturbed)
            for name, port, perturbed in (("hf", False, False), ("port", True, False), ("bad", True, True))}


@pytest.mark.slow
def test_a_rotary_embedding_computed_over_the_batch_aligns_operation_by_operation(rotary_runs):
    report = align_files(rotary_runs["hf"], rotary_runs["port"])
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    rotary = [r for r in report["records"] if r["kind"] == "op" and r["path"] == "model.rotary_emb"
              and r["phase"] == "forward"]
    assert ("cat", "cat") in {(r["op"]["kind"], r["op_b"]["kind"]) for r in rotary}
    assert ("cat", "matmul") not in {(r["op"]["kind"], r["op_b"]["kind"]) for r in rotary}


@pytest.mark.slow
def test_a_weight_perturbed_behind_that_rotary_embedding_is_named_where_it_is(rotary_runs):
    report = align_files(rotary_runs["hf"], rotary_runs["bad"])
    origin = report["forward"]["first_divergence"]
    assert origin["module"] == "model.layers.1.self_attn.q_proj", origin["description"]


class Masked(torch.nn.Module):
    """Attention scores masked causally and to a window; the mask built as transformers builds it (``&`` of a
    triangle and a band) or as a port does (rows assigned into zeros, ``__setitem__``)."""

    def __init__(self, by_rows: bool):
        super().__init__()
        self.by_rows = by_rows
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        n = x.shape[1]
        if self.by_rows:
            causal = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                causal[i, : i + 1] = True
        else:
            causal = torch.ones(n, n, dtype=torch.bool).tril()
        band = torch.ones(n, n, dtype=torch.bool).triu(-3)
        keep = causal & band
        h = self.proj(x)
        scores = (h @ h.transpose(1, 2)).masked_fill(~keep, float("-inf"))
        return scores.softmax(-1) @ h


def test_masks_built_two_ways_are_not_paired_on_their_counts_of_true(tmp_path):
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    for name, by_rows in (("and", False), ("rows", True)):
        torch.manual_seed(0)
        model = Masked(by_rows)
        with layerdiff.trace(model, tmp_path / f"{name}.h5", ops=True):
            model(x).sum().backward()
    report = align_files(tmp_path / "and.h5", tmp_path / "rows.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    pairs = {(r["op"]["kind"], r["op_b"]["kind"]) for r in report["records"] if r["kind"] == "op"}
    assert not any(a != b and "setitem" in (a, b) for a, b in pairs), pairs


def test_frequencies_that_differ_are_named_at_their_cast_in_both_formulations(tmp_path):
    """Found by ``tools/sweep_paddleformers.py`` (Gemma 3, gpt-oss): transformers multiplies the positions by the
    inverse frequencies, PaddleFormers takes a matmul of both, and its frequencies are other values (built from the
    config otherwise). Both runs cast the positions (integers) and the frequencies (floats) to float: the
    frequencies' casts are paired, and named, not a cast of the positions against a cast of the frequencies
    (which had been named, and called inputs that agree)."""
    import inspect

    runs = {}
    for name, formulation, scale in (("mul", positions_times_frequencies, 1.0), ("matmul", batch_rotary, 1.01)):
        model = _llama()
        rotary = model.model.rotary_emb
        rotary.forward = types.MethodType(formulation, rotary)
        rotary.inv_freq.mul_(scale)  # another rotary base: other frequencies
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        with layerdiff.trace(model, tmp_path / f"{name}.h5", ops=True):
            model(input_ids=ids, labels=ids).loss.backward()
        runs[name] = tmp_path / f"{name}.h5"
    origin = align_files(runs["mul"], runs["matmul"])["forward"]["first_divergence"]
    op = origin["op"]
    lines, first = inspect.getsourcelines(positions_times_frequencies)
    line_a = first + next(i for i, text in enumerate(lines) if "self.inv_freq.to(" in text)
    assert origin["module"] == "model.rotary_emb" and op["kind"] == "to", origin["description"]
    assert op["source"].endswith(f"test_op_pairing_evidence.py:{line_a}"), op
    path_b, _, line_b = op["source_b"].rpartition(":")
    text_b = open(path_b).read().splitlines()[int(line_b) - 1]
    assert op["name_b"] == "Tensor.float" and "inv_freq" in text_b, (op, text_b)
    # the frequencies come from operations only B runs (its expand to the batch): their inputs are not called agreed
    code, out, _ = run_cli("align", runs["mul"], runs["matmul"])
    assert code == 1 and "inputs agree where they pair (input:args.0 has no counterpart in B)" in out, out
