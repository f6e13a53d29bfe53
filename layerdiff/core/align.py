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
import os
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import LayerdiffError
from . import compare_workers, modules, ranks, schema
from .layouts import LayoutRules, relate_shapes, type_family
from .mapping import ModuleMapping, match_modules
from .match import RenameRules, TensorPair, TraceSide, match_records, token_order
from .operands import Operand
from .metrics import CHUNK_ELEMS, compare_arrays, compare_data, compare_stats, relative_error
from .compare_workers import aligned_pairs, compare_pairs, worker_count
from .configs import diff_configs, from_values
from .rules import RuleSet, ruleset
from .settings import settings_report
from .modules import find_blocks
from .tensors import as_float
from .tolerance import TolerancePolicy, judge

IN_ROLES = {"forward": ("input",), "backward": ("grad_output",)}
OUT_ROLES = {"forward": ("output",), "backward": ("grad_input", "param_grad")}
HPARAM_ALIASES = {"epsilon": "eps", "variance_epsilon": "eps", "layer_norm_eps": "eps", "rms_norm_eps": "eps",
                  "layer_norm_epsilon": "eps", "norm_eps": "eps", "dropout_p": "p", "attention_dropout": "p"}


# ---------------------------------------------------------------------------------------------------------
# Pass 1: measure
# ---------------------------------------------------------------------------------------------------------
def trace_summary(reader) -> schema.RunSummary:
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


def _region(entry: dict):
    return entry.get("offset"), entry.get("nbytes"), entry["dtype"]


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


def _prepared(tp: TensorPair, path_a: str, layouts: LayoutRules, swap: bool):
    """(A's operand, B's operand, a declared layout rule or None, how their shapes relate)."""
    a, b = _resolved(tp.a, tp.b.shape), _resolved(tp.b, tp.a.shape)
    return a, b, layouts.find(path_a), relate_shapes(a.shape, b.shape, swap if tp.activation else False)


def _stored_key(a: Operand, b: Operand, rule, relation):
    """The key of a pair compared straight from its stored bytes, element by element (None: another way)."""
    if rule is None and relation.ok and a.has_data and b.has_data and a.plain and b.plain \
            and relation.kind in ("same", "reshape"):
        return (_region(a.entry), _region(b.entry), a.shape, b.shape)
    return None


def _compare_in_workers(pairs, readers, layouts: LayoutRules, swap: bool, workers: int | None, progress) -> dict:
    """Metrics of the pairs compared straight from stored bytes, by worker processes (``compare_workers``), keyed
    like ``_pair_metrics``' memo; empty when they are too few bytes to be worth it, or workers cannot be used."""
    count = worker_count(workers)
    if count < 2:
        return {}
    jobs = {}
    for pair in pairs:
        for tp in pair.tensors:
            a, b, rule, relation = _prepared(tp, pair.a["path"], layouts, swap)
            key = _stored_key(a, b, rule, relation)
            if key is None or key in jobs:
                continue
            segments_a, segments_b = (getattr(r, "data_segments", lambda e: None)(o.entry)
                                      for r, o in zip(readers, (a, b)))
            if segments_a and segments_b:
                pieces = aligned_pairs(segments_a, a.entry["dtype"], segments_b, b.entry["dtype"])
                if pieces:
                    jobs[key] = pieces
    total = sum(piece.nbytes() for pieces in jobs.values() for piece in pieces)
    if total < 2 * compare_workers.MIN_BYTES:
        return {}
    if progress is not None:
        progress.start(total)
    stored = [piece for pieces in jobs.values() for piece in pieces]
    groups = [n for n, pieces in enumerate(jobs.values()) for _ in pieces]
    results = compare_pairs(stored, count, progress, groups=groups)
    if progress is not None:
        progress.close()
    return dict(zip(jobs, results)) if results is not None else {}


