"""``layerdiff demo``: the whole job on an embedded example, offline.

Builds the torch_llama recipe twice (the second with one injected defect), traces both, aligns them and
shows the report, says whether layerdiff named the module where the defect was injected, and confirms it with
``layerdiff bisect`` (the candidate re-run on the reference's recorded values). Where the origin is a module's
own code, it then does what the report says to do next: traces both runs again with that module's operations
recorded and shows the operation and the line of code where they part.
"""
from __future__ import annotations

import re
import shlex
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.adapters import FRAMEWORKS
from layerdiff.errors import LayerdiffError

if TYPE_CHECKING:
    from rich.console import Console

    from layerdiff.schema import Origin, Report


def _trace_elsewhere(recipe: str, path: Path, defect: str | None, ops_in: str | None = None) -> None:
    """Trace a recipe with the real CLI in its own process (one framework per process, as users run it);
    ``defect`` None for none; ``ops_in``: the operations of the modules it matches recorded too."""
    import subprocess
    import sys

    options = (["--arg", f"defect={defect}"] if defect else []) + (["--ops-in", ops_in] if ops_in else [])
    proc = subprocess.run([sys.executable, "-m", "layerdiff", "trace", recipe, "-o", str(path), "-q", *options],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise LayerdiffError(f"tracing {recipe} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def _trace_run(path: Path, framework: str, defect: str | None, ops_in: str | None = None) -> None:
    """One run of the demo's Llama traced to ``path``: torch's in this process, a port in its own
    (``_trace_elsewhere``); ``defect`` None for the reference; ``ops_in``: the operations of the modules it matches
    recorded too."""
    from layerdiff.recipes import torch_llama
    from layerdiff.tracing import trace

    if framework != "torch":
        _trace_elsewhere(f"{framework}_llama", path, defect, ops_in)
        return
    built = torch_llama.build(defect)
    with trace(built["model"], path, ops=[ops_in] if ops_in else False):
        built["step"]()


def _aligned(reference: Path, candidate: Path, out: Path) -> Report:
    """The two traces aligned, the report also written to ``out`` as JSON."""
    from layerdiff.judge.evaluate import align
    from layerdiff.report.jsonio import write_json
    from layerdiff.tracefile.reader import open_trace

    with open_trace(reference) as a, open_trace(candidate) as b:
        report = align(a, b)
    write_json(report, out)
    return report


def _first_divergence(report: Report, direction: str) -> Origin | None:
    """The report's origin in the direction the injected defect acts in ("forward" or "backward")."""
    return (report["forward"] if direction == "forward" else report["backward"])["first_divergence"]


def run_demo(defect: str = "eps", keep: str | None = None, framework: str = "torch") -> int:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise LayerdiffError("the demo needs torch and transformers: pip install 'layerdiff[demo]'") from None
    from layerdiff.recipes import torch_llama
    from layerdiff.report.ops_view import retrace_hint
    from layerdiff.report.terminal import make_console, render

    if defect not in torch_llama.DEFECTS:
        raise LayerdiffError(f"unknown defect {defect!r}; choose from {', '.join(torch_llama.DEFECTS)}")
    if framework not in FRAMEWORKS:
        raise LayerdiffError(f"unknown framework {framework!r}; choose {', '.join(FRAMEWORKS)}")
    console = make_console()
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="layerdiff-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"reference": workdir / "reference.h5", "candidate": workdir / f"candidate_{framework}_{defect}.h5",
             "reference_ops": workdir / "reference_ops.h5",
             "candidate_ops": workdir / f"candidate_{framework}_{defect}_ops.h5"}
    for p in list(paths.values()) + [workdir / "report.json", workdir / "report_ops.json"]:
        if p.exists():
            raise LayerdiffError(f"{p} exists; choose an empty --keep directory")
    direction, expected = torch_llama.DEFECTS[defect]
    where = "" if framework == "torch" else f", ported to {framework} (recipes/{framework}_llama.py, same weights)"
    console.print(f"[bold]layerdiff demo[/]: a 2-layer Llama (transformers, built from a config) traced twice; "
                  f"the candidate{where} has one injected defect ([cyan]{defect}[/], {direction}).")
    start = time.perf_counter()
    _trace_run(paths["reference"], "torch", None)
    console.print(f"  traced reference (torch) -> {paths['reference']}")
    _trace_run(paths["candidate"], framework, defect)
    console.print(f"  traced candidate ({framework}) -> {paths['candidate']}")
    report = _aligned(paths["reference"], paths["candidate"], workdir / "report.json")
    console.print(f"  aligned in {time.perf_counter() - start:.1f} s total; JSON report: {workdir / 'report.json'}\n")
    render(report, console)
    found = _first_divergence(report, direction)
    hit = found is not None and found["module"] == expected
    console.print(f"\ninjected at [bold]{expected}[/] ({direction}); layerdiff named "
                  f"[bold]{found['module'] if found else 'nothing'}[/]: "
                  + ("[bold green]correct[/]" if hit else "[bold red]WRONG[/]"))
    confirmed = _confirm_by_replay(console, paths["reference"], framework, defect, workdir, direction, expected)
    if found is not None and found["module"] and retrace_hint(report, found):
        _step_into_operations(console, found["module"], direction, framework, defect, paths, workdir)
    console.print(f"\n[dim]try: layerdiff demo --defect backward [--framework paddle|mindspore]   "
                  f"(defects: {', '.join(torch_llama.DEFECTS)})[/]")
    return 0 if hit and confirmed else 1


def _confirm_by_replay(console: Console, reference: Path, framework: str, defect: str, workdir: Path,
                      direction: str, expected: str) -> bool:
    """``layerdiff bisect``: the candidate re-run on the reference's values; its own error must be the defect."""
    import json
    import subprocess
    import sys

    start = time.perf_counter()
    out = workdir / "bisect.json"
    proc = subprocess.run([sys.executable, "-m", "layerdiff", "bisect", str(reference), f"{framework}_llama",
                           "--arg", f"defect={defect}", "--workdir", str(workdir / "bisect"), "--json", str(out),
                           "-q"], capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not out.exists():
        raise LayerdiffError(f"bisect failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(out.read_text())
    culprit = result[direction]["culprit"]
    ok = culprit is not None and culprit["module"] == expected
    console.print(f"\n[bold]layerdiff bisect[/] re-ran the candidate on the reference's recorded values "
                  f"({time.perf_counter() - start:.1f} s): own {direction} error in [bold]"
                  f"{culprit['description'] if culprit else 'nothing'}[/]: "
                  + ("[bold green]confirmed[/], not inherited" if ok else "[bold red]NOT confirmed[/]"))
    return ok


def _step_into_operations(console: Console, module: str, direction: str, framework: str, defect: str,
                          paths: dict[str, Path], workdir: Path) -> None:
    """The report's next step, taken: both runs traced again with the operations of the origin's module recorded
    (``ops=[...]``, ``--ops-in``), aligned, and the origin shown down to its operation and line of code."""
    from layerdiff.report.terminal import origin_lines

    start = time.perf_counter()
    window = "^" + re.escape(module) + "$"
    _trace_run(paths["reference_ops"], "torch", None, window)
    _trace_run(paths["candidate_ops"], framework, defect, window)
    report = _aligned(paths["reference_ops"], paths["candidate_ops"], workdir / "report_ops.json")
    found = _first_divergence(report, direction)
    console.print(f"\n[bold]inside {module}[/], operation by operation: both runs traced again with "
                  f"--ops-in {shlex.quote(window)} ({time.perf_counter() - start:.1f} s; "
                  f"{workdir / 'report_ops.json'}):")
    if found is None:
        console.print("  [yellow]no operation of it differs: its own code agrees once its operations are "
                      "compared one by one[/]")
        return
    for line in origin_lines(found):
        console.print("  " + line)
