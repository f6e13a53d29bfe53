"""Rendering of an alignment report: a terminal view a person reads in ten seconds, and JSON for tools.

The JSON holds every measured metric, so ``layerdiff report`` can re-judge it under other tolerances.
Non-finite floats are written as the strings "inf", "-inf" and "nan" to keep the file standard JSON.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import LayerdiffError

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _from_json(obj):
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


def write_json(report: dict, path, *, overwrite: bool = False):
    """Write atomically (temp file + rename) and never over an existing file unless asked."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise LayerdiffError(f"{path} exists; pass --force to replace it")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_json_safe(report), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_json(path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise LayerdiffError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LayerdiffError(f"{path}: not a JSON report ({type(exc).__name__})") from None
    if not _valid_report(data):
        raise LayerdiffError(f"{path}: JSON, but not a layerdiff align report")
    return _from_json(data)


_REPORT_KEYS = ("report_version", "a", "b", "records", "only_a", "only_b", "first_nonfinite")
_ROW_KEYS = ("kind", "phase", "path", "call", "step", "begin", "end", "parent", "tensors")
_TENSOR_KEYS = ("role", "key", "dtype_a", "dtype_b", "metrics")


def _valid_report(data) -> bool:
    """The structure ``evaluate`` needs, checked up front so a foreign JSON file is one clear error."""
    if not isinstance(data, dict) or any(k not in data for k in _REPORT_KEYS):
        return False
    if not (isinstance(data["a"], dict) and isinstance(data["b"], dict) and isinstance(data["records"], list)):
        return False
    for row in data["records"]:
        if not isinstance(row, dict) or any(k not in row for k in _ROW_KEYS) or not isinstance(row["tensors"], list):
            return False
        for t in row["tensors"]:
            if not isinstance(t, dict) or any(k not in t for k in _TENSOR_KEYS) or not isinstance(t["metrics"], dict):
                return False
    return True


