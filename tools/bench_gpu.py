"""Tracing on a GPU: what a trace costs on CUDA, and that a CUDA run aligns with the same model run on the CPU.

    python tools/bench_gpu.py [--json docs/benchmarks/data/bench_gpu.json]

Needs PyTorch with a CUDA device and transformers; run where one is (the machines this project is built on have
none: the figures in docs/benchmarks/bench_gpu.md come from a lent H100/H200). Each step is zero_grad + forward
with labels + backward of a transformers LlamaForCausalLM built from a config, timed with
``torch.cuda.synchronize()`` on both ends; untraced and traced blocks alternate in one process. The checks: the
same weights and tokens on the CPU (fp32) and on the GPU (fp32, then bf16) traced in full mode and aligned, and
in stats mode (fp32, then bf16: statistics reduced on the GPU, against the CPU's); a weight scaled by 1 + 1e-3 on
the GPU named at its module; an attention scaling changed on the GPU named at its operation and line with ``ops``
recorded.
"""
from __future__ import annotations

import argparse
import inspect
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

TITLE = "On a GPU: trace cost on CUDA, and CUDA against the CPU"
METHOD = __doc__.split("\n\n")[2]
MODELS = {"toy": dict(layers=4, hidden=256, heads=8, intermediate=688, vocab=1000, batch=2, seq=128),
          "bigger": dict(layers=8, hidden=1024, heads=16, intermediate=2816, vocab=32000, batch=4, seq=512)}
MODES = {"modules, stats": dict(mode="stats"), "modules, full": dict(mode="full"),
         "ops, stats (whole model)": dict(mode="stats", ops=True),
         "ops, stats (one block)": dict(mode="stats", ops=[r"^model\.layers\.1(\.|$)"])}
STEPS, ROUNDS = 10, 3


def build(device: str, dtype: str = "float32", size: str = "toy", attn: str = "sdpa"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = MODELS[size]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                         num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                         num_key_value_heads=c["heads"], max_position_embeddings=4096)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype))
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    return model, step


def cost(size: str, work: Path, steps: int, rounds: int, device: str) -> list[dict]:
    import layerdiff

    model, step = build(device, size=size)
    for _ in range(3):
        step()
    rows = []
    for name, options in MODES.items():
        if size == "bigger" and options["mode"] == "full":
            continue  # gigabytes a step: a full trace of the suspect window is the way there
        untraced, traced = [], []
        collected: dict[int, list] = {}  # the collector's time in the traced steps, per generation
        for r in range(rounds):
            untraced += benchlib.timed_steps(step, steps)[0]
            with layerdiff.trace(model, work / f"{size}_{r}.h5", overwrite=True, **options) as tracer:
                step()
                with benchlib.collector_time() as spent:
                    traced += benchlib.timed_steps(step, steps)[0]
                records = tracer.writer.records_written
            for generation, (count, seconds) in spent.items():
                total = collected.setdefault(generation, [0, 0.0])
                total[0] += count
                total[1] += seconds
            (work / f"{size}_{r}.h5").unlink()
        u, t = benchlib.med(untraced), benchlib.med(traced)
        collector = {str(g): {"collections_per_step": c / (steps * rounds), "ms_per_step": s * 1e3 / (steps * rounds)}
                     for g, (c, s) in sorted(collected.items())}
        rows.append({"model": size, "mode": name, "untraced_ms": u * 1e3, "traced_ms": t * 1e3, "ratio": t / u,
                     "records": records, "collector": collector})
        benchlib.log(f"{size:7} {name:28} {u * 1e3:8.2f} ms {t * 1e3:8.2f} ms {t / u:6.2f}x   collector "
                     f"{_collector_text(collector)}")
    return rows


def checks(work: Path, device: str) -> list[dict]:
    import torch

    import layerdiff

    out = []

    def traced(name, device, dtype="float32", change=None, ops=False, attn="sdpa", mode="full"):
        model, step = build(device, dtype, attn=attn)
        if change:
            change(model)
        path = work / f"{name}.h5"
        with layerdiff.trace(model, path, overwrite=True, ops=ops, mode=mode):
            step()
        return path

    cpu, cpu_stats = traced("cpu", "cpu"), traced("cpu_stats", "cpu", mode="stats")
    for name, reference, path in (
            ("CUDA fp32 against the CPU", cpu, traced("cuda", device)),
            ("statistics reduced on the GPU against numpy's on the CPU (stats traces)", cpu_stats,
             traced("cuda_stats", device, mode="stats")),
            ("CUDA bf16 against the CPU (fp32)", cpu, traced("cuda_bf16", device, "bfloat16")),
            ("bf16 statistics reduced on the GPU against the CPU's (fp32, stats traces)", cpu_stats,
             traced("cuda_bf16_stats", device, "bfloat16", mode="stats"))):
        report = layerdiff.align(reference, path, workers=1)
        logits = next(t for r in report.data["records"] if r["path"] == "" and r["phase"] == "forward"
                      for t in r["tensors"] if t["role"] == "output")
        out.append({"check": name, "verdict": report.verdict, "origin": _origin(report),
                    "logits": _described(logits["metrics"])})

    def scale_o_proj(model):
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight.mul_(1 + 1e-3)

    reference = traced("cuda_ref", device)
    report = layerdiff.align(reference, traced("cuda_weight", device, change=scale_o_proj), workers=1)
    out.append({"check": "a weight x(1 + 1e-3) on the GPU", "verdict": report.verdict, "origin": _origin(report),
                "expected": "model.layers.1.self_attn.o_proj"})

    def rescale(model):
        model.model.layers[1].self_attn.scaling *= 1.01

    reference = traced("cuda_ops", device, ops=[r"^model\.layers\.1(\.|$)"], attn="eager")
    report = layerdiff.align(reference, traced("cuda_ops_scaling", device, change=rescale,
                                               ops=[r"^model\.layers\.1(\.|$)"], attn="eager"), workers=1)
    op = (report.data["forward"]["first_divergence"] or {}).get("op") or {}
    out.append({"check": "attention scaling x1.01 on the GPU, operations recorded", "verdict": report.verdict,
                "origin": f"{op.get('name')} at {Path(op.get('source_b') or '?').name}", "expected": _scaling_line()})
    return out