def _pair_metrics(tp: TensorPair, path_a: str, readers, memo: dict, layouts: LayoutRules, swap: bool) -> dict | None:
    """Metrics for one tensor pair (None: it cannot be compared from what the traces hold). A pair of stored
    regions already compared (records share deduplicated tensors, or workers compared it) is not read again."""
    reader_a, reader_b = readers
    a, b, rule, relation = _prepared(tp, path_a, layouts, swap)
    if rule is not None and a.plain and b.plain:
        return _compare_declared(reader_a, reader_b, a.entry, b.entry, rule)
    if not relation.ok:
        return {"basis": "shape", "mismatch": f"shape {list(a.shape)} vs {list(b.shape)}",
                "numel": math.prod(a.shape)}
    if a.has_data and b.has_data:
        key = _stored_key(a, b, rule, relation)
        if key is not None:
            if key not in memo:
                memo[key] = compare_data(reader_a.tensor_chunks(a.entry, CHUNK_ELEMS),
                                         reader_b.tensor_chunks(b.entry, CHUNK_ELEMS), a.dtype, b.dtype)
            metrics = dict(memo[key])
        else:
            try:
                va, vb = relation.views(a.values(reader_a), b.values(reader_b))
            except ValueError as exc:  # a fused split that the sizes do not allow
                return {"basis": "shape", "mismatch": f"cannot derive the compared tensor: {exc}",
                        "numel": math.prod(a.shape)}
            metrics = _compare_values(va, vb)
        per_rank = _per_rank_metrics(a, b, relation, reader_a, reader_b)
        if per_rank:
            metrics["ranks"] = per_rank
    else:
        sa, sb = a.stats(), b.stats()
        if sa is None or sb is None:
            return None
        metrics = compare_stats(sa, sb)  # min/max/mean/RMS survive reshapes, permutations and broadcasting
    notes = list(tp.notes)
    for side, operand in (("A", a), ("B", b)):
        merge = operand.entry.get("merge") if operand.op == "value" else None
        if merge and len(operand.entry.get("parts", ())) > 1:
            notes.append(f"{side}: {len(operand.entry['parts'])} ranks' " + {
                "concat": f"shards joined on axis {merge['dim']}",
                "concat_parts": f"shards joined part by part on axis {merge['dim']}",
                "replicate": "copies (rank 0's compared; each "
                "rank's checked)", "sum": "partial sums added", "ranks": "tensors, unresolved"}[merge["how"]])
    if a.transposed != b.transposed:
        notes.append(f"compared transposed ({'B' if b.transposed else 'A'} stores this weight as [in, out])")
    for side, operand in (("A", a), ("B", b)):
        text = operand.describe()
        if text and not operand.transposed and operand.op not in ("part", "masked", "cos", "sin"):  # noted already
            notes.append(f"{side}: {text}")
    if relation.note():
        notes.append(relation.note())
    if notes:
        metrics["note"] = "; ".join(dict.fromkeys(notes))
    return metrics


def _resolved(operand: Operand, other_shape) -> Operand:
    """A multi-rank tensor left per rank, read against the other run's shape (``ranks.resolve``)."""
    if operand.op != "value" or operand.entry.get("merge", {}).get("how") != "ranks":
        return operand
    return replace(operand, entries=(ranks.resolve(operand.entry, other_shape),))


