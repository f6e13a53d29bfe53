"""`layerdiff weights diff`: checkpoint readers, Megatron merging, diff metrics, refusal of unsafe pickles."""
import argparse
import json
import os
import pickle
import textwrap

import numpy as np
import pytest

from layerdiff import checkpoints
from layerdiff.checkpoints import diff, file_digest, open_checkpoint, register, run
from layerdiff.match.rename import RenameRules
from layerdiff.errors import LayerdiffError

from conftest import run_python

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch]  # the Megatron checkpoints here are made with torch: megatron-core not needed


def _parser():
    p = argparse.ArgumentParser(prog="layerdiff")
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("weights")
    register(w.add_subparsers(dest="weights_command"), argparse.ArgumentParser)
    return p


def _run(*argv):
    return run(_parser().parse_args(["weights", "diff", *map(str, argv)]))


def _one_line(exc_info):
    msg = str(exc_info.value)
    assert msg and "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "single", safe_serialization=True)
    model.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="8KB")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(sd, root / "sd.pt")
    torch.save({"model": sd, "iteration": 3}, root / "nested.pt")
    return root, sd


def _small_weights():
    rng = np.random.default_rng(1)
    return {"fc.weight": rng.standard_normal((3, 4)).astype(np.float32),
            "fc.bias": rng.standard_normal(3).astype(np.float32),
            "norm.weight": rng.standard_normal(3).astype(np.float32),
            "norm.bias": rng.standard_normal(3).astype(np.float32)}


