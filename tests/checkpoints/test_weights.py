"""Weight transfer through the neutral safetensors form (torch side; other frameworks in their own files)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from layerdiff.checkpoints import safetensors_io  # noqa: E402
from layerdiff.errors import LayerdiffError  # noqa: E402
from layerdiff.recipes import torch_llama  # noqa: E402
from layerdiff.checkpoints.transfer import export_weights, import_weights, transfer_weights  # noqa: E402

from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.torch]


def test_transfer_between_torch_models_is_exact():
    src, dst = torch_llama.build()["model"], torch_llama.build(seed=3)["model"]
    assert not torch.equal(src.lm_head.weight, dst.lm_head.weight)
    assert transfer_weights(src, dst) == len(list(src.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))


def test_exported_file_is_standard_safetensors_and_bf16_round_trips(tmp_path):
    from safetensors.numpy import load_file

    model = torch_llama.build()["model"]
    export_weights(model, tmp_path / "w.safetensors")
    official = load_file(str(tmp_path / "w.safetensors"))
    assert np.array_equal(official["lm_head.weight"], model.lm_head.weight.detach().numpy())
    bf = torch_llama.build(dtype="bfloat16")["model"]
    export_weights(bf, tmp_path / "bf.safetensors")
    other = torch_llama.build(seed=4, dtype="bfloat16")["model"]
    import_weights(other, tmp_path / "bf.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(bf.parameters(), other.parameters()))
    with pytest.raises(LayerdiffError, match="exists"):
        export_weights(model, tmp_path / "w.safetensors")


def test_every_problem_is_listed_and_nothing_is_assigned():
    src = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    dst = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5), nn.Linear(5, 1))
    before = [p.detach().clone() for p in dst.parameters()]
    with pytest.raises(LayerdiffError) as err:
        transfer_weights(src, dst)
    message = str(err.value)
    assert "1.weight: source 1.weight has shape [2, 3], the model wants [5, 3]" in message
    assert "2.weight: no 2.weight in the source" in message and "(4 problems)" in message
    assert all(torch.equal(a, b) for a, b in zip(before, dst.parameters()))


def test_mapping_renames_parameters():
    src = nn.Sequential(nn.Linear(4, 3))

    class Renamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense1 = nn.Linear(4, 3)

    from layerdiff.match.rename import RenameRules

    dst = Renamed()
    transfer_weights(src, dst, RenameRules.parse([r"^dense1=0"]))
    assert torch.equal(dst.dense1.weight, src[0].weight)


@pytest.mark.slow
def test_cli_export_then_trace_with_those_weights(tmp_path):
    code, _, err = run_cli("weights", "export", "torch_llama", "-o", tmp_path / "w.safetensors", "--arg", "seed=11")
    assert code == 0, err
    code, _, err = run_cli("trace", "torch_llama", "-o", tmp_path / "t.h5", "--weights", tmp_path / "w.safetensors")
    assert code == 0, err
    from layerdiff.tracefile.reader import open_trace

    with open_trace(tmp_path / "t.h5") as r:
        rec = next(x for x in r.records if x.kind == "param" and x.path == "lm_head.weight")
        expected = safetensors_io.load(tmp_path / "w.safetensors")[0]["lm_head.weight"][0]
        assert np.array_equal(r.tensor(rec.tensors[0]), expected)
        assert r.meta["user"]["weights"]["parameters"] == 21


@pytest.mark.slow
def test_bad_weight_files_are_one_line_errors(tmp_path):
    import pickle

    (tmp_path / "p.safetensors").write_bytes(pickle.dumps({"w": 1}))
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    for bad in ("p.safetensors", "short.safetensors", "missing.safetensors"):
        code, _, err = run_cli("trace", "torch_llama", "-o", tmp_path / "t.h5", "--weights", tmp_path / bad)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (bad, err)
        assert not (tmp_path / "t.h5").exists()


def test_a_bad_weights_file_is_refused_before_the_model_is_built(tmp_path):
    """``trace --weights`` reads the file first: a bad one fails in a fraction of a second, not after the
    framework is imported and the model built."""
    target = tmp_path / "boom.py"
    target.write_text("def build():\n    raise RuntimeError('the model was built')\n")
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    code, _, err = run_cli("trace", f"{target}:build", "-o", tmp_path / "t.h5", "--weights",
                           tmp_path / "short.safetensors")
    assert code == 2 and "short.safetensors" in err and "the model was built" not in err, err
    assert not (tmp_path / "t.h5").exists()
