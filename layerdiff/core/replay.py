"""Replay: run the candidate with the reference's recorded values forced in at module boundaries.

Forcing at every boundary - each call's inputs and outputs in forward, its output and input gradients in
backward - cuts the candidate's computation into segments that each start from the reference's numbers: a
leaf module's own work, or a parent's own code between two of its children. What the candidate computes,
before the forced value replaces it, is written to an ordinary trace, so ``measure`` compares it with the
reference and every difference left is that segment's OWN error: nothing inherited, nothing amplified.

The binary search (``splice`` / ``next_splice``) is the cheap variant for expensive candidates: force only one
block boundary per run and watch whether the blocks after it recover.

Nothing here imports a framework: a ``Forcer`` hands numpy arrays to the adapter, which converts them.
"""
from __future__ import annotations

import math

import numpy as np

from . import fusion, schema
from .align import call_tree, describe_origin, judge_rows
from .metrics import relative_error
from .layouts import LayoutRules, relate_shapes
from .mapping import Match, ModuleMapping
from .match import (FusedLinks, RenameRules, TraceSide, absorbed_child, canonical_key, pair_role, token_order,
                    transforms_step)
from .rules import RuleSet, ruleset
from .modules import find_blocks as blocks_of
from .tensors import FLOAT_DTYPES, as_float
from .tolerance import TolerancePolicy

_FORWARD_ROLE = {"grad_output": "output", "grad_input": "input"}


def fit_shape(values: np.ndarray, shape) -> np.ndarray | None:
    """The reference's array in the candidate's shape: as is, reshaped (same size) or broadcast ([1,S,D] to
    [B,S,D]); None when neither fits."""
    shape = tuple(shape)
    if values.shape == shape:
        return values
    if values.size == math.prod(shape):
        return values.reshape(shape)
    try:
        return np.ascontiguousarray(np.broadcast_to(values, shape))
    except ValueError:
        return None


