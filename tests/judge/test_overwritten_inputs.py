"""What memory held before model code wrote it makes no difference: an operation that writes all of its first argument
without reading it (an initializer, ``fill_``, ``copy_``), and a tensor allocated unwritten (``new_empty``) until it
is written itself, views of it included.

Found by tools/sweep_hf.py: transformers' BigBird switches from block-sparse to full attention inside its forward
when the sequence is short, building new attention modules there. ``nn.Linear``'s constructor takes its weight from
``torch.empty`` (whatever the memory held) and wraps it in a new ``Parameter`` (another tensor: the allocation's
``undefined`` mark did not follow it); ``nn.init.uniform_`` then overwrites it. Compared, that garbage named
``uniform_`` as the origin ("the tensor passed to torch.nn.init.uniform_ differs") instead of the perturbed weight.
"""
from __future__ import annotations

import pytest

from conftest import align_files

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layerdiff  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

pytestmark = [pytest.mark.torch]
QUERY = "bert.encoder.layer.1.attention.self.query"


def _big_bird(perturbed: bool):
    config = transformers.BigBirdConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=64, is_decoder=True,
                                        attention_type="block_sparse")
    torch.manual_seed(0)
    model = transformers.BigBirdForCausalLM(config).eval()
    if perturbed:
        with torch.no_grad():
            model.get_submodule(QUERY).weight.mul_(1 + 1e-3)
    return model


@pytest.fixture(scope="module")
def big_bird(tmp_path_factory):
    root = tmp_path_factory.mktemp("big_bird")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))  # short: full attention
    for name, perturbed in (("a", False), ("b", False), ("perturbed", True)):
        model = _big_bird(perturbed)
        with layerdiff.trace(model, root / f"{name}.h5", ops=True):
            model(input_ids=ids, labels=ids).loss.backward()
    return root


@pytest.mark.slow
def test_initializers_run_in_a_forward_mark_what_they_overwrite_undefined(big_bird):
    with open_trace(big_bird / "a.h5") as trace:
        inits = [op for op in trace.ops if op.phase == "forward" and op.name.startswith("torch.nn.init.")]
    assert inits, "BigBird builds its full-attention modules inside the forward"
    for op in inits:
        first = next(t for t in op.tensors if t.role == "input")
        assert first.undefined, (op.name, first.key)
        assert not any(t.undefined for t in op.tensors if t.role == "output")


@pytest.mark.slow
def test_modules_built_in_a_forward_neither_alarm_nor_hide_a_perturbed_weight(big_bird):
    assert align_files(big_bird / "a.h5", big_bird / "b.h5")["verdict"] == "aligned"
    origin = align_files(big_bird / "a.h5", big_bird / "perturbed.h5")["forward"]["first_divergence"]
    assert origin["module"] == QUERY, origin["description"]


MINICPM3_QUERY = "model.layers.1.self_attn.q_a_proj"


