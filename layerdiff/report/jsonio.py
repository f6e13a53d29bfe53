"""The JSON report on disk: written atomically and never over a file unless asked; read back only after it is checked
against the schema (a foreign, damaged or hostile file is one clear error). Non-finite floats are the strings
"inf", "-inf" and "nan", so the file stays standard JSON."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from layerdiff import schema
from layerdiff.errors import LayerdiffError
from layerdiff.files import write_atomically


def json_text(report: Mapping[str, Any]) -> str:
    """The report as JSON text (non-finite numbers as "nan", "inf", "-inf": strict JSON readers accept it)."""
    return schema.dumps(report)


def write_json(report: Mapping[str, Any], path, *, overwrite: bool = False):
    """Write atomically (temp file + rename) and never over an existing file unless asked."""
    write_atomically(path, json_text(report), overwrite=overwrite)


def publish(report: Mapping[str, Any], *, json_path=None, overwrite: bool = False, quiet: bool = False, line=None, render=None):
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
        parent_of: dict[tuple, tuple | None] = {}
        for key, r in nodes.items():
            chain = r.get("ancestors")
            if chain is None:
                parent = r.get("parent")
                chain = [parent] if parent else []
            parent_of[key] = next((tuple(up) for up in chain if tuple(up) in nodes), None)
        depth: dict = {}  # call -> depth below its root, None when no root is above it (a cycle)
        for key in nodes:
            walk: list[tuple] = []
            seen: set[tuple] = set()
            k: tuple | None = key
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
