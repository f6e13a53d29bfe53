"""``layerdiff show``: what a trace holds, without reading tensor data."""
from __future__ import annotations

import re
from collections import Counter, defaultdict

from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from layerdiff.compare.nonfinite import first_nonfinite
from layerdiff.errors import LayerdiffError
from layerdiff.report.ops_view import code_at, short_source
from layerdiff.report.terminal import fmt_number, make_console
from layerdiff.runs.ranks import open_run
from layerdiff.tracefile.records import CallRecord, EndRecord

_META_KEYS = ("framework", "framework_version", "model_class", "model_parts", "mode", "distributed", "num_parameters",
              "devices", "param_dtypes",
              "seed", "deterministic_algorithms", "float32_matmul_precision", "tf32_matmul", "num_threads",
              "layerdiff_version", "python", "started", "argv")


def _layout(meta: dict) -> dict:
    """The run's parallel layout (``parallel``: sizes and this rank's coordinates, its flags, the stages a rank runs),
    without the per-module lists it may hold (a pipeline stage's renamed layers)."""
    layout = meta.get("parallel")
    if not isinstance(layout, dict):
        return {}
    return {"parallel": {k: v for k, v in layout.items() if not isinstance(v, (dict, list)) or k == "pp_stages"}}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _forward_calls(records) -> tuple[Counter, dict[str, str | None], list[str]]:
    """(forward calls per module path, each path's type, the paths in the order they were first called)."""
    calls: Counter = Counter()
    types: dict[str, str | None] = {}
    first_call: dict[str, int] = {}
    for r in records:
        if isinstance(r, CallRecord) and r.phase == "forward":
            calls[r.path] += 1
            types[r.path] = r.type
            first_call[r.path] = min(first_call.get(r.path, r.begin), r.begin)
    return calls, types, sorted(calls, key=lambda p: first_call[p])


def module_tree(records) -> Tree:
    """Module paths as a tree, each with its type and how many forward calls it recorded."""
    calls, types, order = _forward_calls(records)
    root = Tree(f"<root> [dim]{types.get('', '')}[/] x{calls.get('', 0)}")
    nodes = {"": root}
    for path in (p for p in order if p):  # in the order the model ran
        parts = path.split(".")
        parent = ""
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in nodes:
                label = parts[i - 1] + (f" [dim]{types[sub]}[/] x{calls[sub]}" if sub in calls else "")
                nodes[sub] = nodes[parent].add(label)
            parent = sub
    return root


def summary(path) -> dict:
    """What ``layerdiff show`` prints, as data (``layerdiff.show`` in Python); no tensor data is read."""
    with open_run(path) as reader:
        return _summary(reader)


def _summary(reader) -> dict:
    meta, end = reader.meta, reader.end or EndRecord(status="interrupted")
    kinds = Counter((r.kind, r.phase) for r in reader.records)  # the end marker is no record
    holding = {id(r) for r in reader.records for t in r.tensors
               if (t.stats.get("nan") or t.stats.get("inf")) and not t.undefined}
    calls, types, order = _forward_calls(reader.records)
    return {"path": str(reader.path), "size_bytes": reader.size_bytes(), "ranks": meta.get("ranks"),
            "status": end.status or "interrupted", "failure": end.failure,
            "meta": {**{key: meta[key] for key in _META_KEYS if key in meta}, **_layout(meta)},
            "records": len(reader.records),
            "record_kinds": {f"{k}/{p}" if p else k: n for (k, p), n in sorted(kinds.items(), key=str)},
            "tensors": sum(len(r.tensors) for r in reader.records),
            "tensor_bytes": sum(t.nbytes or 0 for r in reader.records for t in r.tensors),
            "steps": end.steps, "warnings": end.warnings, "autocast_dtypes": list(end.autocast_dtypes),
            "damage": [d.describe() for d in reader.damage], "unverified": reader.unverified,
            "nonfinite_records": len(holding),
            "ops": {phase: sum(1 for op in reader.ops if op.phase == phase) for phase in ("forward", "backward")},
            "nonfinite_origin": {phase: first_nonfinite(reader.records, phase, reader.ops)
                                 for phase in ("forward", "backward")},
            "modules": [{"path": p, "type": types[p], "calls": calls[p]} for p in order]}


def op_table(ops, pattern: str) -> Table:
    """The forward operations of the module calls whose path matches ``pattern``, in the order they ran."""
    try:
        wanted = re.compile(pattern)
    except re.error as exc:
        raise LayerdiffError(f"bad --ops regular expression {pattern!r}: {exc}") from None
    table = Table(title="operations (forward)", title_justify="left", box=None)
    for col in ("module", "call", "#", "operation", "line", "function", "inputs -> outputs"):
        table.add_column(col)
    # what each made, as its output's statistics say: where values blow up, or a NaN appears, reads down the column
    table.add_column("output max |x|", justify="right")
    table.add_column("NaN/Inf", justify="right")
    for op in sorted((op for op in ops if op.phase == "forward" and wanted.search(op.path)), key=lambda op: op.begin):
        shapes = " ".join(str(t.shape) for t in op.tensors if t.role == "input") + " -> " + \
            " ".join(str(t.shape) for t in op.tensors if t.role == "output")
        outputs = [t.stats for t in op.tensors if t.role == "output" and t.stats and not t.undefined]
        largest = [max(abs(s["min"]), abs(s["max"])) for s in outputs
                   if isinstance(s.get("min"), (int, float)) and isinstance(s.get("max"), (int, float))]
        nonfinite = sum(s.get("nan", 0) + s.get("inf", 0) for s in outputs)
        table.add_row(escape(op.path or "<root>"), str(op.call), str(op.index), escape(op.name),
                      escape(short_source(op.source)), escape(op.function or ""), shapes,
                      fmt_number(float(max(largest))) if largest else "-",
                      f"[bold red]{nonfinite}[/]" if nonfinite else "0" if outputs else "-")
    return table


