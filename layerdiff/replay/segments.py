"""Own errors: which segments of the candidate are wrong on the reference's numbers.

Forcing the reference's values at every boundary cuts the candidate into segments that each start from the
reference's numbers: a leaf module's own work, or a parent's own code between two of its children. What the
candidate computed before a forced value replaced it is compared with the reference (``measure``), and every
difference left is that segment's OWN error: nothing inherited, nothing amplified."""
from __future__ import annotations

import math
from typing import Any, Mapping

from layerdiff import schema
from layerdiff.compare.metrics import relative_error
from layerdiff.compare.tolerance import TolerancePolicy
from layerdiff.judge.origin import describe_op, describe_origin
from layerdiff.judge.tree import call_tree, judge_rows


# ---------------------------------------------------------------------------------------------------------
# Own errors: which segments of the candidate are wrong on the reference's numbers
# ---------------------------------------------------------------------------------------------------------
def _worst(tensors: list[schema.TensorResult]) -> schema.TensorResult | None:
    failing = [t for t in tensors if not t["passed"]]
    return max(failing, key=lambda t: relative_error(t["metrics"]), default=None)


def _segment(node, where: str, description: str, tensor: Mapping[str, Any] | None, order: int, phase: str) -> dict:
    row = node.row
    segment = {"phase": phase, "module": row["path"], "call": row["call"], "where": where,
               "description": description, "order": order,
               "tensor": tensor and {"role": tensor["role"], "key": tensor["key"], "reason": tensor["reason"],
                                     "metrics": tensor["metrics"]},
               "rel_error": relative_error(tensor["metrics"]) if tensor else math.inf}
    if node.kind == "op":  # an operation of the module's own code (traces with ``--ops``)
        info, info_b = row["op"], row.get("op_b") or {}
        segment["op"] = {"name": info["name"], "kind": info["kind"], "index": info["index"],
                         "source": info.get("source"), "function": info.get("function"),
                         "source_b": info_b.get("source"), "function_b": info_b.get("function")}
    return segment


def _op_segment(node, wrong_input: bool, tensor, order: int, phase: str) -> dict:
    """An operation with an own error (its inputs are the reference's, its output is not), or, with
    ``wrong_input``, one that the code handed another tensor."""
    row = node.row
    text = describe_op(row["path"], dict(row["op"]), wrong_input, dict(row.get("op_b") or {}))
    return _segment(node, "op_input" if wrong_input else "op", text + (" (backward)" if phase == "backward" else ""),
                    tensor, order, phase)


def _forward_segments(roots) -> list:
    """Module boundaries carry the reference's values, the operations inside one module's code do not: the
    first operation with an own error in a call explains what its code computes after it (not counted again)."""
    out = []

    def visit(node, parent, previous, inherited=False):
        if inherited and node.kind == "op":  # its inputs come from an operation that already went wrong
            return
        bad_in = _worst(node.ins)
        if bad_in is not None and not inherited:
            if parent is None:
                out.append(_segment(node, "inputs", f"{node.row['path'] or '<root>'}: the runs were given "
                                    "different inputs", bad_in, node.row["begin"], "forward"))
            elif node.kind == "op":
                out.append(_op_segment(node, True, bad_in, node.row["begin"], "forward"))
            else:
                out.append(_segment(parent, "own_code", describe_origin(parent, "own_code", previous, node), bad_in,
                                    node.row["begin"], "forward"))
        if node.kind == "op":
            bad_out = _worst(node.outs)
            if bad_out is not None and bad_in is None:
                out.append(_op_segment(node, False, bad_out, node.row["end"], "forward"))
            return
        before = None
        op_error = False  # an operation of this call's code went wrong: what follows in it inherits
        for child in node.children:
            visit(child, node, before, op_error)
            if child.kind == "op" and (_worst(child.outs) is not None or _worst(child.ins) is not None):
                op_error = True
            before = child
        if node.row.get("error_b"):  # the innermost call that raised; its callers only passed the error on
            if any(child.row.get("error_b") for child in node.children):
                return
            out.append({**_segment(node, "raised", f"{node.row['path'] or '<root>'} raised on the reference's "
                                   f"inputs: {node.row['error_b']}", None, node.row["end"], "forward"),
                        "error": node.row["error_b"]})
            return
        bad_out = _worst(node.outs)
        if bad_out is not None and not op_error:
            where = "own_code" if node.children else "module"
            text = describe_origin(node, where, before, None) if node.children else (node.row["path"] or "<root>")
            out.append(_segment(node, where, text, bad_out, node.row["end"], "forward"))

    for root in roots:
        visit(root, None, None)
    return out


