"""``layerdiff logs diff``: the command, its terminal rendering and its verdict line."""
from __future__ import annotations

from pathlib import Path

from layerdiff.errors import LayerdiffError
from layerdiff.files import refuse_existing
from layerdiff.logs.compare import diff, ranges, ranges_text, tolerances
from layerdiff.logs.parse import FORMAT_NAMES, load_log
from layerdiff.logs.plot import plot_kind, write_plot
from layerdiff.report.terminal import fmt_number

EXIT_OK, EXIT_DIFFERENT = 0, 1


def verdict_line(report: dict) -> str:
    bits = []
    for m, r in report["metrics"].items():
        if not r["compared"]:
            bits.append(f"{m} not compared ({r['note']})")
        elif r["first_over"] is not None:
            bits.append(f"{m} over tolerance from iteration {r['first_over']} ({r['over']} of {r['compared']})")
        else:
            bits.append(f"{m} {r['verdict']}")
    extra = ""
    if report["only_a"]["count"] or report["only_b"]["count"]:
        extra = f"; {report['only_a']['count']} iterations only in A, {report['only_b']['count']} only in B"
    return f"{report['verdict']}: {report['compared']} common iterations; " + "; ".join(bits) + extra


def render(report: dict, console=None):
    from rich.table import Table

    from layerdiff.report.terminal import make_console

    console = console or make_console()
    a, b = report.get("a", {}), report.get("b", {})
    if a:
        console.print(f"[bold]A[/] {a['path']}  ({a['format']}, {a['iterations']} iterations)")
        console.print(f"[bold]B[/] {b['path']}  ({b['format']}, {b['iterations']} iterations)")
    table = Table(show_header=True, header_style="bold")
    for col in ("metric", "iterations compared", "max abs", "max rel", "first over tolerance", "tolerance", "verdict"):
        table.add_column(col, justify="right" if col not in ("metric", "verdict") else "left")
    colors = {"identical": "green", "within tolerance": "green", "different": "red"}
    for m, r in report["metrics"].items():
        if not r["compared"]:
            table.add_row(m, "0", "-", "-", "-", "-", f"[yellow]{r['note']}[/]")
            continue
        first = "-" if r["first_over"] is None else (
            f"{r['first_over']} ({fmt_number(r['first_over_values'][0])} vs "
            f"{fmt_number(r['first_over_values'][1])})")
        table.add_row(m, str(r["compared"]), fmt_number(r["max_abs"]), fmt_number(r["max_rel"]), first,
                      f"atol={fmt_number(r['atol'])} rtol={fmt_number(r['rtol'])}",
                      f"[{colors.get(r['verdict'], 'yellow')}]{r['verdict']}[/]")
    console.print(table)
    for m, r in report["metrics"].items():
        if r.get("nonfinite_mismatch"):
            console.print(f"{m}: {r['nonfinite_mismatch']} iterations NaN/inf in one run only "
                          "(a skipped step; not counted in max abs / max rel)")
    for side in ("only_a", "only_b"):
        o = report[side]
        if o["count"]:
            console.print(f"{o['count']} iterations only in {side[-1].upper()}: {ranges_text(o['ranges'])}")
    color = colors.get(report["verdict"], "yellow")
    console.print(f"[bold {color}]{report['verdict']}[/]")


def add_parser(subparsers, parser_class=None):
    """Add the ``diff`` action to a ``logs`` command's subparsers."""
    kw = {"help": "compare loss, learning rate and grad norm of two training logs by iteration"}
    d = subparsers.add_parser("diff", **kw)
    d.add_argument("a", help="reference log (Megatron-LM, MindSpore Transformers, CSV or JSONL; auto-detected)")
    d.add_argument("b", help="candidate log")
    d.add_argument("--json", metavar="FILE", help="write the full JSON report (refuses to overwrite; see --force)")
    d.add_argument("--plot", metavar="FILE", help="write curves and differences: .html (self-contained SVG) or "
                                                  ".png (needs matplotlib)")
    d.add_argument("--tol", action="append", default=[], metavar="METRIC:atol=..,rtol=..",
                   help="tolerance for loss, lr or grad_norm (repeatable; defaults: loss rtol=1e-3, "
                        "lr rtol=1e-5, grad_norm rtol=5e-2, atol=0)")
    d.add_argument("--force", action="store_true", help="overwrite existing --json / --plot files")
    d.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line")
    return d


def register(sub, parser_class=None):
    """Add ``logs`` (with its ``diff`` action) to the top-level subparsers ``sub``; dispatch with ``run(args)``."""
    kwargs = {"parser_class": parser_class} if parser_class else {}
    logs = sub.add_parser("logs", help="compare training logs (loss, lr, grad norm) of two runs")
    actions = logs.add_subparsers(dest="logs_command", metavar="ACTION", required=True, **kwargs)
    add_parser(actions, parser_class)
    return logs


def compare_files(path_a, path_b, tolerances: dict | None = None) -> dict:
    fa, la = load_log(path_a)
    fb, lb = load_log(path_b)
    report = diff(la, lb, tolerances)
    for key, path, fmt, data in (("a", path_a, fa, la), ("b", path_b, fb, lb)):
        its = list(data)
        report[key] = {"path": str(path), "format": FORMAT_NAMES[fmt], "iterations": len(its),
                       "range": [its[0], its[-1]]}
    if report["verdict"] == "nothing compared" and report["compared"]:
        raise LayerdiffError(f"{path_a} and {path_b} share iterations but no metric (loss, lr, grad_norm) logged in both")
    if not report["compared"]:
        raise LayerdiffError(f"{path_a} and {path_b} share no iteration (A: {ranges_text(ranges(list(la)))}; "
                             f"B: {ranges_text(ranges(list(lb)))})")
    return report


def run(args) -> int:
    """``layerdiff logs diff``: 0 identical or within tolerance, 1 different; LayerdiffError for bad input."""
    if getattr(args, "logs_command", "diff") != "diff":
        raise LayerdiffError(f"unknown logs action {args.logs_command!r}")
    tol = tolerances(args.tol)
    outputs = [p for p in (args.json, args.plot) if p]
    if args.plot:
        plot_kind(Path(args.plot))
    for out in outputs:
        refuse_existing(out, args.force)
    report = compare_files(args.a, args.b, tol)
    if args.plot:
        write_plot(report, args.plot, Path(args.a).name, Path(args.b).name, overwrite=args.force)
    from layerdiff.report.jsonio import publish

    publish(report, json_path=args.json, overwrite=args.force, quiet=args.quiet, line=verdict_line, render=render)
    return EXIT_DIFFERENT if report["verdict"] == "different" else EXIT_OK
