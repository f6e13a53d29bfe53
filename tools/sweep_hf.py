#!/usr/bin/env python
"""Every causal-LM architecture that the installed transformers knows, traced and aligned: does layerdiff work on
each, out of the box? Prints a table; asserts nothing.

    python tools/sweep_hf.py                      # every architecture (about 15 minutes on 2 cores)
    python tools/sweep_hf.py llama gpt2 mamba     # these
    python tools/sweep_hf.py --json out.json      # also save the figures (read by tools/bench_pages.py)

Each architecture runs in a fresh interpreter. Its config comes from ``AutoConfig.for_model``, made tiny: hidden 32,
2 layers, 4 heads (2 key-value heads), vocabulary 128; every other size, dimension or rank over 64 set to 32, a
head's dimensions to 8, experts to 4 (2 a token); its sub-configs alike. A config that refuses that is tried with
whole heads, then with its own number of layers. Over 20M parameters (counted on the meta device) it is skipped.
The model runs in eval mode, one forward with labels (no cache) and one backward on 2 x 12 tokens. Then, each with
``layerdiff.trace``:

- **clean**: two runs of the same model and inputs align (no false alarm);
- **defect**: one run with the weight of the second layer's first weight matrix (``nn.Linear``, ``Conv1D``; one
  that ran and that no other module shares) scaled by 1 + 1e-3; the report's forward origin must be that module;
- **ops clean** / **ops defect**: the same with every operation recorded (``ops=True``);
- **bf16**: the model cast to bfloat16 against its float32 run (the parity workflow's change of precision): aligned
  ("ok"), or what the report says instead: rounding that accumulated with no call at fault, a choice (top-k routing)
  flipped where scores are nearly tied, large inputs' rounding amplified (a softmax of large scores), or the origin
  it names.

Some architectures need more than the generic tiny config (sizes their validators tie together, a layer-type list
that must match the number of layers, a setting their code reads): ``tools/sweep_hf_fittings.json`` holds, per model
type, the keyword arguments its config is built with on top of the generic ones, attributes set on it afterwards,
a method called on the built model and extra inputs, each with why. An architecture that its tiny config still
cannot build or run untraced is counted apart ("not run"): that is the config's limit, not layerdiff's. Everything
else is layerdiff's result.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

TITLE = "Every transformers causal-LM architecture, traced and aligned"
METHOD = ("Each causal-LM model type that the installed transformers registers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) "
          "runs in a fresh interpreter: its config from AutoConfig.for_model made tiny (hidden 32, 2 layers, 4 "
          "heads, 2 key-value heads, vocabulary 128; every other size, dimension or rank over 64 set to 32, a "
          "head's dimensions to 8, experts to 4 with 2 a token; sub-configs alike; where the config refuses that, "
          "whole heads, then its own number of layers; what some architectures need beyond that, per type and "
          "with why, in tools/sweep_hf_fittings.json), built (over 20M parameters: skipped), eval mode, forward "
          "with labels (no cache) and backward on 2 x 12 tokens. clean: two traced runs of the same model align. "
          "defect: one run with the weight of the second layer's first weight matrix (nn.Linear or transformers' "
          "Conv1D, one that ran and is not shared) scaled by 1 + 1e-3; the forward origin must be that module. "
          "ops: the same with every operation recorded (ops=True). bf16: the model cast to bfloat16 against its "
          "float32 run, module level: 'ok' when aligned, else what the report says. 'not run': the tiny config "
          "could not build or run the model untraced (the sweep's limit, not layerdiff's).")
SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MAX_PARAMS = 20_000_000
CHECKS = ("clean", "defect", "ops clean", "ops defect", "bf16")
TIMEOUT_S = 300


FITTINGS = Path(__file__).with_name("sweep_hf_fittings.json")


@dataclass(frozen=True)
class Fitting:
    """What one architecture needs beyond the generic tiny config (``sweep_hf_fittings.json``): ``config`` keyword
    arguments for ``AutoConfig.for_model`` on top of the generic ones (None: leave that generic key out), seen by
    its validators; ``set``: attributes set on the built config (dotted for a sub-config's); ``call``: [method,
    *args] called on the built model; ``inputs``: model inputs added or replaced, each {"randn": shape} (seeded),
    {"tokens": {"reshape": shape, "permute": dims}} (the step's tokens laid out so) or a value; ``skip``: why the
    sweep's step cannot run this architecture (it is then "not run", with that reason)."""

    config: dict[str, Any] = field(default_factory=dict)
    set: dict[str, Any] = field(default_factory=dict)
    call: list | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    skip: str | None = None  # why a causal-LM step cannot run this architecture at all (a draft model's forward)

    @classmethod
    def of(cls, model_type: str) -> "Fitting":
        entry = json.loads(FITTINGS.read_text()).get(model_type, {})
        return cls(**{k: v for k, v in entry.items() if k in cls.__dataclass_fields__})

    def small(self, generic: dict) -> dict:
        """The generic tiny config's keyword arguments with this architecture's own."""
        merged = {**generic, **self.config}
        return {k: v for k, v in merged.items() if v is not None}

    def apply(self, config) -> None:
        for dotted, value in self.set.items():
            *path, name = dotted.split(".")
            target = config
            for part in path:
                target = getattr(target, part)
            setattr(target, name, value)

    def prepare(self, model) -> None:
        if self.call:
            getattr(model, self.call[0])(*self.call[1:])

    def model_inputs(self, ids) -> dict:
        """The step's inputs: the tokens as input and labels, no cache, and this architecture's extra inputs."""
        import torch

        extra = {}
        for name, value in self.inputs.items():
            if isinstance(value, dict) and "randn" in value:
                value = torch.randn(value["randn"], generator=torch.Generator().manual_seed(2))
            elif isinstance(value, dict) and "tokens" in value:  # the tokens laid out otherwise
                value = ids.reshape(value["tokens"]["reshape"]).permute(value["tokens"]["permute"])
            extra[name] = value
        return {"input_ids": ids, "labels": ids, "use_cache": False, **extra}


def _shrink(config) -> None:
    """Every size, dimension or rank over 64 to 32 (a head's dimensions to 8), experts to 4 and at most 2 of them
    per token, one expert group: what the explicit sizes leave large."""
    for key, value in list(vars(config).items()):
        if isinstance(value, bool) or not isinstance(value, int) or "vocab" in key or "position" in key:
            continue
        if ("head_dim" in key or "rotary_dim" in key or "rope_dim" in key) and value > 8:
            small = 8
        elif any(s in key for s in ("per_tok", "top_k", "topk")) and value > 2:
            small = 1 if "group" in key else 2
        elif key in ("n_group", "num_expert_group") and value > 1:
            small = 1
        elif value > 64 and any(s in key for s in ("size", "dim", "rank", "experts", "_ff", "ffn", "inner")):
            small = 4 if "experts" in key else 32
        else:
            continue
        try:
            setattr(config, key, small)
        except Exception:  # noqa: BLE001 - a config that refuses the value keeps its own
            pass


# what the tiny config sets explicitly, tried in turn: a config that refuses a key (a computed head_dim, a layer
# count its layer-type lists must match) is tried without it, and with as many key-value heads as heads (latent
# attention)
_WHOLE_HEADS = {**SMALL, "num_key_value_heads": SMALL["num_attention_heads"]}
ATTEMPTS = (SMALL, {k: v for k, v in _WHOLE_HEADS.items() if k != "head_dim"},
            {k: v for k, v in _WHOLE_HEADS.items() if k not in ("head_dim", "num_hidden_layers")})


def _config(model_type: str, small: dict, fitting: Fitting | None = None):
    """The model type's config with ``small``'s sizes (and ``fitting``'s, where the architecture has one); its
    sub-configs (a vision tower, a text model) made small alike, where they have those keys."""
    from transformers import AutoConfig, PretrainedConfig

    fitting = fitting if fitting is not None else Fitting()
    small = fitting.small(small)  # the sub-configs take the architecture's own sizes too
    config = AutoConfig.for_model(model_type, **small)
    _shrink(config)
    seen = {id(config)}
    todo = [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]
    try:
        todo.append(config.get_text_config())
    except (AttributeError, ValueError):  # none, or several (MusicGen's text encoder and decoder): among the others
        pass
    while todo:
        sub = todo.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        for key, value in small.items():
            if hasattr(sub, key):
                try:
                    setattr(sub, key, value)
                except Exception:  # noqa: BLE001 - a config that refuses the value keeps its own
                    pass
        _shrink(sub)
        todo += [v for v in vars(sub).values() if isinstance(v, PretrainedConfig)]
    fitting.apply(config)
    return config


def _target(model, ran: set[int]) -> str | None:
    """A weight of the model's second layer to perturb: the first leaf module that ran (``ran``: ids), under a path
    with ``.1.``, whose 2-D weight no other module shares (``nn.Linear``, transformers' ``Conv1D``; no embedding,
    no tied head)."""
    import torch

    owners: dict[int, int] = {}
    for _, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            owners[id(weight)] = owners.get(id(weight), 0) + 1
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if id(module) not in ran or ".1." not in f".{name}." or any(True for _ in module.children()) or \
                isinstance(module, torch.nn.Embedding) or not isinstance(weight, torch.nn.Parameter):
            continue
        if weight.dim() == 2 and owners[id(weight)] == 1:
            return name
    return None


def tiny_model(model_type: str, step, attempts: tuple = ATTEMPTS, fitting: Fitting | None = None, **overrides):
    """The model type built from the first of ``attempts`` (tiny configs, with ``fitting``'s changes and
    ``overrides`` set on the config) that builds and runs ``step(model)`` untraced: (config, model in eval mode, ids
    of the modules that ran, parameter count); or why none did (the first attempt's error, or its size over
    ``MAX_PARAMS``)."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook
    from transformers import AutoModelForCausalLM

    fitting = fitting if fitting is not None else Fitting()
    failures = []
    for small in attempts:
        try:
            config = _config(model_type, small, fitting)
            for key, value in overrides.items():
                setattr(config, key, value)
            with torch.device("meta"):
                params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            if params > MAX_PARAMS:
                failures.append(f"{params / 1e6:.0f}M parameters with the tiny config")
                continue
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            fitting.prepare(model)
            ran: set[int] = set()
            hook = register_module_forward_hook(lambda module, args, out: ran.add(id(module)))
            try:
                step(model)
            finally:
                hook.remove()
            model.zero_grad(set_to_none=True)
            return config, model, ran, params
        except Exception as exc:  # noqa: BLE001 - the generic tiny config's limit, reported
            failures.append(_error(exc))
    return failures[0]


def worker(model_type: str, out: Path) -> None:
    """One architecture in this interpreter; its result to ``out`` as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    result: dict = {"type": model_type}
    try:
        with tempfile.TemporaryDirectory(prefix="layerdiff-sweep-") as work:
            _checks(model_type, result, Path(work))
    finally:
        out.write_text(json.dumps(result))


def _checks(model_type: str, result: dict, work: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import layerdiff

    t0 = time.perf_counter()
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    fitting = Fitting.of(model_type)
    if fitting.skip:
        result["not_run"] = fitting.skip
        return
    inputs = fitting.model_inputs(ids)

    def step(model) -> None:
        model(**inputs).loss.backward()

    built = tiny_model(model_type, step, fitting=fitting)
    if isinstance(built, str):
        result["not_run"] = built
        return
    config, model, ran, params = built

    def build():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        fitting.prepare(model)
        return model

    result["params"] = params
    target = _target(model, ran)
    result["target"] = target

    def traced(name: str, ops: bool, defect: bool = False) -> Path:
        model = build()
        if defect and target:
            with torch.no_grad():
                model.get_submodule(target).weight.mul_(1 + 1e-3)
        path = work / f"{name}.h5"
        with layerdiff.trace(model, path, ops=ops):
            step(model)
        return path

    for ops in (False, True):
        prefix = "ops " if ops else ""
        try:
            reference = traced(f"a{int(ops)}", ops)
        except Exception as exc:  # noqa: BLE001 - layerdiff failed on this architecture: the finding
            result[f"{prefix}clean"] = result[f"{prefix}defect"] = f"error: {_error(exc)}"
            continue
        for check in ("clean", "defect"):
            try:
                result[prefix + check] = _check(check, reference, traced, ops, target)
            except Exception as exc:  # noqa: BLE001
                result[prefix + check] = f"error: {_error(exc)}"
    try:
        result["bf16"] = _precision(build, work / "a0.h5", work, step)
    except Exception as exc:  # noqa: BLE001
        result["bf16"] = f"error: {_error(exc)}"
    result["seconds"] = round(time.perf_counter() - t0, 1)


def _precision(build, reference: Path, work: Path, step) -> str:
    """The model cast to bfloat16 against its float32 run (``reference``, module level): aligned, or what the report
    says."""
    import torch

    import layerdiff
    from layerdiff.api import align

    path = work / "bf16.h5"
    try:
        model = build().to(torch.bfloat16)
        with layerdiff.trace(model, path):
            step(model)
    except Exception as exc:  # noqa: BLE001 - whose failure it is: the same run untraced tells
        try:
            model = build().to(torch.bfloat16)
            step(model)
        except Exception:  # noqa: BLE001 - the model's own code, untraced: not layerdiff's
            return f"not run: the model fails in bfloat16 untraced ({_error(exc)})"
        raise
    report = align(reference, path).data
    if report["verdict"] == "aligned":
        return "ok"
    origin = report["forward"].get("first_divergence") or report["backward"].get("first_divergence") or {}
    if origin.get("where") == "accumulated":
        return "rounding accumulated (no call at fault)"
    if origin.get("hint") and "choice" in origin["hint"]:
        return f"choice flipped at {origin.get('module')}"
    if origin.get("hint") and "large inputs rounded" in origin["hint"]:
        return f"large inputs' rounding amplified at {origin.get('module')}"
    return f"named: {_origin_text(report)}"


def _check(check: str, reference: Path, traced, ops: bool, target: str | None) -> str:
    from layerdiff.api import align

    if check == "clean":
        report = align(reference, traced(f"b{int(ops)}", ops)).data
        return "ok" if report["verdict"] == "aligned" else f"false alarm: {_origin_text(report)}"
    if target is None:
        return "no weight matrix to perturb"
    report = align(reference, traced(f"bad{int(ops)}", ops, defect=True)).data
    origin = (report["forward"].get("first_divergence") or {}).get("module")
    return "ok" if origin == target else f"named {origin!r}, not {target!r}"


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _origin_text(report: dict) -> str:
    for direction in ("forward", "backward"):
        origin = report[direction].get("first_divergence")
        if origin:
            return f"{direction} {origin.get('description') or origin.get('module')}"[:200]
    return str(report.get("verdict"))


def run_type(model_type: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="layerdiff-sweep-") as tmp:
        out = Path(tmp) / "result.json"
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--worker", model_type, str(out)],
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"type": model_type, "not_run": f"over {TIMEOUT_S} s"}
        if out.exists() and out.read_text():
            result = json.loads(out.read_text())
            if done.returncode and not any(k in result for k in CHECKS):
                result.setdefault("not_run", f"exit {done.returncode}")
            return result
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return {"type": model_type, "not_run": f"exit {done.returncode} after {time.perf_counter() - t0:.0f} s: "
                                                f"{tail[0][:160]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal-LM type transformers registers)")
    p.add_argument("--jobs", type=int, default=2, help="architectures at once (default 2)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    run = benchlib.BenchRun("sweep_hf", TITLE, METHOD, packages=("numpy", "torch", "transformers"))
    results = run_all(types, run_type, args.jobs, CHECKS)
    ran = [r for r in results if "not_run" not in r]
    passed = {check: sum(r.get(check) == "ok" for r in ran) for check in CHECKS}
    headline = (f"{len(ran)} of {len(results)} architectures ran with the tiny config; " +
                ", ".join(f"{check} {n}/{len(ran)}" for check, n in passed.items()))
    print(headline)
    if args.json:
        write_results(run, args.json, bool(args.types), headline, CHECKS, results, "the tiny config's limit",
                      passed=passed)
    return 0


def run_all(types: list[str], run_one, jobs: int, checks: tuple) -> list[dict]:
    """``run_one(type)`` for each type, ``jobs`` at once; each result printed as it comes (every sweep's driver)."""
    results = []
    with ThreadPoolExecutor(jobs) as pool:
        for result in pool.map(run_one, types):
            results.append(result)
            print(result_line(result, checks), flush=True)
    return results


def result_line(result: dict, checks: tuple) -> str:
    if "not_run" in result:
        return f"{result['type']:20} not run: {result['not_run']}"
    return f"{result['type']:20} " + "  ".join(f"{check}: {result.get(check, '-')}" for check in checks)


def write_results(run, path: str, quick: bool, headline: str, checks: tuple, results: list[dict], not_run_why: str,
                  **more) -> None:
    """A sweep's JSON for its page: a row per architecture that ran (its checks, and the module it perturbed where
    it names one), the others with why they did not run; ``more``: figures for the results."""
    ran = [r for r in results if "not_run" not in r]
    target = any(r.get("target") for r in ran)
    rows = [[r["type"], *(r.get(check, "-") for check in checks), *([r.get("target") or "-"] if target else [])]
            for r in ran]
    skipped = [[r["type"], r["not_run"]] for r in results if "not_run" in r]
    run.write(path, quick=quick, headline=headline,
              tables=[benchlib.table("Architectures that ran",
                                     ["type", *checks, *(["perturbed module"] if target else [])], rows),
                      benchlib.table(f"Not run ({not_run_why})", ["type", "why"], skipped)],
              results={"architectures": results, "ran": len(ran), **more})


if __name__ == "__main__":
    sys.exit(main())
