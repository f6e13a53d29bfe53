"""The terminal view of an alignment report, read in ten seconds: the verdict, each direction's origin and why,
how the error grows block by block, the mapping, the settings that differ; and the view of a run's ranks."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from layerdiff.match.mapping import collapse_indices
from layerdiff.report.ops_view import (code_at, is_origin_row, module_ops, origin_code, origin_hints, row_status,
                                       short_source)

# A report, or a part of one, as it reads back from JSON: rendered as far as it goes, never trusted to hold every key
View = Mapping[str, Any]


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


def _usual_file(rows: list, key: str) -> str | None:
    """The file most of the shown operations' lines are in (the table gives the others' file with their line)."""
    files = Counter(short_source(row[key]["source"]).rpartition(":")[0] for row in rows
                    if (row.get(key) or {}).get("source"))
    return files.most_common(1)[0][0] if files else None


def _render_settings(report: View, console: Console):
    """Run settings that differ (seeds, deterministic switches, versions, ...) and the runs' own notes."""
    settings = report.get("settings") or {}
    differ = settings.get("differ") or []
    if differ:
        console.print("[bold yellow]run settings that differ[/] (they can explain a difference by themselves):")
        for d in differ:
            console.print(f"  [yellow]{as_text(d['key'])}: {as_text(d['a'])} (A) vs {as_text(d['b'])} (B)[/]  [dim]{as_text(d['why'])}[/]")
    notes = settings.get("notes") or {}
    a, b = notes.get("a") or {}, notes.get("b") or {}
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    if keys:
        console.print("notes that differ: " + "; ".join(f"{as_text(k)}: {as_text(a.get(k))} (A) vs {as_text(b.get(k))} (B)"
                                                       for k in keys))


def trace_line(side: View) -> str:
    parts = [side.get("framework") or "?", side.get("framework_version") or "",
             (side.get("model_class") or "").rsplit(".", 1)[-1], f"mode={side.get('mode')}"]
    state = "" if side.get("complete") else " [yellow](incomplete: run did not finish)[/]"
    return f"{as_text(side['path'])}  ({as_text(' '.join(str(p) for p in parts if p))}){state}"


def as_text(value) -> str:
    """A value from a report (a module path, a file name, an error message) shown as text, never as markup."""
    return escape(str(value))


def step_count(report: View) -> int:
    """How many steps the compared records span (a multi-step trace names the step where divergence starts)."""
    return max((r.get("step", 0) for r in report.get("records", ())), default=0) + 1