class Forcer:
    """Serves the reference trace's values to the candidate's hooks (step 0 of the reference).

    ``mapping`` says which module of the candidate is which of the reference (``align``'s, from the free run,
    fused modules included); without one, ``rename`` turns the candidate's paths into the reference's. A fused
    module of the candidate gets the reference's parts merged (and their input gradients summed); one part of a
    module the reference fuses gets its part. Values are laid out as the candidate's tensors ([b, s, h] ->
    [s, b, h], broadcasting), and the user's ``--layout`` rules are inverted. ``where(path_a, role)`` limits
    forcing (the binary search forces one boundary); ``backward`` forces gradients too.
    """

    def __init__(self, reader, rename: RenameRules | None = None, layouts: LayoutRules | None = None, *,
                 backward: bool = True, where=None, rules: RuleSet | None = None, mapping: ModuleMapping | None = None,
                 side_b: TraceSide | None = None):
        self.reader = reader
        rules = rules or ruleset()
        self.side_a = TraceSide(reader.records, reader.meta, rules, reader)
        self.side_b = side_b or TraceSide([], {}, rules)
        self.links = FusedLinks(self.side_a, self.side_b)
        self.mapping = mapping
        self.rename = rename or RenameRules()
        self.layouts = layouts or LayoutRules()
        self.swap = token_order(self.side_a, self.side_b)
        self.backward = backward
        self.where = where
        self.calls = {}  # (phase, path, call) -> the reference's record of step 0
        for rec in reader.records:
            if rec["kind"] == "call" and rec.get("step", 0) == 0:
                self.calls.setdefault((rec["phase"], rec["path"], rec["call"]), rec)
        self.keys: dict = {}  # (B's path, call, forward role) -> {B's key: how to get A's gradient}
        self.forced = 0
        self.unforced: list[str] = []  # why a matched tensor could not be forced (shown in the report)

    def _match(self, path_b: str) -> Match | None:
        if self.mapping is not None:
            return self.mapping.for_b(path_b)
        return Match((self.rename(path_b),), (path_b,))

    def forward(self, frame, role: str, entries_b) -> dict:
        """{B's key: array}: the reference's values for a call's "input" or "output" tensors."""
        match = self._match(frame.path) if frame.step == 0 else None
        if match is None or (self.where is not None and not self.where(match.a[0], role)):
            return {}
        if role == "output" and self.mapping is not None and match.fused_side is None and \
                absorbed_child(frame.path, match, self.side_b, self.mapping):
            return {}  # its output is its child's (forced there); A has no tensor for what it computes before
        pseudo_b = {"kind": "call", "path": frame.path, "type": frame.type, "arg_names": list(frame.arg_names),
                    "tensors": entries_b}
        keys = self.keys.setdefault((frame.path, frame.call, role), {})
        if role == "output" and match.fused_side == "b":
            return self._merged_outputs(frame, match, entries_b, keys)
        if role == "output" and match.fused_side == "a":
            return self._part_outputs(frame, match, entries_b, keys)
        path_a = match.a[0]  # inputs are shared by a fused module's parts
        rec = self.calls.get(("forward", path_a, frame.call))
        if rec is None or not any("offset" in t for t in rec["tensors"]):
            return {}  # not recorded, or statistics only (the model itself around a --layers window)
        transformed: list = []  # rotary angles vs cos/sin, masks: compared after a transform, never forced
        pairs, _, _ = pair_role([t for t in rec["tensors"] if t["role"] == role], entries_b, rec, pseudo_b,
                                self.side_a, self.side_b,
                                before_shapes=transforms_step(role, rec, pseudo_b, self.side_a, self.side_b, transformed))
        for tp in transformed:
            self._unforced(f"{path_a or '<root>'} {role} {tp.key_b}: represented differently ({tp.notes[0].split(':')[0]}),"
                           " left as the candidate computed it")
        out = {}
        for ta, tb, _ in pairs:
            if not rec.get("parent") and self.side_a.labels_shifted != self.side_b.labels_shifted and \
                    canonical_key(ta["key"], rec.get("arg_names")) == "labels":
                self._unforced(f"<root> {role} {tb['key']}: labels shifted by one run's pipeline, left as given")
                continue
            if "offset" not in ta:
                self._unforced(f"{path_a or '<root>'} {role} {ta['key']}: the reference holds statistics only")
                continue
            if role == "input" and match.fused_side == "b":
                keys[tb["key"]] = ("sum", match.a, ta["key"], tb["shape"])
            elif role == "input" and match.fused_side == "a":
                keys[tb["key"]] = None  # one part's own input gradient: the reference only has the parts' sum
            else:
                keys[tb["key"]] = ("plain", path_a, ta["key"], tb["shape"])
            value = self._fit(self._values(ta), tb["shape"], path_a, f"{path_a or '<root>'} {role} {tb['key']}")
            if value is not None:
                out[tb["key"]] = value
        return out

    def _merged_outputs(self, frame, match: Match, entries_b, keys) -> dict:
        """B's fused output from A's parts (q, k, v -> linear_qkv)."""
        link = self.links.resolve(match, None)
        if link.out_sizes is None:
            return {}
        parts = [self._part_entry(p, frame.call, "forward", "output", size) for p, size in zip(match.a, link.out_sizes)]
        if None in parts:
            return {}
        out = {}
        for tb in entries_b:
            if tb["shape"] and tb["shape"][-1] == sum(link.out_sizes):
                keys[tb["key"]] = ("merge", match.a, [t["key"] for t in parts], tb["shape"], link.groups)
                merged = fusion.merge([self._values(t) for t in parts], -1, link.groups)
                value = self._fit(merged, tb["shape"], match.a[0], f"{match.a[0]} (merged parts) {tb['key']}")
                if value is not None:
                    out[tb["key"]] = value
                break
        return out

    def _part_outputs(self, frame, match: Match, entries_b, keys) -> dict:
        """One part of A's fused output (linear_qkv -> k_proj)."""
        link = self.links.resolve(match, None)
        if link.out_sizes is None:
            return {}
        index = match.b.index(frame.path)
        fused = self._part_entry(match.a[0], frame.call, "forward", "output", sum(link.out_sizes))
        target = next((t for t in entries_b if t["shape"] and t["shape"][-1] == link.out_sizes[index]), None)
        if fused is None or target is None:
            return {}
        keys[target["key"]] = ("part", match.a[0], fused["key"], target["shape"], link.out_sizes, link.groups, index)
        part = fusion.split(self._values(fused), -1, link.out_sizes, link.groups)[index]
        value = self._fit(part, target["shape"], match.a[0], f"{match.a[0]} (part {index}) {target['key']}")
        return {} if value is None else {target["key"]: value}

    def _part_entry(self, path_a: str, call: int, phase: str, role: str, last: int):
        rec = self.calls.get((phase, path_a, call))
        return next((t for t in (rec or {}).get("tensors", ()) if t["role"] == role and "offset" in t
                     and t["shape"] and t["shape"][-1] == last), None)

    def gradient(self, frame, grad_role: str, key_b: str):
        """The reference's gradient w.r.t. one of a call's outputs ("grad_output") or inputs ("grad_input"),
        for a tensor whose forward value was matched; None to keep the candidate's own."""
        if not self.backward or frame.step != 0:
            return None
        how = self.keys.get((frame.path, frame.call, _FORWARD_ROLE[grad_role]), {}).get(key_b)
        if how is None:
            return None
        kind, paths, keys_a, shape = how[:4]
        what = f"{frame.path or '<root>'} {grad_role} {key_b}"
        if kind == "plain":
            entry = self._grad_entry(paths, frame.call, grad_role, keys_a)
            return None if entry is None else self._fit(self._values(entry), shape, paths, what)
        if kind == "sum":  # the parts' input gradients meet in the fused module's one input
            entries = [self._grad_entry(p, frame.call, grad_role, keys_a) for p in paths]
            if None in entries:
                return None
            return self._fit(np.sum([self._values(e) for e in entries], axis=0), shape, paths[0], what)
        if kind == "merge":
            entries = [self._grad_entry(p, frame.call, grad_role, k) for p, k in zip(paths, keys_a)]
            if None in entries:
                return None
            return self._fit(fusion.merge([self._values(e) for e in entries], -1, how[4]), shape, paths[0], what)
        entry = self._grad_entry(paths, frame.call, grad_role, keys_a)  # one part of A's fused gradient
        if entry is None:
            return None
        sizes, groups, index = how[4:]
        return self._fit(fusion.split(self._values(entry), -1, sizes, groups)[index], shape, paths, what)

    def _grad_entry(self, path_a: str, call: int, grad_role: str, key_a: str):
        rec = self.calls.get(("backward", path_a, call))
        entry = next((t for t in (rec or {}).get("tensors", ()) if t["role"] == grad_role and t["key"] == key_a), None)
        if entry is not None and "offset" not in entry:
            self._unforced(f"{path_a} {grad_role} {key_a}: the reference holds statistics only")
            return None
        return entry

    def _values(self, ta: dict) -> np.ndarray:
        raw = self.reader.tensor(ta)
        return as_float(raw, ta["dtype"]) if ta["dtype"] in FLOAT_DTYPES else raw

    def _fit(self, values: np.ndarray, shape_b, path_a: str, what: str):
        """A's values in B's layout: a declared ``--layout`` rule inverted, else the relation of the shapes."""
        rule = self.layouts.find(path_a)
        if rule is not None:
            values = LayoutRules.invert(rule, values, shape_b)
        fitted = relate_shapes(values.shape, tuple(shape_b), self.swap).to_b(values)
        if fitted is None:
            fitted = fit_shape(values, shape_b)
        if fitted is None:
            self._unforced(f"{what}: reference shape {list(values.shape)} does not fit {list(shape_b)}")
            return None
        self.forced += 1
        return np.ascontiguousarray(fitted)

    def _unforced(self, message: str):
        if len(self.unforced) < 50 and message not in self.unforced:
            self.unforced.append(message)


