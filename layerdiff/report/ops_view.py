"""What the terminal and the HTML report show of operations (``ops`` tracing): the line of code each run ran at the
origin, the origin module's operations side by side, and, where a report names a module's own code without them,
the command that traces both runs again with operations recorded in that module."""
from __future__ import annotations

import linecache
import re
import shlex
from typing import Any, Mapping

View = Mapping[str, Any]
_SHOWN_AROUND = 6  # operations shown before and after the origin's
_FRAMEWORK_LEAVES = {"linear", "embedding"}


def code_at(source: str | None) -> str | None:
    """The text of the line ``FILE:LINE`` names, read from the file where it still exists (None elsewhere)."""
    if not source:
        return None
    file, _, line = source.rpartition(":")
    if not line.isdigit():
        return None
    text = linecache.getline(file, int(line)).strip()
    return text or None


def short_source(source: str | None) -> str:
    """``modeling_llama.py:193`` of a full ``FILE:LINE``."""
    if not source:
        return "-"
    file, _, line = source.rpartition(":")
    return f"{file.replace(chr(92), '/').rpartition('/')[2]}:{line}"


def origin_code(op: View) -> list[tuple[str, str, str | None]]:
    """(run, short source, code) of the origin's operation in A and, where its line differs, in B; and the lines of
    the operations only one run has that the origin names (an inserted cast, a step with its own backward)."""
    rows: list[tuple[str, str, str | None]] = []
    for run, source, inserted in (("A", op.get("source"), op.get("only_a")), ("B", op.get("source_b"), op.get("only_b"))):
        shown = {rows[0][1]} if rows and run == "B" and source == op.get("source") else set()
        for line in ([source] if source else []) + [entry[2] for entry in inserted or [] if entry[2]]:
            if short_source(line) not in shown:
                shown.add(short_source(line))
                rows.append((run, short_source(line), code_at(line)))
    return rows


def module_ops(report: View, origin: View) -> list[View]:
    """The op rows of the origin's module call (its phase), in A's order, around the origin's operation; in
    forward, with the operations only one run ran among them (rows with ``unpaired``: "a" or "b")."""
    op = origin.get("op") or {}
    rows = [r for r in report.get("records", ()) if r.get("kind") == "op" and r.get("path") == origin.get("module")
            and r.get("call") == origin.get("call") and r.get("phase") == origin.get("phase")]
    rows.sort(key=lambda r: (r.get("op") or {}).get("index", 0))
    if origin.get("phase") == "forward":
        rows = _with_unpaired(report, origin, rows)
    index = next((i for i, r in enumerate(rows) if is_origin_row(r, op)), None)
    if index is None and op.get("index") is None and op.get("index_b") is not None:  # an operation B alone runs:
        before = [i for i, r in enumerate(rows) if (r.get("op_b") or {}).get("index", -1) < op["index_b"]]
        index = before[-1] if before else None  # around the last pair B ran before it
    if index is None:
        return rows[:2 * _SHOWN_AROUND + 1]
    return rows[max(0, index - _SHOWN_AROUND):index + _SHOWN_AROUND + 1]


def _with_unpaired(report: View, origin: View, rows: list[View]) -> list[View]:
    """``rows`` with the operations only one run ran (the module call's ``ops.only_a`` / ``only_b``) placed after
    the last paired operation that ran before them in that run."""
    call = next((r for r in report.get("records", ()) if r.get("kind") == "call" and r.get("phase") == "forward"
                 and r.get("path") == origin.get("module") and r.get("call") == origin.get("call")), None)
    summary = (call or {}).get("ops") or {}
    out = list(rows)
    for side, key in (("a", "op"), ("b", "op_b")):
        for entry in summary.get(f"only_{side}") or []:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], int)):
                continue  # a report from elsewhere, or edited: shown without it
            index, name, source = entry
            row = {"kind": "op", "unpaired": side, "tensors": [], "op": {}, "op_b": {},
                   key: {"index": index, "name": name, "source": source}}
            before = [i for i, r in enumerate(out) if isinstance((r.get(key) or {}).get("index"), int)
                      and r[key]["index"] < index]
            out.insert(before[-1] + 1 if before else 0, row)
    return out