def origin_lines(origin: View, steps: int = 1) -> list[str]:
    lines = [f"[bold red]{as_text(origin['description'])}[/]"
             + (f"  [dim]({as_text(origin['type'])})[/]" if origin.get("type") else "")
             + (f"  [bold]at step {origin.get('step', 0) + 1} of {steps}[/]" if steps > 1 else "")]
    where = origin.get("where")
    tensor = origin.get("tensor")
    if where == "inputs":
        lines.append("the two runs start from different inputs: check data, seeds and preprocessing first")
        if tensor:
            lines.append(f"{as_text(tensor['role'])} [cyan]{as_text(tensor['key'])}[/]: {as_text(tensor['reason'])}")
    elif where == "raised":
        lines.append("the run stopped with this exception; modules active when it was raised are the chain below")
    elif where == "forward":
        lines.append("backward differs because forward already does; fix the forward origin first")
    elif where == "accumulated":
        lines.append("judge the output at the precision it has (--rtol/--cos), or compare with a reference in that "
                     "precision")
        if tensor:
            lines.append(f"{as_text(tensor['role'])} [cyan]{as_text(tensor['key'])}[/]: {as_text(tensor['reason'])}")
    elif where == "update":
        lines.append("compare the optimizers' settings, and what runs between backward and optimizer.step() "
                     "(gradient clipping, scaling, accumulation)")
    elif tensor:
        if where == "op_input":
            lead = "where its input was made was not recorded; " if (origin.get("op") or {}).get("unknown_maker") \
                else "what made its input agrees; "
        elif origin["phase"] == "forward":
            lead = "inputs agree; " if where in ("module", "op") else "its children agree up to here; "
            unpaired = [k for k in (origin.get("unpaired") or {}).get("a", []) if k.startswith("input:")]
            if where == "op" and unpaired:  # an input one run computes otherwise: no counterpart to compare with
                lead = f"inputs agree where they pair ({', '.join(unpaired)} has no counterpart in B); "
        else:
            lead = "gradient w.r.t. outputs agrees; " if where in ("module", "op") else "children agree up to here; "
        verb = ":" if tensor.get("within_tolerance") else " differs:"  # named for its weight, not over tolerance
        lines.append(f"{lead}{as_text(tensor['role'])} [cyan]{as_text(tensor['key'])}[/]{verb} "
                     f"{as_text(tensor['reason'])}")
        m = tensor.get("metrics") or {}
        if m.get("basis") == "data":
            over = "  (over the values finite in both)" if m.get("nonfinite_mismatch") else ""
            lines.append(f"max abs {fmt_number(m.get('max_abs'))}  mean abs {fmt_number(m.get('mean_abs'))}  "
                         f"max rel {fmt_number(m.get('max_rel'))}  cosine {fmt_cos(m.get('cosine'))}{over}")
        if origin.get("ranks"):
            ranks = origin["ranks"]
            lines.append(f"[yellow]on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                         + (f": {as_text(origin['hint'])}" if origin.get("hint") else "") + "[/]")
        elif origin.get("hint"):
            lines.append(f"[yellow]{as_text(origin['hint'])}[/]")
        path_b = origin.get("path_b")
        if path_b is not None and (path_b != origin["module"] or m.get("note")):
            lines.append(f"[dim]in B: {as_text(path_b or '<root>')}" + (f" ({as_text(m['note'])})" if m.get("note") else "")
                         + "[/]")
    if origin.get("error") and where != "raised":
        lines.append(f"[red]raised:[/] {as_text(origin['error'])}")
    op = origin.get("op")
    if op:
        for run, source, code in origin_code(op):
            lines.append(f"[bold]{run}[/] {as_text(source)}  " + (f"[cyan]{as_text(code)}[/]" if code else
                                                                  "[dim](source not readable here)[/]"))
        for key, (a, b) in (op.get("args_diff") or {}).items():
            lines.append(f"[yellow]argument {as_text(key)}: {as_text(repr(a))} (A) vs {as_text(repr(b))} (B)[/]")
    for key, (a, b) in (origin.get("hparam_diff") or {}).items():
        lines.append(f"[yellow]{as_text(key)}: {as_text(repr(a))} (A) vs {as_text(repr(b))} (B)[/]")
    if origin.get("class_diff"):
        a, b = origin["class_diff"]
        lines.append(f"[yellow]class: {as_text(a)} (A) vs {as_text(b)} (B), the same type family[/]")
    for p in (origin.get("param_diffs") or [])[:4]:
        lines.append(f"[yellow]parameter {as_text(p['name'])} differs: {as_text(p['reason'])}[/]")
    if origin.get("chain") and len(origin["chain"]) > 1:
        lines.append("[dim]chain: " + as_text(" > ".join(origin["chain"])) + "[/]")
    return lines


def scalar_outputs_by_step(report: View) -> list[tuple[int, str, float, float, bool]]:
    """(step, key, A's value, B's value, within tolerance) of the model's one-element outputs (the loss) in
    every step: what a training comparison looks at first."""
    out = []
    for row in report.get("records", ()):
        if row.get("kind") == "call" and row.get("phase") == "forward" and row.get("path") == "" and \
                row.get("parent") is None:
            out += [(row.get("step", 0), t["key"], t["value_a"], t["value_b"], bool(t.get("passed")))
                    for t in row["tensors"] if t.get("role") == "output" and "value_a" in t and "value_b" in t]
    return sorted(out)


def _render_steps(report: View, console: Console):
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
                      f"{as_text(first['description'])}")
    elif differing:
        console.print(f"[bold]steps[/] {steps}: first differs at step {differing[0] + 1}")
    else:
        console.print(f"[bold]steps[/] {steps}: every step agrees")
    if rows:
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for column in ("step", "output", "A", "B", ""):
            table.add_column(column, justify="right" if column in ("step", "A", "B") else "left")
        for step, key, a, b, ok in rows:
            table.add_row(str(step + 1), as_text(key), _value(a), _value(b), "ok" if ok else "[red]x[/]")
        console.print(table)


def _value(x) -> str:
    return "-" if x is None else f"{x:.7g}"  # a loss: enough digits to see a difference in the 6th