def _subprocess(code, tmp_path):
    r = run_python(textwrap.dedent(code), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------ HF / safetensors
def test_hf_folders_and_torch_state_dict_identical(llama, capsys):
    root, sd = llama
    sharded = root / "sharded"
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single = open_checkpoint(root / "single")
    assert set(single.names()) == set(sd)
    arr, dtype = single.load("model.norm.weight")
    assert dtype == "float32" and np.array_equal(arr, sd["model.norm.weight"].numpy())
    for other in (sharded, root / "sd.pt", root / "nested.pt"):
        rename = ["^model\\.model\\.=model.", "^model\\.lm_head=lm_head"] if other.name == "nested.pt" else []
        b = open_checkpoint(other)
        report = diff(single, b, mapping=RenameRules.parse(rename))
        s = report["__summary__"]
        assert s["compared"] == len(sd) and s["identical"] == len(sd), (other, s)
        assert not s["missing_in_b"] and not s["extra_in_b"]
    hf_bin = root / "hf_bin"
    hf_bin.mkdir()
    (hf_bin / "pytorch_model.bin").write_bytes((root / "sd.pt").read_bytes())
    assert open_checkpoint(hf_bin).format == "torch"
    assert _run(root / "single", sharded) == 0
    assert _run(hf_bin, root / "single", "-q") == 0
    out = capsys.readouterr().out
    assert "identical" in out


def test_perturbed_tensor_listed(llama, tmp_path, capsys):
    root, sd = llama
    pert = {k: v.clone() for k, v in sd.items()}
    name = "model.layers.1.mlp.down_proj.weight"
    pert[name][0, 0] += 0.5
    torch.save(pert, tmp_path / "pert.pt")
    out_json = tmp_path / "r.json"
    assert _run(root / "single", tmp_path / "pert.pt", "-o", out_json) == 1
    report = json.loads(out_json.read_text())
    e = report[name]
    assert e["max_diff"] == pytest.approx(0.5, rel=1e-6)
    assert e["l2"] == pytest.approx(0.5, rel=1e-6)
    assert 0 < e["cos"] < 1 and e["numel"] == sd[name].numel() and e["shape"] == list(sd[name].shape)
    s = report["__summary__"]
    assert s["different"] == 1 and s["identical"] == len(sd) - 1 and s["max_abs_diff"] == pytest.approx(0.5)
    assert name in capsys.readouterr().out
    with pytest.raises(LayerdiffError) as exc:  # refuses to overwrite
        _run(root / "single", tmp_path / "pert.pt", "-o", out_json)
    assert "exists" in _one_line(exc)
    assert _run(root / "single", tmp_path / "pert.pt", "-o", out_json, "--force", "-q") == 1


def test_exact_lists_every_difference(llama, tmp_path, capsys):
    root, sd = llama
    pert = {k: v + 1e-7 * (i % 2) * torch.randn_like(v) if v.is_floating_point() else v
            for i, (k, v) in enumerate(sd.items())}
    torch.save(pert, tmp_path / "tiny.pt")
    report = diff(open_checkpoint(root / "sd.pt"), open_checkpoint(tmp_path / "tiny.pt"), exact=True)
    changed = [k for k in sd if not torch.equal(sd[k], pert[k])]
    assert len(changed) >= 8
    assert sorted(k for k, v in report.items() if k != "__summary__" and v["status"] == "different") \
        == sorted(changed)
    loose = diff(open_checkpoint(root / "sd.pt"), open_checkpoint(tmp_path / "tiny.pt"))
    assert loose["__summary__"]["different"] == len(changed)  # still "different", but flagged as close
    assert all(loose[k]["within_tolerance"] for k in changed if sd[k].abs().max() > 0.01)
    assert _run(root / "sd.pt", tmp_path / "tiny.pt", "--exact") == 1
    out = capsys.readouterr().out
    assert all(k in out for k in changed)


def test_missing_and_extra_keys(llama, tmp_path):
    root, sd = llama
    part = {k: v for k, v in sd.items() if "layers.1." not in k}
    part["extra.weight"] = torch.zeros(2)
    torch.save(part, tmp_path / "part.pt")
    s = diff(open_checkpoint(root / "sd.pt"), open_checkpoint(tmp_path / "part.pt"))["__summary__"]
    assert s["extra_in_b"] == ["extra.weight"]
    assert len(s["missing_in_b"]) == sum("layers.1." in k for k in sd)
    assert _run(root / "sd.pt", tmp_path / "part.pt", "-q") == 1


def test_npz_and_bf16(tmp_path):
    w = _small_weights()
    np.savez(tmp_path / "w.npz", **w)
    st = {k: torch.from_numpy(v) for k, v in w.items()}
    torch.save(st, tmp_path / "w.pt")
    assert _run(tmp_path / "w.npz", tmp_path / "w.pt", "-q") == 0
    torch.save({k: v.to(torch.bfloat16) for k, v in st.items()}, tmp_path / "bf.pt")
    ck = open_checkpoint(tmp_path / "bf.pt")
    assert ck.info("fc.weight") == ("bfloat16", [3, 4])
    r = diff(open_checkpoint(tmp_path / "w.npz"), ck)
    assert r["fc.weight"]["dtype_b"] == "bfloat16" and 0 < r["fc.weight"]["max_diff"] < 0.05


# -------------------------------------------------------------------------------------- paddle / mindspore
@pytest.mark.slow
@pytest.mark.paddle
@pytest.mark.mindspore
def test_paddle_and_mindspore_against_torch(tmp_path):
    w = _small_weights()
    np.savez(tmp_path / "w.npz", **w)
    torch.save({k: torch.from_numpy(v) for k, v in w.items()}, tmp_path / "w.pt")
    _subprocess("""
        import numpy as np, paddle
        w = dict(np.load("w.npz"))
        lin = paddle.nn.Linear(4, 3)               # Paddle Linear weight is [in, out]
        lin.weight.set_value(w["fc.weight"].T)
        lin.bias.set_value(w["fc.bias"])
        norm = paddle.nn.LayerNorm(3)
        norm.weight.set_value(w["norm.weight"]); norm.bias.set_value(w["norm.bias"])
        sd = {"fc." + k: v for k, v in lin.state_dict().items()}
        sd.update({"norm." + k: v for k, v in norm.state_dict().items()})
        paddle.save(sd, "w.pdparams")
    """, tmp_path)
    _subprocess("""
        import numpy as np, mindspore as ms
        w = dict(np.load("w.npz"))
        names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", "norm.weight": "norm.gamma",
                 "norm.bias": "norm.beta"}
        ms.save_checkpoint([{"name": names[k], "data": ms.Tensor(v)} for k, v in w.items()], "w.ckpt")
    """, tmp_path)
    a = open_checkpoint(tmp_path / "w.pt")
    pd = open_checkpoint(tmp_path / "w.pdparams")
    assert pd.info("fc.weight") == ("float32", [4, 3])
    r = diff(a, pd)
    assert r["fc.weight"]["transposed"] is True and r["fc.weight"]["status"] == "identical"
    assert r["__summary__"]["identical"] == 4
    # an explicit rule (needed for square Linear weights) gives the same answer
    r2 = diff(a, open_checkpoint(tmp_path / "w.pdparams"), transpose=[r"^fc\.weight$"])
    assert r2["__summary__"]["identical"] == 4
    ms_ck = open_checkpoint(tmp_path / "w.ckpt")
    assert "norm.gamma" in ms_ck.names()
    r3 = diff(a, ms_ck)
    assert r3["__summary__"]["identical"] == 4 and r3["norm.weight"]["b_name"] == "norm.gamma"
    assert _run(tmp_path / "w.pdparams", tmp_path / "w.ckpt", "-q") == 0  # both whole-loaded: A is spilled


def test_pdparams_code_payload_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"echo pwned > {marker}",)

    with open(tmp_path / "evil.pdparams", "wb") as f:
        pickle.dump({"w": np.zeros(2, np.float32), "x": Evil()}, f)
    with pytest.raises(LayerdiffError) as exc:
        open_checkpoint(tmp_path / "evil.pdparams")
    assert "refused" in _one_line(exc)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------- unsafe pickle