# ---------------------------------------------------------------------------------------------------------
# Own errors: which segments of the candidate are wrong on the reference's numbers
# ---------------------------------------------------------------------------------------------------------
def _worst(tensors: list[schema.TensorResult]) -> schema.TensorResult | None:
    failing = [t for t in tensors if not t["passed"]]
    return max(failing, key=lambda t: relative_error(t["metrics"]), default=None)


def _segment(node, where: str, description: str, tensor: dict | None, order: int, phase: str) -> dict:
    row = node.row
    return {"phase": phase, "module": row["path"], "call": row["call"], "where": where,
            "description": description, "order": order,
            "tensor": tensor and {"role": tensor["role"], "key": tensor["key"], "reason": tensor["reason"],
                                  "metrics": tensor["metrics"]},
            "rel_error": relative_error(tensor["metrics"]) if tensor else math.inf}


def _forward_segments(roots) -> list:
    out = []

    def visit(node, parent, previous):
        bad_in = _worst(node.ins)
        if bad_in is not None:
            if parent is None:
                out.append(_segment(node, "inputs", f"{node.row['path'] or '<root>'}: the runs were given "
                                    "different inputs", bad_in, node.row["begin"], "forward"))
            else:
                out.append(_segment(parent, "own_code", describe_origin(parent, "own_code", previous, node), bad_in,
                                    node.row["begin"], "forward"))
        before = None
        for child in node.children:
            visit(child, node, before)
            before = child
        if node.row.get("error_b"):  # the innermost call that raised; its callers only passed the error on
            if any(child.row.get("error_b") for child in node.children):
                return
            out.append({**_segment(node, "raised", f"{node.row['path'] or '<root>'} raised on the reference's "
                                   f"inputs: {node.row['error_b']}", None, node.row["end"], "forward"),
                        "error": node.row["error_b"]})
            return
        bad_out = _worst(node.outs)
        if bad_out is not None:
            where = "own_code" if node.children else "module"
            text = describe_origin(node, where, before, None) if node.children else (node.row["path"] or "<root>")
            out.append(_segment(node, where, text, bad_out, node.row["end"], "forward"))

    for root in roots:
        visit(root, None, None)
    return out


