#!/usr/bin/env python
"""Tracing cost on tiny Hugging Face models, where the fixed cost of a traced module call dominates. Prints
numbers; asserts nothing.

    python tools/bench_tiny.py            # GPT-2, BERT, T5 and ViT tiny configs (about a minute)
    python tools/bench_tiny.py --steps 40

Each model is built from a tiny config (transformers, random init, fp32, CPU), one step = zero_grad + forward
with labels + backward. Untraced and `stats`-traced blocks of steps alternate in one process (each traced block
is one trace; its first step, which also records every parameter's value, is not timed). Printed per model: the
median step untraced and traced, their ratio, module calls and records per step, and the fixed cost per module
call: (traced - untraced) / module calls per step. "floor" is the same model with hooks that record nothing: a
forward pre-hook and post-hook on every module that pass the first tensor argument and the output through an
identity autograd function (the least a tracer of every module's forward and backward must add), timed in
the same interleaved blocks.

    python tools/bench_tiny.py --chain    # + per-call cost on a chain of 300 tiny modules, against a minimal tracer

``--chain``: a Sequential of 100 x (Linear 16x16, Tanh) blocks (301 module calls per step, batch 4), so the
model's own work is small and steady; besides untraced, layerdiff `stats` and the floor it times a minimal
hand-written tracer that does only the essential work (statistics of each input, output, gradient and parameter
gradient by numpy, one orjson line per record with one ``pwrite``, layerdiff's own gradient tap) and none of the
rest (deduplication, keys, pairing of gradients, in-place checks, hyper-parameters): what the features cost.

    python tools/bench_tiny.py --quick    # 5 steps per block, 1 round (checks the tool, not a figure to quote)
    python tools/bench_tiny.py --json docs/benchmarks/data/bench_tiny.json  # also save the figures (benchlib.BenchRun)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib (stdlib only at import time)
import benchlib  # noqa: E402

TITLE = "Tracing cost on tiny models"
METHOD = """Transformers GPT-2, BERT, T5 and ViT built from tiny configs (2 layers, hidden size 64, batch 2, fp32,
random init), one step = zero_grad + forward with labels + backward on the CPU. Untraced blocks of steps, "floor" blocks
(hooks that record nothing: a forward pre- and post-hook on every module passing the first input and the output
through an identity autograd function, the least any tracer of every module's forward and backward adds) and
`stats`-traced blocks (one trace each, its first step not timed) alternate in one process. Per model: the median
step untraced and traced, their ratio, module calls and records per step, and the fixed cost per traced module call
= (traced - untraced) / module calls per step. With --chain, also a Sequential of 100 x (Linear 16x16, Tanh) (301
calls per step) against a minimal hand-written tracer doing only the essential work (statistics, one orjson line
per record, layerdiff's gradient tap)."""
STEPS, ROUNDS = 20, 3  # the full mode; --quick: 5 steps, 1 round


def models():
    """(name, model, step function) for each tiny config; built here so the script imports torch only when run."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))

    def lm_step(model, **inputs):
        def step():
            model.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()
        return step

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                            bos_token_id=0, eos_token_id=0))
    bert = tf.BertForMaskedLM(tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=128, max_position_embeddings=64))
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                   pad_token_id=0))
    vit = tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=128, num_labels=10))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    return [("GPT-2", gpt2, lm_step(gpt2, input_ids=ids, labels=ids)),
            ("BERT", bert, lm_step(bert, input_ids=ids, labels=ids)),
            ("T5", t5, lm_step(t5, input_ids=ids, labels=ids)),
            ("ViT", vit, lm_step(vit, pixel_values=pixels, labels=torch.tensor([1, 7])))]


def bare_hooks(model):
    """Hooks that record nothing: the floor of per-module forward and backward tracing (see the docstring)."""
    import torch

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            return tuple(t.detach() for t in tensors)

        @staticmethod
        def backward(ctx, *grads):
            return grads

    def pre(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            return (Identity.apply(args[0])[0], *args[1:]), kwargs
        return None

    def post(module, args, kwargs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return Identity.apply(output)[0]
        return None

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def minimal_tracer(model, path: Path):
    """The essential work of a per-module `stats` tracer, hand-written (see the docstring); returns hook handles."""
    import os

    import numpy as np
    import orjson

    from layerdiff.adapters.torch_adapter import _GradTap

    fd, end = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), [0]

    def stats(t):
        a = t.detach().numpy().reshape(-1)
        return {"numel": a.size, "min": float(a.min()), "max": float(a.max()), "mean": float(a.sum()) / a.size,
                "l2": float(np.dot(a, a)) ** 0.5}

    def write(record):
        line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        end[0] += os.pwrite(fd, line, end[0])

    def grad_writer(name, phase):
        return lambda grads: write({"path": name, "phase": phase, "grad": stats(grads[0])})

    def pre(name):
        def hook(module, args):
            module._minimal_input = stats(args[0])
            if args[0].requires_grad:
                return (_GradTap.apply(grad_writer(name, "grad_input"), None, args[0])[0], *args[1:])
            return None
        return hook

    def post(name):
        def hook(module, args, output):
            write({"path": name, "phase": "forward", "input": module._minimal_input, "output": stats(output)})
            return _GradTap.apply(grad_writer(name, "grad_output"), None, output)[0]
        return hook

    handles = []
    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]
    for name, p in model.named_parameters():
        handles.append(p.register_post_accumulate_grad_hook(lambda p, name=name: write({"path": name,
                                                                                        "grad": stats(p.grad)})))
    return handles


def chain():
    """(name, model, step function) of the 301-call chain (``--chain``)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(100)])
    x = torch.randn(4, 16)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    return "chain", model, step