class _Payload:
    marker = None

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


def test_torch_code_payload_refused(tmp_path):
    marker = tmp_path / "pwned"
    p = _Payload()
    p.marker = marker
    torch.save({"w": torch.zeros(2), "evil": p}, tmp_path / "evil.pt")
    with open(tmp_path / "evil.bin", "wb") as f:  # a plain (non-zip) pickle too
        pickle.dump({"evil": p}, f)
    for name in ("evil.pt", "evil.bin"):
        with pytest.raises(LayerdiffError) as exc:
            _run(tmp_path / name, tmp_path / name)
        msg = _one_line(exc)
        assert "refused" in msg or "not a readable" in msg, msg
    assert not marker.exists()
    # end to end through a Python process: one stderr line, nothing executed
    code = ("import sys; from layerdiff.checkpoints import open_checkpoint; from layerdiff.errors import "
            "LayerdiffError\ntry: open_checkpoint(sys.argv[1])\nexcept LayerdiffError as e: "
            "print(e, file=sys.stderr); sys.exit(2)")
    r = run_python(code, tmp_path / "evil.pt")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "refused" in r.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_inputs(tmp_path, llama):
    root, _ = llama
    data = (root / "single" / "model.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:len(data) // 2])
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    (tmp_path / "garbage.safetensors").write_bytes(os.urandom(64))
    (tmp_path / "weights.xyz").write_bytes(b"hello world, not a checkpoint")
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 broken zip")
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "emptydir").mkdir()
    cases = {"trunc.safetensors": "truncated", "corrupt.safetensors": "not a safetensors",
             "garbage.safetensors": "safetensors", "weights.xyz": "unknown checkpoint format",
             "bad.pt": "PyTorch", "empty.npz": "empty", "emptydir": "no known checkpoint",
             "nothere.safetensors": "no such"}
    for name, expected in cases.items():
        with pytest.raises(LayerdiffError) as exc:
            open_checkpoint(tmp_path / name)
        assert expected in _one_line(exc), (name, str(exc.value))