def _per_rank_metrics(a: Operand, b: Operand, relation, reader_a, reader_b) -> dict | None:
    """For a tensor one run holds spread over ranks: each rank's shard or copy against the matching piece of the
    other run, so a report can say "rank 1's shard of ..." ({rank: metrics})."""
    for side, operand, reader, other, other_reader in (("b", b, reader_b, a, reader_a), ("a", a, reader_a, b, reader_b)):
        if operand.op != "value" or operand.transposed or len(operand.entry.get("parts", ())) < 2 \
                or not hasattr(reader, "part_values") or other.op != "value":
            continue
        other_values = other.values(other_reader)
        if side == "b":
            laid_out = relation.to_b(other_values)
        else:
            laid_out = other_values.reshape(operand.shape) if math.prod(operand.shape) == other_values.size else None
        pieces = ranks.rank_slices(operand.entry, laid_out) if laid_out is not None else None
        if pieces is None:
            return None
        out, copies = {}, []
        for rank, (mine, theirs) in enumerate(zip(reader.part_values(operand.entry), pieces)):
            mine = as_float(mine, operand.entry["dtype"]).reshape(-1)
            theirs = np.ascontiguousarray(theirs).reshape(-1)
            if mine.size != theirs.size:
                return None
            copies.append(mine)
            out[str(rank)] = _compare_values(theirs, mine) if side == "b" else _compare_values(mine, theirs)
        sharded = operand.entry["merge"]["how"] in ("concat", "concat_parts")
        out["how"] = "shards" if sharded else "copies"
        if not sharded and any(not np.array_equal(copies[0], c) for c in copies[1:]):
            # copies that should be equal are not: do they add up to the other run's (a missing all-reduce)?
            total = np.sum(np.stack([c.astype(np.float64) for c in copies]), axis=0)
            out["sum"] = _compare_values(pieces[0].reshape(-1).astype(np.float64), total)
        return out
    return None


def _tensor_row(tp: TensorPair, metrics: schema.Metrics) -> schema.TensorResult:
    def nonfinite(op):
        return sum(e["stats"].get("nan", 0) + e["stats"].get("inf", 0) for e in op.entries if e.get("stats"))

    row = {"role": tp.role, "key": tp.key, "dtype_a": tp.a.dtype, "dtype_b": tp.b.dtype,
           "shape_a": list(tp.a.shape), "shape_b": list(tp.b.shape), "metrics": metrics,
           "nonfinite_a": nonfinite(tp.a), "nonfinite_b": nonfinite(tp.b)}
    for side, op in (("a", tp.a), ("b", tp.b)):  # a loss or a scalar: its value, shown step by step
        if len(op.entries) == 1 and (op.entries[0].get("stats") or {}).get("numel") == 1:
            row[f"value_{side}"] = op.entries[0]["stats"].get("mean")
    if tp.key_b != tp.key:
        row["key_b"] = tp.key_b
        if tp.a.plain and tp.b.plain and not tp.notes:
            metrics["matched_by"] = f"position and shape (B's key: {tp.key_b})"
    return row


def _data_bytes(rec: dict) -> int:
    return sum(t.get("nbytes", 0) for t in rec.get("tensors", ()))


def _ancestors(records) -> dict:
    """(path, call) -> A's chain of enclosing calls, innermost first: a row whose parent has no counterpart hangs
    under its nearest ancestor that has one."""
    parents = {(r["path"], r["call"]): tuple(r["parent"]) if r.get("parent") else None
               for r in records if r["kind"] == "call" and r["phase"] == "forward"}
    out = {}
    for key in parents:
        chain, seen, up = [], {key}, parents[key]
        while up is not None and up not in seen:
            chain.append(list(up))
            seen.add(up)
            up = parents.get(up)
        out[key] = chain
    return out


def module_mapping(reader_a, reader_b, rules: RuleSet, rename: RenameRules | None = None,
                   auto_map: bool = True) -> ModuleMapping:
    """Which module of B is which of A (``core.mapping``), from the two traces' records."""
    return match_modules(modules.from_records(reader_a.records), modules.from_records(reader_b.records), rules,
                         rename or RenameRules(), auto_map)