def show(path, records: bool = False, nan: bool = False, ops: str | None = None):
    """``layerdiff show``; ``ops``: also list the operations of the module calls whose path matches this regular
    expression ("" for every module)."""
    console = make_console()
    with open_run(path) as reader:
        info = _summary(reader)
        console.print(f"[bold]{reader.path}[/]  {_mb(info['size_bytes'])} on disk")
        if info["ranks"]:
            console.print(f"a run of {info['ranks']} ranks, shown merged (shards joined by placement, data-parallel "
                          "shares along the batch)")
        status = info["status"] if info["status"] != "interrupted" else \
            "interrupted (the writing process died; records up to its last write: trace with --write-behind 0 " \
            "to keep every record up to a kill)"
        console.print(f"status: {status}")
        for damage in info["damage"]:
            console.print(f"[bold red]DAMAGED: {escape(damage)}[/]")
        if info["damage"]:
            console.print(f"[bold red]{len(info['damage'])} damaged part(s): written whole, they no longer read as "
                          "written (bit rot, a bad copy); the rest of the trace reads as written[/]")
        if info["unverified"]:
            console.print("[dim]note: written before checksums (trace format 2 or older): cannot be verified[/]")
        if info["failure"]:
            f = info["failure"]
            console.print(f"[red]failed in {f.get('module') or '<root>'}: {f.get('error')}[/]")
            if f.get("module_stack"):
                console.print(f"[red]modules active: {' > '.join(p or '<root>' for p in f['module_stack'])}[/]")
        for key, value in info["meta"].items():
            console.print(f"[dim]{key}:[/] {value}")
        if info["autocast_dtypes"]:
            console.print(f"[dim]autocast_dtypes:[/] {info['autocast_dtypes']} (automatic mixed precision was on)")
        data = info["tensor_bytes"]
        console.print(f"records: {info['records']} ("
                      + ", ".join(f"{n} {k}" for k, n in info["record_kinds"].items())
                      + f"), {info['tensors']} tensors, {_mb(data)} of tensor data, "
                      f"steps: {info['steps'] if info['steps'] is not None else '?'}")
        holding = info["nonfinite_records"]
        if holding or nan:
            console.print(f"[{'red' if holding else 'green'}]{holding} records hold NaN/Inf[/]")
            for phase, origin in info["nonfinite_origin"].items():
                if origin:
                    console.print(f"[red]  {phase} NaN/Inf origin: {origin['module'] or '<root>'} (call {origin['call']}) "
                                  f"{origin['tensor']}: {origin['nan']} NaN, {origin['inf']} Inf; its inputs are finite[/]")
                    op = origin.get("op")
                    if op:
                        code = code_at(op.get("source"))
                        console.print(f"[red]    born in {escape(op['name'])} at {escape(short_source(op.get('source')))}"
                                      f" ({escape(op.get('function') or '?')})[/]" + (f": {escape(code)}" if code else ""))
        for w in info["warnings"]:
            console.print(f"[yellow]warning: {w}[/]")
        console.print(module_tree(reader.records))
        by_module: defaultdict[str, int] = defaultdict(int)
        for r in reader.records:
            by_module[r.path] += sum(t.nbytes or 0 for t in r.tensors)
        if data:
            table = Table(title="largest modules by stored bytes", title_justify="left", box=None)
            table.add_column("module")
            table.add_column("bytes", justify="right")
            for p, n in sorted(by_module.items(), key=lambda kv: -kv[1])[:8]:
                table.add_row(p or "<root>", _mb(n))
            console.print(table)
        if info["ops"]["forward"] or info["ops"]["backward"]:
            console.print(f"operations inside modules (--ops): {info['ops']['forward']} forward, "
                          f"{info['ops']['backward']} backward")
        recomputed = getattr(reader, "recomputed", ())
        if recomputed:
            calls = sum(r.kind == "call" for r in recomputed)
            console.print(f"recomputed in backward (activation checkpointing): {calls} module calls, "
                          f"{len(recomputed) - calls} operations (kept apart from the forward they replay)")
        if ops is not None:
            console.print(op_table(reader.ops, ops))
        if records:
            table = Table(box=None)
            for col in ("#", "kind", "phase", "module", "call", "step", "tensors"):
                table.add_column(col)
            for i, r in enumerate(reader.records):
                table.add_row(str(i), r.kind, r.phase or "", r.path or "<root>", str(r.call), str(r.step),
                              ", ".join(f"{t.role}:{t.key}{t.shape}" for t in r.tensors))
            console.print(table)