# ------------------------------------------------------------------------------------------------- megatron
def _megatron_state(rng_seed=0, layers=(0,)):
    g = torch.Generator().manual_seed(rng_seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {"language_model.embedding.word_embeddings.weight": r(32, 8)}
    for i in layers:
        p = f"language_model.encoder.layers.{i}."
        sd.update({p + "input_layernorm.weight": r(8), p + "input_layernorm.bias": r(8),
                   p + "self_attention.query_key_value.weight": r(24, 8),
                   p + "self_attention.query_key_value.bias": r(24),
                   p + "self_attention.dense.weight": r(8, 8), p + "self_attention.dense.bias": r(8),
                   p + "mlp.dense_h_to_4h.weight": r(16, 8), p + "mlp.dense_h_to_4h.bias": r(16),
                   p + "mlp.dense_4h_to_h.weight": r(8, 16), p + "mlp.dense_4h_to_h.bias": r(8)})
    sd["language_model.encoder.final_layernorm.weight"] = r(8)
    return sd


def _split(sd, tp, rank):
    out = {}
    for k, v in sd.items():
        dim = checkpoints.megatron_partition_dim(k)
        out[k] = v.chunk(tp, dim=dim)[rank].clone() if dim is not None else v.clone()
    return out


def _nest(flat):
    root = {}
    for k, v in flat.items():
        head, _, rest = k.partition(".")
        root.setdefault(head, {})[rest] = v  # {"language_model": {"embedding....": t}}: nested two levels
    return root


def _save_rank(folder, sd):
    folder.mkdir(parents=True)
    import random

    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state()}]  # what Megatron saves next to the model
    torch.save({"model": _nest(sd), "args": argparse.Namespace(tensor_model_parallel_size=2),
                "iteration": 5, "checkpoint_version": 3.0, "rng_state": rng_state}, folder / "model_optim_rng.pt")


def test_megatron_tp_merge_equals_unsplit(tmp_path):
    sd = _megatron_state()
    root = tmp_path / "megatron"
    for rank in range(2):
        _save_rank(root / "iter_0000005" / f"mp_rank_{rank:02d}", _split(sd, 2, rank))
    (root / "iter_0000002").mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("5\n")
    assert checkpoints.megatron_partition_dim("x.self_attention.dense.bias") is None
    assert checkpoints.megatron_partition_dim("x.self_attention.dense.weight") == 1
    assert checkpoints.megatron_partition_dim("x.linear_qkv.layer_norm_weight") is None
    torch.save(sd, tmp_path / "full.pt")
    for path in (root, root / "iter_0000005"):
        merged = open_checkpoint(path)
        assert set(merged.names()) == set(sd)
        for k, v in sd.items():
            arr, _ = merged.load(k)
            assert np.array_equal(arr, v.numpy()), k
    report = diff(open_checkpoint(tmp_path / "full.pt"), open_checkpoint(root))
    assert report["__summary__"]["identical"] == len(sd) and report["__summary__"]["different"] == 0
    assert _run(root, tmp_path / "full.pt", "-q") == 0


def test_megatron_pp_and_tp(tmp_path):
    sd = _megatron_state(layers=(0, 1))
    it = tmp_path / "iter_0000001"
    for pp in range(2):
        stage = {k: v for k, v in sd.items() if f"layers.{1 - pp}." not in k}
        stage = {k.replace("layers.1.", "layers.0."): v for k, v in stage.items()}  # local layer numbering
        if pp == 1:
            stage.pop("language_model.embedding.word_embeddings.weight")
        else:
            stage.pop("language_model.encoder.final_layernorm.weight")
        for tp in range(2):
            _save_rank(it / f"mp_rank_{tp:02d}_{pp:03d}", _split(stage, 2, tp))
    merged = open_checkpoint(it)
    assert set(merged.names()) == set(sd)
    for k, v in sd.items():
        assert np.array_equal(merged.load(k)[0], v.numpy()), k


def test_megatron_incomplete_and_refused(tmp_path):
    sd = _megatron_state()
    it = tmp_path / "iter_0000001"
    _save_rank(it / "mp_rank_00", _split(sd, 2, 0))
    _save_rank(it / "mp_rank_02", _split(sd, 2, 1))
    with pytest.raises(LayerdiffError) as exc:
        open_checkpoint(it)
    assert "incomplete" in _one_line(exc)
    it2 = tmp_path / "iter_0000002" / "mp_rank_00"
    it2.mkdir(parents=True)
    torch.save({"model": sd, "rng_state": [{"random_rng_state": __import__("random").getstate()}],
                "opt": _Payload()}, it2 / "model_optim_rng.pt")
    with pytest.raises(LayerdiffError) as exc:
        open_checkpoint(it2.parent)
    assert "refused" in _one_line(exc)


