"""Run settings that break parity, compared between two traces' metadata.

Two runs of the same code differ for reasons outside the model more often than inside it: another seed, a
deterministic switch, TF32, the thread count, a framework version, an environment variable. Each adapter records
its framework's switches at trace time; this compares what both traces hold (framework-specific keys are
compared only when both runs recorded them) and says why each one matters.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# key in the trace metadata -> why a difference matters
WHY = {
    "framework_version": "kernels and their numerics change between versions",
    "seed": "random initialization, dropout and sampling (an unseeded run gets a random seed)",
    "deterministic_algorithms": "nondeterministic kernels (atomics) reorder sums run to run",
    "float32_matmul_precision": "'high'/'medium' lets fp32 matmuls run in TF32 or bf16",
    "tf32_matmul": "TF32 matmuls keep 10 mantissa bits",
    "tf32_cudnn": "TF32 convolutions keep 10 mantissa bits",
    "cudnn_deterministic": "nondeterministic cuDNN algorithms",
    "cudnn_benchmark": "cuDNN picks its algorithm by timing, run by run",
    "embedding_deterministic": "nondeterministic embedding gradients",
    "deterministic": "nondeterministic kernels",
    "jit_level": "graph compilation fuses and reorders operations",
    "execution_mode": "graph mode compiles and fuses operations",
    "default_dtype": "tensors created without a dtype",
    "param_dtypes": "parameters held in another precision (every tensor is judged at the less precise one's tolerance)",
    "autocast_dtypes": "mixed precision (torch.autocast, or FSDP's MixedPrecisionPolicy casting the weights) computes "
                       "in another precision (every tensor is judged at the less precise one's tolerance)",
    "devices": "another device runs other kernels",
    "num_threads": "CPU reductions are split by thread count",
    "training": "dropout and batch-norm statistics act only in training mode",
    "rng_state": "the random generator's state when the trace began: in training mode, other dropout masks (the "
                 "same seed consumed differently, as by another order of initialization)",
    "mode": "a stats trace compares statistics only",
}
_ENV_WHY = "an environment variable that changes kernels or their determinism"
_FLAG_WHY = "a framework flag"


@dataclass(frozen=True)
class SettingDiff:
    key: str
    a: object
    b: object
    why: str


# what says nothing across frameworks: each its own versions, its own random generators (a port's weights are
# transferred, and no seed of one framework draws the other's dropout masks) and its own kernels, which split their
# reductions over threads their own way
_OWN_TO_A_FRAMEWORK = frozenset({"framework_version", "seed", "rng_state", "num_threads"})


def differing_settings(meta_a: dict[str, Any], meta_b: dict[str, Any],
                       same_weights: bool = False) -> list[SettingDiff]:
    """Settings both runs recorded with different values, plus environment variables and framework flags set
    differently (set on one side only counts). Between two frameworks, only what means the same in both.
    ``same_weights``: the runs' parameters were found identical (then a seed explains no initialization)."""
    same_framework = meta_a.get("framework") == meta_b.get("framework")
    out = [SettingDiff(key, meta_a[key], meta_b[key], why) for key, why in WHY.items()
           if key in meta_a and key in meta_b and (same_framework or key not in _OWN_TO_A_FRAMEWORK)
           and _differ(key, meta_a[key], meta_b[key], same_framework)
           and _matters(key, meta_a, meta_b, same_weights)]
    if same_framework:
        for group, why in (("env", _ENV_WHY), ("flags", _FLAG_WHY)):
            a, b = meta_a.get(group) or {}, meta_b.get(group) or {}
            if isinstance(a, dict) and isinstance(b, dict):
                out += [SettingDiff(key, a.get(key), b.get(key), why) for key in sorted(set(a) | set(b))
                        if a.get(key) != b.get(key)]
    return out


def _differ(key: str, a: Any, b: Any, same_framework: bool) -> bool:
    """Whether two runs' values of a setting differ; devices across frameworks by their kind (Paddle's
    ``Place(gpu:0)`` is torch's ``cuda:0``; MindSpore names its target alone)."""
    if key == "devices" and not same_framework and isinstance(a, list) and isinstance(b, list):
        return _device_kinds(a) != _device_kinds(b)
    return bool(a != b)


def _device_kinds(devices: list[Any]) -> set[str]:
    kinds = set()
    for device in devices:
        name = str(device).lower()
        if name.startswith("place(") and name.endswith(")"):
            name = name[len("place("):-1]
        kind = name.partition(":")[0]
        kinds.add("cuda" if kind in ("gpu", "gpu_pinned") else "cpu" if kind == "cpu_pinned" else kind)
    return kinds


def _matters(key: str, meta_a: dict[str, Any], meta_b: dict[str, Any], same_weights: bool) -> bool:
    """The seed and the random state matter only where a run's forward drew random numbers at all (``rng_drawn``:
    a Llama of transformers trains with dropout 0 and draws none; unknown in older traces, and then it may have);
    the seed also where the weights differ (its initialization). The random state, besides, only where a run
    trains (dropout draws from it) and the seeds do not already differ (which says it)."""
    if key not in ("seed", "rng_state"):
        return True
    drawn = meta_a.get("rng_drawn") is not False or meta_b.get("rng_drawn") is not False
    if key == "seed":
        return drawn or not same_weights
    return bool(meta_a.get("training") or meta_b.get("training")) and meta_a.get("seed") == meta_b.get("seed") \
        and drawn


def settings_report(meta_a: dict[str, Any], meta_b: dict[str, Any], same_weights: bool = False) -> dict[str, Any]:
    """``report["settings"]``: what differs, and each run's own notes (``meta={...}`` given to trace)."""
    return {"differ": [asdict(d) for d in differing_settings(meta_a, meta_b, same_weights)],
            "notes": {"a": meta_a.get("user") or {}, "b": meta_b.get("user") or {}}}