def _collector_text(collector: dict) -> str:
    """The collector's time a traced step (a mean), by generation: young (0), middle (1), full passes (2)."""
    names = {"0": "young", "1": "middle", "2": "full"}
    return ", ".join(f"{names[g]} {c['ms_per_step']:.2f} ms ({c['collections_per_step']:.1f})"
                     for g, c in collector.items()) or "none"


def _described(metrics: dict) -> str:
    """The logits' difference in words: what the comparison measured (values, or statistics only)."""
    parts = [f"{key.replace('_', ' ')} {metrics[key]:.3g}" for key in ("max_abs", "max_rel")
             if metrics.get(key) is not None]
    if metrics.get("cosine") is not None:
        parts.append(f"cosine {metrics['cosine']:.9f}")
    return ", ".join(parts) + f" ({metrics.get('basis')})"


def _origin(report) -> str:
    first = report.data["forward"]["first_divergence"] or report.data["backward"]["first_divergence"]
    return first["module"] if first else "-"


def _scaling_line() -> str:
    """``FILE:LINE`` of transformers' eager attention line that applies the scaling."""
    from transformers.models.llama import modeling_llama

    lines, start = inspect.getsourcelines(modeling_llama.eager_attention_forward)
    at = next(i for i, text in enumerate(lines) if re.search(r"\* scaling\b", text))
    return f"{Path(modeling_llama.__file__).name}:{start + at}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    p.add_argument("--quick", action="store_true", help="1 round of 3 steps: checks the tool")
    p.add_argument("--commit", help="the commit measured, where the tree has no git history (a copied tree)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the tool itself here")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it where there is one (--device cpu checks the tool)",
              file=sys.stderr)
        return 2
    steps, rounds = (3, 1) if args.quick else (STEPS, ROUNDS)
    run = benchlib.BenchRun("bench_gpu", TITLE, METHOD, packages=("numpy", "torch", "transformers"))
    if args.commit:
        run.commit = args.commit
    work = Path(tempfile.mkdtemp(prefix="layerdiff-bench-gpu-"))
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    benchlib.log(f"{name}, torch {torch.__version__}")
    sizes = list(MODELS) if args.device == "cuda" else ["toy"]
    try:
        rows = [row for size in sizes for row in cost(size, work, steps, rounds, args.device)]
        found = checks(work, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the traces were only timed
    for c in found:
        benchlib.log(f"{c['check']}: {c['verdict']}, origin {c['origin']}" +
                     (f" (expected {c['expected']})" if "expected" in c else f"; logits {c['logits']}"))
    ops = next(r for r in rows if r["model"] == "toy" and r["mode"].startswith("ops, stats (whole"))
    headline = (f"{name}: module stats trace {rows[0]['ratio']:.2f}x the untraced step of "
                f"the toy, ops=True {ops['ratio']:.2f}x; CUDA fp32 vs CPU {found[0]['verdict']}")
    if args.json:
        run.write(args.json, quick=args.quick, headline=headline, tables=[
            benchlib.table("Step time per mode", ["model", "mode", "untraced step", "traced step", "ratio",
                                                  "records per step", "garbage collector per traced step"],
                           [[r["model"], r["mode"], f"{r['untraced_ms']:.2f} ms", f"{r['traced_ms']:.2f} ms",
                             f"{r['ratio']:.2f}x", str(r["records"] // (steps + 1)), _collector_text(r["collector"])]
                            for r in rows],
                           f"Medians of {rounds} round(s) x {steps} timed steps on {name}; "
                           f"toy: {MODELS['toy']}; bigger: {MODELS['bigger']}. The collector's time is a mean over "
                           "the traced steps, by generation (collections a step in brackets): full passes go over "
                           "every object of the process and fall in few steps."),
            benchlib.table("Checks on the GPU", ["check", "verdict", "named", "expected / logits"],
                           [[c["check"], c["verdict"], c["origin"], c.get("expected") or c.get("logits")]
                            for c in found])],
            results={"device": name, "rows": rows, "checks": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