def _backward_segments(roots) -> list:
    """Backward visits children in backward order; descriptions speak of forward positions (the same code)."""
    out = []

    def visit(node, parent):
        bad_in = _worst(node.ins)  # grad_output as it arrived: made by the parent's code after this child
        if bad_in is not None:
            if parent is None:
                out.append(_segment(node, "inputs", f"{node.row['path'] or '<root>'}: the runs were given a "
                                    "different gradient of the loss", bad_in, node.row["begin"], "backward"))
            else:
                short = node.row["path"].rsplit(".", 1)[-1]
                out.append(_segment(parent, "own_code", f"{parent.row['path'] or '<root>'}, own code using "
                                    f"{short}'s output (backward)", bad_in, node.row["begin"], "backward"))
        later = None  # after the loop: the child that ran first in forward
        for child in node.children:
            visit(child, node)
            later = child
        grads_in = [t for t in node.outs if t["role"] == "grad_input"]
        weights = [t for t in node.outs if t["role"] != "grad_input"]
        bad_grad = _worst(grads_in)
        if bad_grad is not None:
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


def amplification(free_report: schema.Report | None) -> dict:
    """(path, call) -> how a module call of the free-running candidate turned its input error into output
    error: relative error in, relative error out, and their ratio."""
    out = {}
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