def row_passed(row: View) -> bool:
    """Every tensor of a report row within tolerance."""
    return all(t.get("passed", True) for t in row.get("tensors", ()))


def make_console(**kwargs) -> Console:
    """Wide enough for module paths when piped (rich would default to 80 columns)."""
    probe = Console(**kwargs)
    return probe if probe.is_terminal else Console(width=max(probe.width, 140), **kwargs)


def render(report: View, console: Console | None = None):
    console = console or make_console()
    _render_body(report, console)
    for problem in (report.get("trust") or {}).get("problems", []):
        console.print(f"[bold yellow]WARNING: {as_text(problem)}[/]")
    for note in (report.get("trust") or {}).get("notes", []):
        console.print(f"[dim]note: {as_text(note)}[/]")
    if (report.get("trust") or {}).get("problems") and report["verdict"] == "aligned":
        console.print("[bold yellow]the runs agree on what was compared, but the comparison is incomplete (exit 3)[/]")


def _render_body(report: View, console: Console):
    console.print(f"[bold]A[/] {trace_line(report['a'])}")
    console.print(f"[bold]B[/] {trace_line(report['b'])}")
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
        if res.get("inherited_tensors"):
            count = res["inherited_tensors"]
            console.print(f"  [dim]{count} tensor{'s' if count > 1 else ''} over tolerance judged agreeing: no more "
                          "error than what they were computed from carries (a change of precision)[/]")
        origin = res.get("first_divergence")
        if origin:
            lines = origin_lines(origin, step_count(report))
            console.print("  origin: " + lines[0])
            for line in lines[1:]:
                console.print("          " + line)
            first = res.get("first_over_tolerance")
            if first and first["module"] != origin["module"] and origin.get("where") not in ("forward",):
                console.print(f"          [dim](first over tolerance in execution order: {as_text(first['module'] or '<root>')};"
                              " the origin is where inputs still agree)[/]")
            if origin.get("op"):
                _render_module_ops(report, origin, console)
            for line in origin_hints(report, origin):
                console.print(f"          [dim]{as_text(line)}[/]")
            if phase == "backward" and origin.get("where") != "forward":
                for line in recompute_explains(report.get("recompute") or {}):
                    console.print(f"          [bold red]{as_text(line)}[/]")
        failure = res.get("failure")
        if failure and (origin or {}).get("where") != "raised":
            console.print(f"  [red]run B raised in {as_text(failure['module'] or '<root>')}: {as_text(failure['error'])}[/]")
    if report.get("config_diff"):
        console.print("[yellow]the models' own configs differ: " + "; ".join(
            f"{as_text(d['key'])} {as_text(d['a'])} (A) vs {as_text(d['b'])} (B)" for d in report["config_diff"]) + "[/]")
    for side in ("a", "b"):
        nf = report.get("first_nonfinite", {}).get(side)
        if nf:
            console.print(f"[red]first NaN/Inf in {side.upper()}:[/] {as_text(nf['module'] or '<root>')} ({nf['phase']}) "
                          f"{as_text(nf['tensor'])}: {nf['nan']} NaN, {nf['inf']} Inf")
            op = nf.get("op")
            if op:
                code = code_at(op.get("source"))
                console.print(f"  born in {as_text(op['name'])} at {as_text(short_source(op.get('source')))}"
                              + (f" ({as_text(op['function'])})" if op.get("function") else "")
                              + (f": [cyan]{as_text(code)}[/]" if code else ""))
    _render_steps(report, console)
    _render_growth(report, console)
    _render_next_pass(report, console)
    _render_footer(report, console)