# ---------------------------------------------------------------------------------------------------------
# terminal rendering
# ---------------------------------------------------------------------------------------------------------
def fmt_number(x, digits=3) -> str:
    """Short, aligned-looking numbers for tables: 0, 0.0123, 1.23e-05, inf."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if x == 0:
            return "0"
        if 1e-3 <= abs(x) < 1e4:
            return f"{x:.{digits}g}"
        return f"{x:.{digits - 1}e}"
    return str(x)


def _fmt_cos(x) -> str:
    if x is None:
        return "-"
    if x == 1.0:
        return "1"
    if 0 < 1.0 - x < 1e-5:
        return f"1-{1.0 - x:.1e}"
    return f"{x:.6f}"


def _trace_line(side: dict) -> str:
    parts = [side.get("framework") or "?", side.get("framework_version") or "",
             (side.get("model_class") or "").rsplit(".", 1)[-1], f"mode={side.get('mode')}"]
    state = "" if side.get("complete") else " [yellow](incomplete: run did not finish)[/]"
    return f"{side['path']}  ({' '.join(p for p in parts if p)}){state}"


def _origin_lines(origin: dict) -> list[str]:
    lines = [f"[bold red]{origin['description']}[/]" + (f"  [dim]({origin['type']})[/]" if origin.get("type") else "")]
    where = origin.get("where")
    tensor = origin.get("tensor")
    if where == "inputs":
        lines.append("the two runs start from different inputs: check data, seeds and preprocessing first")
        if tensor:
            lines.append(f"{tensor['role']} [cyan]{tensor['key']}[/]: {tensor['reason']}")
    elif where == "raised":
        lines.append("the run stopped with this exception; modules active when it was raised are the chain below")
    elif where == "forward":
        lines.append("backward differs because forward already does; fix the forward origin first")
        if origin.get("backward_candidate"):
            lines.append(f"[dim]then check the backward of {origin['backward_candidate']}[/]")
    elif tensor:
        if origin["phase"] == "forward":
            lead = "inputs agree; " if where == "module" else "its children agree up to here; "
        else:
            lead = "gradient w.r.t. outputs agrees; " if where == "module" else "children agree up to here; "
        lines.append(f"{lead}{tensor['role']} [cyan]{tensor['key']}[/] differs: {tensor['reason']}")
        m = tensor.get("metrics") or {}
        if m.get("basis") == "data":
            lines.append(f"max abs {fmt_number(m.get('max_abs'))}  mean abs {fmt_number(m.get('mean_abs'))}  "
                         f"max rel {fmt_number(m.get('max_rel'))}  cosine {_fmt_cos(m.get('cosine'))}")
        if origin.get("ranks"):
            ranks = origin["ranks"]
            lines.append(f"[yellow]on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                         + (f": {origin['hint']}" if origin.get("hint") else "") + "[/]")
        path_b = origin.get("path_b")
        if path_b is not None and (path_b != origin["module"] or m.get("note")):
            lines.append(f"[dim]in B: {path_b or '<root>'}" + (f" ({m['note']})" if m.get("note") else "") + "[/]")
    if origin.get("error") and where != "raised":
        lines.append(f"[red]raised:[/] {origin['error']}")
    for key, (a, b) in (origin.get("hparam_diff") or {}).items():
        lines.append(f"[yellow]{key}: {a!r} (A) vs {b!r} (B)[/]")
    for p in (origin.get("param_diffs") or [])[:4]:
        lines.append(f"[yellow]parameter {p['name']} differs: {p['reason']}[/]")
    if origin.get("chain") and len(origin["chain"]) > 1:
        lines.append("[dim]chain: " + " > ".join(origin["chain"]) + "[/]")
    return lines


def make_console(**kwargs) -> Console:
    """Wide enough for module paths when piped (rich would default to 80 columns)."""
    probe = Console(**kwargs)
    return probe if probe.is_terminal else Console(width=max(probe.width, 140), **kwargs)


def render(report: dict, console: Console | None = None):
    console = console or make_console()
    console.print(f"[bold]A[/] {_trace_line(report['a'])}")
    console.print(f"[bold]B[/] {_trace_line(report['b'])}")
    basis = report.get("basis")
    n_tensors = sum(len(r["tensors"]) for r in report["records"])
    note = ("[yellow]statistics only (a 'stats' trace): min/max/mean/RMS compared, values were not; a defect "
            "that keeps the statistics can hide[/]" if basis in ("stats", "mixed") else "stored tensor values")
    console.print(f"compared {n_tensors} tensor pairs in {len(report['records'])} records from {note}")
    _render_mapping(report, console)
    for phase in ("forward", "backward"):
        res = report[phase]
        if res["status"] == "absent":
            console.print(f"[bold]{phase.upper():9}[/][dim]not in both traces[/]")
            continue
        ok = res["status"] == "aligned"
        if res["status"] == "failed":
            mark = "[bold red]failed[/] (a run raised; everything recorded before it agrees)"
        else:
            mark = "[bold green]aligned[/]" if ok else f"[bold red]divergent[/] ({res['failing_tensors']} tensors over tolerance)"
        console.print(f"[bold]{phase.upper():9}[/]{mark}")
        origin = res.get("first_divergence")
        if origin:
            lines = _origin_lines(origin)
            console.print("  origin: " + lines[0])
            for line in lines[1:]:
                console.print("          " + line)
            first = res.get("first_over_tolerance")
            if first and first["module"] != origin["module"] and origin.get("where") not in ("forward",):
                console.print(f"          [dim](first over tolerance in execution order: {first['module'] or '<root>'};"
                              " the origin is where inputs still agree)[/]")
        failure = res.get("failure")
        if failure and (origin or {}).get("where") != "raised":
            console.print(f"  [red]run B raised in {failure['module'] or '<root>'}: {failure['error']}[/]")
    for side in ("a", "b"):
        nf = report.get("first_nonfinite", {}).get(side)
        if nf:
            console.print(f"[red]first NaN/Inf in {side.upper()}:[/] {nf['module'] or '<root>'} ({nf['phase']}) "
                          f"{nf['tensor']}: {nf['nan']} NaN, {nf['inf']} Inf")
    _render_growth(report, console)
    _render_next_pass(report, console)
    _render_footer(report, console)


def _render_mapping(report: dict, console: Console, shown: int = 12):
    """The inferred mapping, with repeated blocks shown once (``layers.*``), in A's execution order."""
    from .mapping import collapse_indices

    mapping = report.get("mapping") or []
    if mapping:
        groups: dict = {}
        for m in mapping:
            b = " + ".join(m.get("b_parts") or [m["b"]])
            a = " + ".join(m.get("a_parts") or [m["a"]])
            g = groups.setdefault((collapse_indices(b), collapse_indices(a)), {"n": 0, "low": 1.0, "why": m["reason"]})
            g["n"] += 1
            g["low"] = min(g["low"], m["confidence"])
        fused = sum(1 for m in mapping if m.get("rule"))
        low = min(m["confidence"] for m in mapping)
        console.print(f"[yellow]module names differ: matched {len(mapping)} B modules to A"
                      + (f" ({fused} fused)" if fused else "") + f" from weights, names, types and structure "
                      f"(lowest confidence {low:.2f}); --save-map writes them as --map rules[/]")
        for (b, a), g in list(groups.items())[:shown]:
            count = f" x{g['n']}" if g["n"] > 1 else ""
            console.print(f"  [dim]{b} -> {a}{count}  ({g['low']:.2f}: {g['why']})[/]")
        if len(groups) > shown:
            console.print(f"  [dim]... {len(groups) - shown} more[/]")
    unmatched = (report.get("unmatched_modules") or {}).get("b") or []
    if mapping and unmatched:
        names = list(dict.fromkeys(collapse_indices(p) for p in unmatched))
        console.print(f"  [dim]B modules with no counterpart in A: {', '.join(names[:6])}"
                      + (f" (+{len(names) - 6})" if len(names) > 6 else "") + "[/]")


