"""The terminal view of ``layerdiff bisect``: each segment's own error on the reference's numbers and how the free run
amplified what it received (replay), or the binary search's runs and answer (search)."""
from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table
from rich.text import Text

from layerdiff.report.terminal import as_text, fmt_cos, fmt_number, make_console, target_command, trace_line


def _segment_line(seg: dict) -> str:
    t = seg.get("tensor") or {}
    m = t.get("metrics") or {}
    detail = f"{as_text(t.get('role'))} [cyan]{as_text(t.get('key'))}[/]: {as_text(t.get('reason'))}" if t else as_text(seg.get("error", ""))
    extra = f"  (max abs {fmt_number(m.get('max_abs'))}, cosine {fmt_cos(m.get('cosine'))})" if m.get("basis") == "data" else ""
    return f"[bold red]{as_text(seg['description'])}[/]\n      {detail}{extra}"


def render_replay(result: dict, console: Console | None = None, shown: int = 6):
    """Own errors (the candidate on the reference's numbers), then how the free run amplified what it got."""
    console = console or make_console()
    console.print(f"[bold]A[/] {trace_line(result['a'])}")
    console.print(f"[bold]B[/] replayed on A's recorded values (inputs, outputs and gradients forced at every "
                  f"module boundary; {result['forcing'].get('forced_tensors', 0)} tensors forced)")
    for note in result["forcing"].get("not_forced", [])[:3]:
        console.print(f"  [yellow]not forced: {as_text(note)}[/]")
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
            console.print(f"  replay {text} align's origin: {as_text(origin['description'])}")
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
    console.print(f"[{style}]{as_text(name)}{as_text(answer['description'])}[/]")
    if result.get("block"):
        block_b = re.escape(result.get("block_b") or result["block"])
        console.print(f"[dim]next: replay that block module by module: layerdiff bisect {result['a']['path']} "
                      f"{target_command(result['b'], 'CANDIDATE_TARGET')} --include '^{block_b}(\\.|$)'[/]",
                      highlight=False, soft_wrap=True)
