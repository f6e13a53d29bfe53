"""``layerdiff config diff A B``: two model configurations compared in canonical keys (``compare.configs``)."""
from __future__ import annotations

from pathlib import Path

from layerdiff.compare.configs import CanonicalConfig, diff_configs, from_megatron_args, read_config
from layerdiff.files import refuse_existing

EXIT_SAME, EXIT_DIFFERENT = 0, 1
_SHOWN = 12


def register(sub, parser_class=None):
    """Add ``config`` (with its ``diff`` action) to the top-level subparsers ``sub``; dispatch with ``run``."""
    kwargs = {"parser_class": parser_class} if parser_class else {}
    config = sub.add_parser("config", help="compare model configurations across frameworks (Megatron-LM, "
                            "MindSpore Transformers, Hugging Face)")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True, **kwargs)
    d = actions.add_parser("diff", help="the hyper-parameters two configuration files set differently")
    d.add_argument("a", help="a Megatron-LM launch script or args file, a Megatron-LM checkpoint (its stored "
                   "args), a MindSpore Transformers .yaml, or a config.json (Hugging Face, PaddleFormers)")
    d.add_argument("b", help="the other configuration, any of the same kinds")
    d.add_argument("--json", metavar="FILE", help="write the comparison as JSON (refuses to overwrite; see --force)")
    d.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    d.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line")
    return config


def _read(path) -> CanonicalConfig:
    """A configuration file, or the args stored in a Megatron-LM checkpoint (a directory or a ``.pt`` file)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".pt":
        from layerdiff.checkpoints import megatron_args

        return from_megatron_args(megatron_args(path), str(path))
    return read_config(path)


def compare_files(path_a, path_b) -> dict:
    return diff_configs(_read(path_a), _read(path_b))


def verdict_line(report: dict) -> str:
    if report["verdict"] == "same":
        return f"same: {report['compared']} hyper-parameters agree"
    return f"differ: {len(report['differ'])} of {report['compared']} hyper-parameters (" + ", ".join(
        f"{d['key']}: {d['a']} vs {d['b']}" for d in report["differ"]) + ")"


def run(args) -> int:
    """0 the configurations agree, 1 they differ; LayerdiffError for bad input."""
    if args.json:
        refuse_existing(args.json, args.force)
    report = compare_files(args.a, args.b)
    from layerdiff.report.jsonio import publish

    publish(report, json_path=args.json, overwrite=args.force, quiet=args.quiet, line=verdict_line, render=render)
    return EXIT_DIFFERENT if report["differ"] else EXIT_SAME


def render(report: dict):
    from rich.table import Table

    from layerdiff.report.terminal import make_console

    console = make_console()
    esc = _escape
    for side in ("a", "b"):
        console.print(f"[bold]{side.upper()}[/] {esc(report[side]['path'])}  ({report[side]['kind']})")
    if report["differ"]:
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for column in ("hyper-parameter", "A", "B", "named in A", "named in B"):
            table.add_column(column)
        for d in report["differ"]:
            table.add_row(esc(d["key"]), f"[red]{esc(d['a'])}[/]", f"[red]{esc(d['b'])}[/]",
                          esc(d["name_a"] + (" (default)" if d["default_a"] else "")),
                          esc(d["name_b"] + (" (default)" if d["default_b"] else "")))
        console.print(table)
    console.print(f"[bold]{verdict_line(report)}[/]" if report["differ"] else f"[green]{verdict_line(report)}[/]")
    for side, keys in (("A", report["only_a"]), ("B", report["only_b"])):
        if keys:
            console.print(f"set in {side} only: {esc(', '.join(keys))}")
    for side in ("a", "b"):
        keys = report["unmapped"][side]
        if keys:
            console.print(f"[dim]{len(keys)} keys of {side.upper()} have no counterpart here: "
                          f"{esc(', '.join(keys[:_SHOWN]))}{' ...' if len(keys) > _SHOWN else ''}[/]")


def _escape(value) -> str:
    from rich.markup import escape

    return escape(str(value))