def measure(reader_a, reader_b, rename: RenameRules | None = None, progress=None, auto_map: bool = True,
            layouts: LayoutRules | None = None, rules: RuleSet | None = None,
            mapping: ModuleMapping | None = None, workers: int | None = 1) -> schema.Report:
    """Match the two traces (inferring renamed and fused modules) and compute metrics for every tensor pair
    (``workers`` processes compare large stored tensors: None, one per core; 1, none)."""
    rename = rename or RenameRules()
    layouts = layouts or LayoutRules()
    rules = rules or ruleset()
    for reader in (reader_a, reader_b):
        if not any(r["kind"] == "call" for r in reader.records):
            raise LayerdiffError(f"{reader.path}: holds no module calls (interrupted before its first flush, "
                                 "or damaged)")
    side_a = TraceSide(reader_a.records, reader_a.meta, rules, reader_a)
    side_b = TraceSide(reader_b.records, reader_b.meta, rules, reader_b)
    if mapping is None:  # a mapping made elsewhere (bisect's statistics run of the whole candidate) is reused
        mapping = module_mapping(reader_a, reader_b, rules, rename, auto_map)
    matching = match_records(side_a, side_b, mapping)
    _check_related(matching, reader_a, reader_b, rules)
    swap = token_order(side_a, side_b)
    memo = _compare_in_workers(matching.pairs, (reader_a, reader_b), layouts, swap, workers, progress)
    if progress is not None:
        progress.start(sum(_data_bytes(p.a) + sum(_data_bytes(rb) for rb in p.b) for p in matching.pairs))
    records = []
    ancestors = _ancestors(reader_a.records)
    for pair in matching.pairs:
        ra, rb = pair.a, pair.b[0]
        tensors, skipped = [], list(pair.skipped)
        for tp in pair.tensors:
            metrics = _pair_metrics(tp, ra["path"], (reader_a, reader_b), memo, layouts, swap)
            if metrics is None:
                skipped.append(f"{tp.role}:{tp.key} (statistics only: a part or transform needs the values)")
            else:
                tensors.append(_tensor_row(tp, metrics))
        row = {"kind": ra["kind"], "phase": ra.get("phase"), "path": ra["path"],
               "path_b": " + ".join(r["path"] for r in pair.b),
               "call": ra["call"], "step": ra.get("step", 0), "type_a": ra.get("type"), "type_b": rb.get("type"),
               "begin": ra.get("begin", ra.get("seq", 0)), "end": ra.get("end", ra.get("seq", 0)),
               "parent": ra.get("parent"), "ancestors": ancestors.get((ra["path"], ra["call"]), []),
               "module": ra.get("module"), "hparams_a": ra.get("hparams"), "hparams_b": rb.get("hparams"),
               "family_a": rules.family(ra.get("type") or ra.get("module_type")),
               "family_b": rules.family(rb.get("type") or rb.get("module_type")),
               "error_a": ra.get("error"), "error_b": next((r.get("error") for r in pair.b if r.get("error")), None),
               "tensors": tensors, "only_a": pair.only_a, "only_b": pair.only_b}
        if skipped:
            row["skipped"] = skipped
        if ra.get("tied"):
            row["tied"] = ra["tied"]
        records.append(row)
        if progress is not None:
            progress.advance(_data_bytes(ra) + sum(_data_bytes(r) for r in pair.b))
    bases = {t["metrics"]["basis"] for r in records if r["kind"] != "param_grad_use" for t in r["tensors"]} - {"shape"}
    same_model = reader_a.meta.get("model_class") == reader_b.meta.get("model_class")
    phases = {phase: {side: any(r["kind"] == "call" and r["phase"] == phase for r in reader.records)
                      for side, reader in (("a", reader_a), ("b", reader_b))} for phase in ("forward", "backward")}
    return {"report_version": schema.REPORT_VERSION, "a": trace_summary(reader_a), "b": trace_summary(reader_b),
            "basis": bases.pop() if len(bases) == 1 else ("mixed" if bases else "none"),
            "map": rename.as_list(), "layouts": layouts.as_list(), "rules": rules.describe(), "records": records,
            "structure": "same_model" if same_model else "ported", "phases": phases,
            "same_file": _same_file(reader_a.path, reader_b.path),
            "mapping": [m.as_dict() for m in mapping.renamed()],
            "unmatched_modules": {"a": mapping.only_a, "b": mapping.only_b},
            "only_a": [_short(r) for r in matching.only_a], "only_b": [_short(r) for r in matching.only_b],
            "first_nonfinite": {"a": first_nonfinite(reader_a.records), "b": first_nonfinite(reader_b.records)},
            "settings": settings_report(reader_a.meta, reader_b.meta),
            "config_diff": _config_diff(reader_a.meta, reader_b.meta)}