def measure(model, step, steps: int, rounds: int, directory: Path, minimal: bool = False) -> dict:
    import layerdiff
    from layerdiff.tracefile.reader import open_trace

    def block():
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times

    for _ in range(3):
        step()
    untraced, traced, floor, hand_written = [], [], [], []
    path = directory / "t.h5"
    for _ in range(rounds):
        untraced += block()
        handles = bare_hooks(model)
        floor += block()
        for handle in handles:
            handle.remove()
        if minimal:
            handles = minimal_tracer(model, directory / "minimal.jsonl")
            step()
            hand_written += block()
            for handle in handles:
                handle.remove()
        with layerdiff.trace(model, path, mode="stats", overwrite=True):
            step()
            traced += block()
    with open_trace(path) as trace:  # every round records the same: the last trace's timed steps are counted
        timed = [rec for rec in trace.records if rec.step > 0]
    calls = sum(rec.kind == "call" and rec.phase == "forward" for rec in timed) / steps
    records = len(timed) / steps
    base, cost = statistics.median(untraced), statistics.median(traced)
    out = {"untraced": base, "stats": cost, "calls": calls, "records": records, "floor": statistics.median(floor),
           "per_call": (cost - base) / max(calls, 1)}
    if hand_written:
        out["minimal_per_call"] = (statistics.median(hand_written) - base) / max(calls, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, help=f"timed steps per block (default {STEPS}; --quick 5)")
    p.add_argument("--rounds", type=int, help=f"untraced/traced block pairs per model (default {ROUNDS}; --quick 1)")
    p.add_argument("--chain", action="store_true", help="also the 300-module chain against a minimal tracer")
    p.add_argument("--quick", action="store_true", help="5 steps per block, 1 round: checks the tool")
    p.add_argument("--json", metavar="PATH", help="also save the figures as JSON (read by tools/bench_pages.py)")
    args = p.parse_args(argv)
    run = benchlib.BenchRun("bench_tiny", TITLE, METHOD, packages=("numpy", "torch", "transformers"))
    steps = args.steps or (5 if args.quick else STEPS)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    print(f"{'model':8} {'untraced':>10} {'stats':>10} {'ratio':>7} {'calls/step':>11} {'records/step':>13} "
          f"{'cost per call':>14} {'floor':>7} {'minimal tracer per call':>24}")
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="layerdiff-tiny-") as d:
        for name, model, step in models() + ([chain()] if args.chain else []):
            r = measure(model, step, steps, rounds, Path(d), minimal=name == "chain")
            results[name] = r
            minimal = f"{r['minimal_per_call'] * 1e6:21.0f} us" if "minimal_per_call" in r else ""
            print(f"{name:8} {r['untraced'] * 1e3:8.1f}ms {r['stats'] * 1e3:8.1f}ms {r['stats'] / r['untraced']:6.2f}x "
                  f"{r['calls']:11.0f} {r['records']:13.0f} {r['per_call'] * 1e6:11.0f} us "
                  f"{r['floor'] / r['untraced']:6.2f}x {minimal}")
            rows.append([name, f"{r['untraced'] * 1e3:.1f} ms", f"{r['stats'] * 1e3:.1f} ms",
                         f"{r['stats'] / r['untraced']:.2f}x", f"{r['calls']:.0f} / {r['records']:.0f}",
                         f"{r['per_call'] * 1e6:.0f} us", f"{r['floor'] / r['untraced']:.2f}x",
                         f"{r['minimal_per_call'] * 1e6:.0f} us" if "minimal_per_call" in r else "-"])
    if args.json:
        tiny = [r for name, r in results.items() if name != "chain"]
        ratios = [r["stats"] / r["untraced"] for r in tiny]
        per_call = [r["per_call"] * 1e6 for r in tiny]
        headline = (f"`stats` step {min(ratios):.2f}x to {max(ratios):.2f}x the untraced one; "
                    f"{min(per_call):.0f} to {max(per_call):.0f} us per traced module call")
        columns = ["model", "untraced step", "`stats` step", "ratio", "module calls / records per step",
                   "cost per module call", "floor", "minimal tracer per call"]
        note = (f"Medians of {rounds} round(s) x {steps} timed steps per block. \"floor\" is the step with hooks that "
                "record nothing, against the untraced step.")
        run.write(args.json, quick=args.quick or steps < STEPS or rounds < ROUNDS, headline=headline,
                  tables=[benchlib.table("Step time per model", columns, rows, note)],
                  results={"steps": steps, "rounds": rounds, "models": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
