"""Snapshot the JSON reports of the demo's defects and the tested ports, to check that a change of structure changes
no answer.

    python tools/report_snapshot.py write DIR      # trace every pair with the CLI, align, keep the JSON reports
    python tools/report_snapshot.py compare A B    # the reports of two snapshots, key by key

Each pair is traced and aligned through the command line only (``layerdiff trace`` / ``align --json``), the public
interface, so the same script runs on any version. ``compare`` leaves out what changes from one run to the next
by nature (paths of the snapshot directory, timings) and prints every other difference; exit 1 if there is one.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# (name, reference target and args, candidate target and args, extra trace flags)
_TORCH_DEFECTS = ("eps", "backward", "act", "weight", "owncode", "residual", "fp16", "nan")
PAIRS = [(f"torch_{d}", "torch_llama", [], "torch_llama", [f"defect={d}"], []) for d in _TORCH_DEFECTS]
PAIRS += [("torch_clean", "torch_llama", [], "torch_llama", [], []),
          ("torch_stats_eps", "torch_llama", [], "torch_llama", ["defect=eps"], ["--mode", "stats"]),
          ("torch_reimpl", "torch_llama", [], "torch_llama", ["defect=reimpl"], [])]
PAIRS += [(f"paddle_{d}", "torch_llama", [], "paddle_llama", [f"defect={d}"] if d else [], [])
          for d in (None, "eps", "backward", "owncode", "weight")]
PAIRS += [(f"mindspore_{d}", "torch_llama", [], "mindspore_llama", [f"defect={d}"] if d else [], [])
          for d in (None, "eps", "backward", "act")]
PAIRS += [(f"megatron_{d}", "torch_llama", [], "megatron_llama", [f"defect={d}"] if d else [], [])
          for d in (None, "eps", "owncode", "weight")]
PAIRS += [(f"mindformers_{d}", "torch_llama", [], "mindformers_llama", [f"defect={d}"] if d else [], [])
          for d in (None, "eps", "act")]
PAIRS += [(f"moe_{d}", "megatron_moe", ["impl=hf"], "megatron_moe", [f"defect={d}"] if d else [], [])
          for d in (None, "router", "expert")]
# keys whose values differ between two runs of the same code: where the snapshot lives, and times; and the settings
# that do (an unseeded process's torch seed)
_VOLATILE = {"path", "started", "argv", "host", "elapsed", "seconds"}
_VOLATILE_SETTINGS = {"seed"}


def _run(cmd: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerdiff", *cmd], cwd=cwd, capture_output=True, text=True)


def write(out: Path, only: list | None = None):
    out.mkdir(parents=True, exist_ok=True)
    traces: dict = {}
    for name, ref, ref_args, cand, cand_args, flags in PAIRS:
        if only and name not in only:
            continue
        sides = []
        for side, target, args in (("a", ref, ref_args), ("b", cand, cand_args)):
            key = (side, target, tuple(args), tuple(flags))  # a clean pair: two runs, never one file twice
            if key not in traces:
                path = out / f"trace{len(traces)}.h5"
                done = _run(["trace", target, "-o", path.name, "-q", "--force", *flags,
                             *[x for a in args for x in ("--arg", a)]], out)
                traces[key] = path.name if done.returncode in (0, 1) and path.exists() else None
                if traces[key] is None:
                    print(f"{name}: tracing {target} {args} failed: {done.stderr.strip().splitlines()[-1:]}")
            sides.append(traces[key])
        if None in sides:
            continue
        start = time.perf_counter()
        done = _run(["align", *sides, "--json", f"{name}.json", "--force", "-q"], out)
        print(f"{name:24} exit {done.returncode}  {time.perf_counter() - start:5.1f} s  {done.stdout.strip()[:100]}")


def _strip(value, key=None):
    if isinstance(value, dict):
        return {k: _strip(v, k) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value if not (isinstance(v, dict) and v.get("key") in _VOLATILE_SETTINGS)]
    return value


def _differences(a, b, where="", out=None, limit=20) -> list:
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{where}.{key}: only in {'A' if key in a else 'B'}")
            else:
                _differences(a[key], b[key], f"{where}.{key}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{where}[{i}]", out, limit)
    elif a != b and not (a != a and b != b):  # NaN equals NaN here
        out.append(f"{where}: {str(a)[:80]} vs {str(b)[:80]}")
    return out


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    bad = 0
    for name in names:
        if not (a / name).exists() or not (b / name).exists():
            print(f"{name}: only in {'A' if (a / name).exists() else 'B'}")
            bad += 1
            continue
        found = _differences(_strip(json.loads((a / name).read_text())), _strip(json.loads((b / name).read_text())))
        print(f"{name:28} {'identical' if not found else f'{len(found)} difference(s)'}")
        for line in found:
            print(f"    {line}")
        bad += bool(found)
    print(f"{len(names) - bad} of {len(names)} reports identical (paths and times left out)")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--only", action="append", help="only these pairs (by name)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "write":
        write(args.dir, args.only)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