@pytest.fixture(scope="module")
def minicpm3(tmp_path_factory):
    """MiniCPM3's latent attention fills ``key_states = kv_nope.new_empty(...)`` through two slices
    (``key_states[..., :n].copy_(k_nope)``, then ``key_states[..., n:].copy_(k_rot)``); compared, the slices' and the
    half-written tensor's garbage named layer 0's slicing as the origin of a weight perturbed in layer 1."""
    root = tmp_path_factory.mktemp("minicpm3")
    config = transformers.AutoConfig.for_model(
        "minicpm3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, max_position_embeddings=64)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    for name, perturbed in (("a", False), ("b", False), ("perturbed", True)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        if perturbed:
            with torch.no_grad():
                model.get_submodule(MINICPM3_QUERY).weight.mul_(1 + 1e-3)
        with layerdiff.trace(model, root / f"{name}.h5", ops=True):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return root


@pytest.mark.slow
def test_a_tensor_written_through_its_slices_stays_undefined_until_written_itself(minicpm3):
    with open_trace(minicpm3 / "a.h5") as trace:
        ops = [op for op in trace.ops if op.phase == "forward" and op.path == "model.layers.0.self_attn"]
    start = next(i for i, op in enumerate(ops) if op.name == "Tensor.new_empty")
    slices = [op for op in ops[start:] if op.name == "Tensor.__getitem__"][:2]
    copies = [op for op in ops[start:] if op.name == "Tensor.copy_"][:2]
    assert len(slices) == 2 and len(copies) == 2
    for op in slices:  # the tensor (half-written before the second) and each slice of it: no evidence
        assert [t.undefined for t in op.tensors if t.key in ("args.0", "out")] == [True, True], op.index
    for op in copies:  # what each copy wrote: evidence
        assert not [t for t in op.tensors if t.role == "output" and t.undefined], op.index


@pytest.mark.slow
def test_a_tensor_written_through_its_slices_neither_alarms_nor_hides_a_perturbed_weight(minicpm3):
    assert align_files(minicpm3 / "a.h5", minicpm3 / "b.h5")["verdict"] == "aligned"
    origin = align_files(minicpm3 / "a.h5", minicpm3 / "perturbed.h5")["forward"]["first_divergence"]
    assert origin["module"] == MINICPM3_QUERY, origin["description"]


class _Scratch(torch.nn.Module):
    """Fills a scratch tensor it keeps (not a parameter or buffer: its producer is unknown) and adds it: what the
    scratch held before differs between the runs, what it holds after does not."""

    def __init__(self, held: float, perturbed: bool):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        if perturbed:
            with torch.no_grad():
                self.linear.weight.mul_(1 + 1e-3)
        self.scratch = torch.full((2, 4), held)
        self.source = torch.full((2, 4), 0.25)

    def forward(self, x):
        self.scratch.fill_(0.5)
        y = self.linear(x) + self.scratch
        self.scratch.copy_(self.source)
        return y * self.scratch


@pytest.mark.parametrize("held_b", [0.0, float("nan")])
def test_what_a_fill_or_copy_overwrites_is_not_compared(tmp_path, held_b):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for name, held, perturbed in (("a", 1.0, False), ("b", held_b, False), ("perturbed", held_b, True)):
        torch.manual_seed(0)
        model = _Scratch(held, perturbed)
        with layerdiff.trace(model, tmp_path / f"{name}.h5", ops=True):
            model(x).sum().backward()
    report = align_files(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report["verdict"] == "aligned", report["forward"]["first_divergence"]
    fills = [r for r in report["records"] if r["kind"] == "op" and r["op"]["name"] in ("Tensor.fill_", "Tensor.copy_")]
    assert len(fills) == 2 and all("args.0" not in [t["key"] for t in r["tensors"] if t["role"] == "input"]
                                   for r in fills)
    origin = align_files(tmp_path / "a.h5", tmp_path / "perturbed.h5")["forward"]["first_divergence"]
    assert origin["module"] == "linear", origin["description"]  # not fill_, whose scratch held another value


class _Reads(torch.nn.Module):
    """Reads a tensor it keeps (made before the trace: no producer) that differs between the runs."""

    def __init__(self, held: float):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.kept = torch.full((2, 4), held)

    def forward(self, x):
        return self.linear(x) + self.kept


def test_an_input_made_where_nothing_was_recorded_is_not_said_to_agree(tmp_path):
    """Unlike what is overwritten, what is read counts: the origin is the operation that reads it, and it does not
    claim that what made the input agrees, which nothing recorded."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for name, held in (("a", 1.0), ("b", 0.0)):
        torch.manual_seed(0)
        model = _Reads(held)
        with layerdiff.trace(model, tmp_path / f"{name}.h5", ops=True):
            model(x).sum().backward()
    origin = align_files(tmp_path / "a.h5", tmp_path / "b.h5")["forward"]["first_divergence"]
    assert origin["where"] == "op_input" and origin["op"]["name"] == "Tensor.add", origin["description"]
    assert origin["op"]["unknown_maker"] and "nothing was recorded" in origin["description"]
    assert "what made it agrees" not in origin["description"]