def _render_growth(report: dict, console: Console):
    rows = report.get("growth") or []
    if not rows or report["forward"]["status"] == "aligned":
        return
    table = Table(title="forward, block by block: how the error grows", title_justify="left", box=None,
                  header_style="bold", pad_edge=False)
    for col, kw in (("module", {"no_wrap": True}), ("type", {"style": "dim"}), ("max abs", {"justify": "right"}),
                    ("rel", {"justify": "right"}), ("cosine", {"justify": "right"}), ("", {})):
        table.add_column(col, **kw)
    for r in rows:
        indent = "  " * r["depth"]
        name = (r["module"] or "<root>") + (f" #{r['call']}" if r["call"] else "")
        style = "bold red" if r["origin"] else ("" if r["passed"] else "red")
        mark = Text("<- origin", style="bold red") if r["origin"] else Text("ok" if r["passed"] else "x",
                                                                            style="green" if r["passed"] else "red")
        table.add_row(Text(indent + name, style=style), r["type"] or "", fmt_number(r["max_abs"]), fmt_number(r["rel"]),
                      _fmt_cos(r["cosine"]), mark)
    console.print(table)


def _command(side: dict, placeholder: str) -> str:
    target = side.get("target")
    if not target:
        return placeholder
    return " ".join([target] + [f"--arg {k}={v}" for k, v in (side.get("target_args") or {}).items()])


def _render_next_pass(report: dict, console: Console):
    nxt = report.get("next_pass")
    if not nxt:
        return
    console.print(f"[bold]next:[/] these were statistics; trace the suspect block {nxt['block']} in full mode and "
                  "replay the candidate on it:", highlight=False)
    console.print(f"  layerdiff trace {_command(report['a'], 'REFERENCE_TARGET')} --layers {nxt['layers']} "
                  f"-o a_window.h5", highlight=False, soft_wrap=True)
    console.print(f"  layerdiff bisect a_window.h5 {_command(report['b'], 'CANDIDATE_TARGET')}", highlight=False,
                  soft_wrap=True)