def _render_module_ops(report: View, origin: View, console: Console):
    """The origin module's operations around the origin's, both runs side by side with their lines (a line in the
    origin's own file shown by its number) and B's code."""
    rows = module_ops(report, origin)
    if len(rows) < 2:
        return
    op = origin.get("op") or {}
    files = {side: _usual_file(rows, key)
             or short_source(op.get(f"source{suffix}") or op.get("source")).rpartition(":")[0]
             for side, key, suffix in (("a", "op", ""), ("b", "op_b", "_b"))}

    def line(info: View, side: str) -> str:
        file, _, number = short_source(info.get("source")).rpartition(":")
        return f"{number}" if file == files[side] else f"{file}:{number}"

    table = Table(title=f"operations of {origin.get('module') or '<root>'} ({origin.get('phase')}), A | B "
                        f"(lines of {files['a']} | {files['b']})", title_justify="left", box=None, pad_edge=False)
    # short columns keep their width on a narrow terminal (the origin's mark, a line number); the code gives way
    for col, least in (("#", 2), ("operation (A)", 12), ("line A", 6), ("B", 12), ("line B", 6), ("max rel", 7),
                       ("", 9)):
        table.add_column(col, no_wrap=True, min_width=least)
    table.add_column("code (B)", no_wrap=True, overflow="ellipsis", max_width=60, min_width=10)
    for r in rows:
        a, b = r.get("op") or {}, r.get("op_b") or {}
        rel = max((t["metrics"].get("max_rel") or 0 for t in r.get("tensors", ()) if t.get("metrics")
                   and t["role"] in ("output", "grad_input")), default=None)
        status = row_status(r)
        mark = "<- origin" if is_origin_row(r, op) else ("" if status == "ok" else
                                                          status if r.get("unpaired") else "x")
        code = code_at(b.get("source")) or code_at(a.get("source")) or ""
        table.add_row("" if a.get("index") is None else str(a.get("index")), as_text(a.get("name") or ""),
                      as_text(line(a, "a")) if a else "",
                      "=" if b.get("name") == a.get("name") else as_text(b.get("name") or ""),
                      as_text(line(b, "b")) if b else "", fmt_number(rel), mark, as_text(code))
    console.print(table)


def _render_mapping(report: View, console: Console, shown: int = 12):
    """The inferred mapping, with repeated blocks shown once (``layers.*``), in A's execution order."""
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
            console.print(f"  [dim]{as_text(b)} -> {as_text(a)}{count}  ({g['low']:.2f}: {as_text(g['why'])})[/]")
        if len(groups) > shown:
            console.print(f"  [dim]... {len(groups) - shown} more[/]")
    unmatched = (report.get("unmatched_modules") or {}).get("b") or []
    if mapping and unmatched:
        names = list(dict.fromkeys(collapse_indices(p) for p in unmatched))
        console.print(f"  [dim]B modules with no counterpart in A: {as_text(', '.join(names[:6]))}"
                      + (f" (+{len(names) - 6})" if len(names) > 6 else "") + "[/]")


def _render_growth(report: View, console: Console):
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
        nonfinite = r.get("nonfinite") or 0  # its other metrics are over the finite values: 0 and 1 would hide it
        table.add_row(Text(indent + name, style=style), as_text(r["type"] or ""),
                      f"NaN/Inf x{nonfinite}" if nonfinite else fmt_number(r["max_abs"]),
                      "-" if nonfinite else fmt_number(r["rel"]), "-" if nonfinite else fmt_cos(r["cosine"]), mark)
    console.print(table)


def target_command(side: View, placeholder: str) -> str:
    target = side.get("target")
    if not target:
        return placeholder
    return " ".join([target] + [f"--arg {k}={v}" for k, v in (side.get("target_args") or {}).items()])


def _render_next_pass(report: View, console: Console):
    nxt = report.get("next_pass")
    if not nxt:
        return
    console.print(f"[bold]next:[/] these were statistics; trace the suspect block {nxt['block']} in full mode and "
                  "replay the candidate on it:", highlight=False)
    console.print(f"  layerdiff trace {target_command(report['a'], 'REFERENCE_TARGET')} --layers {nxt['layers']} "
                  f"-o a_window.h5", highlight=False, soft_wrap=True)
    console.print(f"  layerdiff bisect a_window.h5 {target_command(report['b'], 'CANDIDATE_TARGET')}", highlight=False,
                  soft_wrap=True)


def recompute_explains(checks: dict) -> list[str]:
    """Under a backward origin: a run whose recomputation departs from its forward differentiates another forward
    than the one its loss came from, whatever the backward's first difference looks like."""
    lines = []
    for side in ("a", "b"):
        departs = [d for d in (checks.get(side) or {}).get("differ", ()) if d.get("inputs_agree")]
        if departs:
            lines.append(f"run {side.upper()}'s recomputation (activation checkpointing) departs from its forward at "
                         f"{departs[0]['path'] or '<root>'}: its backward uses other activations than its forward "
                         "made; look there first")
    return lines