def evaluate_replay(measurements: schema.Report, policy: TolerancePolicy | None = None, free_report: dict | None = None,
                    forcer_notes: dict | None = None) -> dict:
    """Judge the replay trace against the reference; list the segments with own error, in execution order,
    and set them against what ``align`` (the free run) blamed."""
    policy = policy or TolerancePolicy()
    # records with statistics only were not forced (the model itself around a --layers window): its "own code"
    # would include every module outside the window
    measurements = {**measurements, "records": [r for r in measurements["records"] if not _stats_only(r)]}
    rows = judge_rows(measurements, policy)
    strict = measurements.get("structure") == "same_model"  # a tensor given to one run only is a difference
    forward = _forward_segments(call_tree(rows, "forward", strict))
    backward = _backward_segments(call_tree(rows, "backward", strict))
    forward.sort(key=lambda s: s["order"])
    backward.sort(key=lambda s: s["order"])
    amp = amplification(free_report)
    own_forward = {(s["module"], s["call"]) for s in forward}
    modules = []
    for row in sorted((r for r in rows if r["kind"] == "call" and r["phase"] == "forward"), key=lambda r: r["begin"]):
        key = (row["path"], row["call"])
        outs = [t for t in row["tensors"] if t["role"] == "output"]
        own = max((relative_error(t["metrics"]) for t in outs), default=None)
        modules.append({"module": row["path"], "call": row["call"], "type": row.get("type_a"),
                        "depth": row["path"].count(".") + 1 if row["path"] else 0,
                        "own_rel": own, "own_error": key in own_forward, **amp.get(key, {})})
    result = {"kind": "replay", "a": measurements["a"], "b": measurements["b"], "map": measurements.get("map"),
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
    return culprit["module"] == origin["module"]


# ---------------------------------------------------------------------------------------------------------
# Binary search over top-level blocks
# ---------------------------------------------------------------------------------------------------------
def find_blocks(records, container: str | None = None) -> tuple[str, list[str]]:
    """The ordered top-level blocks among a trace's forward calls (see ``modules.find_blocks``)."""
    return blocks_of([r["path"] for r in records if r["kind"] == "call" and r["phase"] == "forward"], container)


def observe(measurements: schema.Report, policy: TolerancePolicy, blocks: list[str], spliced: int | None) -> dict:
    """What one splice run shows: whether B's input to the first block, B's own value at the splice boundary
    (before A's replaced it), the last block's output and the model's final output agree with A's."""
    calls = {r["path"]: r for r in judge_rows(measurements, policy) if r["kind"] == "call"
             and r["phase"] == "forward" and r["call"] == 0}

    def ok(path, role):
        row = calls.get(path)
        if row is None:
            return None
        tensors = [t for t in row["tensors"] if t["role"] == role]
        return bool(tensors) and all(t["passed"] for t in tensors) and not row.get("error_b")

    final = ""  # the model itself
    return {"spliced": spliced, "splice_block": blocks[spliced] if spliced is not None else None,
            "first_input_ok": ok(blocks[0], "input"),
            "arrival_ok": ok(blocks[spliced], "input") if spliced is not None else None,
            "last_output_ok": ok(blocks[-1], "output"), "final_ok": ok(final, "output"), "final_module": final}


def next_splice(n_blocks: int, runs: list[dict]) -> tuple[int | None, dict | None]:
    """Given the runs so far (the baseline, spliced=None, first), the next block to splice at, or the answer.

    The defect block d is the one after which the candidate's blocks stop recovering: splicing the reference's
    activation at block k gives a correct last-block output exactly when k > d. The baseline (no splice)
    says whether any block is at fault at all; then each run halves [lo, hi]: log2(N) splice runs.
    """
    baseline = runs[0]
    if baseline["last_output_ok"] and baseline["final_ok"]:
        return None, {"where": "none", "description": "the candidate's final output agrees with the reference"}
    if baseline["last_output_ok"]:
        return None, {"where": "after", "description": "the blocks agree; the divergence is after the last block"}
    lo, hi = 0, n_blocks - 1
    if not baseline["first_input_ok"]:  # B's prefix already differs: block 0 must be tested on A's input too
        splice0 = next((r for r in runs[1:] if r["spliced"] == 0), None)
        if splice0 is None:
            return 0, None
        if splice0["last_output_ok"]:
            return None, {"where": "before", "description": "the blocks recover on the reference's input: "
                          "the divergence is before the first block"}
    for run in runs[1:]:
        k = run["spliced"]
        if k is None or not lo <= k <= hi:
            continue
        if run["last_output_ok"]:
            hi = k - 1
        else:
            lo = k
    if lo >= hi:
        return None, {"where": "block", "block": lo, "description": f"block {lo} is the first whose output does "
                      "not recover"}
    return (lo + hi + 1) // 2, None
