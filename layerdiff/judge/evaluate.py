"""The judging pass of align: every measured tensor judged under a tolerance policy, the origin named forward and
backward, and what else a reader of the verdict needs (trust, how the error grows, the window to trace next).

Pure functions of the measured report: ``evaluate`` never reads a trace, so a saved report is judged again under
other tolerances (``layerdiff report``) with the same result as a new alignment."""
from __future__ import annotations

from layerdiff import schema
from layerdiff.compare.measure import measure
from layerdiff.compare.metrics import relative_error
from layerdiff.compare.spec import Comparison
from layerdiff.compare.tolerance import TolerancePolicy
from layerdiff.judge.origin import phase_result, update_origin
from layerdiff.judge.tree import call_tree, judge_rows, param_rows
from layerdiff.match.modules import find_blocks


def evaluate(measurements: schema.Report, policy: TolerancePolicy) -> schema.Report:
    """Judge every tensor and locate the origin, forward and backward. Returns the full report dict, a new one:
    ``measurements`` is not changed."""
    rows = judge_rows(measurements, policy)
    params = {kind: param_rows(rows, kind) for kind in ("param", "param_grad", "param_grad_use")}
    strict = measurements.get("structure") == "same_model"
    forward = phase_result(rows, "forward", call_tree(rows, "forward", strict), params, None)
    forward["first_divergence"] = update_origin(rows, params, forward["first_divergence"])
    backward = phase_result(rows, "backward", call_tree(rows, "backward", strict), params,
                             forward["first_divergence"])
    forward["failure"], forward["failure_a"] = _failure(measurements["b"]), _failure(measurements["a"])
    crash = forward["failure"] or forward["failure_a"]
    if crash and forward["first_divergence"] is None:  # everything before the crash agrees: the crash is it
        run = "B" if forward["failure"] else "A"
        forward["status"] = "failed"
        forward["first_divergence"] = {
            "module": crash["module"], "where": "raised", "phase": "forward", "error": crash["error"],
            "description": f"{crash['module'] or '<root>'} raised in run {run}: {crash['error']}",
            "chain": [p or "<root>" for p in crash["module_stack"]], "hparam_diff": {}, "param_diffs": []}
    param_values = params["param"]
    report: schema.Report = {**measurements, "records": rows}
    report["trust"] = trust(measurements, forward, backward)
    report["next_pass"] = window_suggestion(measurements, forward["first_divergence"])
    report["tolerances"] = policy.describe()
    report["forward"], report["backward"] = forward, backward
    report["params"] = {
        "compared": len(param_values), "differ": [p["name"] for p in param_values if not p["passed"]],
        "grads_compared": len(params["param_grad"]),
        "grads_differ": [p["name"] for p in params["param_grad"] if not p["passed"]],
        "grad_uses_differ": [f"{p['module']} (call {p['call']})" for p in params["param_grad_use"] if not p["passed"]]}
    report["growth"] = growth_table(rows, forward["first_divergence"])
    divergent = {"divergent", "failed"} & {forward["status"], backward["status"]}
    report["verdict"] = "divergent" if divergent or any(not p["passed"] for p in param_values) else "aligned"
    return report


def _failure(run: schema.RunSummary) -> schema.Failure | None:
    """A run that raised: where, and what."""
    failure = run.get("failure")
    if not failure:
        return failure
    return {"module": failure.get("module"), "error": failure.get("error"),
            "module_stack": failure.get("module_stack", [])}


def trust(measurements: schema.Report, forward: schema.PhaseResult, backward: schema.PhaseResult) -> schema.Trust:
    """Why an "aligned" verdict could still be wrong: a damaged trace, a run that did not finish, a phase recorded
    on one side only, the same trace twice. ``{"ok": bool, "problems": [...], "notes": [...]}``; the CLI exits 3
    for aligned-but-not-ok. ``notes``: traces written before checksums (not verified)."""
    problems, notes = [], []
    for summary, name in ((measurements["a"], "A"), (measurements["b"], "B")):
        damage = summary.get("damage") or []
        if damage:
            shown = "; ".join(damage[:3]) + (f"; and {len(damage) - 3} more" if len(damage) > 3 else "")
            problems.append(f"{name} ({summary['path']}) is damaged: {len(damage)} part(s) do not read as written "
                            f"(not compared, or compared by statistics only): {shown}")
        if not summary.get("complete", True):
            problems.append(f"{name} ({summary['path']}) is incomplete: its run did not finish, so only what it "
                            "recorded before was compared")
        if summary.get("unverified"):
            notes.append(f"{name} ({summary['path']}) cannot be verified: written before checksums (trace format "
                         "2 or older), so damage to it would go unnoticed")
    phases = measurements.get("phases") or {}
    for phase in ("forward", "backward"):
        present = phases.get(phase, {})
        if present.get("a") != present.get("b"):
            only = "A" if present.get("a") else "B"
            problems.append(f"{phase} was recorded in {only} only (traced with --no-backward, or no backward "
                            "pass run?): it was not compared")
    if measurements.get("same_file"):
        problems.append("A and B are the same file: nothing was compared with another run")
    missing = measurements.get("not_compared") or []
    if missing:
        problems.append(not_compared_line(missing))
    result: schema.Trust = {"ok": not problems, "problems": problems}
    if notes:
        result["notes"] = notes
    return result