def _config_diff(meta_a: dict, meta_b: dict) -> list | None:
    """The hyper-parameters the two models' own configurations set differently (None: a trace holds none)."""
    a, b = meta_a.get("model_config"), meta_b.get("model_config")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    try:
        return diff_configs(from_values(a.get("values") or {}, a.get("kind", "hf"), "A"),
                            from_values(b.get("values") or {}, b.get("kind", "hf"), "B"))["differ"]
    except (TypeError, ValueError, AttributeError):  # a damaged or foreign config in a trace: not compared
        return None


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_related(matching, reader_a, reader_b, rules: RuleSet):
    """Refuse to compare traces of unrelated models: nothing below the root matches, or types disagree."""
    calls = [(p.a, p.b[0]) for p in matching.pairs if p.a["kind"] == "call" and p.a["path"]]
    if not calls:
        a_paths = sorted({r["path"] for r in reader_a.records if r["kind"] == "call" and r["path"]})[:2]
        b_paths = sorted({r["path"] for r in reader_b.records if r["kind"] == "call" and r["path"]})[:2]
        raise LayerdiffError(f"the traces share no module paths (A: {', '.join(a_paths) or 'none'}; "
                             f"B: {', '.join(b_paths) or 'none'}): different models? map names with "
                             "--map 'B_PATTERN=A_NAME'")
    same_type = sum(1 for ra, rb in calls if rules.family(ra.get("type")) == rules.family(rb.get("type")))
    if same_type < 0.5 * len(calls):
        raise LayerdiffError(f"only {same_type} of {len(calls)} matched module calls have the same type: the "
                             "traces look like different models")
    matched = {"a": {ra["path"] for ra, _ in calls}, "b": {rb["path"] for _, rb in calls}}
    shares = []
    for side, reader in (("a", reader_a), ("b", reader_b)):
        paths = {r["path"] for r in reader.records if r["kind"] == "call" and r["path"]}
        shares.append(len(matched[side] & paths) / max(len(paths), 1))
    if max(shares) < 0.5:  # a shared lm_head is not a shared model
        raise LayerdiffError(f"only {len(matched['a'])} modules of A and B could be matched ({shares[0]:.0%} of A's, "
                             f"{shares[1]:.0%} of B's): the traces look like different models; if they are one "
                             "model renamed, map names with --map or a rule file")


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
    row: schema.Row
    ins: list[schema.TensorResult]
    outs: list[schema.TensorResult]
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


def judge_rows(measurements: schema.Report, policy: TolerancePolicy) -> list[schema.Row]:
    """The measured rows with every tensor judged under ``policy``: new rows and tensors, the measurements are
    left as they were (the same measurements can be judged again under other tolerances)."""
    return [{**row, "tensors": [_judged(row["path"], t, policy) for t in row["tensors"]]}
            for row in measurements["records"]]


def _judged(path: str, tensor: schema.TensorResult, policy: TolerancePolicy) -> schema.TensorResult:
    tol = policy.for_tensor(path, tensor["dtype_a"], tensor["dtype_b"])
    passed, reason = judge(tensor["metrics"], tol)
    t = {**tensor, "passed": passed, "reason": reason, "tolerance": tol.as_dict()}
    for stale in ("ranks", "hint"):  # from an earlier judgement under other tolerances
        t.pop(stale, None)
    per_rank = tensor["metrics"].get("ranks")
    if per_rank:  # which ranks' shards or copies are off (the run spread over several ranks)
        t["ranks"] = [int(r) for r, m in per_rank.items() if r.isdigit() and not judge(m, tol)[0]]
        if t["ranks"] and "sum" in per_rank and judge(per_rank["sum"], tol)[0]:
            t["hint"] = ("the ranks' copies differ from each other but add up to the reference's: a "
                         "reduction (all-reduce) is missing")
    return t


