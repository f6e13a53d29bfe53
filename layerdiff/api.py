"""The Python face of the CLI: ``layerdiff.align`` and ``layerdiff.rethreshold`` return a ``Report``.

The CLI's ``align`` and ``report`` commands are thin layers over these functions; options carry the flags' names
(``--map`` is ``map=``, ``--no-auto-map`` is ``auto_map=False``). Framework-free: aligning imports no framework.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, cast

from layerdiff import schema
from layerdiff.compare.spec import Comparison
from layerdiff.compare.tasks import Workers
from layerdiff.errors import LayerdiffError
from layerdiff.files import refuse_existing

EXIT_OK, EXIT_DIVERGENT, EXIT_UNTRUSTED = 0, 1, 3


def comparison(*, atol=None, rtol=None, cos=None, tol=(), map=(), layout=(), rules=(),  # noqa: A002
               auto_map: bool = True, workers: Workers | None = None, all_positions: bool = False) -> Comparison:
    """Validate the comparison options once (``Comparison.of``); a bad value is a ``LayerdiffError`` naming the
    option. ``workers``: where the work runs (``Workers.of``; this process when None). ``all_positions``: compare
    padded positions too (by default, where both runs' root call got the same ``attention_mask`` with zeros,
    tensors that lead with [batch, seq] are compared where it is 1)."""
    return Comparison.of(atol=atol, rtol=rtol, cos=cos, tol=tol, map=map, layout=layout, rules=rules,
                         auto_map=auto_map, workers=workers, all_positions=all_positions)


@dataclass(frozen=True)
class Report:
    """An align report. ``data`` is exactly the JSON report (``layerdiff align --json``); the properties read it.

    Re-judging under other tolerances needs no trace: ``report.rethreshold(atol=1e-3)``."""

    data: Mapping[str, Any]

    @property
    def verdict(self) -> str:
        return self.data["verdict"]

    @property
    def multi_rank(self) -> bool:
        """A comparison of one run's ranks with each other (``align(RUN)``), not of two runs."""
        return "ranks" in self.data and "forward" not in self.data

    def origin(self, phase: str = "forward") -> dict | None:
        """The first divergence of ``phase`` ("forward" or "backward"): module, description, metrics, ..."""
        if self.multi_rank:
            first = self.data.get("first_divergence")
            return first if first and first.get("phase") == phase else None
        return self.data[phase]["first_divergence"]

    @property
    def forward(self) -> dict | None:
        return self.origin("forward")

    @property
    def backward(self) -> dict | None:
        return self.origin("backward")

    @property
    def steps(self) -> int:
        """How many steps the compared traces span (an origin's ``step`` is 0-based)."""
        from layerdiff.report.terminal import step_count

        return step_count(self.data)

    @property
    def records(self) -> list:
        """Every compared record pair with its tensors' metrics and verdicts."""
        return self.data.get("records", [])

    @property
    def mapping(self) -> list:
        """The module mapping used (B's module -> A's), with the evidence for each pair."""
        return self.data.get("mapping", [])

    @property
    def problems(self) -> list:
        """Why an "aligned" result cannot be trusted (incomplete run, one-sided phase, comparisons a cluster could
        not finish, ...); empty if it can."""
        if self.multi_rank:
            from layerdiff.runs.desync import missing_line

            return [missing_line(self.data["missing"])] if self.data.get("missing") else []
        return (self.data.get("trust") or {}).get("problems", [])

    @property
    def exit_code(self) -> int:
        """What ``layerdiff align`` exits with: 0 aligned, 1 divergent, 3 aligned but not trustworthy."""
        if self.verdict != "aligned":
            return EXIT_DIVERGENT
        return EXIT_UNTRUSTED if self.problems else EXIT_OK

    def rethreshold(self, *, atol=None, rtol=None, cos=None, tol=()) -> Report:
        return rethreshold(self, atol=atol, rtol=rtol, cos=cos, tol=tol)

    def to_json(self, path=None, *, overwrite: bool = False) -> str:
        """The JSON report as text; with ``path``, also written there atomically (never over a file unless
        ``overwrite``)."""
        from layerdiff.report.jsonio import json_text, write_json

        if path is not None:
            write_json(self.data, path, overwrite=overwrite)
        return json_text(self.data)

    def to_html(self, path=None, *, overwrite: bool = False) -> str:
        """The report as one self-contained HTML page (no script, no network); with ``path``, also written
        there atomically."""
        from layerdiff.files import write_atomically
        from layerdiff.report.html import report_html

        if self.multi_rank:
            raise LayerdiffError("a comparison of ranks has no HTML page yet: align two runs for one")
        page = report_html(self.data)
        if path is not None:
            write_atomically(path, page, overwrite=overwrite)
        return page

    def summary(self) -> str:
        """One line per phase: what ``layerdiff align -q`` prints, without the exit code."""
        if self.multi_rank:
            from layerdiff.runs.desync import against_rank0

            first = self.data["first_divergence"]
            compared = self.data["world_size"] - len(self.data.get("missing") or [])
            warnings = "".join(f"; WARNING: {p}" for p in self.problems)
            if first:
                return f"{self.verdict}: {first['phase']} {first['description']} on rank(s) " \
                    f"{', '.join(map(str, first['ranks']))}{warnings}"
            params = [r for r in self.data["ranks"] if r["params_differ"]]
            if params:  # the replicas' weights differ, nothing they computed yet
                return f"{self.verdict}: parameters differ on rank(s) {', '.join(str(r['rank']) for r in params)}: " \
                    f"{', '.join(params[0]['params_differ'][:3])}{warnings}"
            whom = "rank 0" if against_rank0(self.data) else "the first rank of their replicas"
            return f"{self.verdict}: all {compared} ranks agree with {whom}{warnings}"
        lines = [f"{self.verdict}"]
        for phase in ("forward", "backward"):
            first = self.origin(phase)
            lines.append(f"  {phase:8} " + (f"origin {first['description']}" if first else self.data[phase]["status"]))
        lines += [f"  WARNING: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in (self.data.get("trust") or {}).get("notes", [])]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<layerdiff.Report {self.summary()}>"

    def _repr_pretty_(self, printer, cycle):  # IPython / Jupyter
        printer.text(repr(self) if cycle else self.summary())


def align(a, b=None, *, atol=None, rtol=None, cos=None, tol=(), map=(), layout=(), rules=(),  # noqa: A002
          auto_map: bool = True, workers: int | None = None, scheduler: str | None = None,
          progress: bool = False, all_positions: bool = False) -> Report:
    """Compare trace ``b`` (the candidate) with trace ``a`` (the reference), as ``layerdiff align A B``.

    Either may be a multi-rank run directory. With ``b`` omitted, ``a`` is a multi-rank run whose ranks are
    compared with rank 0. ``workers``: processes comparing ranks, or the stored tensors of two large traces
    (None: one per core; 1: all in this process). ``scheduler``: a Dask scheduler's address (or a scheduler file,
    or "local" for a LocalCluster of ``workers`` processes) whose workers do that work, reading the traces by path
    from a filesystem they share with this machine; None: ``$LAYERDIFF_SCHEDULER`` if set. ``all_positions``:
    compare padded positions too (``--all-positions``; see ``comparison``)."""
    from layerdiff.compare.tasks import scheduler_address
    from layerdiff.judge.evaluate import align as align_traces
    from layerdiff.report.progress import ByteProgress, TaskProgress
    from layerdiff.runs.ranks import open_run

    how = comparison(atol=atol, rtol=rtol, cos=cos, tol=tol, map=map, layout=layout, rules=rules, auto_map=auto_map,
                     workers=Workers.of(workers, *scheduler_address(scheduler)), all_positions=all_positions)
    if b is None:
        from layerdiff.runs.desync import check_run

        tasks = TaskProgress("comparing ranks with rank 0", enabled=None if progress else False)
        try:
            return Report(check_run(a, how, progress=tasks))
        finally:
            tasks.close()
    with open_run(a, how.rules) as ra, open_run(b, how.rules) as rb:
        bar = ByteProgress("aligning", enabled=None if progress else False)
        try:
            data = align_traces(ra, rb, how, progress=bar)
        finally:
            bar.close()
    return Report(data)


def rethreshold(report, *, atol=None, rtol=None, cos=None, tol=()) -> Report:
    """Judge a report's measurements again under other tolerances (``layerdiff report REPORT --atol ...``).

    ``report`` is a ``Report``, a report dict, or the path of a JSON report."""
    from layerdiff.judge.evaluate import evaluate
    from layerdiff.report.jsonio import read_json

    data: Mapping[str, Any]
    if isinstance(report, Report):
        data = report.data
    elif isinstance(report, dict):
        data = report
    else:
        data = read_json(Path(report))
    if "forward" not in data:
        raise LayerdiffError("a comparison of ranks is judged when it is made: align the run again instead")
    policy = comparison(atol=atol, rtol=rtol, cos=cos, tol=tol).policy
    # a report given in Python is taken as the schema says (a file is checked by read_json); evaluate returns a new
    # report: the one given is not changed
    return Report(evaluate(cast(schema.Report, data), policy))


def bisect(reference, target, *, args=(), search: bool = False, blocks=None, include=None, exclude=None,
           workdir=None, restart: bool = False, json=None, force: bool = False, atol=None, rtol=None, cos=None,
           tol=(), map=(), layout=(), rules=(), auto_map: bool = True, progress: bool = False) -> dict:  # noqa: A002
    """``layerdiff bisect REFERENCE TARGET``: replay the candidate on the reference's recorded values (or, with
    ``search``, splice blocks) and return the result the CLI writes with ``--json`` (``json=`` writes it too).
    ``args`` are the target's ``NAME=VALUE`` arguments, as ``--arg``."""
    from layerdiff import runner
    from layerdiff.replay import driver as bisection
    from layerdiff.report.jsonio import write_json
    from layerdiff.report.progress import RunProgress

    how = comparison(atol=atol, rtol=rtol, cos=cos, tol=tol, map=map, layout=layout, rules=rules, auto_map=auto_map)
    if json:
        refuse_existing(json, force)
    if json and not Path(json).resolve().parent.is_dir():
        raise LayerdiffError(f"directory {Path(json).parent} does not exist")
    if blocks and not search:
        raise LayerdiffError("--blocks goes with --search")
    bisection.check_reference(reference)
    runner.resolve(target)
    kwargs = runner.parse_args(list(args or ()))
    command = {"strategy": "search" if search else "replay", "reference": bisection.reference_identity(reference),
               "target": target, "args": kwargs, "map": list(map or ()), "layout": list(layout or ()),
               "include": include, "exclude": exclude, "blocks": blocks, "auto_map": auto_map,
               "rules": [str(p) for p in rules or ()], "tolerances": how.policy.describe() if search else None}
    work = bisection.Workdir(workdir or bisection.default_workdir(reference, command), command, restart=restart)
    bar = RunProgress(enabled=progress)
    try:
        if search:
            result = bisection.search(reference, target, kwargs, work, how, container=blocks, progress=bar)
        else:
            result = bisection.replay(reference, target, kwargs, work, how, include=include, exclude=exclude,
                                      progress=bar)
    finally:
        bar.close()
    if json:
        write_json(result, json, overwrite=force)
    return result


def weights_diff(a, b, *, map=(), exact: bool = False, transpose=(), rules=()) -> dict:  # noqa: A002
    """``layerdiff weights diff A B``: the per-parameter report (``-o``) of two checkpoints of any supported
    kind (safetensors, HF index, torch with ``weights_only``, Paddle, MindSpore, Megatron, a trace)."""
    from layerdiff.checkpoints import compare_files

    return compare_files(a, b, mapping=list(map or ()), exact=exact, transpose=list(transpose or ()),
                         rules=list(rules or ()))


def logs_diff(a, b, *, tol=()) -> dict:
    """``layerdiff logs diff A B``: loss, lr and grad norm of two training logs, iteration by iteration."""
    from layerdiff.logs import compare_files, tolerances

    return compare_files(a, b, tolerances(tol))


def config_diff(a, b) -> dict:
    """``layerdiff config diff A B``: two model configurations (Megatron-LM, MindSpore Transformers, HF) in
    canonical keys."""
    from layerdiff.configdiff import compare_files

    return compare_files(a, b)


def show(path) -> dict:
    """``layerdiff show TRACE`` as data: status, metadata, record counts, NaN/Inf origins and the modules in call
    order (a multi-rank run shown merged); no tensor data is read."""
    from layerdiff.report.show_trace import summary

    return summary(path)