# ---------------------------------------------------------------------------------------------------- sha256
def test_sha256(tmp_path, capsys):
    w = _small_weights()
    np.savez(tmp_path / "a.npz", **w)
    np.savez(tmp_path / "b.npz", **w)
    digest = file_digest(tmp_path / "a.npz")
    import hashlib
    assert digest == hashlib.sha256((tmp_path / "a.npz").read_bytes()).hexdigest()
    assert len(file_digest(tmp_path)) == 64
    assert _run(tmp_path / "a.npz", tmp_path / "b.npz", "--sha256") == 0
    assert digest in capsys.readouterr().out
    assert _run(tmp_path / "a.npz", tmp_path / "b.npz", "--sha256", f"{tmp_path / 'a.npz'}={digest}") == 0
    with pytest.raises(LayerdiffError) as exc:
        _run(tmp_path / "a.npz", tmp_path / "b.npz", "--sha256", f"{tmp_path / 'b.npz'}={'0' * 64}")
    assert "mismatch" in _one_line(exc)


def test_trace_params(tmp_path):
    import layerdiff
    w = _small_weights()
    model = torch.nn.Module()
    model.fc = torch.nn.Linear(4, 3)
    model.norm = torch.nn.LayerNorm(3)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
    trace_fn = getattr(layerdiff, "trace", None)
    if trace_fn is None:
        pytest.skip("no layerdiff.trace entry point")
    with trace_fn(model, tmp_path / "t.h5"):
        model.norm(model.fc(torch.randn(2, 4)))
    np.savez(tmp_path / "w.npz", **w)
    r = diff(open_checkpoint(tmp_path / "w.npz"), open_checkpoint(tmp_path / "t.h5"))
    assert r["__summary__"]["identical"] == 4, r["__summary__"]


# ------------------------------------------------------------------------------ Transformer Engine norms
def _te_state(cfg, scaled=None):
    """HF Llama weights as Megatron-core with Transformer Engine names them: each norm's weight kept in the
    linear after it (``linear_qkv.layer_norm_weight``), as Megatron-Bridge and Megatron's own checkpoints do."""
    from layerdiff.recipes import megatron_llama, llama_shared

    state = {}
    for name, value in megatron_llama.hf_to_megatron(llama_shared.weights(cfg), cfg).items():
        name = name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
        state[name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")] = torch.from_numpy(value.copy())
    if scaled:
        state[scaled] *= 1.001
    return state


def test_norms_fused_into_transformer_engine_linears_are_compared_with_the_hf_norms(tmp_path):
    from layerdiff.checkpoints import safetensors_io
    from layerdiff.recipes import llama_shared

    cfg = llama_shared.config()
    hf = llama_shared.weights(cfg)
    safetensors_io.save(tmp_path / "hf.safetensors", {k: (v, "float32") for k, v in hf.items()}, {})
    fc1_norm = "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    torch.save(_te_state(cfg, scaled=fc1_norm), tmp_path / "te.pt")

    report = checkpoints.compare_files(tmp_path / "hf.safetensors", tmp_path / "te.pt")
    summary = report.pop("__summary__")
    assert (summary["compared"], summary["missing_in_b"], summary["extra_in_b"]) == (len(hf), [], [])
    differ = {name: entry for name, entry in report.items() if entry["status"] != "identical"}
    assert list(differ) == ["model.layers.1.post_attention_layernorm.weight"]
    assert differ["model.layers.1.post_attention_layernorm.weight"]["b_name"] == fc1_norm
    assert report["model.layers.0.input_layernorm.weight"]["b_name"] == \
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"

    back = checkpoints.compare_files(tmp_path / "te.pt", tmp_path / "hf.safetensors")  # reported in TE's names
    back.pop("__summary__")
    assert [n for n, e in back.items() if e["status"] != "identical"] == [fc1_norm]
    assert back[fc1_norm]["b_name"] == "model.layers.1.post_attention_layernorm.weight"


def test_hf_model_loads_a_transformer_engine_checkpoint_bit_exactly(tmp_path):
    from layerdiff.recipes import llama_shared, torch_llama
    from layerdiff.checkpoints.transfer import load_neutral, neutral_state

    cfg = llama_shared.config()
    model = torch_llama.build_model(seed=7)[0]  # other weights, to be overwritten
    te = {name: (value.numpy(), "float32") for name, value in _te_state(cfg).items()}
    assert load_neutral(model, te) == len(llama_shared.weights(cfg))
    loaded = neutral_state(model)
    for name, value in llama_shared.weights(cfg).items():
        assert np.array_equal(loaded[name][0], value), name
