#!/usr/bin/env python
"""transformers' models against Megatron-core's GPTModel configured as the same architecture: do the weights cross,
and do the two runs align, with no map written by hand? Prints a table; asserts nothing.

    python tools/sweep_megatron.py                 # every architecture below (a few minutes on 2 cores)
    python tools/sweep_megatron.py llama qwen3     # these
    python tools/sweep_megatron.py --json out.json # also save the figures (read by tools/bench_pages.py)

For each type, in a fresh interpreter: the transformers model is built from ``sweep_hf``'s tiny config (hidden 32,
2 layers, 4 heads, 2 key-value heads, head dim 8; eager attention); a GPTModel with the local (no Transformer
Engine) layer spec is configured from that config as Megatron-Bridge configures one (``MEGATRON``: query-key-value
biases, query-key norms, experts; LayerNorm, linear biases, MLPs that are not gated, partial rotary, learned
positions) on one CPU rank (gloo); every bias and norm weight of the transformers model is moved off its initial
zero or one (a bias lost or left unadded would not show otherwise), and the Megatron model's weights are set with
``layerdiff.checkpoints.transfer.transfer_weights`` from the transformers model (names, fused ``linear_qkv`` and
``linear_fc1``, layouts: matched by layerdiff, no map). One step each: forward on 2 x 12 tokens, cross entropy of
each position against the next token, backward, traced in full mode. Checks:

- **weights**: every parameter set, and set back into a fresh transformers model bit for bit equal;
- **logits**: the ground truth, outside layerdiff: the two models' untraced logits agree (within 1e-4 of their
  largest magnitude) or differ (then the checks below must report the divergence and the defect checks are
  left out);
- **clean** / **ops clean** / **stats clean**: the two runs align, module by module, then with every operation
  recorded, then traced in ``stats`` mode (statistics only);
- **defect** / **ops defect** / **stats defect**: the Megatron run with its second layer's ``linear_proj`` weight
  scaled by 1 + 1e-3: the forward origin must be transformers' ``model.layers.1.self_attn.o_proj`` (``TARGET_HF``:
  where it is named otherwise).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import sweep_hf  # noqa: E402
import sweep_paddleformers  # noqa: E402

TITLE = "transformers architectures against Megatron-core's GPTModel"
METHOD = ("For each architecture, one interpreter: transformers' model from sweep_hf's tiny config (hidden 32, 2 "
          "layers, 4 heads, 2 key-value heads, head dim 8, vocabulary 128; eager attention), and a Megatron-core "
          "GPTModel (local layer spec, no Transformer Engine, fp32, one CPU rank over gloo) configured from that "
          "config as Megatron-Bridge configures the architecture (query-key-value biases, query-key norms, "
          "experts; LayerNorm, linear biases, an MLP that is not gated, rotary over part of each head, learned "
          "positions). Every bias and norm weight of the transformers model is moved off its initial zero or one "
          "(0.1 x N(0, 1) added). The weights go from transformers to Megatron and back with transfer_weights (names, fused "
          "linear_qkv and linear_fc1, layouts matched by layerdiff, no map). One step each: forward on 2 x 12 "
          "tokens, cross entropy of each position against the next token, backward, traced in full mode. weights: "
          "every parameter set, and set back bit for bit equal. logits: the untraced logits agree (max abs diff "
          "within 1e-4 of their largest magnitude) or differ. clean: the two runs align; defect: the Megatron run "
          "with its second layer's linear_proj weight scaled by 1 + 1e-3 must be named at transformers' "
          "model.layers.1.self_attn.o_proj; ops: the same with every operation recorded.")
# model type -> what Megatron-Bridge sets for it beyond a Llama (``recipes/megatron_like_hf.py``: TransformerConfig and
# layer-spec options; experts come from the config)
MEGATRON = {"llama": {}, "mistral": {}, "qwen2": {"add_qkv_bias": True}, "qwen3": {"qk_layernorm": True},
            "mixtral": {}, "qwen2_moe": {"add_qkv_bias": True}, "qwen3_moe": {"qk_layernorm": True},
            # q, k and v back to back in one qkv_proj, laid out anew per query group
            "phi3": {},
            # LayerNorm, biases, a gelu MLP that is not gated (c_fc, c_proj)
            "starcoder2": {"normalization": "LayerNorm", "add_bias_linear": True, "gated_linear_unit": False},
            # LayerNorm, rotary over a quarter of each head
            "stablelm": {"normalization": "LayerNorm"},
            # one query_key_value per head, LayerNorm, biases, gelu; rotary over a quarter of each head
            "gpt_neox": {"normalization": "LayerNorm", "add_bias_linear": True, "gated_linear_unit": False,
                         "mha": True},
            # Conv1D ([in, out]) weights, one c_attn [q; k; v], learned positions, LayerNorm, biases, gelu
            "gpt2": {"normalization": "LayerNorm", "add_bias_linear": True, "gated_linear_unit": False,
                     "position_embedding_type": "learned_absolute", "mha": True},
            # StarCoder 1 (GPT-BigCode): as GPT-2 with plain linears and one key-value head in c_attn
            "gpt_bigcode": {"normalization": "LayerNorm", "add_bias_linear": True, "gated_linear_unit": False,
                            "position_embedding_type": "learned_absolute", "num_query_groups": 1}}
# what the transformers model is given beyond sweep_hf's tiny config: the layer as Megatron's, one residual after
# the other (GPT-NeoX adds attention and MLP to one residual by default)
HF_OVERRIDES = {"gpt_neox": {"use_parallel_residual": False}}
CHECKS = ("weights", "logits", "clean", "defect", "ops clean", "ops defect", "stats clean", "stats defect")
# how each pair of checks traces: (prefix of the checks' names, operations recorded, mode)
TRACINGS = (("", False, "full"), ("ops ", True, "full"), ("stats ", False, "stats"))
TARGET = ("decoder.layers.1.self_attention.linear_proj", "model.layers.1.self_attn.o_proj")  # Megatron's, HF's
TARGET_HF = {"gpt_neox": "gpt_neox.layers.1.attention.dense", "gpt2": "transformer.h.1.attn.c_proj",
             "gpt_bigcode": "transformer.h.1.attn.c_proj"}  # named otherwise
TIMEOUT_S = 300


def checks(model_type: str, work: Path) -> dict:
    """Both models in this interpreter (torch alone); the checks' results."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import layerdiff
    from layerdiff.api import align
    from layerdiff.checkpoints.transfer import neutral_state, transfer_weights
    from layerdiff.recipes import megatron_like_hf

    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))

    def loss_of(logits):
        logits = logits.float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def hf_step(model) -> None:
        loss_of(model(input_ids=ids, use_cache=False).logits).backward()

    def mg_step(model) -> None:
        loss_of(megatron_like_hf.logits(model, ids)).backward()

    built = sweep_hf.tiny_model(model_type, hf_step, attempts=sweep_hf.ATTEMPTS[:1], _attn_implementation="eager",
                                **HF_OVERRIDES.get(model_type, {}))
    if isinstance(built, str):
        return {"not_run": f"transformers: {built}"}
    config, hf, _, params = built
    with torch.no_grad():  # biases and norms start as zeros and ones: a bias lost or left unadded would not show
        noise = torch.Generator().manual_seed(2)
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=noise))
    options = dict(MEGATRON[model_type])
    if options.pop("mha", False):  # no query groups (the tiny config's key-value heads are not read)
        options["num_query_groups"] = config.num_attention_heads
    try:
        megatron = megatron_like_hf.build(config, ids.shape, **options)
        sent = transfer_weights(hf, megatron)
        mg_step(megatron)
    except Exception as exc:  # noqa: BLE001 - the weights did not cross, or Megatron does not run it: reported
        return {"not_run": f"megatron: {sweep_hf._error(exc)}"}
    megatron.zero_grad(set_to_none=True)
    result: dict = {"params": params}
    back = AutoModelForCausalLM.from_config(config)
    transfer_weights(megatron, back)
    before, after = neutral_state(hf), neutral_state(back)
    differ = [n for n in before if n not in after or not np.array_equal(before[n][0], after[n][0])]
    result["weights"] = "ok" if not differ and len(before) == len(after) and sent else \
        f"{len(differ)} of {len(before)} differ after the round trip (e.g. {differ[:2]})"
    with torch.no_grad():
        a = hf(input_ids=ids, use_cache=False).logits.float().numpy()
        b = megatron_like_hf.logits(megatron, ids).float().numpy()
    np.save(work / "logits_a.npy", a)
    np.save(work / "logits_b.npy", b)
    result["logits"] = sweep_paddleformers._logits(work)
    for prefix, ops, mode in TRACINGS:
        name = prefix.strip() or "modules"
        reference = work / f"hf_{name}.h5"
        with layerdiff.trace(hf, reference, ops=ops, mode=mode):
            hf_step(hf)
        hf.zero_grad(set_to_none=True)
        for check in ("clean", "defect"):
            if check == "defect" and not result["logits"].startswith("agree"):
                result[prefix + check] = "-"  # the two already differ: no planted defect to single out
                continue
            try:
                candidate = megatron_like_hf.build(config, ids.shape, **options)
                transfer_weights(hf, candidate)
                if check == "defect":
                    with torch.no_grad():
                        candidate.get_submodule(TARGET[0]).weight.mul_(1 + 1e-3)
                path = work / f"mg_{name}_{check}.h5"
                with layerdiff.trace(candidate, path, ops=ops, mode=mode):
                    mg_step(candidate)
                result[prefix + check] = sweep_paddleformers._verdict(check, align(reference, path).data,
                                                                      TARGET_HF.get(model_type, TARGET[1]),
                                                                      result["logits"])
            except Exception as exc:  # noqa: BLE001 - layerdiff failed on this architecture: the finding
                result[prefix + check] = f"error: {sweep_hf._error(exc)}"
    return result


