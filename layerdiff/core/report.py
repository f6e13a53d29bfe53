"""Rendering of an alignment report: a terminal view a person reads in ten seconds, and JSON for tools.

The JSON holds every measured metric, so ``layerdiff report`` can re-judge it under other tolerances.
Non-finite floats are written as the strings "inf", "-inf" and "nan" to keep the file standard JSON.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import LayerdiffError
from . import schema
from .files import write_atomically


def json_text(report: dict) -> str:
    """The report as JSON text (non-finite numbers as "nan", "inf", "-inf": strict JSON readers accept it)."""
    return schema.dumps(report)


def write_json(report: dict, path, *, overwrite: bool = False):
    """Write atomically (temp file + rename) and never over an existing file unless asked."""
    write_atomically(path, json_text(report), overwrite=overwrite)


def publish(report: dict, *, json_path=None, overwrite: bool = False, quiet: bool = False, line=None, render=None):
    """What a comparing command does with its result: the JSON file if asked, then one verdict line (quiet) or
    the full rendering."""
    if json_path:
        write_json(report, json_path, overwrite=overwrite)
    if quiet:
        print(line(report))
    else:
        render(report)


def read_json(path) -> schema.Report:
    """A JSON report written by ``layerdiff align --json``, checked before anything reads it: a foreign, damaged
    or hostile file (wrong shapes, wrong types, nesting too deep) is one ``LayerdiffError`` naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise LayerdiffError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LayerdiffError(f"{path}: is a directory, not a JSON report") from None
    except RecursionError:
        raise LayerdiffError(f"{path}: not a JSON report (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LayerdiffError(f"{path}: not a JSON report ({type(exc).__name__})") from None
    if _too_deep(data, _MAX_JSON_DEPTH):  # from_json_safe and evaluate recurse: bound the depth first
        raise LayerdiffError(f"{path}: JSON, but not a layerdiff align report (nested more than {_MAX_JSON_DEPTH} "
                             "levels)")
    data = schema.from_json_safe(data)
    problem = report_problem(data)
    if problem:
        raise LayerdiffError(f"{path}: JSON, but not a layerdiff align report ({problem})")
    return data


_MAX_JSON_DEPTH = 64  # a real report nests about 8 levels (records, tensors, metrics, per-rank metrics)
_MAX_TREE_DEPTH = 128  # module nesting; evaluate descends the call tree recursively


def _too_deep(data, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels (iterative: no recursion on hostile input)."""
    stack = [(data, 0)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, (dict, list)):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    return False


def _metrics_problem(m: schema.Metrics, where: str) -> str | None:
    """Beyond the declared types: ``judge`` compares max_abs unless the pair was not comparable or identical."""
    if not (m.get("mismatch") or m.get("nonfinite_mismatch") or m.get("identical")):
        if m.get("max_abs") is None:
            return f"{where} has no max_abs"
        if "ref_max_abs" in m and m["ref_max_abs"] is None:
            return f"{where}.ref_max_abs is not a number"
    for rank, per_rank in (m.get("ranks") or {}).items():  # "0", "1", ... and "sum"; other keys are notes
        if rank.isdigit() or rank == "sum":
            if rank != "sum" and not re.fullmatch(r"[0-9]{1,9}", rank):
                return f"{where}.ranks has a bad rank number"
            found = schema.problem(per_rank, schema.Metrics, f"{where}.ranks.{rank}") or \
                _metrics_problem(per_rank, f"{where}.ranks.{rank}")
            if found:
                return found
    return None


def _row_problem(row: schema.Row, where: str) -> str | None:
    """Beyond the declared types: what depends on a row's kind."""
    if row["kind"] == "call" and row["phase"] is None:
        return f"{where}.phase must be forward or backward"
    if row["kind"] == "call" and "type_a" not in row:  # the growth table reads it
        return f"{where} has no type_a"
    if row["kind"] in ("param", "param_grad", "param_grad_use") and not isinstance(row.get("module"), str):
        return f"{where}.module must be a string"
    for j, t in enumerate(row["tensors"]):
        found = _metrics_problem(t["metrics"], f"{where}.tensors[{j}].metrics")
        if found:
            return found
    return None


def _tree_too_deep(rows: list[schema.Row], limit: int) -> bool:
    """Whether the call tree ``align.call_tree`` builds from these rows (a call hangs under its nearest recorded
    ancestor) nests deeper than ``limit``; cycles never reach a root, so they do not count."""
    for phase in ("forward", "backward"):
        nodes = {(r["path"], r["call"]): r for r in rows if r["kind"] == "call" and r["phase"] == phase}
        parent_of = {}
        for key, r in nodes.items():
            chain = r.get("ancestors")
            if chain is None:
                chain = [r["parent"]] if r.get("parent") else []
            parent_of[key] = next((tuple(up) for up in chain if tuple(up) in nodes), None)
        depth: dict = {}  # call -> depth below its root, None when no root is above it (a cycle)
        for key in nodes:
            walk, seen, k = [], set(), key
            while k is not None and k not in depth and k not in seen:
                walk.append(k)
                seen.add(k)
                k = parent_of[k]
            base = -1 if k is None else depth.get(k)  # None: k is on a cycle, or under one
            for w in reversed(walk):
                base = None if base is None else base + 1
                depth[w] = base
                if base is not None and base > limit:
                    return True
    return False


def report_problem(data) -> str | None:
    """What keeps ``data`` (parsed JSON, non-finite numbers restored) from being a report that ``evaluate`` and
    ``render`` can take: the declared shape (``schema.Report``), then what types alone do not say. None: nothing."""
    found = schema.problem(data, schema.Report, "report")
    if found:
        return found.removeprefix("report.")
    for i, row in enumerate(data["records"]):
        found = _row_problem(row, f"records[{i}]")
        if found:
            return found
    if _tree_too_deep(data["records"], _MAX_TREE_DEPTH):
        return f"calls nested more than {_MAX_TREE_DEPTH} levels"
    return None


# ---------------------------------------------------------------------------------------------------------
# terminal rendering
# ---------------------------------------------------------------------------------------------------------
def fmt_number(x, digits=3) -> str:
    """Short, aligned-looking numbers for tables: 0, 0.0123, 1.23e-05, inf."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        if 1e-3 <= abs(x) < 1e4:
            return f"{x:.{digits}g}"
        return f"{x:.{digits - 1}e}"
    return str(x)


def fmt_cos(x) -> str:
    """A cosine similarity, with the distance from 1 shown where six decimals would round it to 1."""
    if x is None:
        return "-"
    if x == 1.0:
        return "1"
    if 0 < 1.0 - x < 1e-5:
        return f"1-{1.0 - x:.1e}"
    return f"{x:.6f}"


def _render_settings(report: schema.Report, console: Console):
    """Run settings that differ (seeds, deterministic switches, versions, ...) and the runs' own notes."""
    settings = report.get("settings") or {}
    differ = settings.get("differ") or []
    if differ:
        console.print("[bold yellow]run settings that differ[/] (they can explain a difference by themselves):")
        for d in differ:
            console.print(f"  [yellow]{_e(d['key'])}: {_e(d['a'])} (A) vs {_e(d['b'])} (B)[/]  [dim]{_e(d['why'])}[/]")
    notes = settings.get("notes") or {}
    a, b = notes.get("a") or {}, notes.get("b") or {}
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    if keys:
        console.print("notes that differ: " + "; ".join(f"{_e(k)}: {_e(a.get(k))} (A) vs {_e(b.get(k))} (B)"
                                                       for k in keys))


def _trace_line(side: schema.RunSummary) -> str:
    parts = [side.get("framework") or "?", side.get("framework_version") or "",
             (side.get("model_class") or "").rsplit(".", 1)[-1], f"mode={side.get('mode')}"]
    state = "" if side.get("complete") else " [yellow](incomplete: run did not finish)[/]"
    return f"{_e(side['path'])}  ({_e(' '.join(str(p) for p in parts if p))}){state}"


def _e(value) -> str:
    """A value from a report (a module path, a file name, an error message) shown as text, never as markup."""
    return escape(str(value))


def step_count(report: schema.Report) -> int:
    """How many steps the compared records span (a multi-step trace names the step where divergence starts)."""
    return max((r.get("step", 0) for r in report.get("records", ())), default=0) + 1


def origin_lines(origin: schema.Origin, steps: int = 1) -> list[str]:
    lines = [f"[bold red]{_e(origin['description'])}[/]"
             + (f"  [dim]({_e(origin['type'])})[/]" if origin.get("type") else "")
             + (f"  [bold]at step {origin.get('step', 0) + 1} of {steps}[/]" if steps > 1 else "")]
    where = origin.get("where")
    tensor = origin.get("tensor")
    if where == "inputs":
        lines.append("the two runs start from different inputs: check data, seeds and preprocessing first")
        if tensor:
            lines.append(f"{_e(tensor['role'])} [cyan]{_e(tensor['key'])}[/]: {_e(tensor['reason'])}")
    elif where == "raised":
        lines.append("the run stopped with this exception; modules active when it was raised are the chain below")
    elif where == "forward":
        lines.append("backward differs because forward already does; fix the forward origin first")
    elif tensor:
        if origin["phase"] == "forward":
            lead = "inputs agree; " if where == "module" else "its children agree up to here; "
        else:
            lead = "gradient w.r.t. outputs agrees; " if where == "module" else "children agree up to here; "
        lines.append(f"{lead}{_e(tensor['role'])} [cyan]{_e(tensor['key'])}[/] differs: {_e(tensor['reason'])}")
        m = tensor.get("metrics") or {}
        if m.get("basis") == "data":
            lines.append(f"max abs {fmt_number(m.get('max_abs'))}  mean abs {fmt_number(m.get('mean_abs'))}  "
                         f"max rel {fmt_number(m.get('max_rel'))}  cosine {fmt_cos(m.get('cosine'))}")
        if origin.get("ranks"):
            ranks = origin["ranks"]
            lines.append(f"[yellow]on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                         + (f": {_e(origin['hint'])}" if origin.get("hint") else "") + "[/]")
        path_b = origin.get("path_b")
        if path_b is not None and (path_b != origin["module"] or m.get("note")):
            lines.append(f"[dim]in B: {_e(path_b or '<root>')}" + (f" ({_e(m['note'])})" if m.get("note") else "")
                         + "[/]")
    if origin.get("error") and where != "raised":
        lines.append(f"[red]raised:[/] {_e(origin['error'])}")
    for key, (a, b) in (origin.get("hparam_diff") or {}).items():
        lines.append(f"[yellow]{_e(key)}: {_e(repr(a))} (A) vs {_e(repr(b))} (B)[/]")
    if origin.get("class_diff"):
        a, b = origin["class_diff"]
        lines.append(f"[yellow]class: {_e(a)} (A) vs {_e(b)} (B), the same type family[/]")
    for p in (origin.get("param_diffs") or [])[:4]:
        lines.append(f"[yellow]parameter {_e(p['name'])} differs: {_e(p['reason'])}[/]")
    if origin.get("chain") and len(origin["chain"]) > 1:
        lines.append("[dim]chain: " + _e(" > ".join(origin["chain"])) + "[/]")
    return lines


def scalar_outputs_by_step(report: schema.Report) -> list[tuple[int, str, float, float, bool]]:
    """(step, key, A's value, B's value, within tolerance) of the model's one-element outputs (the loss) in
    every step: what a training comparison looks at first."""
    out = []
    for row in report.get("records", ()):
        if row.get("kind") == "call" and row.get("phase") == "forward" and row.get("path") == "" and \
                row.get("parent") is None:
            out += [(row.get("step", 0), t["key"], t["value_a"], t["value_b"], bool(t.get("passed")))
                    for t in row["tensors"] if t.get("role") == "output" and "value_a" in t and "value_b" in t]
    return sorted(out)


def _render_steps(report: schema.Report, console: Console):
    steps = step_count(report)
    if steps < 2:
        return
    rows = scalar_outputs_by_step(report)
    differing = sorted({r.get("step", 0) for r in report["records"] if not row_passed(r)})
    origins = [report[p]["first_divergence"] for p in ("forward", "backward")
               if (report.get(p) or {}).get("first_divergence")]
    if origins:
        first = min(origins, key=lambda o: o.get("step", 0))
        console.print(f"[bold]steps[/] {steps}: first diverges at step {first.get('step', 0) + 1}: "
                      f"{_e(first['description'])}")
    elif differing:
        console.print(f"[bold]steps[/] {steps}: first differs at step {differing[0] + 1}")
    else:
        console.print(f"[bold]steps[/] {steps}: every step agrees")
    if rows:
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for column in ("step", "output", "A", "B", ""):
            table.add_column(column, justify="right" if column in ("step", "A", "B") else "left")
        for step, key, a, b, ok in rows:
            table.add_row(str(step + 1), _e(key), _value(a), _value(b), "ok" if ok else "[red]x[/]")
        console.print(table)


def _value(x) -> str:
    return "-" if x is None else f"{x:.7g}"  # a loss: enough digits to see a difference in the 6th


def row_passed(row: schema.Row) -> bool:
    """Every tensor of a report row within tolerance."""
    return all(t.get("passed", True) for t in row.get("tensors", ()))


def make_console(**kwargs) -> Console:
    """Wide enough for module paths when piped (rich would default to 80 columns)."""
    probe = Console(**kwargs)
    return probe if probe.is_terminal else Console(width=max(probe.width, 140), **kwargs)


def render(report: schema.Report, console: Console | None = None):
    console = console or make_console()
    _render_body(report, console)
    for problem in (report.get("trust") or {}).get("problems", []):
        console.print(f"[bold yellow]WARNING: {_e(problem)}[/]")
    if (report.get("trust") or {}).get("problems") and report["verdict"] == "aligned":
        console.print("[bold yellow]the runs agree on what was compared, but the comparison is incomplete (exit 3)[/]")


def _render_body(report: schema.Report, console: Console):
    console.print(f"[bold]A[/] {_trace_line(report['a'])}")
    console.print(f"[bold]B[/] {_trace_line(report['b'])}")
    basis = report.get("basis")
    n_tensors = sum(len(r["tensors"]) for r in report["records"])
    note = ("[yellow]statistics only (a 'stats' trace): min/max/mean/RMS compared, values were not; a defect "
            "that keeps the statistics can hide[/]" if basis in ("stats", "mixed") else "stored tensor values")
    console.print(f"compared {n_tensors} tensor pairs in {len(report['records'])} records from {note}")
    _render_settings(report, console)
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
            lines = origin_lines(origin, step_count(report))
            console.print("  origin: " + lines[0])
            for line in lines[1:]:
                console.print("          " + line)
            first = res.get("first_over_tolerance")
            if first and first["module"] != origin["module"] and origin.get("where") not in ("forward",):
                console.print(f"          [dim](first over tolerance in execution order: {_e(first['module'] or '<root>')};"
                              " the origin is where inputs still agree)[/]")
        failure = res.get("failure")
        if failure and (origin or {}).get("where") != "raised":
            console.print(f"  [red]run B raised in {_e(failure['module'] or '<root>')}: {_e(failure['error'])}[/]")
    if report.get("config_diff"):
        console.print("[yellow]the models' own configs differ: " + "; ".join(
            f"{_e(d['key'])} {_e(d['a'])} (A) vs {_e(d['b'])} (B)" for d in report["config_diff"]) + "[/]")
    for side in ("a", "b"):
        nf = report.get("first_nonfinite", {}).get(side)
        if nf:
            console.print(f"[red]first NaN/Inf in {side.upper()}:[/] {_e(nf['module'] or '<root>')} ({nf['phase']}) "
                          f"{_e(nf['tensor'])}: {nf['nan']} NaN, {nf['inf']} Inf")
    _render_steps(report, console)
    _render_growth(report, console)
    _render_next_pass(report, console)
    _render_footer(report, console)


def _render_mapping(report: schema.Report, console: Console, shown: int = 12):
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
            console.print(f"  [dim]{_e(b)} -> {_e(a)}{count}  ({g['low']:.2f}: {_e(g['why'])})[/]")
        if len(groups) > shown:
            console.print(f"  [dim]... {len(groups) - shown} more[/]")
    unmatched = (report.get("unmatched_modules") or {}).get("b") or []
    if mapping and unmatched:
        names = list(dict.fromkeys(collapse_indices(p) for p in unmatched))
        console.print(f"  [dim]B modules with no counterpart in A: {_e(', '.join(names[:6]))}"
                      + (f" (+{len(names) - 6})" if len(names) > 6 else "") + "[/]")


def _render_growth(report: schema.Report, console: Console):
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
        table.add_row(Text(indent + name, style=style), _e(r["type"] or ""), fmt_number(r["max_abs"]), fmt_number(r["rel"]),
                      fmt_cos(r["cosine"]), mark)
    console.print(table)


def _command(side: schema.RunSummary, placeholder: str) -> str:
    target = side.get("target")
    if not target:
        return placeholder
    return " ".join([target] + [f"--arg {k}={v}" for k, v in (side.get("target_args") or {}).items()])


def _render_next_pass(report: schema.Report, console: Console):
    nxt = report.get("next_pass")
    if not nxt:
        return
    console.print(f"[bold]next:[/] these were statistics; trace the suspect block {nxt['block']} in full mode and "
                  "replay the candidate on it:", highlight=False)
    console.print(f"  layerdiff trace {_command(report['a'], 'REFERENCE_TARGET')} --layers {nxt['layers']} "
                  f"-o a_window.h5", highlight=False, soft_wrap=True)
    console.print(f"  layerdiff bisect a_window.h5 {_command(report['b'], 'CANDIDATE_TARGET')}", highlight=False,
                  soft_wrap=True)


def _render_footer(report: schema.Report, console: Console):
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
        console.print(f"[dim]{_e(n)}[/]")
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
    detail = f"{_e(t.get('role'))} [cyan]{_e(t.get('key'))}[/]: {_e(t.get('reason'))}" if t else _e(seg.get("error", ""))
    extra = f"  (max abs {fmt_number(m.get('max_abs'))}, cosine {fmt_cos(m.get('cosine'))})" if m.get("basis") == "data" else ""
    return f"[bold red]{_e(seg['description'])}[/]\n      {detail}{extra}"


def render_replay(result: dict, console: Console | None = None, shown: int = 6):
    """Own errors (the candidate on the reference's numbers), then how the free run amplified what it got."""
    console = console or make_console()
    console.print(f"[bold]A[/] {_trace_line(result['a'])}")
    console.print(f"[bold]B[/] replayed on A's recorded values (inputs, outputs and gradients forced at every "
                  f"module boundary; {result['forcing'].get('forced_tensors', 0)} tensors forced)")
    for note in result["forcing"].get("not_forced", [])[:3]:
        console.print(f"  [yellow]not forced: {_e(note)}[/]")
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
            console.print(f"  replay {text} align's origin: {_e(origin['description'])}")
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
    console.print(f"[{style}]{_e(name)}{_e(answer['description'])}[/]")
    if result.get("block"):
        block_b = re.escape(result.get("block_b") or result["block"])
        console.print(f"[dim]next: replay that block module by module: layerdiff bisect {result['a']['path']} "
                      f"{_command(result['b'], 'CANDIDATE_TARGET')} --include '^{block_b}(\\.|$)'[/]",
                      highlight=False, soft_wrap=True)


def render_ranks(result: dict, console: Console):
    """``layerdiff align RUN``: one line per rank against rank 0, then the first desync."""
    console.print(f"[bold]{_e(result['path'])}[/]: {result['world_size']} ranks, each compared with rank 0 on what "
                  "replicas must agree on (shards and partial sums left out)")
    for r in result["ranks"]:
        if r["verdict"] == "aligned":
            console.print(f"  rank {r['rank']}: [green]agrees with rank 0[/]")
            continue
        parts = [f"{phase} {r[phase]['description']}" for phase in ("forward", "backward") if r[phase]]
        differ = f"; parameters differ: {', '.join(r['params_differ'][:3])}" if r["params_differ"] else ""
        console.print(f"  rank {r['rank']}: [red]differs[/]: {_e('; '.join(parts) or 'parameters only')}{_e(differ)}")
    first = result["first_divergence"]
    if first:
        console.print(f"[bold red]first desync ({first['phase']}): {_e(first['description'])}[/] on rank(s) "
                      f"{', '.join(map(str, first['ranks']))}")
    console.print(f"verdict: {result['verdict']}")