def recompute_lines(checks: dict) -> list[str]:
    """One line per trace that recomputed calls in backward (activation checkpointing): whether each replayed
    its forward exactly, or the first that did not."""
    lines = []
    for side in ("a", "b"):
        check = checks.get(side)
        if not check:
            continue
        head = f"recomputation ({side.upper()}, activation checkpointing): "
        differ = check["differ"]
        if not differ:
            lines.append(head + f"{check['compared']} of {check['calls']} recomputed calls compared, each "
                         "reproduced its forward")
            continue
        first = next((d for d in differ if d.get("inputs_agree")), differ[0])
        lines.append(head + f"{len(differ)} of {check['compared']} recomputed calls differ from the forward they "
                     f"replay (their backward differentiates another forward); "
                     f"{'it departs at' if first.get('inputs_agree') else 'first'} {first['path'] or '<root>'} "
                     f"call {first['call']} at step {first['step']}"
                     + (f" on rank {first['rank']}" if "rank" in first else "") + f" ({first['tensor']}, max |diff| "
                     f"{first['max_abs']:.3g}, by {first['basis']})")
    return lines


def _render_footer(report: View, console: Console):
    notes = []
    p = report.get("params", {})
    if p.get("compared"):
        notes.append(f"parameters: {len(p['differ'])} of {p['compared']} differ"
                     + (f" (first: {p['differ'][0]})" if p["differ"] else "")
                     # their gradients too: a backward defect leaves every value alike and the gradients not
                     + (f"; their gradients: {len(p.get('grads_differ') or [])} of {p['grads_compared']} differ"
                        if p.get("grads_compared") else ""))
    if report.get("only_a") or report.get("only_b"):
        def names(rs):
            return ", ".join(sorted({r["path"] or "<root>" for r in rs})[:3])
        notes.append(f"unmatched records: {len(report['only_a'])} only in A ({names(report['only_a'])}), "
                     f"{len(report['only_b'])} only in B ({names(report['only_b'])})")
    for side in ("a", "b"):
        for w in report[side].get("warnings", []):
            notes.append(f"warning ({side.upper()}): {w}")
    for n in notes:
        console.print(f"[dim]{as_text(n)}[/]")
    for line in recompute_lines(report.get("recompute") or {}):
        console.print(as_text(line), style="bold red" if "differ" in line else "dim", highlight=False)
    verdict = report["verdict"]
    console.print(f"verdict: [bold {'green' if verdict == 'aligned' else 'red'}]{verdict}[/]")


def render_ranks(result: View, console: Console):
    """``layerdiff align RUN``: one line per rank against the first of its replicas, then the first desync."""
    from layerdiff.runs.desync import against_rank0  # only for a run's ranks against each other

    with_whom = "rank 0" if against_rank0(result) else "the first rank of its replicas"
    console.print(f"[bold]{as_text(result['path'])}[/]: {result['world_size']} ranks, each compared with {with_whom} on "
                  "what replicas must agree on (shards and partial sums left out)")
    if result.get("own_shares"):
        console.print("  each data-parallel rank was given its own share of the batch: their weights are compared, "
                      "not what they computed")
    for r in result["ranks"]:
        if r["verdict"] == "aligned":
            console.print(f"  rank {r['rank']}: [green]agrees with rank {r.get('against', 0)}[/]")
            continue
        parts = [f"{phase} {r[phase]['description']}" for phase in ("forward", "backward") if r[phase]]
        differ = f"; parameters differ: {', '.join(r['params_differ'][:3])}" if r["params_differ"] else ""
        console.print(f"  rank {r['rank']}: [red]differs[/]: {as_text('; '.join(parts) or 'parameters only')}{as_text(differ)}")
    for missing in result.get("missing") or []:
        console.print(f"  rank {missing['rank']}: [yellow]not compared[/]: {as_text(missing['reason'])}")
    first = result["first_divergence"]
    if first:
        console.print(f"[bold red]first desync ({first['phase']}): {as_text(first['description'])}[/] on rank(s) "
                      f"{', '.join(map(str, first['ranks']))}")
    console.print(f"verdict: {result['verdict']}")
    if result.get("missing"):
        from layerdiff.runs.desync import missing_line

        console.print(f"[bold yellow]WARNING: {as_text(missing_line(result['missing']))}[/]")