def not_compared_line(missing: list[schema.NotCompared], named: int = 5) -> str:
    """The tensor pairs a cluster could not compare, as one line: the first few named, then how many more."""
    names = [f"{m['path'] or '<root>'} {m['tensor']}" + (f" ({m['phase']})" if m.get("phase") else "")
             for m in missing[:named]]
    more = f" and {len(missing) - named} more (not_compared in the JSON report lists them)" \
        if len(missing) > named else ""
    return (f"{len(missing)} tensor comparison(s) did not complete, so the result is incomplete: "
            f"{'; '.join(names)}{more}: {missing[0]['reason']}")


def window_suggestion(measurements: schema.Report, origin: schema.Origin | None) -> dict | None:
    """Two-pass tracing: after a statistics-only align, the block to trace again in full mode and bisect."""
    module = origin.get("module") if origin is not None else None
    if not module or measurements.get("basis") not in ("stats", "mixed"):
        return None
    container, blocks = find_blocks(r["path"] for r in measurements["records"] if r["kind"] == "call")
    index = next((i for i, b in enumerate(blocks) if module == b or module.startswith(b + ".")), None)
    if index is None:
        return None
    return {"block": blocks[index], "layers": f"{index}:{index + 1}", "container": container}


def _parent_path(row: schema.Row) -> str | None:
    parent = row.get("parent")
    return parent[0] if parent else None


def growth_table(rows: list[schema.Row], origin: schema.Origin | None, max_rows: int = 16) -> list:
    """Forward calls at the coarsest depth that still shows the model's blocks, plus the origin's ancestors
    and siblings: how the error grows, block by block, and where it starts."""
    step = origin["step"] if origin and "step" in origin else 0
    calls = sorted((r for r in rows if r["kind"] == "call" and r["phase"] == "forward" and r["step"] == step),
                   key=lambda r: r["begin"])
    depth = lambda r: 0 if not r["path"] else r["path"].count(".") + 1  # noqa: E731
    chosen = 1
    for d in range(1, 12):
        if sum(1 for r in calls if depth(r) <= d) > max_rows:
            break
        chosen = d
    near = set()
    if origin and origin.get("chain"):
        chain = [p if p != "<root>" else "" for p in origin["chain"]]
        near.update(chain)
        grandparent = chain[-2] if len(chain) > 1 else None
        near.update(r["path"] for r in calls if grandparent is not None and _parent_path(r) == grandparent)
        near.update(r["path"] for r in calls if _parent_path(r) == chain[-1])
    tree_depth: dict[tuple | None, int] = {}
    for r in calls:  # depth in the call tree (a never-called ModuleList adds no level)
        parent = r.get("parent")
        tree_depth[(r["path"], r["call"])] = tree_depth.get(tuple(parent) if parent else None, -1) + 1
    table = []
    for r in calls:
        if depth(r) > chosen and r["path"] not in near:
            continue
        outs = [t for t in r["tensors"] if t["role"] == "output"]
        worst = max(outs, key=lambda t: relative_error(t["metrics"]), default=None)
        table.append({"module": r["path"], "call": r["call"], "type": r["type_a"],
                      "depth": tree_depth[(r["path"], r["call"])],
                      "passed": all(t["passed"] for t in r["tensors"]) and not r.get("error_b"),
                      "max_abs": worst and worst["metrics"].get("max_abs"),
                      "rel": worst and relative_error(worst["metrics"]),
                      "cosine": worst and worst["metrics"].get("cosine"),
                      # elements NaN or infinite in one run only: the other metrics are over finite values
                      "nonfinite": (worst["metrics"].get("nonfinite_mismatch") or 0) if worst else 0,
                      "origin": bool(origin and r["path"] == origin["module"] and r["call"] == origin.get("call"))})
    return table


def align(reader_a, reader_b, how: Comparison | None = None, *, progress=None) -> schema.Report:
    """Two traces (readers) measured and judged as ``how`` says: the report ``layerdiff align`` writes."""
    how = how or Comparison()
    return evaluate(measure(reader_a, reader_b, how, progress=progress), how.policy)