def _one_sided(row: schema.Row, phase: str) -> list[schema.TensorResult]:
    """Pseudo-tensors that fail: inputs given to one run only (a mask passed on one side)."""
    roles = IN_ROLES[phase]
    out = []
    for side, other in (("only_a", "B"), ("only_b", "A")):
        for item in row.get(side) or ():
            role, _, key = item.partition(":")
            if role in roles:
                out.append({"role": role, "key": key, "passed": False, "one_sided": True,
                            "reason": f"given to run {'A' if other == 'B' else 'B'} only",
                            "metrics": {"basis": "shape", "mismatch": f"absent in run {other}"}})
    return out


def _build_tree(rows: list[schema.Row], phase: str, param_grads: dict, strict_inputs: bool = False, uses: dict | None = None) -> list:
    """The call tree of A's matched calls. A call whose parent has no counterpart hangs under its nearest
    ancestor that has one. With ``strict_inputs`` (two runs of the same model class), a tensor given to the
    root of one run only counts as a difference of the inputs."""
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
        for key, tensors in (uses or {}).items():  # a tied weight's gradient, per use: on the call that used it
            if key in nodes:
                nodes[key].outs.extend(tensors)
    roots = []
    for node in sorted(nodes.values(), key=lambda n: n.row["begin"]):
        chain = node.row.get("ancestors")
        if chain is None:
            chain = [node.row["parent"]] if node.row.get("parent") else []
        parent = next((nodes[tuple(up)] for up in chain if tuple(up) in nodes), None)
        if parent is not None:
            parent.children.append(node)
        else:
            if strict_inputs and not chain:
                node.ins = node.ins + _one_sided(node.row, phase)
            roots.append(node)
    return roots


def call_tree(rows: list[schema.Row], phase: str, strict_inputs: bool = False) -> list[Node]:
    """The judged call tree of one phase (``_build_tree``) with parameter gradients placed on the calls they
    belong to: a module's own on its first call of the step; a tied weight's per use, on the call that used it
    (its total, the sum of its uses, then stays off the tree)."""
    if phase == "forward":
        return _build_tree(rows, phase, {}, strict_inputs)
    uses = _param_rows(rows, "param_grad_use")
    used = {p["name"] for p in uses}
    grads_by_module, uses_by_call = {}, {}
    for p in _param_rows(rows, "param_grad"):
        if not (p.get("tied") and used):
            grads_by_module.setdefault((p["module"], p["step"]), []).append(p)
    for p in uses:
        uses_by_call.setdefault((p["module"], p["call"]), []).append(p)
    return _build_tree(rows, phase, grads_by_module, strict_inputs, uses_by_call)


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


def describe_origin(node: Node, where: str, after, before, ranks: tuple | None = None) -> str:
    path = node.row["path"] or "<root>"
    if ranks and where != "own_code":
        numbers, how = ranks
        owner = f"rank {numbers[0]}'s" if len(numbers) == 1 else f"ranks {', '.join(map(str, numbers))}'"
        return f"{owner} {'shard' if how == 'shards' else 'copy'}{'s' if len(numbers) > 1 else ''} of {path}"
    if where != "own_code":
        return path
    repeated = after is not None and before is not None and after.row["path"] == before.row["path"]

    def short(n):  # a module called several times is named with its call
        if n is None:
            return None
        name = n.row["path"].rsplit(".", 1)[-1]
        return f"{name} (call {n.row['call']})" if repeated or n.row["call"] else name
    if after and before:
        return f"{path}, own code between {short(after)} and {short(before)}"
    if before:
        return f"{path}, own code before {short(before)}"
    if after:
        return f"{path}, own code after {short(after)}"
    return f"{path}, own code"


def _partial_ranks(tensor: dict | None) -> tuple | None:
    """(ranks, "shards" or "copies") whose part is off, when only some are (all of them: none is singled out)."""
    ranks = (tensor or {}).get("ranks")
    per_rank = ((tensor or {}).get("metrics") or {}).get("ranks", {})
    numbers = [r for r in per_rank if r.isdigit()]
    return (ranks, per_rank.get("how")) if ranks and len(ranks) < len(numbers) else None


