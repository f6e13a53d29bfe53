"""``layerdiff weights diff A B``: the command, digest checks and the terminal table."""
from __future__ import annotations

import re
from pathlib import Path

from layerdiff.checkpoints.compare import compare_files
from layerdiff.checkpoints.formats import file_digest
from layerdiff.errors import LayerdiffError
from layerdiff.files import refuse_existing
from layerdiff.report.terminal import fmt_cos, fmt_number


def _parse_digests(specs, paths):
    """--sha256 values: None (flag absent), [] / [""] (print only), or PATH=HEX / HEX entries."""
    expected = {}
    for spec in specs or ():
        if not spec:
            continue
        p, eq, hexd = spec.rpartition("=")
        if not eq:
            raise LayerdiffError(f"bad --sha256 {spec!r}: expected PATH=HEX")
        hexd = hexd.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", hexd):
            raise LayerdiffError(f"bad --sha256 {spec!r}: not a 64-digit hex SHA-256")
        target = Path(p).resolve()
        if target not in paths:
            raise LayerdiffError(f"--sha256 {p}: not one of the compared checkpoints")
        expected[target] = hexd
    return expected


def run(args) -> int:
    """``layerdiff weights diff A B``: 0 when every compared parameter is identical and none is missing, 1 else."""
    from layerdiff.report.jsonio import write_json
    from layerdiff.report.terminal import make_console
    quiet = getattr(args, "quiet", False)
    console = make_console(stderr=False, quiet=quiet)
    output = getattr(args, "output", None)
    if output:
        refuse_existing(output, getattr(args, "force", False))
    specs = getattr(args, "sha256", None)
    if specs is not None:
        paths = {Path(args.a).resolve(): args.a, Path(args.b).resolve(): args.b}
        expected = _parse_digests(specs, paths)
        for target, shown in paths.items():
            digest = file_digest(target)
            console.print(f"sha256 {digest}  {shown}")
            if target in expected and expected[target] != digest:
                raise LayerdiffError(f"{shown}: SHA-256 mismatch (expected {expected[target]}, got {digest})")
    exact = bool(getattr(args, "exact", False))
    report = compare_files(args.a, args.b, mapping=getattr(args, "map", None), exact=exact,
                           transpose=getattr(args, "transpose", None), rules=getattr(args, "rules", None))
    summary = report["__summary__"]
    if output:
        write_json(report, output, overwrite=getattr(args, "force", False))
    if not quiet:
        _render(report, console, exact)
        if output:
            console.print(f"report written to {output}")
    bad = summary["different"] or summary["missing_in_b"] or summary["extra_in_b"]
    return 1 if bad else 0


def _render(report: dict, console, exact: bool, shown: int = 20):
    from rich.table import Table
    s = report["__summary__"]
    console.print(f"[bold]A[/] {s['a']} ({s['format_a']})   [bold]B[/] {s['b']} ({s['format_b']})")
    for note in s["notes"]:
        console.print(f"[dim]{note}[/]")
    rows = [(k, v) for k, v in report.items() if k != "__summary__" and v.get("status") != "identical"]
    rows.sort(key=lambda kv: (kv[1]["status"] != "shape_mismatch", -(kv[1].get("max_diff") or 0.0)))
    limit = len(rows) if exact else shown
    if rows:
        table = Table(title="parameters that differ (largest first)")
        for col in ("parameter", "shape", "dtype", "max_diff", "l2", "cos", "note"):
            table.add_column(col, justify="left" if col in ("parameter", "shape", "dtype", "note") else "right")
        for name, e in rows[:limit]:
            if e["status"] == "shape_mismatch":
                table.add_row(name, f"{e['shape']} vs {e['shape_b']}", e["dtype"], "", "", "", "[red]shape differs[/]")
                continue
            dtype = e["dtype"] + (f"/{e['dtype_b']}" if "dtype_b" in e else "")
            notes = ([f"B: {e['b_name']}"] if e.get("b_name") else []) + \
                (["B transposed"] if e.get("transposed") else []) + \
                (["within default tolerance"] if e.get("within_tolerance") else [])
            table.add_row(name, str(e["shape"]), dtype, fmt_number(e["max_diff"]), fmt_number(e["l2"]), fmt_cos(e["cos"]),
                          ", ".join(notes))
        console.print(table)
        if len(rows) > limit:
            console.print(f"... and {len(rows) - limit} more (see -o JSON, or --exact for all)")
    for label, key in (("missing in B", "missing_in_b"), ("extra in B", "extra_in_b")):
        if s[key]:
            console.print(f"[yellow]{len(s[key])} {label}:[/] " + ", ".join(s[key][:8])
                          + (" ..." if len(s[key]) > 8 else ""))
    verdict = "[green]identical[/]" if not (s["different"] or s["missing_in_b"] or s["extra_in_b"]) \
        else "[red]different[/]"
    console.print(f"{s['compared']} compared: {s['identical']} identical, {s['different']} different"
                  + (f" ({s['different_within_tolerance']} within default tolerance)"
                     if s.get("different_within_tolerance") else "")
                  + f"; {len(s['missing_in_b'])} missing in B, {len(s['extra_in_b'])} extra in B; "
                  f"max abs diff {fmt_number(s['max_abs_diff'])} -> {verdict}")


def register(sub, parser_class=None):
    """Add ``diff`` under the ``layerdiff weights`` subparsers ``sub``; sets ``func=run``."""
    p = sub.add_parser("diff", help="compare two checkpoints parameter by parameter (l2, cos, max diff)",
                       description="Compare two checkpoints (safetensors, HF folder, .pt/.bin, .pdparams, .ckpt, "
                                   ".npz, trace .h5, Megatron folder). Exit 0 identical, 1 different, 2 error.")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("-o", "--output", metavar="FILE.json", help="write the per-parameter report as JSON")
    p.add_argument("--exact", action="store_true", help="list every parameter with any difference")
    p.add_argument("--map", action="append", default=[], metavar="PATTERN=REPLACEMENT",
                   help="rename B's parameter names to A's (regex; repeatable, or a file of rules)")
    p.add_argument("--transpose", action="append", default=[], metavar="REGEX",
                   help="compare B's tensor transposed for A names matching REGEX (e.g. Paddle Linear weights)")
    p.add_argument("--sha256", nargs="?", action="append", const="", metavar="PATH=HEX",
                   help="print both SHA-256 digests; with PATH=HEX, verify that file (repeatable)")
    p.add_argument("--rules", action="append", metavar="FILE.toml",
                   help="extra naming/fusion rules (docs/concepts/rule-files.md); repeatable")
    p.add_argument("--force", action="store_true", help="overwrite the -o file")
    p.add_argument("-q", "--quiet", action="store_true", help="no table; exit status only")
    p.set_defaults(func=run)
    return p