def _backward_segments(roots) -> list:
    """Backward visits children in backward order; descriptions speak of forward positions (the same code)."""
    out = []

    def visit(node, parent, inherited=False):
        bad_in = _worst(node.ins)  # grad_output as it arrived: made by the parent's code after this child
        if node.kind == "op":  # in backward order: its output gradients arrive, its input gradients leave
            if inherited:
                return
            bad_grad = _worst(node.outs)
            if bad_in is not None:
                out.append(_op_segment(node, True, bad_in, node.row["begin"], "backward"))
            elif bad_grad is not None:
                out.append(_op_segment(node, False, bad_grad, node.row["end"], "backward"))
            return
        if bad_in is not None and not inherited:
            if parent is None:
                out.append(_segment(node, "inputs", f"{node.row['path'] or '<root>'}: the runs were given a "
                                    "different gradient of the loss", bad_in, node.row["begin"], "backward"))
            else:
                short = node.row["path"].rsplit(".", 1)[-1]
                out.append(_segment(parent, "own_code", f"{parent.row['path'] or '<root>'}, own code using "
                                    f"{short}'s output (backward)", bad_in, node.row["begin"], "backward"))
        later = None  # after the loop: the child that ran first in forward
        op_error = False
        for child in node.children:
            visit(child, node, op_error)
            if child.kind == "op" and (_worst(child.outs) is not None or _worst(child.ins) is not None):
                op_error = True
            later = child
        grads_in = [t for t in node.outs if t["role"] == "grad_input"]
        weights = [t for t in node.outs if t["role"] != "grad_input"]
        bad_grad = _worst(grads_in)
        if bad_grad is not None and not op_error:
            text = (describe_origin(node, "own_code", None, later) + " (backward)") if node.children \
                else f"{node.row['path'] or '<root>'} (backward)"
            out.append(_segment(node, "own_code" if node.children else "module", text, bad_grad,
                                node.row["end"], "backward"))
        bad_weight = _worst(weights)
        if bad_weight is not None:
            out.append(_segment(node, "weight_grad", f"{bad_weight['key']} gradient of {node.row['path']}",
                                bad_weight, node.row["end"], "backward"))

    for root in roots:
        visit(root, None)
    return out


def amplification(free_report: Mapping[str, Any] | None) -> dict:
    """(path, call) -> how a module call of the free-running candidate turned its input error into output
    error: relative error in, relative error out, and their ratio."""
    out: dict[tuple, dict] = {}
    for row in (free_report or {}).get("records", []):
        if row["kind"] != "call" or row["phase"] != "forward":
            continue
        ins = [relative_error(t["metrics"]) for t in row["tensors"] if t["role"] == "input"]
        outs = [relative_error(t["metrics"]) for t in row["tensors"] if t["role"] == "output"]
        if not outs:
            continue
        rin, rout = max(ins, default=0.0), max(outs)
        ratio = rout / rin if rin > 0 else (math.inf if rout > 0 else None)
        out[(row["path"], row["call"])] = {"in_rel": rin, "out_rel": rout, "amplification": ratio}
    return out


def evaluate_replay(measurements: schema.Report, policy: TolerancePolicy | None = None,
                    free_report: Mapping[str, Any] | None = None,
                    forcer_notes: dict | None = None) -> dict:
    """Judge the replay trace against the reference; list the segments with own error, in execution order,
    and set them against what ``align`` (the free run) blamed."""
    policy = policy or TolerancePolicy()
    # records with statistics only were not forced (the model itself around a --layers window): its "own code"
    # would include every module outside the window
    kept: schema.Report = {**measurements, "records": [r for r in measurements["records"] if not _stats_only(r)]}
    rows = judge_rows(kept, policy)
    strict = measurements.get("structure") == "same_model"  # a tensor given to one run only is a difference
    forward = _forward_segments(call_tree(rows, "forward", strict))
    backward = _backward_segments(call_tree(rows, "backward", strict))
    forward.sort(key=lambda s: s["order"])
    backward.sort(key=lambda s: s["order"])
    amp = amplification(free_report)
    # a segment's error is its module's own: in its own code it shows on a child's input (replay forces the
    # child's output, so the module's output agrees), not on the module's output
    segment_error: dict[tuple, float] = {}
    for segment in forward:
        key = (segment["module"], segment["call"])
        segment_error[key] = max(segment_error.get(key, 0.0), segment["rel_error"])
    modules = []
    for row in sorted((r for r in rows if r["kind"] == "call" and r["phase"] == "forward"), key=lambda r: r["begin"]):
        key = (row["path"], row["call"])
        outs = [t for t in row["tensors"] if t["role"] == "output"]
        errors = [relative_error(t["metrics"]) for t in outs] + ([segment_error[key]] if key in segment_error else [])
        own = max(errors, default=None)
        modules.append({"module": row["path"], "call": row["call"], "type": row.get("type_a"),
                        "depth": row["path"].count(".") + 1 if row["path"] else 0,
                        "own_rel": own, "own_error": key in segment_error, **amp.get(key, {})})
    result: dict[str, Any] = {"kind": "replay", "a": kept["a"], "b": kept["b"], "map": kept.get("map"),
              "tolerances": policy.describe(),
              "forward": {"segments": forward, "culprit": forward[0] if forward else None},
              "backward": {"segments": backward, "culprit": backward[0] if backward else None},
              "modules": modules, "forcing": forcer_notes or {},
              "verdict": "own_error" if forward or backward else "clean"}
    if free_report is not None:
        result["align"] = {phase: free_report[phase]["first_divergence"] for phase in ("forward", "backward")}
        result["confirms"] = {phase: _confirms(result[phase]["culprit"], free_report[phase]["first_divergence"])
                              for phase in ("forward", "backward")}
    return result


def _stats_only(row: schema.Row) -> bool:
    return bool(row["tensors"]) and all(t["metrics"].get("basis") == "stats" for t in row["tensors"])


def _confirms(culprit: dict | None, origin: dict | None) -> bool | None:
    """Whether replay's first own error is the module align named (None when align named nothing)."""
    if origin is None:
        return None if culprit is None else False
    if culprit is None:
        return False
    if origin.get("where") == "forward":  # a backward divergence align attributed to the forward origin
        return None
    if origin.get("op") and culprit.get("op"):  # both at an operation: the same one
        return culprit["module"] == origin["module"] and culprit["op"]["index"] == origin["op"]["index"]
    return culprit["module"] == origin["module"]