def hparam_diff(a: dict | None, b: dict | None) -> dict:
    def norm(h):
        return {HPARAM_ALIASES.get(k, k): v for k, v in (h or {}).items()}

    na, nb = norm(a), norm(b)
    return {k: [na[k], nb[k]] for k in sorted(set(na) & set(nb)) if na[k] != nb[k]}


def _origin_dict(node: Node, where: str, after, before, chain, phase: str, params: list) -> schema.Origin:
    row = node.row
    if where == "inputs":
        bad = _first_failing(node.ins)
    else:
        bad = _first_failing(node.outs) or _first_failing(before.ins if before else []) or _first_failing(node.ins)
    diff = hparam_diff(row.get("hparams_a"), row.get("hparams_b"))
    families = (row.get("family_a"), row.get("family_b")) if "family_a" in row else \
        (type_family(row.get("type_a")), type_family(row.get("type_b")))
    if families[0] != families[1]:  # Linear vs Dense is no difference
        diff = {"type": [row.get("type_a"), row.get("type_b")], **diff}
    same_family_types = None
    if families[0] == families[1] and row.get("type_a") != row.get("type_b") and row.get("type_b"):
        same_family_types = [row.get("type_a"), row.get("type_b")]  # NewGELU vs GELU: worth a look
    own = [p for p in params if p["module"] == row["path"] and not p["passed"]]
    return {"module": row["path"], "call": row["call"], "step": row["step"], "type": row.get("type_a"),
            "where": where, "between": [after.row["path"] if after else None, before.row["path"] if before else None],
            "description": describe_origin(node, where, after, before, _partial_ranks(bad)),
            "tensor": bad and {"role": bad["role"], "key": bad["key"], "reason": bad["reason"],
                               "metrics": bad["metrics"]},
            "ranks": bad.get("ranks") if bad else None, "hint": bad.get("hint") if bad else None,
            "hparam_diff": diff, "param_diffs": own, "error": row.get("error_b") or row.get("error_a"),
            "class_diff": same_family_types,
            "chain": [n.row["path"] or "<root>" for n in chain], "phase": phase,
            "path_b": row.get("path_b"), "unpaired": {"a": row.get("only_a") or [], "b": row.get("only_b") or []}}


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
            out.append({"name": r["path"], "module": r["module"], "step": r["step"], "call": r["call"],
                        "tied": r.get("tied"), "passed": t["passed"],
                        "reason": t["reason"], "metrics": t["metrics"], "role": t["role"], "key": r["path"].rsplit(".", 1)[-1]})
    return out


def _phase_result(rows, phase, roots, params, forward_origin) -> schema.PhaseResult:
    present = any(r["kind"] == "call" and r["phase"] == phase for r in rows)
    failing = [t for r in rows if r["kind"] == "call" and r["phase"] == phase for t in r["tensors"]
               if not t["passed"]]
    if phase == "backward":
        failing += [p for kind in ("param_grad", "param_grad_use") for p in params.get(kind, []) if not p["passed"]]
    failing += [t for root in roots for t in root.ins if t.get("one_sided")]
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


def _origin(roots, phase, params) -> schema.Origin | None:
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
        description = f"{bad_param['name']} gradient"
        if bad_param.get("tied"):
            description += (f" (a weight tied across {', '.join(bad_param['tied'])}: one of its users computes its "
                            "weight gradient differently)")
        return {"module": bad_param["module"], "where": "param_grad", "description": description,
                "tensor": bad_param, "hparam_diff": {}, "param_diffs": [bad_param], "chain": [], "phase": phase}
    return None


