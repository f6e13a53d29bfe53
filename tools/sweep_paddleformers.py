#!/usr/bin/env python
"""Every causal-LM architecture that the installed PaddleFormers ships, against the transformers model of the same
type: do the weights cross, and do the two runs align, with no map written by hand? Prints a table; asserts nothing.

    python tools/sweep_paddleformers.py                 # every architecture (a few minutes on 2 cores)
    python tools/sweep_paddleformers.py llama qwen3     # these
    python tools/sweep_paddleformers.py --json out.json # also save the figures (read by tools/bench_pages.py)

For each type, two fresh interpreters (torch and Paddle never share one): the transformers model is built from the
tiny config ``sweep_hf`` makes (hidden 32, 2 layers, ...; eager attention), its weights exported with
``layerdiff.checkpoints.transfer.export_weights`` (safetensors), and it is traced: one forward on 2 x 12 tokens,
cross entropy of each position against the next token, backward. The PaddleFormers model is built from the same
config (its own config class, from the same dictionary), the weights imported with ``import_weights`` (names and
layouts matched by layerdiff, no map) and it runs the same step, traced. Checks:

- **weights**: every parameter imported, exported back and imported into transformers again bit for bit equal
  (the parity workflow's first level);
- **logits**: the ground truth, outside layerdiff: the two models' untraced logits agree (within 1e-4 of their
  largest magnitude) or differ. Where they differ the two are not the same model (a port that reads the config
  otherwise): **clean** must then report the divergence (its origin is printed, to be read), and the defect checks
  are left out;
- **clean**: the two runs align (module level; then **ops clean** with every operation recorded);
- **defect**: the Paddle run with the weight of the second layer's first weight matrix (the one ``sweep_hf``
  picks on the torch side, found by name) scaled by 1 + 1e-3: the forward origin must be that module
  (**ops defect**: with operations).

A pair that cannot be built or run untraced on one side is counted apart ("not run", with that side's error): the
tiny config's limit or the port's, not layerdiff's.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import sweep_hf  # noqa: E402

TITLE = "Every PaddleFormers causal-LM architecture against transformers"
METHOD = ("Each causal-LM model type that the installed PaddleFormers ships and transformers also registers: the "
          "transformers model built from sweep_hf's tiny config (hidden 32, 2 layers, 4 heads, 2 key-value heads, "
          "vocabulary 128, other sizes over 64 set to 32, experts 4 with 2 a token; eager attention), in one "
          "interpreter; the PaddleFormers model from the same config dictionary (its own config class), in "
          "another. The weights go across through safetensors (export_weights, import_weights: names and layouts "
          "matched by layerdiff, no map). One step each: forward on 2 x 12 tokens, cross entropy of each position "
          "against the next token, backward, traced in full mode. weights: every parameter imported, exported "
          "back and imported into transformers again, bit for bit equal. logits: the untraced logits of the two "
          "agree (max abs diff within 1e-4 of their largest magnitude) or differ: then the two are not the same "
          "model, the report must say so, and the defect checks are left out. clean: the two runs align; defect: the Paddle run with the weight of the second "
          "layer's first weight matrix (sweep_hf's choice on the torch side, by name) scaled by 1 + 1e-3 must be "
          "the forward origin; ops: the same with every operation recorded. 'not run': one side could not build "
          "or run the model untraced.")
CHECKS = ("weights", "logits", "clean", "defect", "ops clean", "ops defect")
TIMEOUT_S = 300
# what a port's config needs beyond transformers' dictionary to build the same model: PaddleFormers' ERNIE 4.5 MoE
# adds a multi-token-prediction block by default, which transformers' model does not have
PORT_CONFIG = {"ernie4_5_moe": {"num_nextn_predict_layers": 0}}


def paddleformers_types() -> list[str]:
    """The model types PaddleFormers ships a causal LM for, read from its package (not imported here: the parent
    process stays free of both frameworks)."""
    spec = importlib.util.find_spec("paddleformers")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "transformers"
    return sorted(d.name for d in root.iterdir()
                  if d.name != "auto" and (d / "modeling.py").exists() and "ForCausalLM(" in (d / "modeling.py").read_text())


# -- the torch side ------------------------------------------------------------------------------------------

def torch_side(model_type: str, work: Path) -> dict:
    """The transformers model: its config, weights, inputs and untraced logits to ``work``; its traces (``hf.h5``,
    ``hf_ops.h5``)."""
    import numpy as np
    import torch

    import layerdiff
    from layerdiff.checkpoints.transfer import export_weights

    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))

    def step(model) -> None:
        logits = model(input_ids=ids, use_cache=False).logits.float()
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                          ids[:, 1:].reshape(-1)).backward()

    # eager attention: PaddleFormers' default, so that both sides run the same attention code path
    built = sweep_hf.tiny_model(model_type, step, _attn_implementation="eager")
    if isinstance(built, str):
        return {"not_run": f"torch: {built}"}
    config, model, ran, params = built
    (work / "config.json").write_text(json.dumps(config.to_dict(), default=str))
    np.save(work / "ids.npy", ids.numpy())
    with torch.no_grad():
        np.save(work / "logits_a.npy", model(input_ids=ids, use_cache=False).logits.float().numpy())
    export_weights(model, work / "weights.safetensors", overwrite=True)
    for name, ops in (("hf", False), ("hf_ops", True)):
        with layerdiff.trace(model, work / f"{name}.h5", ops=ops):
            step(model)
        model.zero_grad(set_to_none=True)
    return {"params": params, "target": sweep_hf._target(model, ran)}


def torch_back(model_type: str, work: Path) -> dict:
    """The weights' way back: the Paddle model's export (``back.safetensors``) imported into a transformers model
    of the same config, exported again: bit for bit the weights that went out?"""
    import numpy as np
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from layerdiff.checkpoints.transfer import export_weights, import_weights, read_weights

    config = CONFIG_MAPPING[model_type].from_dict(json.loads((work / "config.json").read_text()))
    model = AutoModelForCausalLM.from_config(config)
    import_weights(model, work / "back.safetensors")
    export_weights(model, work / "again.safetensors", overwrite=True)
    sent, again = read_weights(work / "weights.safetensors"), read_weights(work / "again.safetensors")
    differ = [n for n in sent if n not in again or not np.array_equal(sent[n][0], again[n][0])]
    return {"weights": "ok" if not differ and len(again) == len(sent) else
            f"{len(differ)} of {len(sent)} differ after the round trip (e.g. {differ[:2]})"}


# -- the Paddle side -----------------------------------------------------------------------------------------

def paddle_side(model_type: str, work: Path, target: str | None) -> dict:
    """The PaddleFormers model from the same config and weights: its traces, clean and with ``target`` perturbed."""
    import huggingface_hub

    if not hasattr(huggingface_hub, "repo_type_and_id_from_hf_id"):
        # gone in huggingface_hub 2.x; paddleformers 1.0 imports it at load time (only its push-to-hub code calls it)
        huggingface_hub.repo_type_and_id_from_hf_id = None
    import importlib

    import numpy as np
    import paddle
    from paddleformers.transformers.auto.configuration import CONFIG_MAPPING

    import layerdiff
    from layerdiff.checkpoints.transfer import export_weights, import_weights

    module = importlib.import_module(f"paddleformers.transformers.{model_type}")
    classes = [getattr(module, n) for n in dir(module) if n.endswith("ForCausalLM")]
    config = CONFIG_MAPPING[model_type].from_dict({**json.loads((work / "config.json").read_text()),
                                                   **PORT_CONFIG.get(model_type, {})})
    config._attn_implementation = "eager"
    ids = paddle.to_tensor(np.load(work / "ids.npy"))

    def build():
        paddle.seed(0)
        model = classes[0](config)
        model.eval()
        import_weights(model, work / "weights.safetensors")
        return model

    def step(model) -> None:
        logits = model(input_ids=ids, use_cache=False, return_dict=True).logits.astype("float32")
        paddle.nn.functional.cross_entropy(logits[:, :-1].reshape([-1, logits.shape[-1]]),
                                           ids[:, 1:].reshape([-1])).backward()

    result: dict = {}
    try:
        model = build()
        step(model)
    except Exception as exc:  # noqa: BLE001 - reported: the weights did not cross, or the port does not run
        result["not_run"] = f"paddle: {sweep_hf._error(exc)}"
        return result
    with paddle.no_grad():
        logits = model(input_ids=ids, use_cache=False, return_dict=True).logits.astype("float32")
    np.save(work / "logits_b.npy", logits.numpy())
    export_weights(model, work / "back.safetensors", overwrite=True)
    for ops in (False, True):
        for defect in (False, True):
            name = f"pf{'_ops' if ops else ''}{'_bad' if defect else ''}"
            try:
                model = build()
                if defect:
                    if target is None:
                        continue
                    weight = model.get_sublayer(target).weight
                    with paddle.no_grad():
                        weight.set_value(weight * (1 + 1e-3))
                with layerdiff.trace(model, work / f"{name}.h5", ops=ops):
                    step(model)
            except Exception as exc:  # noqa: BLE001 - layerdiff (or finding the target) failed: the finding
                result[name] = f"error: {sweep_hf._error(exc)}"
    return result


# -- the parent: both sides, then the alignments (no framework imported here) ------------------------------

def worker(side: str, model_type: str, work: Path, target: str | None) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    out: dict = {}
    try:
        sides = {"torch": lambda: torch_side(model_type, work), "back": lambda: torch_back(model_type, work),
                 "paddle": lambda: paddle_side(model_type, work, target)}
        out = sides[side]()
    except Exception as exc:  # noqa: BLE001 - the side's own failure, reported
        out = {"not_run": f"{side}: {sweep_hf._error(exc)}"}
    finally:
        (work / f"{side}.json").write_text(json.dumps(out))


def _side(side: str, model_type: str, work: Path, target: str | None = None) -> dict:
    args = [sys.executable, __file__, "--worker", side, model_type, str(work), target or ""]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"not_run": f"{side}: over {TIMEOUT_S} s"}
    out = work / f"{side}.json"
    if out.exists() and out.read_text():
        return json.loads(out.read_text())
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return {"not_run": f"{side}: exit {done.returncode}: {tail[0][:160]}"}


def run_type(model_type: str) -> dict:
    from layerdiff.api import align

    result: dict = {"type": model_type}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="layerdiff-sweep-pf-") as tmp:
        work = Path(tmp)
        made = _side("torch", model_type, work)
        if "not_run" in made:
            return {**result, **made}
        result.update(made)
        ported = _side("paddle", model_type, work, made.get("target"))
        if "not_run" in ported:
            return {**result, **ported}
        back = _side("back", model_type, work)
        result["weights"] = back.get("weights") or back["not_run"]
        differ = _logits(work)
        result["logits"] = differ
        for ops in (False, True):
            prefix, suffix = ("ops ", "_ops") if ops else ("", "")
            reference = work / f"hf{suffix}.h5"
            for check in ("clean", "defect"):
                name = f"pf{suffix}{'_bad' if check == 'defect' else ''}"
                if name in ported:
                    result[prefix + check] = ported[name]
                elif not (work / f"{name}.h5").exists():
                    result[prefix + check] = "no weight matrix to perturb"
                elif check == "defect" and not differ.startswith("agree"):
                    result[prefix + check] = "-"  # the ports already differ: no planted defect to single out
                else:
                    result[prefix + check] = _verdict(check, align(reference, work / f"{name}.h5").data,
                                                      made.get("target"), differ)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def _logits(work: Path) -> str:
    """The ground truth, outside layerdiff: the two models' untraced logits, "agree" within float32's rounding
    (max abs diff at most 1e-4 of their largest magnitude) or "differ", with the max abs diff."""
    import numpy as np

    a, b = np.load(work / "logits_a.npy"), np.load(work / "logits_b.npy")
    if a.shape != b.shape:
        return f"differ: shapes {list(a.shape)} and {list(b.shape)}"
    diff = float(np.max(np.abs(a.astype(np.float64) - b)))
    return f"{'agree' if diff <= 1e-4 * max(1.0, float(np.max(np.abs(a)))) else 'differ'} (max abs {diff:.1e})"


def _verdict(check: str, report: dict, target: str | None, logits: str) -> str:
    """A check's result against the ground truth: where the untraced logits differ, the two ports are not the same
    model, and the report must say so (its origin is printed, to be read)."""
    if check == "clean":
        if not logits.startswith("agree"):
            return f"ports differ: {sweep_hf._origin_text(report)}" if report["verdict"] != "aligned" else \
                "missed: aligned, but the logits differ"
        return "ok" if report["verdict"] == "aligned" else f"false alarm: {sweep_hf._origin_text(report)}"
    origin = (report["forward"].get("first_divergence") or {}).get("module")
    return "ok" if origin == target else f"named {origin!r}, not {target!r}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal LM PaddleFormers ships)")
    p.add_argument("--jobs", type=int, default=2, help="architectures at once (default 2)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        side, model_type, work, target = args.worker
        worker(side, model_type, Path(work), target or None)
        return 0
    types = args.types or paddleformers_types()
    run = benchlib.BenchRun("sweep_paddleformers", TITLE, METHOD,
                            packages=("numpy", "torch", "transformers", "paddlepaddle", "paddleformers"))
    results = sweep_hf.run_all(types, run_type, args.jobs, CHECKS)
    ran = [r for r in results if "not_run" not in r]
    same = [r for r in ran if r.get("logits", "").startswith("agree")]
    differ = [r for r in ran if r not in same]
    passed = {check: sum(r.get(check) == "ok" for r in same) for check in CHECKS if check != "logits"}
    detected = sum(r.get(check, "").startswith("ports differ") for r in differ for check in ("clean", "ops clean"))
    headline = (f"{len(ran)} of {len(results)} PaddleFormers architectures ran against transformers; "
                f"{len(same)} compute the same logits: " +
                ", ".join(f"{check} {n}/{len(same)}" for check, n in passed.items()) +
                f"; {len(differ)} compute other logits ({', '.join(r['type'] for r in differ) or 'none'}): "
                f"reported divergent in {detected} of {2 * len(differ)} alignments")
    print(headline)
    if args.json:
        sweep_hf.write_results(run, args.json, bool(args.types), headline, CHECKS, results,
                               "one side could not build or run it", passed=passed, same_logits=len(same),
                               other_logits=[r["type"] for r in differ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