def worker(model_type: str, out: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    result: dict = {"type": model_type}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="layerdiff-sweep-mg-") as work:
            result.update(checks(model_type, Path(work)))
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the sweep goes on
        result["not_run"] = sweep_hf._error(exc)
    finally:
        result["seconds"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result))


def run_type(model_type: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="layerdiff-sweep-mg-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            done = subprocess.run([sys.executable, __file__, "--worker", model_type, str(out)],
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"type": model_type, "not_run": f"over {TIMEOUT_S} s"}
        if out.exists() and out.read_text():
            return json.loads(out.read_text())
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return {"type": model_type, "not_run": f"exit {done.returncode}: {tail[0][:160]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("types", nargs="*", help=f"model types (default: {', '.join(MEGATRON)})")
    p.add_argument("--jobs", type=int, default=2, help="architectures at once (default 2)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    types = args.types or list(MEGATRON)
    run = benchlib.BenchRun("sweep_megatron", TITLE, METHOD, packages=("numpy", "torch", "transformers",
                                                                       "megatron-core"))
    results = sweep_hf.run_all(types, run_type, args.jobs, CHECKS)
    ran = [r for r in results if "not_run" not in r]
    same = [r for r in ran if r.get("logits", "").startswith("agree")]
    passed = {check: sum(r.get(check) == "ok" for r in same) for check in CHECKS if check != "logits"}
    headline = (f"{len(ran)} of {len(results)} architectures ran as a Megatron-core GPTModel; {len(same)} compute "
                f"transformers' logits: " + ", ".join(f"{check} {n}/{len(same)}" for check, n in passed.items()))
    print(headline)
    if args.json:
        sweep_hf.write_results(run, args.json, bool(args.types), headline, CHECKS, results,
                               "Megatron could not take it", passed=passed, same_logits=len(same))
    return 0


if __name__ == "__main__":
    sys.exit(main())