def evaluate(measurements: schema.Report, policy: TolerancePolicy) -> schema.Report:
    """Judge every tensor and locate the origin, forward and backward. Returns the full report dict, a new one:
    ``measurements`` is not changed."""
    rows = judge_rows(measurements, policy)
    params = {kind: _param_rows(rows, kind) for kind in ("param", "param_grad", "param_grad_use")}
    strict = measurements.get("structure") == "same_model"
    forward = _phase_result(rows, "forward", call_tree(rows, "forward", strict), params, None)
    backward = _phase_result(rows, "backward", call_tree(rows, "backward", strict), params,
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
    report = {**measurements, "records": rows}
    report["trust"] = trust(measurements, forward, backward)
    report["next_pass"] = window_suggestion(measurements, forward["first_divergence"])
    report.update(
        tolerances=policy.describe(), forward=forward, backward=backward,
        params={"compared": len(param_values), "differ": [p["name"] for p in param_values if not p["passed"]],
                "grads_compared": len(params["param_grad"]),
                "grads_differ": [p["name"] for p in params["param_grad"] if not p["passed"]],
                "grad_uses_differ": [f"{p['module']} (call {p['call']})" for p in params["param_grad_use"]
                                     if not p["passed"]]},
        growth=growth_table(rows, forward["first_divergence"]),
        verdict="divergent" if {"divergent", "failed"} & {forward["status"], backward["status"]}
        or any(not p["passed"] for p in param_values) else "aligned")
    return report


def trust(measurements: schema.Report, forward: schema.PhaseResult, backward: schema.PhaseResult) -> schema.Trust:
    """Why an "aligned" verdict could still be wrong: a run that did not finish, a phase recorded on one side
    only, the same trace twice. ``{"ok": bool, "problems": [...]}``; the CLI exits 3 for aligned-but-not-ok."""
    problems = []
    for side, name in (("a", "A"), ("b", "B")):
        summary = measurements[side]
        if not summary.get("complete", True):
            problems.append(f"{name} ({summary['path']}) is incomplete: its run did not finish, so only what it "
                            "recorded before was compared")
    phases = measurements.get("phases") or {}
    for phase in ("forward", "backward"):
        present = phases.get(phase, {})
        if present.get("a") != present.get("b"):
            only = "A" if present.get("a") else "B"
            problems.append(f"{phase} was recorded in {only} only (traced with --no-backward, or no backward "
                            "pass run?): it was not compared")
    if measurements.get("same_file"):
        problems.append("A and B are the same file: nothing was compared with another run")
    return {"ok": not problems, "problems": problems}


def window_suggestion(measurements: schema.Report, origin: schema.Origin | None) -> dict | None:
    """Two-pass tracing: after a statistics-only align, the block to trace again in full mode and bisect."""
    if origin is None or measurements.get("basis") not in ("stats", "mixed") or not origin.get("module"):
        return None
    container, blocks = find_blocks(r["path"] for r in measurements["records"] if r["kind"] == "call")
    index = next((i for i, b in enumerate(blocks) if origin["module"] == b or origin["module"].startswith(b + ".")),
                 None)
    if index is None:
        return None
    return {"block": blocks[index], "layers": f"{index}:{index + 1}", "container": container}


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
        worst = max(outs, key=lambda t: relative_error(t["metrics"]), default=None)
        table.append({"module": r["path"], "call": r["call"], "type": r["type_a"],
                      "depth": tree_depth[(r["path"], r["call"])],
                      "passed": all(t["passed"] for t in r["tensors"]) and not r.get("error_b"),
                      "max_abs": worst and worst["metrics"].get("max_abs"),
                      "rel": worst and relative_error(worst["metrics"]),
                      "cosine": worst and worst["metrics"].get("cosine"),
                      "origin": bool(origin and r["path"] == origin["module"] and r["call"] == origin.get("call"))})
    return table


def align(reader_a, reader_b, *, rename: RenameRules | None = None, policy: TolerancePolicy | None = None,
          progress=None, auto_map: bool = True, layouts: LayoutRules | None = None,
          rules: RuleSet | None = None, workers: int | None = 1) -> schema.Report:
    return evaluate(measure(reader_a, reader_b, rename, progress, auto_map, layouts, rules, workers=workers),
                    policy or TolerancePolicy())
