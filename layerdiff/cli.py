"""The ``layerdiff`` command line.

Exit codes: 0 aligned / success, 1 divergent (or the traced run raised), 2 bad input, 3 aligned but the result
cannot be trusted (a run that did not finish, a phase on one side only, the same file twice). Bad input is reported
as one line on stderr, never a traceback (``--debug`` shows it).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from layerdiff.adapters import FRAMEWORKS
from layerdiff.api import EXIT_DIVERGENT, EXIT_OK  # 3: aligned, but see report["trust"]
from layerdiff.errors import LayerdiffError
from layerdiff.files import refuse_existing
from layerdiff.version import __version__

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_tolerance_flags(p, outputs: str = "--json file"):
    """The tolerance flags, and the report's: ``outputs``, what ``--force`` may overwrite, as its help says."""
    g = p.add_argument_group("tolerances (default: per dtype; docs/concepts/tolerances.md)")
    g.add_argument("--atol", type=float, help="absolute tolerance for every floating dtype")
    g.add_argument("--rtol", type=float, help="tolerance relative to the reference tensor's max |value|")
    g.add_argument("--cos", type=float, help="minimum cosine similarity")
    g.add_argument("--tol", action="append", default=[], metavar="REGEX:atol=..,rtol=..,cos=..",
                   help="override for module paths matching REGEX (first matching rule wins; repeatable)")
    p.add_argument("--json", metavar="FILE", help="write the full JSON report (refuses to overwrite; see --force)")
    p.add_argument("--force", action="store_true", help=f"overwrite an existing {outputs}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar; print only the verdict line")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layerdiff", description="Find where two runs of the same model start to differ.")
    parser.add_argument("--version", action="version", version=f"layerdiff {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("trace", help="run a model step under the tracer and write an HDF5 trace")
    t.add_argument("target", help="file.py:function, package.module:function, or a recipe name (e.g. torch_llama)")
    t.add_argument("-o", "--output", required=True, help="trace file to write (.h5)")
    t.add_argument("--mode", choices=["full", "stats"], default="full",
                   help="full: statistics and tensor values (default); stats: statistics only")
    t.add_argument("--no-backward", action="store_true", help="forward only (no gradient taps)")
    t.add_argument("--include", action="append", metavar="REGEX", help="trace only module paths matching")
    t.add_argument("--exclude", action="append", metavar="REGEX", help="skip module paths matching")
    t.add_argument("--layers", metavar="START:END", help="trace only blocks START..END-1 of the model's main module "
                   "list (e.g. model.layers) and their submodules: the full-mode second pass of two-pass tracing")
    t.add_argument("--no-params", action="store_true", help="do not record parameter values and gradients")
    t.add_argument("--ops", action="store_true",
                   help="also record every operation the modules' own code runs (torch functions, tensor methods "
                        "and operators, custom autograd functions), with its source line and where each input came "
                        "from; an origin is then named at its operation and line")
    t.add_argument("--ops-in", action="append", metavar="REGEX",
                   help="record operations only inside modules whose path matches (repeatable; --include's "
                        "matching): the window a module-level report points at")
    t.add_argument("--compression", choices=["gzip", "lzf"], help="compress tensor data (slower to write)")
    t.add_argument("--flush-interval", type=float, default=1.0, metavar="SECONDS",
                   help="the longest a record waits in memory before it is written (compressed traces: their data "
                        "too); 0: every record is written before the step goes on; a crash keeps what was written")
    t.add_argument("--write-behind", type=float, metavar="MB",
                   help="full mode: tensor bytes go through a ring of at most this size to a writer thread (O_DIRECT "
                        "where the filesystem allows), so the disk works while the model computes (default 256; the "
                        "ring starts at 8 and grows while the disk falls behind); a process "
                        "killed outright loses what is queued, and the records held to be written together (at most "
                        "256, none older than --flush-interval): 0 writes every record before the step goes on")
    t.add_argument("--steps", type=int, default=1, help="call the step function this many times")
    t.add_argument("--arg", action="append", metavar="NAME=VALUE", help="keyword argument for the target function")
    t.add_argument("--force", action="store_true", help="overwrite an existing output file")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    t.add_argument("--weights", metavar="FILE.safetensors",
                   help="load these weights before tracing: a file from `layerdiff weights export` (any framework), "
                        "or a checkpoint in PyTorch layout (safetensors, HF folder, .pt, distributed checkpoint)")
    t.add_argument("--map", action="append", metavar="MODEL_REGEX=FILE_NAME",
                   help="rename the model's parameter names to the file's (with --weights)")
    t.add_argument("--rules", action="append", metavar="FILE.toml",
                   help="extra naming/fusion rules for --weights (docs/concepts/rule-files.md)")

    a = sub.add_parser("align", help="compare two traces and name where they start to differ")
    a.add_argument("a", help="reference trace (a file, or the directory of a multi-rank run)")
    a.add_argument("b", nargs="?", help="candidate trace (a file or a run directory); omitted: compare the ranks "
                   "of run A with its rank 0 (data-parallel replicas that should agree)")
    a.add_argument("--workers", type=int, metavar="N", help="processes comparing the rank pairs of one run or the "
                   "stored tensors of two traces, when they hold over 512 MB a side (default: one per core, at most "
                   "8; 1: all in this process)")
    a.add_argument("--scheduler", metavar="ADDRESS",
                   help="send that work to a Dask cluster: its scheduler's address (tcp://HOST:PORT) or scheduler "
                   "file, whose workers read the traces by path from a filesystem shared with this machine; 'local' "
                   "starts a LocalCluster of processes here (--workers of them). Default: $LAYERDIFF_SCHEDULER. "
                   "Needs layerdiff[dask] (docs/cluster.md)")
    a.add_argument("--map", action="append", metavar="B_REGEX=A_NAME",
                   help="rename B's module paths to A's (regex substitution; or a file of rules; repeatable)")
    a.add_argument("--layout", action="append", metavar="REGEX=TRANSFORM",
                   help="compare B's tensors of records whose (A) path matches REGEX after transpose, "
                        "permute(3,2,0,1) or reshape(-1,64) (repeatable)")
    a.add_argument("--html", metavar="FILE", help="also write the report as one self-contained HTML page (refuses "
                   "to overwrite; see --force)")
    a.add_argument("--save-map", metavar="FILE",
                   help="write the module mapping inferred for renamed modules as an editable --map file")
    a.add_argument("--no-auto-map", action="store_true",
                   help="do not infer renamed modules from structure (names must match, or --map them)")
    a.add_argument("--all-positions", action="store_true",
                   help="compare padded positions too (by default, where both runs were given the same "
                        "attention_mask with zeros, tensors that lead with [batch, seq] are compared where it is 1)")
    a.add_argument("--rules", action="append", metavar="FILE.toml",
                   help="extra naming/fusion/transform rules on top of the built-in ones (docs/concepts/rule-files.md)")
    _add_tolerance_flags(a, "--json, --html or --save-map file")

    r = sub.add_parser("report", help="re-judge a saved JSON report under other tolerances (no traces needed)")
    r.add_argument("report", help="JSON written by `layerdiff align --json`")
    _add_tolerance_flags(r)

    s = sub.add_parser("show", help="metadata, module tree, record counts and sizes of a trace")
    s.add_argument("trace")
    s.add_argument("--records", action="store_true", help="list every record")
    s.add_argument("--nan", action="store_true",
                   help="where NaN/Inf are born: the first call with finite inputs and non-finite outputs, "
                        "forward and backward (and, in a trace made with --ops, the operation and its line)")
    s.add_argument("--ops", nargs="?", const="", metavar="REGEX",
                   help="list the operations recorded inside modules (--ops traces), of every module or of those "
                        "whose path matches")

    w = sub.add_parser("weights", help="weights in a framework-neutral file (safetensors, PyTorch layout)")
    wsub = w.add_subparsers(dest="weights_command", metavar="ACTION", parser_class=_Parser, required=True)
    we = wsub.add_parser("export", help="build a TARGET's model and write its weights")
    we.add_argument("target", help="as for `layerdiff trace`")
    we.add_argument("-o", "--output", required=True, help=".safetensors file to write")
    we.add_argument("--arg", action="append", metavar="NAME=VALUE", help="keyword argument for the target")
    we.add_argument("--force", action="store_true", help="overwrite an existing output file")
    from layerdiff import checkpoints

    checkpoints.register(wsub, _Parser)

    from layerdiff import configdiff, logs

    logs.register(sub, _Parser)
    configdiff.register(sub, _Parser)

    b = sub.add_parser("bisect", help="run the candidate on the reference's recorded values: each module's own "
                       "error, or a binary search over blocks (--search)")
    b.add_argument("reference", help="trace A, in full mode (a window traced with --layers/--include works)")
    b.add_argument("target", help="the candidate, as for `layerdiff trace` (file.py:function, module:function, recipe)")
    b.add_argument("--arg", action="append", metavar="NAME=VALUE", help="keyword argument for the target function")
    b.add_argument("--search", action="store_true",
                   help="binary search over the top-level blocks: a baseline and log2(N) forward runs, three "
                   "blocks hooked in each")
    b.add_argument("--blocks", metavar="PATH", help="with --search: the module holding the blocks (default: the "
                   "module list with the most numbered children, e.g. model.layers)")
    b.add_argument("--include", action="append", metavar="REGEX", help="replay only module paths matching "
                   "(default: what the reference traced)")
    b.add_argument("--exclude", action="append", metavar="REGEX", help="do not replay module paths matching")
    b.add_argument("--map", action="append", metavar="B_REGEX=A_NAME", help="rename the candidate's modules, as for align")
    b.add_argument("--layout", action="append", metavar="REGEX=TRANSFORM", help="as for align (inverted to feed B)")
    b.add_argument("--no-auto-map", action="store_true", help="do not infer renamed modules")
    b.add_argument("--rules", action="append", metavar="FILE.toml", help="extra rules, as for align")
    b.add_argument("--workdir", metavar="DIR", help="traces and state.json of the runs (default: REFERENCE.bisect); "
                   "rerunning the same command resumes from it")
    b.add_argument("--restart", action="store_true", help="ignore the work directory's finished runs")
    _add_tolerance_flags(b)

    sub.add_parser("recipes", help="list the built-in recipes (runnable TARGETs) and the defects each can inject")

    d = sub.add_parser("demo", help="trace a small Llama twice (one with an injected defect) and align them")
    d.add_argument("--defect", default="eps", help="which defect to inject (see recipes/torch_llama.py)")
    d.add_argument("--keep", metavar="DIR", help="keep the traces and report in DIR (default: a temp dir)")
    d.add_argument("--framework", default="torch", choices=FRAMEWORKS,
                   help="trace the candidate in this framework's port of the model (needs it installed)")
    return parser


def _tolerances(args) -> dict:
    return {"atol": args.atol, "rtol": args.rtol, "cos": args.cos, "tol": args.tol}


def _finish_report(report, args) -> int:
    from layerdiff.report.jsonio import write_json
    from layerdiff.report.terminal import make_console, render

    if args.json:
        write_json(report.data, args.json, overwrite=args.force)
    if args.quiet:
        data = report.data
        f, b = report.forward, report.backward
        differ = data.get("params", {}).get("differ", [])
        at = (lambda o: f" at step {o.get('step', 0) + 1}") if report.steps > 1 else (lambda o: "")
        print(f"{report.verdict}: forward {f['description'] + at(f) if f else data['forward']['status']}; "
              f"backward {b['description'] + at(b) if b else data['backward']['status']}"
              + (f"; {len(differ)} parameter values differ (first: {differ[0]})" if differ else "")
              + "".join(f"; WARNING: {p}" for p in report.problems))
    else:
        render(report.data, make_console())
    return report.exit_code


def cmd_align(args) -> int:

    from layerdiff import api

    for out in (args.json, args.save_map, args.html):
        if out:
            refuse_existing(out, args.force)
    if args.b is None:
        if args.html:
            raise LayerdiffError("--html is for two runs (layerdiff align A B); a run's ranks have no HTML page yet")
        return _align_ranks(args)
    report = api.align(args.a, args.b, **_tolerances(args), map=args.map or (), layout=args.layout or (),
                       rules=args.rules or (), auto_map=not args.no_auto_map, progress=not args.quiet,
                       workers=args.workers, scheduler=args.scheduler, all_positions=args.all_positions)
    if args.save_map:
        from layerdiff.files import write_atomically
        from layerdiff.match.mapping import rules_text

        write_atomically(args.save_map, rules_text(report.mapping), overwrite=args.force)
    if args.html:
        report.to_html(args.html, overwrite=args.force)
    return _finish_report(report, args)


def _align_ranks(args) -> int:
    """``layerdiff align RUN``: every rank of a multi-rank run against rank 0."""
    from layerdiff import api
    from layerdiff.report.jsonio import write_json
    from layerdiff.report.terminal import make_console, render_ranks

    report = api.align(args.a, **_tolerances(args), rules=args.rules or (), workers=args.workers,
                       scheduler=args.scheduler, progress=not args.quiet)
    if args.json:
        write_json(report.data, args.json, overwrite=args.force)
    if args.quiet:
        print(report.summary())
    else:
        render_ranks(report.data, make_console())
    return report.exit_code


def cmd_report(args) -> int:
    from layerdiff import api

    return _finish_report(api.rethreshold(args.report, **_tolerances(args)), args)


def cmd_trace(args) -> int:
    from pathlib import Path

    from layerdiff import runner
    from layerdiff.capture.filters import parse_layers
    from layerdiff.tracing import trace

    if args.steps < 1:
        raise LayerdiffError("--steps must be at least 1")
    if not (math.isfinite(args.flush_interval) and args.flush_interval >= 0):
        raise LayerdiffError(f"--flush-interval must be a finite number of seconds >= 0, not {args.flush_interval}")
    if args.write_behind is not None and not (math.isfinite(args.write_behind) and 0 <= args.write_behind < 2**20):
        raise LayerdiffError(f"--write-behind must be a number of MB >= 0, not {args.write_behind}")
    try:
        layers = parse_layers(args.layers) if args.layers else None
    except ValueError as exc:
        raise LayerdiffError(str(exc)) from None
    out = Path(args.output)
    if out.is_file() and not args.force:  # a directory is a multi-rank run: each rank checks its own file
        raise LayerdiffError(f"{out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise LayerdiffError(f"directory {out.parent} does not exist")
    target_args = runner.parse_args(args.arg)
    if args.weights:  # read, and the naming rules parsed, before the model is built: a bad file fails at once
        from layerdiff.checkpoints.transfer import load_neutral, read_weights
        from layerdiff.match.rename import RenameRules
        from layerdiff.match.rules import ruleset

        state, mapping, rules = read_weights(args.weights), RenameRules.parse(args.map), ruleset(args.rules)
    elif args.map:
        raise LayerdiffError("--map goes with --weights")
    model, step, meta = runner.build(args.target, target_args)
    meta = {"target": args.target, "target_args": target_args, **(meta or {})}
    if args.weights:
        meta["weights"] = {"file": args.weights, "parameters": load_neutral(model, state, mapping, rules=rules)}
        del state  # the model holds the values now
    tracer = trace(model, out, mode=args.mode, backward=not args.no_backward, include=args.include,
                   exclude=args.exclude, layers=layers, overwrite=args.force, compression=args.compression,
                   flush_interval=args.flush_interval, params=not args.no_params, meta=meta,
                   write_behind=args.write_behind, ops=args.ops_in or args.ops)
    from layerdiff.report.progress import StepProgress

    progress = StepProgress(args.steps, enabled=None if not args.quiet else False)
    opened = False
    try:
        with tracer:  # opening the file can fail (bad input): raised as it is, before any step runs
            opened = True
            for _ in range(args.steps):
                step()
                progress.advance(tracer.writer)
    except Exception as exc:  # the trace is closed by now and keeps every record written before
        if not opened:
            raise
        if isinstance(exc, (LayerdiffError, OSError)) and not isinstance(exc, (FileNotFoundError,)):
            raise LayerdiffError(f"writing {out} failed ({_one_line(exc)}); the records written before are "
                                 "readable") from None  # a full disk
        failure = tracer.failure or {}  # the user's model raised
        where = failure.get("module")
        print(f"layerdiff: the traced run raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
              f"{f' in module {where!r}' if where else ''}; {out} holds every record before it", file=sys.stderr)
        return EXIT_DIVERGENT
    finally:
        progress.close()
    writer = tracer.writer
    held = f"{writer.tensor_bytes / 1e6:.1f} MB of tensors" if writer.tensor_bytes or args.mode != "stats" else \
        "statistics of every tensor"  # a stats trace stores no tensor: "0.0 MB of tensors" read as nothing kept
    records = writer.records_written - 1  # as `show` counts them: the end marker is not one
    print(f"wrote {writer.path}: {records} records, {held} ({args.mode} mode)")
    return EXIT_OK


def cmd_bisect(args) -> int:
    from layerdiff import api
    from layerdiff.replay import driver as bisection
    from layerdiff.report.replay_view import render_replay, render_search
    from layerdiff.report.terminal import make_console

    result = api.bisect(args.reference, args.target, args=args.arg or (), search=args.search, blocks=args.blocks,
                        include=args.include, exclude=args.exclude, workdir=args.workdir, restart=args.restart,
                        json=args.json, force=args.force, map=args.map or (), layout=args.layout or (),
                        rules=args.rules or (), auto_map=not args.no_auto_map, progress=not args.quiet,
                        **_tolerances(args))
    if args.quiet:
        print(bisection.summary_line(result))
    else:
        (render_search if args.search else render_replay)(result, make_console())
    return EXIT_OK if result["verdict"] in ("clean", "aligned") else EXIT_DIVERGENT


def cmd_weights(args) -> int:
    from pathlib import Path

    from layerdiff import runner
    from layerdiff.checkpoints.transfer import export_weights

    if args.weights_command == "diff":
        from layerdiff import checkpoints

        return checkpoints.run(args)

    out = Path(args.output)
    refuse_existing(out, args.force)
    model, _, _ = runner.build(args.target, runner.parse_args(args.arg))
    export_weights(model, out, overwrite=args.force)
    print(f"wrote {out}")
    return EXIT_OK


def cmd_logs(args) -> int:
    from layerdiff import logs

    return logs.run(args)


def cmd_config(args) -> int:
    from layerdiff import configdiff

    return configdiff.run(args)


def cmd_show(args) -> int:
    from layerdiff.report.show_trace import show

    show(args.trace, records=args.records, nan=args.nan, ops=args.ops)
    return EXIT_OK


def cmd_recipes(args) -> int:  # noqa: ARG001
    """Each recipe of ``layerdiff.recipes``: its first docstring line and its DEFECTS, read from the source (no
    framework is imported: listing stays instant and works where a framework is missing)."""
    from pathlib import Path

    from layerdiff import recipes

    for path in sorted(Path(recipes.__path__[0]).glob("*.py")):
        if path.stem.startswith("_") or path.stem.endswith("_shared"):  # helpers the recipes share
            continue
        summary, defects = _recipe_summary(path)
        print(f"{path.stem:22} {summary}" + (f"\n{'':22} --arg defect= {', '.join(defects)}" if defects else ""))
    return EXIT_OK


def _recipe_summary(path) -> tuple[str, list]:
    """(first docstring line, DEFECTS keys) from a recipe's source: dict literals, comprehensions over a tuple of
    names, ``shared.DEFECTS`` and later ``DEFECTS[...] = ...`` assignments."""
    import ast

    from layerdiff.recipes import llama_shared

    tree = ast.parse(Path(path).read_text())
    paragraph = " ".join((ast.get_docstring(tree) or "").strip().split("\n\n")[0].split())
    summary = paragraph.removeprefix("Recipe: ").split(". ")[0].rstrip(".:")
    if len(summary) > 100:
        summary = summary[:100].rsplit(" ", 1)[0] + " ..."
    defects: list = []
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and target.id == "DEFECTS":
            if isinstance(value, ast.Dict):
                defects = [k.value for k in value.keys if isinstance(k, ast.Constant)]
            elif isinstance(value, ast.Attribute) and value.attr == "DEFECTS":
                defects = list(llama_shared.DEFECTS)
            elif isinstance(value, ast.DictComp) and isinstance(value.generators[0].iter, ast.Tuple):
                defects = [e.value for e in value.generators[0].iter.elts if isinstance(e, ast.Constant)]
        elif isinstance(target, ast.Name) and target.id == "CODE_DEFECTS":  # planted in the recipe's own code
            if isinstance(value, ast.Dict):
                defects += [k.value for k in value.keys if isinstance(k, ast.Constant)]
            elif isinstance(value, ast.Attribute) and value.attr == "CODE_DEFECTS":
                defects += list(llama_shared.CODE_DEFECTS)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                and target.value.id == "DEFECTS" and isinstance(target.slice, ast.Constant):
            defects.append(target.slice.value)
    return summary, defects


def cmd_demo(args) -> int:
    from layerdiff.demo import run_demo

    return run_demo(defect=args.defect, keep=args.keep, framework=args.framework)


COMMANDS = {"recipes": cmd_recipes, "trace": cmd_trace, "align": cmd_align, "bisect": cmd_bisect, "report": cmd_report, "show": cmd_show, "demo": cmd_demo,
            "weights": cmd_weights, "logs": cmd_logs, "config": cmd_config}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("layerdiff: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line, never a traceback (--debug shows it)
        if args.debug:
            raise
        print(f"layerdiff: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _one_line(exc: BaseException) -> str:
    """What to tell the user: our own errors as they are; a file the system refused (disk full, permission) by
    name; anything else as an internal error to report."""
    if isinstance(exc, LayerdiffError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"internal error ({type(exc).__name__}: {first}); rerun with --debug for the traceback and report it"


if __name__ == "__main__":
    sys.exit(main())