def is_origin_row(row: View, op: View) -> bool:
    """Whether ``row`` is the origin's operation (``op``: the origin's), paired or one run's own."""
    if row.get("unpaired") == "b":
        return op.get("index") is None and (row.get("op_b") or {}).get("index") == op.get("index_b")
    return op.get("index") is not None and (row.get("op") or {}).get("index") == op.get("index")


def row_status(row: View) -> str:
    if row.get("unpaired"):
        return f"{row['unpaired'].upper()} only"
    tensors = row.get("tensors") or []
    if any(not t.get("passed", True) for t in tensors if t.get("role") in ("input", "grad_output")):
        return "inputs differ"
    if any(not t.get("passed", True) for t in tensors):
        return "differs"
    return "ok"


def _window(paths: str) -> str:
    """The ``--ops-in`` pattern of a module, or of the modules of one run that stand for it together (B's
    ``a + b`` where a port splits or fuses it)."""
    parts = [re.escape(p) for p in paths.split(" + ")]
    return "^" + (parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")") + "$"


def retrace_hint(report: View, origin: View) -> list[str]:
    """Where the origin is a module's own code and no operations were recorded there: the commands that trace both
    runs again with ``--ops-in`` on that module (or the Python form, for runs traced from Python)."""
    if origin.get("op") or origin.get("where") not in ("own_code", "module") or not origin.get("module"):
        return []
    path = origin["module"]
    calls = [r for r in report.get("records", ()) if r.get("kind") == "call" and r.get("path") == path]
    if any(r.get("ops") is not None for r in calls) or \
            any(r.get("family_a") in _FRAMEWORK_LEAVES for r in calls):  # nn.Linear: its operations are torch's
        return []
    patterns = {"a": _window(path), "b": _window(origin.get("path_b") or path)}  # B may name it otherwise (a port)
    lines = []
    for side in ("a", "b"):
        run = report.get(side) or {}
        target = run.get("target")
        pattern = patterns[side]
        if not target:
            if patterns["a"] == patterns["b"]:
                return [f"to see the operation and line: trace both runs again with "
                        f"layerdiff.trace(model, path, ops=[{pattern!r}]) (or --ops-in {shlex.quote(pattern)})"]
            return [f"to see the operation and line: trace both runs again with layerdiff.trace(model, path, "
                    f"ops=[...]) (or --ops-in): A with ops=[{patterns['a']!r}], B with ops=[{patterns['b']!r}]"]
        out = str(run.get("path") or f"{side}.h5")
        out = re.sub(r"(\.h5)?$", "_ops.h5", out, count=1)
        args = " ".join(f"--arg {shlex.quote(f'{k}={v}')}" for k, v in (run.get("target_args") or {}).items())
        lines.append(f"layerdiff trace {shlex.quote(target)} {args + ' ' if args else ''}--ops-in "
                     f"{shlex.quote(pattern)} -o {shlex.quote(out)}")
    return ["to see the operation and line, trace both runs again with operations recorded in that module:",
            *lines]


def origin_hints(report: View, origin: View) -> list[str]:
    """What the terminal and HTML reports print under an origin about its operations: how to record them
    (``retrace_hint``), or why those recorded were not compared (``not_compared_lines``)."""
    return retrace_hint(report, origin) + not_compared_lines(origin)


def not_compared_lines(origin: View) -> list[str]:
    """Why no operation is named where the origin is a module's own code whose operations both runs recorded
    (``Origin.ops_not_compared``), and what to do about it."""
    lines = []
    for why in origin.get("ops_not_compared") or ():
        run, other = why["side"].upper(), "B" if why["side"] == "a" else "A"
        missing = why.get("without_counterpart") or 0
        left = f" ({missing} of {other}'s operations in this call found no counterpart)" if missing else ""
        lines.append(f"{run}'s operations in this call are not compared: its run holds none of them, as a run whose "
                     f"ranks split a module's work keeps them per rank{left}. To compare them: one rank's trace "
                     f"against a run of the same layout, or a one-rank port traced with --ops-in")
    return lines
