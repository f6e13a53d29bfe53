"""Alignment: measure every matched tensor pair, judge it, and name where the divergence originates.

Three passes, each usable alone:
1. ``measure``  - match records (match.py) and compute metrics for every tensor pair (the expensive part);
2. ``evaluate`` - judge metrics against a tolerance policy and locate the origin, forward and backward.
   It needs only the measurements, so a saved JSON report can be re-thresholded without the traces.

The origin is the module call whose inputs agree but whose outputs don't. From there we descend into its
children in execution order: the first child whose inputs already disagree means the divergence was born in
the parent's own code, between the previous child and that one; the first child whose outputs disagree is
descended into. Backward is the same with gradients: w.r.t. outputs (the inputs of backward) and w.r.t.
inputs plus the module's own parameter gradients (the outputs of backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import LayerdiffError
from .layouts import LayoutRules, is_transposed, type_family
from .mapping import infer_mapping
from .match import RenameRules, match_records, match_tensors
from .session import find_blocks
from .metrics import CHUNK_ELEMS, compare_arrays, compare_data, compare_stats
from .tensors import as_float
from .tolerance import TolerancePolicy, judge

REPORT_VERSION = 1
IN_ROLES = {"forward": ("input",), "backward": ("grad_output",)}
OUT_ROLES = {"forward": ("output",), "backward": ("grad_input", "param_grad")}
HPARAM_ALIASES = {"epsilon": "eps", "variance_epsilon": "eps", "layer_norm_eps": "eps", "rms_norm_eps": "eps",
                  "layer_norm_epsilon": "eps", "norm_eps": "eps", "dropout_p": "p", "attention_dropout": "p"}


# ---------------------------------------------------------------------------------------------------------
# Pass 1: measure
# ---------------------------------------------------------------------------------------------------------
def trace_summary(reader) -> dict:
    meta = reader.meta
    end = reader.end or {}
    return {"path": str(reader.path), "framework": meta.get("framework"),
            "framework_version": meta.get("framework_version"), "model_class": meta.get("model_class"),
            "mode": meta.get("mode"), "records": len(reader.records), "complete": not reader.crashed,
            "status": end.get("status", "interrupted"), "failure": end.get("failure"),
            "warnings": end.get("warnings", []), "param_dtypes": meta.get("param_dtypes"),
            "target": (meta.get("user") or {}).get("target"), "target_args": (meta.get("user") or {}).get("target_args"),
            "devices": meta.get("devices")}


def _short(rec: dict) -> dict:
    return {"kind": rec["kind"], "phase": rec.get("phase"), "path": rec["path"], "call": rec["call"]}


def _region(t: dict):
    return t.get("offset"), t.get("nbytes"), t["dtype"]


@dataclass
class _Side:
    """One trace as the comparison needs it: its reader, framework, and the type of each module path."""

    reader: object
    framework: str | None
    types: dict

    @classmethod
    def of(cls, reader):
        types = {r["module"]: r["module_type"] for r in reader.records if r.get("module_type")}  # never called
        types.update({r["path"]: r.get("type") for r in reader.records if r["kind"] == "call"})
        return cls(reader, reader.meta.get("framework"), types)

    def transposed(self, rec: dict, t: dict) -> bool:
        """A parameter (or its gradient) this framework stores transposed relative to PyTorch."""
        return (rec["kind"] in ("param", "param_grad") and len(t["shape"]) == 2
                and is_transposed(self.framework, self.types.get(rec.get("module")), rec["path"]))


def _compare_entries(a: _Side, b: _Side, ra: dict, rb: dict, ta: dict, tb: dict, memo: dict,
                     layouts: LayoutRules) -> dict:
    """Metrics for one tensor pair; a pair of byte regions already compared (records share deduplicated
    tensors, e.g. a layer's output and the next layer's input) is not read again."""
    rule = layouts.find(ra["path"])
    if rule is not None:
        return _compare_declared(a.reader, b.reader, ta, tb, rule)
    flip_a, flip_b = a.transposed(ra, ta), b.transposed(rb, tb)
    key = (_region(ta), _region(tb), tuple(ta["shape"]), tuple(tb["shape"]), flip_a, flip_b)
    if "offset" in ta and "offset" in tb and key in memo:
        metrics = dict(memo[key])
    else:
        metrics = memo[key] = _compute_metrics(a.reader, b.reader, ta, tb, flip_a != flip_b)
        metrics = dict(metrics)
    if flip_a != flip_b:
        metrics["note"] = f"compared transposed ({'B' if flip_b else 'A'} stores this weight as [in, out])"
    elif ta["shape"] != tb["shape"] and not metrics.get("mismatch"):
        how = "flattened" if math.prod(ta["shape"]) == math.prod(tb["shape"]) else "after broadcasting"
        metrics["note"] = f"shapes differ ({ta['shape']} vs {tb['shape']}); compared {how}"
    return metrics


def _compare_declared(reader_a, reader_b, ta: dict, tb: dict, rule) -> dict:
    """B's tensor through a user-declared layout transform, then compared as A's shape."""
    if "offset" not in ta or "offset" not in tb:
        metrics = compare_stats(ta["stats"], tb["stats"])  # statistics survive transposes and reshapes
    else:
        try:
            b = LayoutRules.apply(rule, _values(reader_b, tb))
        except ValueError as exc:
            return {"basis": "shape", "mismatch": f"layout {rule[2]} on B's {tb['shape']}: {exc}",
                    "numel": math.prod(ta["shape"])}
        if list(b.shape) != list(ta["shape"]):
            return {"basis": "shape", "mismatch": f"shape {ta['shape']} vs {list(b.shape)} after {rule[2]}",
                    "numel": math.prod(ta["shape"])}
        metrics = _compare_values(_values(reader_a, ta), b)
    metrics["note"] = f"B compared after layout rule {rule[2]}"
    return metrics


def _values(reader, t: dict) -> np.ndarray:
    """Decoded values: float32 (for fp32/fp16/bf16) or float64 (fp64, integers)."""
    values = as_float(reader.tensor(t), t["dtype"])
    return values if values.dtype in (np.float32, np.float64) else values.astype(np.float64)


def _compare_values(a: np.ndarray, b: np.ndarray) -> dict:
    return compare_arrays(np.ascontiguousarray(a), np.ascontiguousarray(b), str(a.dtype), str(b.dtype))


def _compute_metrics(reader_a, reader_b, ta: dict, tb: dict, transpose: bool) -> dict:
    shape_a, shape_b = ta["shape"], tb["shape"]
    na, nb = math.prod(shape_a), math.prod(shape_b)
    data = "offset" in ta and "offset" in tb
    if transpose:
        if list(shape_a) != list(shape_b)[::-1]:
            return {"basis": "shape", "mismatch": f"shape {shape_a} vs transposed {shape_b}", "numel": na}
        if not data:
            return compare_stats(ta["stats"], tb["stats"])  # statistics do not change under transposition
        return _compare_values(_values(reader_a, ta), _values(reader_b, tb).T)
    if na == nb:
        if data:
            return compare_data(reader_a.tensor_chunks(ta, CHUNK_ELEMS), reader_b.tensor_chunks(tb, CHUNK_ELEMS),
                                ta["dtype"], tb["dtype"])
        return compare_stats(ta["stats"], tb["stats"])
    try:
        shape = np.broadcast_shapes(tuple(shape_a), tuple(shape_b))
    except ValueError:
        return {"basis": "shape", "mismatch": f"shape {shape_a} vs {shape_b}", "numel": na}
    if not data:
        return compare_stats(ta["stats"], tb["stats"])  # min/max/mean/RMS survive broadcasting
    return _compare_values(np.broadcast_to(_values(reader_a, ta), shape), np.broadcast_to(_values(reader_b, tb), shape))


def _tensor_row(ta: dict, tb: dict, metrics: dict) -> dict:
    if ta["key"] != tb["key"]:
        metrics["matched_by"] = f"position and shape (B's key: {tb['key']})"
    return {"role": ta["role"], "key": ta["key"], "dtype_a": ta["dtype"], "dtype_b": tb["dtype"],
            "shape_a": ta["shape"], "shape_b": tb["shape"], "metrics": metrics,
            "nonfinite_a": ta["stats"].get("nan", 0) + ta["stats"].get("inf", 0),
            "nonfinite_b": tb["stats"].get("nan", 0) + tb["stats"].get("inf", 0)}


def _data_bytes(rec: dict) -> int:
    return sum(t.get("nbytes", 0) for t in rec.get("tensors", ()))



def _infer_renames(reader_a, reader_b, rename: RenameRules, auto_map: bool):
    """Mapping entries for B's modules whose names (after the user's rules) are not in A."""
    paths_a = {r["path"] for r in reader_a.records if r["kind"] == "call"}
    unknown = [r for r in reader_b.records if r["kind"] == "call" and rename(r["path"]) not in paths_a]
    if not auto_map or not unknown:
        return []
    return infer_mapping(reader_a.records, reader_b.records, known=rename)


def measure(reader_a, reader_b, rename: RenameRules | None = None, progress=None, auto_map: bool = True,
            layouts: LayoutRules | None = None) -> dict:
    """Match the two traces (inferring renamed modules) and compute metrics for every matched tensor pair."""
    rename = rename or RenameRules()
    layouts = layouts or LayoutRules()
    for reader in (reader_a, reader_b):
        if not any(r["kind"] == "call" for r in reader.records):
            raise LayerdiffError(f"{reader.path}: holds no module calls (interrupted before its first flush, "
                                 "or damaged)")
    inferred = _infer_renames(reader_a, reader_b, rename, auto_map)
    rename = rename.with_exact({e.b_path: e.a_path for e in inferred})
    matching = match_records(reader_a.records, reader_b.records, rename)
    _check_related(matching, reader_a, reader_b)
    if progress is not None:
        progress.start(sum(_data_bytes(ra) + _data_bytes(rb) for ra, rb in matching.pairs))
    records, memo = [], {}
    side_a, side_b = _Side.of(reader_a), _Side.of(reader_b)
    for ra, rb in matching.pairs:
        pairs, only_a, only_b = match_tensors(ra["tensors"], rb["tensors"])
        row = {"kind": ra["kind"], "phase": ra.get("phase"), "path": ra["path"], "path_b": rb["path"],
               "call": ra["call"], "step": ra.get("step", 0), "type_a": ra.get("type"), "type_b": rb.get("type"),
               "begin": ra.get("begin", ra.get("seq", 0)), "end": ra.get("end", ra.get("seq", 0)),
               "parent": ra.get("parent"),
               "module": ra.get("module"), "hparams_a": ra.get("hparams"), "hparams_b": rb.get("hparams"),
               "error_a": ra.get("error"), "error_b": rb.get("error"),
               "tensors": [_tensor_row(ta, tb, _compare_entries(side_a, side_b, ra, rb, ta, tb, memo, layouts)) for ta, tb in pairs],
               "only_a": [t["role"] + ":" + t["key"] for t in only_a],
               "only_b": [t["role"] + ":" + t["key"] for t in only_b]}
        records.append(row)
        if progress is not None:
            progress.advance(_data_bytes(ra) + _data_bytes(rb))
    bases = {t["metrics"]["basis"] for r in records for t in r["tensors"]} - {"shape"}
    return {"report_version": REPORT_VERSION, "a": trace_summary(reader_a), "b": trace_summary(reader_b),
            "basis": bases.pop() if len(bases) == 1 else ("mixed" if bases else "none"),
            "map": rename.as_list(), "layouts": layouts.as_list(), "records": records,
            "mapping": [{"b": e.b_path, "a": e.a_path, "confidence": e.confidence, "reason": e.reason}
                        for e in inferred],
            "only_a": [_short(r) for r in matching.only_a], "only_b": [_short(r) for r in matching.only_b],
            "first_nonfinite": {"a": first_nonfinite(reader_a.records), "b": first_nonfinite(reader_b.records)}}


def _check_related(matching, reader_a, reader_b):
    """Refuse to compare traces of unrelated models: nothing below the root matches, or types disagree."""
    calls = [(ra, rb) for ra, rb in matching.pairs if ra["kind"] == "call" and ra["path"]]
    if not calls:
        a_paths = sorted({r["path"] for r in reader_a.records if r["kind"] == "call" and r["path"]})[:2]
        b_paths = sorted({r["path"] for r in reader_b.records if r["kind"] == "call" and r["path"]})[:2]
        raise LayerdiffError(f"the traces share no module paths (A: {', '.join(a_paths) or 'none'}; "
                             f"B: {', '.join(b_paths) or 'none'}): different models? map names with "
                             "--map 'B_PATTERN=A_NAME'")
    same_type = sum(1 for ra, rb in calls if type_family(ra.get("type")) == type_family(rb.get("type")))
    if same_type < 0.5 * len(calls):
        raise LayerdiffError(f"only {same_type} of {len(calls)} matched module calls have the same type: the "
                             "traces look like different models")


def first_nonfinite(records, phase: str | None = None) -> dict | None:
    """The first module call (execution order; forward before backward unless ``phase`` picks one) whose
    outputs hold NaN/Inf while its inputs are finite: where the NaN was born, not where it was first seen."""
    def bad(t):
        return t["stats"].get("nan", 0) + t["stats"].get("inf", 0)

    calls = sorted((r for r in records if r["kind"] == "call" and phase in (None, r["phase"])),
                   key=lambda r: (r["phase"] != "forward", r["end"]))
    for rec in calls:
        ins = [t for t in rec["tensors"] if t["role"] in IN_ROLES[rec["phase"]]]
        outs = [t for t in rec["tensors"] if t["role"] in OUT_ROLES[rec["phase"]]]
        bad_outs = [t for t in outs if bad(t)]
        if bad_outs and not any(bad(t) for t in ins):
            t = bad_outs[0]
            return {"module": rec["path"], "call": rec["call"], "phase": rec["phase"], "tensor": t["key"],
                    "nan": t["stats"].get("nan", 0), "inf": t["stats"].get("inf", 0)}
    return None


# ---------------------------------------------------------------------------------------------------------
# Pass 2: evaluate
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Node:
    row: dict
    ins: list
    outs: list
    children: list = field(default_factory=list)

    @property
    def key(self):
        return self.row["path"], self.row["call"]

    @property
    def inputs_ok(self) -> bool:
        return all(t["passed"] for t in self.ins)

    @property
    def outputs_ok(self) -> bool:
        return all(t["passed"] for t in self.outs) and not (self.row.get("error_a") or self.row.get("error_b"))

    def subtree_ok(self) -> bool:
        return self.inputs_ok and self.outputs_ok and all(c.subtree_ok() for c in self.children)


def judge_rows(measurements: dict, policy: TolerancePolicy):
    for row in measurements["records"]:
        for t in row["tensors"]:
            tol = policy.for_tensor(row["path"], t["dtype_a"], t["dtype_b"])
            t["passed"], t["reason"] = judge(t["metrics"], tol)
            t["tolerance"] = tol.as_dict()


def _build_tree(rows: list, phase: str, param_grads: dict) -> list:
    nodes = {}
    for row in rows:
        if row["kind"] != "call" or row["phase"] != phase:
            continue
        ins = [t for t in row["tensors"] if t["role"] in IN_ROLES[phase]]
        outs = [t for t in row["tensors"] if t["role"] in OUT_ROLES[phase]]
        nodes[(row["path"], row["call"])] = Node(row, ins, outs)
    if phase == "backward":  # a module's parameter gradients belong to its first call of that step
        for (module, step), tensors in param_grads.items():
            owner = min((n for n in nodes.values() if n.row["path"] == module and n.row["step"] == step),
                        key=lambda n: n.row["call"], default=None)
            if owner is not None:
                owner.outs.extend(tensors)
    roots = []
    for node in sorted(nodes.values(), key=lambda n: n.row["begin"]):
        parent = nodes.get(tuple(node.row["parent"])) if node.row.get("parent") else None
        (parent.children if parent else roots).append(node)
    return roots


def _first_failing(tensors) -> dict | None:
    return next((t for t in tensors if not t["passed"]), None)


def _locate(node: Node, chain: list):
    """Descend from a call whose inputs agree but which diverges somewhere inside or at its outputs."""
    chain = chain + [node]
    previous = None
    for child in node.children:
        if not child.inputs_ok:
            return node, "own_code", previous, child, chain
        if not child.outputs_ok or not child.subtree_ok():
            found = _locate(child, chain)
            if found:
                return found
        previous = child
    if not node.outputs_ok:
        return node, ("own_code" if node.children else "module"), previous, None, chain
    return None


def _describe(node: Node, where: str, after, before) -> str:
    path = node.row["path"] or "<root>"
    if where != "own_code":
        return path
    short = lambda n: n.row["path"].rsplit(".", 1)[-1] if n else None  # noqa: E731
    if after and before:
        return f"{path}, own code between {short(after)} and {short(before)}"
    if before:
        return f"{path}, own code before {short(before)}"
    if after:
        return f"{path}, own code after {short(after)}"
    return f"{path}, own code"


def hparam_diff(a: dict | None, b: dict | None) -> dict:
    def norm(h):
        return {HPARAM_ALIASES.get(k, k): v for k, v in (h or {}).items()}

    na, nb = norm(a), norm(b)
    return {k: [na[k], nb[k]] for k in sorted(set(na) & set(nb)) if na[k] != nb[k]}


def _origin_dict(node: Node, where: str, after, before, chain, phase: str, params: list) -> dict:
    row = node.row
    bad = _first_failing(node.outs) or _first_failing(before.ins if before else []) or _first_failing(node.ins)
    diff = hparam_diff(row.get("hparams_a"), row.get("hparams_b"))
    if type_family(row.get("type_a")) != type_family(row.get("type_b")):  # Linear vs Dense is no difference
        diff = {"type": [row.get("type_a"), row.get("type_b")], **diff}
    own = [p for p in params if p["module"] == row["path"] and not p["passed"]]
    return {"module": row["path"], "call": row["call"], "step": row["step"], "type": row.get("type_a"),
            "where": where, "between": [after.row["path"] if after else None, before.row["path"] if before else None],
            "description": _describe(node, where, after, before),
            "tensor": bad and {"role": bad["role"], "key": bad["key"], "reason": bad["reason"],
                               "metrics": bad["metrics"]},
            "hparam_diff": diff, "param_diffs": own, "error": row.get("error_b") or row.get("error_a"),
            "chain": [n.row["path"] or "<root>" for n in chain], "phase": phase}


def _first_over_tolerance(rows, phase):
    over = [r for r in rows if r["kind"] == "call" and r["phase"] == phase
            and any(not t["passed"] for t in r["tensors"])]
    if not over:
        return None
    first = min(over, key=lambda r: r["end"])  # completion order: the first result that was off
    return {"module": first["path"], "call": first["call"]}


def _param_rows(rows, kind):
    out = []
    for r in rows:
        if r["kind"] == kind and r["tensors"]:
            t = r["tensors"][0]
            out.append({"name": r["path"], "module": r["module"], "step": r["step"], "passed": t["passed"],
                        "reason": t["reason"], "metrics": t["metrics"], "role": t["role"], "key": r["path"].rsplit(".", 1)[-1]})
    return out


def _phase_result(rows, phase, roots, params, forward_origin) -> dict:
    present = any(r["kind"] == "call" and r["phase"] == phase for r in rows)
    failing = [t for r in rows if r["kind"] == "call" and r["phase"] == phase for t in r["tensors"]
               if not t["passed"]]
    if phase == "backward":
        failing += [p for p in params.get("param_grad", []) if not p["passed"]]
    result = {"present": present, "status": "aligned" if present and not failing else
              ("divergent" if failing else "absent"), "failing_tensors": len(failing),
              "first_divergence": None, "first_over_tolerance": _first_over_tolerance(rows, phase)}
    if failing:
        origin = _origin(roots, phase, params)
        if phase == "backward" and forward_origin is not None:
            # Once forward differs, every gradient is computed from differing activations, and small
            # differences grow through sums (weight gradients): backward is attributed to the forward origin;
            # what the backward descent alone would name is kept to look at after the forward fix.
            inherited = {**forward_origin, "where": "forward", "phase": "backward",
                         "description": f"{forward_origin['description']} (inherited from the forward divergence)"}
            if origin is not None and origin["where"] != "inputs":
                inherited["backward_candidate"] = origin["description"]
            origin = inherited
        result["first_divergence"] = origin
    return result


def _origin(roots, phase, params) -> dict | None:
    for root in roots:
        if not root.inputs_ok:
            what = "inputs" if phase == "forward" else "gradient of the loss w.r.t. the outputs"
            origin = _origin_dict(root, "inputs", None, None, [root], phase, [])
            origin["description"] = f"{root.row['path'] or '<root>'}: the runs were given different {what}"
            return origin
        found = _locate(root, [])
        if found:
            node, where, after, before, chain = found
            own_params = params.get("param" if phase == "forward" else "param_grad", [])
            return _origin_dict(node, where, after, before, chain, phase, own_params)
    bad_param = next((p for p in params.get("param_grad", []) if not p["passed"]), None)
    if phase == "backward" and bad_param is not None:  # parameter gradients differ though no call shows it
        return {"module": bad_param["module"], "where": "param_grad", "description": f"{bad_param['name']} gradient",
                "tensor": bad_param, "hparam_diff": {}, "param_diffs": [bad_param], "chain": [], "phase": phase}
    return None


def evaluate(measurements: dict, policy: TolerancePolicy) -> dict:
    """Judge every tensor and locate the origin, forward and backward. Returns the full report dict."""
    judge_rows(measurements, policy)
    rows = measurements["records"]
    params = {kind: _param_rows(rows, kind) for kind in ("param", "param_grad")}
    grads_by_module = {}
    for p in params["param_grad"]:
        grads_by_module.setdefault((p["module"], p["step"]), []).append(p)
    forward = _phase_result(rows, "forward", _build_tree(rows, "forward", {}), params, None)
    backward = _phase_result(rows, "backward", _build_tree(rows, "backward", grads_by_module), params,
                             forward["first_divergence"])
    for key, side in (("failure", "b"), ("failure_a", "a")):  # a run that raised: where, and what
        failure = measurements[side].get("failure")
        forward[key] = failure and {"module": failure.get("module"), "error": failure.get("error"),
                                    "module_stack": failure.get("module_stack", [])}
    crash = forward["failure"] or forward["failure_a"]
    if crash and forward["first_divergence"] is None:  # everything before the crash agrees: the crash is it
        run = "B" if forward["failure"] else "A"
        forward["status"] = "failed"
        forward["first_divergence"] = {
            "module": crash["module"], "where": "raised", "phase": "forward", "error": crash["error"],
            "description": f"{crash['module'] or '<root>'} raised in run {run}: {crash['error']}",
            "chain": [p or "<root>" for p in crash["module_stack"]], "hparam_diff": {}, "param_diffs": []}
    param_values = params["param"]
    report = dict(measurements)
    report["next_pass"] = window_suggestion(measurements, forward["first_divergence"])
    report.update(
        tolerances=policy.describe(), forward=forward, backward=backward,
        params={"compared": len(param_values), "differ": [p["name"] for p in param_values if not p["passed"]],
                "grads_compared": len(params["param_grad"]),
                "grads_differ": [p["name"] for p in params["param_grad"] if not p["passed"]]},
        growth=growth_table(rows, forward["first_divergence"]),
        verdict="divergent" if {"divergent", "failed"} & {forward["status"], backward["status"]}
        or any(not p["passed"] for p in param_values) else "aligned")
    return report


def window_suggestion(measurements: dict, origin: dict | None) -> dict | None:
    """Two-pass tracing: after a statistics-only align, the block to trace again in full mode and bisect."""
    if origin is None or measurements.get("basis") not in ("stats", "mixed") or not origin.get("module"):
        return None
    container, blocks = find_blocks(r["path"] for r in measurements["records"] if r["kind"] == "call")
    index = next((i for i, b in enumerate(blocks) if origin["module"] == b or origin["module"].startswith(b + ".")),
                 None)
    if index is None:
        return None
    return {"block": blocks[index], "layers": f"{index}:{index + 1}", "container": container}


def growth_table(rows: list, origin: dict | None, max_rows: int = 16) -> list:
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
        parent = chain[-2] if len(chain) > 1 else None
        near.update(r["path"] for r in calls if parent is not None and r.get("parent") and r["parent"][0] == parent)
        near.update(r["path"] for r in calls if r.get("parent") and r["parent"][0] == chain[-1])
    tree_depth = {}
    for r in calls:  # depth in the call tree (a never-called ModuleList adds no level)
        parent = tuple(r["parent"]) if r.get("parent") else None
        tree_depth[(r["path"], r["call"])] = tree_depth.get(parent, -1) + 1
    table = []
    for r in calls:
        if depth(r) > chosen and r["path"] not in near:
            continue
        outs = [t for t in r["tensors"] if t["role"] == "output"]
        worst = max(outs, key=lambda t: _rel_error(t["metrics"]), default=None)
        table.append({"module": r["path"], "call": r["call"], "type": r["type_a"],
                      "depth": tree_depth[(r["path"], r["call"])],
                      "passed": all(t["passed"] for t in r["tensors"]) and not r.get("error_b"),
                      "max_abs": worst and worst["metrics"].get("max_abs"),
                      "rel": worst and _rel_error(worst["metrics"]),
                      "cosine": worst and worst["metrics"].get("cosine"),
                      "origin": bool(origin and r["path"] == origin["module"] and r["call"] == origin.get("call"))})
    return table


def _rel_error(m: dict) -> float:
    if m.get("mismatch") or m.get("nonfinite_mismatch"):
        return math.inf
    ref = m.get("ref_max_abs") or 0.0
    mx = m.get("max_abs") or 0.0
    return mx / ref if ref else (0.0 if mx == 0 else math.inf)


def align(reader_a, reader_b, *, rename: RenameRules | None = None, policy: TolerancePolicy | None = None,
          progress=None, auto_map: bool = True, layouts: LayoutRules | None = None) -> dict:
    return evaluate(measure(reader_a, reader_b, rename, progress, auto_map, layouts), policy or TolerancePolicy())