def _render_footer(report: dict, console: Console):
    notes = []
    p = report.get("params", {})
    if p.get("compared"):
        notes.append(f"parameters: {len(p['differ'])} of {p['compared']} differ"
                     + (f" (first: {p['differ'][0]})" if p["differ"] else ""))
    if report.get("only_a") or report.get("only_b"):
        def names(rs):
            return ", ".join(sorted({r["path"] or "<root>" for r in rs})[:3])
        notes.append(f"unmatched records: {len(report['only_a'])} only in A ({names(report['only_a'])}), "
                     f"{len(report['only_b'])} only in B ({names(report['only_b'])})")
    for side in ("a", "b"):
        for w in report[side].get("warnings", []):
            notes.append(f"warning ({side.upper()}): {w}")
    for n in notes:
        console.print(f"[dim]{n}[/]")
    verdict = report["verdict"]
    console.print(f"verdict: [bold {'green' if verdict == 'aligned' else 'red'}]{verdict}[/]")


class ByteProgress:
    """A rich progress bar over bytes, shown only on a terminal and when not quiet."""

    def __init__(self, description: str, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.description = description
        self._bar = None
        self._task = None

    def start(self, total: int):
        if not self.enabled or total <= 0:
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self._bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                             TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                             transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=total)

    def advance(self, n: int):
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class StepProgress:
    """Steps done, records and bytes written, while ``layerdiff trace`` runs (terminal only)."""

    def __init__(self, steps: int, enabled: bool | None = None):
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress("tracing", BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[written]}"),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("steps", total=steps, written="")

    def advance(self, writer):
        if self._bar is not None:
            self._bar.update(self._task, advance=1,
                             written=f"{writer.records_written} records, {writer.tensor_bytes / 1e6:.1f} MB")

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class RunProgress:
    """``layerdiff bisect``: a bar over the runs (each is a whole step of the candidate) with the current one's
    label on a terminal; one line per run otherwise, so logs show how far an interrupted bisect got."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._bar = None
        self._task = None
        self.started = 0

    def expect(self, runs: int):
        """The number of runs this bisect will take (the binary search knows it once it has found the blocks)."""
        if not self.enabled or not self.console.is_terminal:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._bar is None:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("bisect", total=runs)
        else:
            self._bar.update(self._task, total=runs)

    def __call__(self, message: str, start: bool = False):
        if not self.enabled:
            return
        if start:
            self.started += 1
            message = f"run {self.started}: {message}"
        if self._bar is not None:
            self._bar.update(self._task, description=message, advance=0 if start else 1)
        self.console.print(f"[dim]{message}[/]", highlight=False)

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _segment_line(seg: dict) -> str:
    t = seg.get("tensor") or {}
    m = t.get("metrics") or {}
    detail = f"{t.get('role')} [cyan]{t.get('key')}[/]: {t.get('reason')}" if t else seg.get("error", "")
    extra = f"  (max abs {fmt_number(m.get('max_abs'))}, cosine {_fmt_cos(m.get('cosine'))})" if m.get("basis") == "data" else ""
    return f"[bold red]{seg['description']}[/]\n      {detail}{extra}"


def render_replay(result: dict, console: Console | None = None, shown: int = 6):
    """Own errors (the candidate on the reference's numbers), then how the free run amplified what it got."""
    console = console or make_console()
    console.print(f"[bold]A[/] {_trace_line(result['a'])}")
    console.print(f"[bold]B[/] replayed on A's recorded values (inputs, outputs and gradients forced at every "
                  f"module boundary; {result['forcing'].get('forced_tensors', 0)} tensors forced)")
    for note in result["forcing"].get("not_forced", [])[:3]:
        console.print(f"  [yellow]not forced: {note}[/]")
    for phase in ("forward", "backward"):
        segs = result[phase]["segments"]
        if not segs:
            what = "outputs from A's inputs" if phase == "forward" else "input gradients from A's output gradients"
            console.print(f"[bold]{phase.upper():9}[/][bold green]no own error[/]: every module reproduces A's {what}")
        else:
            console.print(f"[bold]{phase.upper():9}[/][bold red]{len(segs)} segment(s) with own error[/], in "
                          "execution order:")
            for i, seg in enumerate(segs[:shown]):
                console.print(f"  {i + 1}. " + _segment_line(seg))
            if len(segs) > shown:
                console.print(f"  [dim]... {len(segs) - shown} more (see --json)[/]")
        origin = (result.get("align") or {}).get(phase)
        confirms = (result.get("confirms") or {}).get(phase)
        if origin is not None and confirms is not None:
            text = "[green]confirms[/]" if confirms else "[yellow]disagrees with[/]"
            console.print(f"  replay {text} align's origin: {origin['description']}")
    _render_amplification(result, console)
    verdict = result["verdict"]
    console.print(f"verdict: [bold {'green' if verdict == 'clean' else 'red'}]{verdict}[/]")


def _render_amplification(result: dict, console: Console, max_rows: int = 16):
    culprits = {(s["module"], s["call"]) for s in result["forward"]["segments"]}
    rows = [m for m in result["modules"] if "out_rel" in m]
    if not rows or not any(m["out_rel"] for m in rows):
        return
    depth = 1
    while depth < 8 and sum(1 for m in rows if m["depth"] <= depth + 1) <= max_rows:
        depth += 1
    shown = [m for m in rows if m["depth"] <= depth or (m["module"], m["call"]) in culprits]
    table = Table(title="own error vs inherited (free run): relative error in -> out", title_justify="left",
                  box=None, header_style="bold", pad_edge=False)
    for col in ("module", "own (replay)", "in (free)", "out (free)", "amplification", ""):
        table.add_column(col, justify="left" if col in ("module", "") else "right", no_wrap=col == "module")
    for m in shown:
        own = (m["module"], m["call"]) in culprits
        mark = Text("<- own error", style="bold red") if own else Text("")
        table.add_row(Text("  " * m["depth"] + (m["module"] or "<root>"), style="bold red" if own else ""),
                      fmt_number(m["own_rel"]), fmt_number(m.get("in_rel")), fmt_number(m.get("out_rel")),
                      fmt_number(m.get("amplification")), mark)
    console.print(table)


def render_search(result: dict, console: Console | None = None):
    console = console or make_console()
    blocks = result["blocks"]
    console.print(f"binary search over {len(blocks)} blocks of {result['container'] or '<root>'}: "
                  f"{result['splice_runs']} splice run(s) after the baseline (log2 N = {result['expected_runs']})")
    for run in result["runs"]:
        what = "baseline (nothing spliced)" if run["spliced"] is None else f"A's input spliced into {run['splice_block']}"
        def ok(v):
            return "-" if v is None else ("[green]ok[/]" if v else "[red]differs[/]")
        console.print(f"  {what:55} first block input {ok(run['first_input_ok'])}  "
                      f"last block output {ok(run['last_output_ok'])}  final output {ok(run['final_ok'])}"
                      + (f"  [red]raised: {run['raised']}[/]" if run.get("raised") else ""))
    answer = result["answer"]
    style = "green" if answer["where"] == "none" else "bold red"
    name = f"{result['block']}: " if result.get("block") else ""
    console.print(f"[{style}]{name}{answer['description']}[/]")
    if result.get("block"):
        block_b = re.escape(result.get("block_b") or result["block"])
        console.print(f"[dim]next: replay that block module by module: layerdiff bisect {result['a']['path']} "
                      f"{_command(result['b'], 'CANDIDATE_TARGET')} --include '^{block_b}(\\.|$)'[/]",
                      highlight=False, soft_wrap=True)


def render_ranks(result: dict, console: Console):
    """``layerdiff align RUN``: one line per rank against rank 0, then the first desync."""
    console.print(f"[bold]{result['path']}[/]: {result['world_size']} ranks, each compared with rank 0 on what "
                  "replicas must agree on (shards and partial sums left out)")
    for r in result["ranks"]:
        if r["verdict"] == "aligned":
            console.print(f"  rank {r['rank']}: [green]agrees with rank 0[/]")
            continue
        parts = [f"{phase} {r[phase]['description']}" for phase in ("forward", "backward") if r[phase]]
        differ = f"; parameters differ: {', '.join(r['params_differ'][:3])}" if r["params_differ"] else ""
        console.print(f"  rank {r['rank']}: [red]differs[/]: {'; '.join(parts) or 'parameters only'}{differ}")
    first = result["first_divergence"]
    if first:
        console.print(f"[bold red]first desync ({first['phase']}): {first['description']}[/] on rank(s) "
                      f"{', '.join(map(str, first['ranks']))}")
    console.print(f"verdict: {result['verdict']}")
