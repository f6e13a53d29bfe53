"""The call tree that judging walks: one node per matched call (a module call today; an operation inside one
tomorrow), with its tensors judged under a tolerance policy and sorted into the node's inputs and outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

from layerdiff import schema
from layerdiff.compare.tolerance import TolerancePolicy, dtype_class, judge, precision_floor
from layerdiff.judge.inherited import inherit
from layerdiff.match.mapping import collapse_indices
from layerdiff.schema import IN_ROLES, OUT_ROLES

Judged = Mapping[str, Any]  # a judged tensor of a row (``schema.TensorResult``), or a parameter's (``param_rows``)
NodeKind = Literal["module", "op"]
CallKey = tuple[str, int]  # (path, call number): one module call
NodeKey = tuple[Any, ...]  # a module call's CallKey, or (path, call, index) of the index-th operation of that call
NODE_KINDS = {"call": "module", "op": "op"}  # the rows a tree is made of, by the kind of their record


@dataclass
class Node:
    """One call of the judged tree: a module call, or (``kind`` "op") an operation that a module's own code ran.
    ``ins``/``outs`` are its tensors by direction (in backward, gradients w.r.t. outputs are its inputs)."""

    row: schema.Row
    ins: list[Judged]
    outs: list[Judged]
    children: list[Node] = field(default_factory=list)

    @property
    def kind(self) -> NodeKind:
        return "op" if self.row["kind"] == "op" else "module"

    @property
    def key(self) -> NodeKey:
        return node_key(self.row)

    @property
    def inputs_ok(self) -> bool:
        return all(t["passed"] for t in self.ins)

    @property
    def outputs_ok(self) -> bool:
        return all(t["passed"] for t in self.outs) and not (self.row.get("error_a") or self.row.get("error_b"))

    def subtree_ok(self) -> bool:
        return self.inputs_ok and self.outputs_ok and all(c.subtree_ok() for c in self.children)

    def modules_ok(self) -> bool:
        """``subtree_ok`` over the module calls alone: an operation that differs inside a call whose modules all
        agree is a formulation that comes back together (transformers' router takes the top-k of probabilities,
        Megatron's of logits, then a softmax of those: the same weights come out), not a divergence that a later
        module inherits. A phase's verdict does not count it either."""
        if self.kind == "op":
            return True
        return self.inputs_ok and self.outputs_ok and all(c.modules_ok() for c in self.children)


def node_key(row: schema.Row) -> NodeKey:
    """A row's place in the tree: its module call, and for an operation its index in that call's code."""
    op = row.get("op")
    return (row["path"], row["call"]) if op is None or row["kind"] != "op" else (row["path"], row["call"], op["index"])


def judge_rows(measurements: schema.Report, policy: TolerancePolicy) -> list[schema.Row]:
    """The measured rows with every tensor judged under ``policy``: new rows and tensors, the measurements are
    left as they were (the same measurements can be judged again under other tolerances)."""
    run_a, run_b = measurements.get("a"), measurements.get("b")
    floor = precision_floor(run_a.get("param_dtypes") if run_a else None, run_b.get("param_dtypes") if run_b else None,
                            (run_a or {}).get("autocast_dtypes") or (), (run_b or {}).get("autocast_dtypes") or ())
    rows: list[schema.Row] = [{**row, "tensors": [_judged(row["path"], t, policy, floor) for t in row["tensors"]]}
                              for row in measurements["records"]]
    return inherit(rows, floor) if floor is not None else rows  # a change of precision: error carried is no fault


DISCRETE_HINT = ("an integer or boolean tensor, made by a choice (top-k, argmax, sort, a threshold): inputs that agree "
                 "only within tolerance, as under another precision, choose otherwise where they are nearly tied; "
                 "if few positions differ, that is rounding, not the code")


def _mask_hint(metrics: Mapping[str, Any]) -> str | None:
    """Where most of a tensor's error sits at positions that are zero in one run only: a mask that chose otherwise
    (None where the error lies elsewhere as much)."""
    flips, elsewhere, total = metrics.get("zero_mismatch"), metrics.get("rel_l2_elsewhere"), metrics.get("rel_l2")
    if not flips or not isinstance(elsewhere, (int, float)) or not isinstance(total, (int, float)) or \
            elsewhere > total / 2:
        return None
    return (f"it differs most where one run holds zero and the other not ({flips} of {metrics.get('numel')} "
            "positions): a mask chose otherwise there (a ReLU's or a threshold's whose inputs differ slightly, "
            f"dropout's, an attention mask's); elsewhere its relative error is {elsewhere:.2g}")


def _judged(path: str, tensor: schema.TensorResult, policy: TolerancePolicy,
            floor: str | None = None) -> schema.TensorResult:
    tol = policy.for_tensor(path, tensor["dtype_a"], tensor["dtype_b"], floor)
    passed, reason = judge(tensor["metrics"], tol)
    t: schema.TensorResult = {**tensor, "passed": passed, "reason": reason, "tolerance": tol.as_dict()}
    t.pop("ranks", None)  # from an earlier judgement under other tolerances
    t.pop("hint", None)
    t.pop("inherited", None)  # judged again below, under these tolerances
    t.pop("accumulated", None)
    if not passed and tensor["role"] in ("output", "input") and \
            dtype_class(tensor["dtype_a"], tensor["dtype_b"]) == "exact":  # integers or booleans
        t["hint"] = DISCRETE_HINT
    elif not passed and (hint := _mask_hint(tensor["metrics"])):
        t["hint"] = hint
    per_rank = tensor["metrics"].get("ranks")
    if per_rank:  # which ranks' shards or copies are off (the run spread over several ranks)
        t["ranks"] = [int(r) for r, m in per_rank.items() if r.isdigit() and not judge(m, tol)[0]]
        if t["ranks"] and "sum" in per_rank and judge(per_rank["sum"], tol)[0]:
            t["hint"] = ("the ranks' copies differ from each other but add up to the reference's: a "
                         "reduction (all-reduce) is missing")
    return t


def _one_sided(row: schema.Row, phase: str) -> list[Judged]:
    """Pseudo-tensors that fail: inputs given to one run only (a mask passed on one side, or dropped)."""
    roles = IN_ROLES[phase]
    out: list[Judged] = []
    for items, other in ((row.get("only_a"), "B"), (row.get("only_b"), "A")):
        for item in items or ():
            role, _, key = item.partition(":")
            if role in roles:
                out.append({"role": role, "key": key, "passed": False, "one_sided": True,
                            "reason": f"given to run {'A' if other == 'B' else 'B'} only",
                            "metrics": {"basis": "shape", "mismatch": f"absent in run {other}"}})
    return out


def _build_tree(rows: list[schema.Row], phase: str, param_grads: dict[CallKey, list[Judged]],
                strict_inputs: bool = False, uses: dict[CallKey, list[Judged]] | None = None) -> list[Node]:
    """The call tree of A's matched calls (and operations). A call whose parent has no counterpart hangs under its
    nearest ancestor that has one. A tensor given to a call in one run only (its caller's own code dropped it, or
    made it) counts as a difference of that call's inputs where the call's results differ although the inputs both
    runs gave it agree: the divergence was then born in the caller's code, which gave it something else. Not where
    the same module's results agree without it in another call or block (``_harmless_one_sided``: a port whose
    attention never takes position_ids, a causal mask one implementation takes and another builds itself): that is
    a difference of representation. Between two runs of the same model class (``strict_inputs``) every such
    tensor counts, made or dropped; between a model and its port, one that a port's code makes where the other's
    never does is a difference of design, so only a tensor the caller got in both runs and handed on in one counts
    (``dropped``). With ``strict_inputs``, a tensor given to the root of one run only counts as a difference of the
    inputs."""
    nodes: dict[NodeKey, Node] = {}
    for row in rows:
        if row["kind"] not in NODE_KINDS or row["phase"] != phase:
            continue
        ins: list[Judged] = [t for t in row["tensors"] if t["role"] in IN_ROLES[phase]]
        outs: list[Judged] = [t for t in row["tensors"] if t["role"] in OUT_ROLES[phase]]
        nodes[node_key(row)] = Node(row, ins, outs)
    if phase == "backward":  # a module's parameter gradients belong to its first call of that step
        for (module, step), tensors in param_grads.items():
            owner = min((n for n in nodes.values()
                         if n.kind == "module" and n.row["path"] == module and n.row["step"] == step),
                        key=lambda n: n.row["call"], default=None)
            if owner is not None:
                owner.outs.extend(tensors)
        for key, tensors in (uses or {}).items():  # a tied weight's gradient, per use: on the call that used it
            if key in nodes:
                nodes[key].outs.extend(tensors)
    harmless = _harmless_one_sided(nodes.values(), phase)
    roots: list[Node] = []
    for node in sorted(nodes.values(), key=lambda n: n.row["begin"]):
        chain = node.row.get("ancestors")
        if chain is None:
            parent_ref = node.row.get("parent")
            chain = [parent_ref] if parent_ref else []
        parent = next((nodes[tuple(up)] for up in chain if tuple(up) in nodes), None)
        if parent is not None:
            parent.children.append(node)
            if node.inputs_ok and not node.outputs_ok:
                node.ins = node.ins + _given_otherwise(node.row, phase, harmless, strict_inputs)
        else:
            if strict_inputs and not chain:
                node.ins = node.ins + _one_sided(node.row, phase)
            roots.append(node)
    return roots


Harmless = set[tuple[str, str, str]]  # (module with block indices as *, role, key): see _harmless_one_sided


def _given_otherwise(row: schema.Row, phase: str, harmless: Harmless, strict_inputs: bool) -> list[Judged]:
    """The tensors given to a call in one run only that count as a difference of its inputs (``_build_tree``): not
    where the other run gives it an unpaired tensor of that role (one that may stand in for it), nor where the
    module does without it elsewhere (``harmless``)."""
    place = collapse_indices(row["path"])
    dropped = row.get("dropped") or []
    sides = {"B": row.get("only_b") or [], "A": row.get("only_a") or []}  # "given to run A only": B has none
    return [t for t in _one_sided(row, phase)
            if (place, t["role"], t["key"]) not in harmless
            and (strict_inputs or f"{t['role']}:{t['key']}" in dropped)
            and not any(item.startswith(t["role"] + ":") for item in sides["B" if t["reason"].endswith("A only")
                                                                            else "A"])]


def _harmless_one_sided(nodes: Iterable[Node], phase: str) -> Harmless:
    """(module with its block indices as *, role, key) of the tensors given to one run only at a call whose results
    agree: the module does without them, in any block."""
    out: Harmless = set()
    for node in nodes:
        if node.kind == "module" and node.inputs_ok and node.outputs_ok:
            place = collapse_indices(node.row["path"])
            out.update((place, t["role"], t["key"]) for t in _one_sided(node.row, phase))
    return out


def call_tree(rows: list[schema.Row], phase: str, strict_inputs: bool = False) -> list[Node]:
    """The judged call tree of one phase (``_build_tree``) with parameter gradients placed on the calls they
    belong to: a module's own on its first call of the step; a tied weight's per use, on the call that used it
    (its total, the sum of its uses, then stays off the tree)."""
    if phase == "forward":
        return _build_tree(rows, phase, {}, strict_inputs)
    uses = param_rows(rows, "param_grad_use")
    used = {p["name"] for p in uses}
    grads_by_module: dict[CallKey, list[Judged]] = {}
    uses_by_call: dict[CallKey, list[Judged]] = {}
    for p in param_rows(rows, "param_grad"):
        if not (p.get("tied") and used):
            grads_by_module.setdefault((p["module"], p["step"]), []).append(p)
    for p in uses:
        uses_by_call.setdefault((p["module"], p["call"]), []).append(p)
    return _build_tree(rows, phase, grads_by_module, strict_inputs, uses_by_call)


def param_rows(rows: list[schema.Row], kind: str) -> list[dict[str, Any]]:
    """The judged rows of one kind of parameter record (``param``, ``param_grad``, ``param_grad_use``), one entry
    each: what the report lists under ``params`` and an origin under ``param_diffs``."""
    out = []
    for r in rows:
        if r["kind"] == kind and r["tensors"]:
            t = r["tensors"][0]
            row: dict[str, Any] = {
                "name": r["path"], "module": r["module"], "step": r["step"], "call": r["call"], "tied": r.get("tied"),
                "passed": t["passed"], "reason": t["reason"], "metrics": t["metrics"], "role": t["role"],
                "key": r["path"].rsplit(".", 1)[-1]}
            row.update({k: t.get(k) for k in ("ranks", "hint") if t.get(k)})  # a parameter spread over ranks
            out.append(row)
    return out
