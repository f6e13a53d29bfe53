"""The origin rule: the call whose inputs agree and whose outputs do not, found by descending the judged call tree.

From a call whose inputs agree, the children are visited in execution order: the first child whose inputs already
disagree means the divergence was born in the parent's own code, between the previous child and that one; the
first child whose outputs disagree is descended into. Backward is the same with gradients: w.r.t. outputs (the
inputs of backward) and w.r.t. inputs plus the module's own parameter gradients (the outputs of backward)."""
from __future__ import annotations

import math

from typing import Any, Iterator, Mapping

from layerdiff import schema
from layerdiff.compare.metrics import relative_error
from layerdiff.compare.replayed import REPLAYED
from layerdiff.judge.inherited import computes_as_replayed
from layerdiff.judge.tree import DISCRETE_HINT, Judged, Node
from layerdiff.match.ops import arguments_diff
from layerdiff.match.rules import builtin

HPARAM_ALIASES = {"epsilon": "eps", "variance_epsilon": "eps", "layer_norm_eps": "eps", "rms_norm_eps": "eps",
                  "layer_norm_epsilon": "eps", "norm_eps": "eps", "dropout_p": "p", "attention_dropout": "p"}


def _first_failing(tensors: list[Judged]) -> Judged | None:
    return next((t for t in tensors if not t["passed"]), None)


def _locate(node: Node, chain: list):
    """Descend from a call whose inputs agree but which diverges somewhere inside or at its outputs."""
    chain = chain + [node]
    previous = None
    for child in node.children:
        if child.kind == "op" and not child.inputs_ok and child.outs and child.outputs_ok:
            # an operation whose output agrees took what differs of its inputs in its stride (a port's matmul with
            # transpose_b given the key untransposed, compared with HF's transposed one): no divergence there
            previous = child
            continue
        if not child.inputs_ok:
            return node, "own_code", previous, child, chain
        if not child.outputs_ok or not child.modules_ok():
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


def _origin_ranks(row: schema.Row, bad: Judged | None) -> list[int] | None:
    """The ranks of the origin: the candidate's ranks whose shard or copy is off, or else the only ranks of the
    candidate that ran the module (a pipeline stage, an expert's rank), or else the reference's."""
    ranks = bad.get("ranks") if bad else None
    run = (((bad or {}).get("metrics") or {}).get("ranks") or {}).get("run")
    if ranks and run != "a":
        return ranks
    return row.get("held_b") or ranks or row.get("held_a")


def _partial_ranks(tensor: Judged | None) -> tuple | None:
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


def _origin_dict(node: Node, where: str, after, before, chain, phase: schema.Phase, params: list) -> schema.Origin:
    row = node.row
    handed = [t for t in (before.ins if before else []) if t.get("one_sided")]  # what its own code gave otherwise
    if where == "inputs":
        bad = _first_failing(node.ins)
    elif handed:
        bad = handed[0]
    else:
        bad = _first_failing(node.outs) or _first_failing(before.ins if before else []) or _first_failing(node.ins)
    diff = hparam_diff(row.get("hparams_a"), row.get("hparams_b"))
    families = (row.get("family_a"), row.get("family_b")) if "family_a" in row else \
        (builtin().family(row.get("type_a")), builtin().family(row.get("type_b")))  # a report made before families
    if families[0] != families[1]:  # Linear vs Dense is no difference
        diff = {"type": [row.get("type_a"), row.get("type_b")], **diff}
    same_family_types = None
    if families[0] == families[1] and row.get("type_a") != row.get("type_b") and row.get("type_b"):
        same_family_types = [row.get("type_a"), row.get("type_b")]  # NewGELU vs GELU: worth a look
    own = [p for p in params if p["module"] == row["path"] and not p["passed"]]
    if where == "own_code":  # a module inside it that the other run has no module for runs in its own code there
        paired = {n.row["path"] for n in (node, *_descendants(node))}
        prefix = f"{row['path']}." if row["path"] else ""
        own += [p for p in params if not p["passed"] and p["module"] not in paired and p["module"].startswith(prefix)]
    return {"module": row["path"], "call": row["call"], "step": row["step"], "type": row.get("type_a"),
            "where": where, "between": [after.row["path"] if after else None, before.row["path"] if before else None],
            "description": describe_origin(node, where, after, before, _partial_ranks(bad)) + (
                f": it gives {before.row['path'].rpartition('.')[2] or '<root>'} {_tensor_name(handed)} in run "
                f"{'A' if handed[0]['reason'].endswith('A only') else 'B'} only" if handed else ""),
            "tensor": {"role": bad["role"], "key": bad["key"], "reason": bad["reason"], "metrics": bad["metrics"]}
            if bad else None,
            "ranks": _origin_ranks(row, bad), "hint": _hint(bad, node),
            "hparam_diff": diff, "param_diffs": own, "error": row.get("error_b") or row.get("error_a"),
            "class_diff": same_family_types,
            "chain": [n.row["path"] or "<root>" for n in chain], "phase": phase,
            "path_b": row.get("path_b"), "unpaired": {"a": row.get("only_a") or [], "b": row.get("only_b") or []},
            **({"ops_not_compared": why} if where == "own_code" and (why := ops_not_compared(row.get("ops"))) else {})}


def ops_not_compared(summary: schema.OpsSummary | None) -> list[schema.OpsNotCompared]:
    """Why operations that both runs recorded in a call's own code were not compared with each other (where the
    origin is that code and no operation is named there): a run read holds none of them (``OpsSummary``)."""
    if not summary:
        return []
    out: list[schema.OpsNotCompared] = []
    for side, other in (("a", "b"), ("b", "a")):
        without = len((summary.get("only_b") if other == "b" else summary.get("only_a")) or [])
        if side in (summary.get("not_in_run") or []):
            out.append({"side": side, "why": "not_in_run", "without_counterpart": without})
    return out


def _hint(bad: Judged | None, node: Node) -> str | None:
    """What may explain the origin's tensor: its own hint, or, where a choice among the call's outputs flipped too
    (a router's experts), that choice's: the scores handed on with the experts follow from which were chosen."""
    if bad is None:
        return None
    if bad.get("hint") or bad["role"] != "output":
        return bad.get("hint")
    choice = next((t for t in node.outs if not t["passed"] and t.get("hint") == DISCRETE_HINT), None)
    if choice is not None:
        return f"{choice['key']} differs too: {DISCRETE_HINT}"
    return _amplified(bad, node)


def _amplified(bad: Judged, node: Node) -> str | None:
    """Where an operation of ``compare.replayed``'s table (a module or an operation of that family in both runs) is
    the origin: that a run's output is not what the operation makes of its own input, where it was replayed and is
    off; else, where its inputs' absolute error alone can make its output's relative one, the bound that allows.
    Large inputs (CPM-Ant's attention scores, 25 on average) that agree within a lower precision's relative tolerance
    differ by much in absolute terms (0.97 at most), and a softmax makes of that a relative error (2.5 at most; up to
    e^(2 x 0.97) - 1 = 6.0 allows). A defect may do the same: a hint, not a judgement."""
    family = node.row.get("family_a")
    replay = REPLAYED.get(family or "") if family == node.row.get("family_b") else None
    factor = replay.amplifies if replay is not None else None
    if factor and computes_as_replayed(bad) is False:
        errors = bad["metrics"].get("own_error") or {}
        side = max(("a", "b"), key=lambda s: errors.get(s, 0.0))
        return (f"run {side.upper()}'s output is not what a {family} makes of its own input: replayed in float64 from "
                f"it, as run A's call does it, the output is {errors.get(side, 0.0):.2g} off (relative); the code that "
                "computes it differs")
    largest = [t["metrics"].get("max_abs") for t in node.ins if t["passed"]]
    change = max((float(d) for d in largest if isinstance(d, (int, float)) and math.isfinite(d)), default=0.0)
    relative = bad["metrics"].get("max_rel")
    if not factor or not change or not isinstance(relative, (int, float)) or not node.inputs_ok:
        return None
    bound = math.expm1(factor * change)
    if relative > bound:
        return None
    return (f"its inputs agree within tolerance but differ by up to {change:.3g}, and a {family} makes of an input's "
            f"absolute difference d a relative one of up to e^({factor:g}d) - 1 = {bound:.3g} here (its output's: "
            f"{relative:.3g} at most): large inputs rounded in a lower precision do this, and so may a defect; compare "
            "in one precision to tell them apart")


def _tensor_name(tensors: list[Judged]) -> str:
    keys = [t["key"].removeprefix("kwargs.") for t in tensors]
    return ", ".join(keys[:-1]) + (" and " if len(keys) > 1 else "") + keys[-1]


def args_diff(a: dict | None, b: dict | None) -> dict:
    """The non-tensor arguments two calls of an operation set differently, under the built-in rule set (a report
    made before ``args_diff`` was kept in its op rows)."""
    return arguments_diff(a, b, builtin().op_arguments)


def _at(info: dict) -> str:
    """`` at modeling_llama.py:193 (eager_attention_forward)``."""
    source = info.get("source") or ""
    file, _, line = source.rpartition(":")
    where = f" at {file.replace(chr(92), '/').rpartition('/')[2]}:{line}" if source else ""
    return where + (f" ({info['function']})" if info.get("function") else "")


def describe_op(path: str, info: dict, wrong_input: bool, info_b: dict | None = None,
                unknown_maker: bool = False) -> str:
    """``model.layers.1.self_attn: Tensor.mul at modeling_llama.py:193 (eager_attention_forward)``, and B's line
    where it is another. ``unknown_maker``: the differing input of a ``wrong_input`` origin was made where nothing
    was recorded, so nothing says that what made it agrees."""
    in_b = f"; in B{_at(info_b)}" if info_b and info_b.get("source") and info_b.get("source") != info.get("source") \
        else ""
    if wrong_input and unknown_maker:
        return (f"{path or '<root>'}: the tensor passed to {info['name']}{_at(info)} differs; it was made where "
                f"nothing was recorded (before the traced call, or outside model code){in_b}")
    if wrong_input:
        return (f"{path or '<root>'}: the tensor passed to {info['name']}{_at(info)} differs, though what made it "
                f"agrees{in_b}")
    return f"{path or '<root>'}: {info['name']}{_at(info)}{in_b}"


def describe_inserted(path: str, info: dict | None, only_a: list, only_b: list) -> str:
    """Code one run has and the other does not, making an operation's input (``info``: that operation), or the
    call's output (``info`` None)."""
    def names(ops: list) -> str:
        return ", ".join(f"{name}{_at({'source': source})}" for _, name, source in ops)

    runs = []
    if only_b:
        runs.append(f"B runs {names(only_b)}, which A does not")
    if only_a:
        runs.append(f"A runs {names(only_a)}, which B does not")
    made = f"the input of {info['name']}{_at(info)}" if info is not None else "its output"
    return f"{path or '<root>'}: " + "; ".join(runs) + f", making {made}"


def _dtype_change(node: Node, module: Node | None) -> Node:
    """An operation whose inputs agree only in a lower precision (their dtypes differ, so a looser tolerance judged
    them): the origin is the earlier operation of the same call that changed the dtype, found along the
    producers (``.to(torch.bfloat16)`` where the other run keeps float32)."""
    siblings = {c.row["op"]["index"]: c for c in (module.children if module is not None else ()) if c.kind == "op"}
    current, seen = node, {id(node)}
    while True:
        changed = [t for t in current.ins if t.get("dtype_a") and t.get("dtype_b") and t["dtype_a"] != t["dtype_b"]]
        producer = (current.row["op"].get("producers") or {}).get(changed[0]["key"]) if changed else None
        index = producer.get("index") if producer and producer.get("kind") == "op" else None
        earlier = siblings.get(index) if index is not None else None
        if earlier is None or id(earlier) in seen:
            return current
        seen.add(id(earlier))
        current = earlier


def _inserted(bad: Judged | None, info: dict, info_b: dict, module_row: schema.Row | None) -> tuple[list, list]:
    """The operations without a counterpart that make a differing input: (A's, B's), each [index, name, source]:
    code one run has and the other does not (A's: those before this operation)."""
    summary = module_row.get("ops") if module_row is not None else None
    if bad is None or not summary:
        return [], []
    made_a = (info.get("producers") or {}).get(bad["key"]) or {}
    made_b = (info_b.get("producers") or {}).get(bad.get("key_b", bad["key"])) or {}
    only_a = [o for o in summary["only_a"] if o[0] < info["index"]] \
        if made_a.get("kind") == "op" and made_a.get("index") in {o[0] for o in summary["only_a"]} else []
    only_b = [o for o in summary["only_b"] if info_b.get("index") is None or o[0] < info_b["index"]] \
        if made_b.get("kind") == "op" and made_b.get("index") in {o[0] for o in summary["only_b"]} else []
    return only_a, only_b


def _inserted_cast(node: Node, info: dict, info_b: dict, module_row: schema.Row | None) -> tuple[str, list] | None:
    """Where an operation's input differs in dtype between the runs and, in the run with the narrower one, was
    made by an operation without a counterpart (a cast one run inserts): ("a" | "b", [index, name, source])."""
    summary = module_row.get("ops") if module_row is not None else None
    changed = next((t for t in node.ins if t.get("dtype_a") and t.get("dtype_b") and t["dtype_a"] != t["dtype_b"]),
                   None)
    if not summary or changed is None:
        return None
    for side, own in (("b", info_b), ("a", info)):
        key = changed.get("key_b", changed["key"]) if side == "b" else changed["key"]
        made = (own.get("producers") or {}).get(key) or {}
        inserted = {o[0]: o for o in (summary["only_b"] if side == "b" else summary["only_a"])}
        if made.get("kind") == "op" and made.get("index") in inserted:
            return side, inserted[made["index"]]
    return None


def _op_origin(node: Node, chain: list, phase: schema.Phase, wrong_input: bool,
               module_row: schema.Row | None = None) -> schema.Origin:
    """The origin at an operation inside a module's own code (``ops`` tracing): the first whose inputs agree and
    whose output does not, or (``wrong_input``) whose inputs differ while whatever made them agrees (or is code
    that only one run has: ``only_a``/``only_b``)."""
    row = node.row
    info, info_b = row["op"], row.get("op_b") or {"index": None, "name": None, "kind": None}
    bad = _first_failing(node.ins) if wrong_input else (_first_failing(node.outs) or _first_failing(node.ins))
    out = next((t for t in node.outs if t.get("dtype_a") != t.get("dtype_b")), None)
    if bad is None and out is not None:  # the operation that changed the dtype (``_dtype_change``)
        bad = out
    op: schema.OriginOp = {
        "name": info["name"], "kind": info["kind"], "index": info["index"], "source": info.get("source"),
        "function": info.get("function"),
        "args_diff": row["args_diff"] if "args_diff" in row else args_diff(info.get("args"), info_b.get("args")),
        "metrics": bad["metrics"] if bad else None, "name_b": info_b.get("name"), "index_b": info_b.get("index"),
        "source_b": info_b.get("source"), "function_b": info_b.get("function"), "wrong_input": wrong_input}
    module = next((n for n in reversed(chain) if n.kind == "module"), None)
    maker = (info.get("producers") or {}).get(bad["key"]) if bad is not None else None
    unknown_maker = wrong_input and (maker or {}).get("kind", "unknown") == "unknown"
    if unknown_maker:
        op["unknown_maker"] = True
    description = describe_op(row["path"], dict(info), wrong_input, dict(info_b), unknown_maker=unknown_maker)
    if out is not None and not wrong_input:
        op["dtype_diff"] = [out.get("dtype_a"), out.get("dtype_b")]
        description += f": its output is {out.get('dtype_a')} in A, {out.get('dtype_b')} in B"
    cast = _inserted_cast(node, dict(info), dict(info_b), module_row if module_row is not None else
                          (module.row if module is not None else None))
    if cast is not None and not wrong_input:  # the dtype changed in an operation only one run has
        side, found = cast
        changed = next(t for t in node.ins if t.get("dtype_a") != t.get("dtype_b"))
        if side == "b":
            op["only_b"], run, narrow, kept = [found], "B", changed.get("dtype_b"), changed.get("dtype_a")
        else:
            op["only_a"], run, narrow, kept = [found], "A", changed.get("dtype_a"), changed.get("dtype_b")
        seen_at = describe_op(row["path"], dict(info), False, dict(info_b)).partition(": ")[2]
        description = (f"{row['path']}: {found[1]}{_at({'source': found[2]})}, which only {run} runs, makes this "
                       f"tensor {narrow} (the other run keeps {kept}); first seen at {seen_at}")
    if wrong_input:
        only_a, only_b = _inserted(bad, dict(info), dict(info_b), module_row)
        if only_a or only_b:
            op["only_a"], op["only_b"] = only_a, only_b
            description = describe_inserted(row["path"], dict(info), only_a, only_b)
    description += " (backward)" if phase == "backward" else ""
    return {"module": row["path"], "call": row["call"], "step": row["step"],
            "type": module.row.get("type_a") if module is not None else None,
            "where": "op_input" if wrong_input else "op", "between": [None, None], "description": description,
            "tensor": {"role": bad["role"], "key": bad["key"], "reason": bad["reason"], "metrics": bad["metrics"]}
            if bad else None, "ranks": None, "hint": _hint(bad, node) if not wrong_input else None,
            "hparam_diff": {}, "param_diffs": [],
            "error": row.get("error_b") or row.get("error_a"), "class_diff": None,
            "chain": [n.row["path"] or "<root>" for n in chain if n.kind == "module"], "phase": phase,
            "path_b": row.get("path_b"), "unpaired": {"a": row.get("only_a") or [], "b": row.get("only_b") or []},
            "op": op}


def _one_sided_op(side: str, index: int, name: str, source: str | None, function: str | None,
                  metrics: schema.Metrics | None = None) -> schema.OriginOp:
    """The origin's ``op`` for an operation that only run ``side`` ("a" or "b") has."""
    in_a = side == "a"
    return {"name": name, "kind": name.rpartition(".")[0].rpartition(".")[2] or name,
            "index": index if in_a else None, "source": source if in_a else None,
            "function": function if in_a else None, "args_diff": {}, "metrics": metrics,
            "name_b": None if in_a else name, "index_b": None if in_a else index,
            "source_b": None if in_a else source, "function_b": None if in_a else function, "wrong_input": False,
            "only_a": [[index, name, source]] if in_a else [], "only_b": [] if in_a else [[index, name, source]]}


def _inserted_gradient_origin(node: Node, chain: list, phase: schema.Phase) -> schema.Origin:
    """The module's own code is the origin in backward, and one run inserted an operation there that passes its
    values through unchanged but not its gradient (``OpsSummary.gradient_changed``): that operation, named."""
    changed = node.row.get("ops_gradient_changed") or {}
    side, found = next((s, ops[0]) for s, ops in (("b", changed.get("b")), ("a", changed.get("a"))) if ops)
    index, name, source, function = found
    run, other = ("B", "A") if side == "b" else ("A", "B")
    info = {"source": source, "function": function}
    origin = _origin_dict(node, "own_code", None, None, chain, phase, [])
    origin["where"] = "op"
    origin["description"] = (f"{node.row['path']}: {name}{_at(info)}, which only {run} runs, passes its values "
                             f"through unchanged but changes their gradient ({other} has no such step) (backward)")
    origin["op"] = _one_sided_op(side, index, name, source, function)
    return origin


def _trailing_inserted(node: Node, previous: Node | None) -> tuple[list, list]:
    """Operations of the call's own code that one run has and the other does not, run after the last child that
    agrees (``previous``: a paired operation or module call, or None): (A's, B's), each [index, name, source].
    With every paired operation agreeing and the call's output not, they are what makes the difference."""
    summary: Mapping[str, Any] = node.row.get("ops") or {}
    info = previous.row.get("op") if previous is not None and previous.kind == "op" else None
    info_b = previous.row.get("op_b") if previous is not None and previous.kind == "op" else None
    if previous is not None and info is None:  # after a child module: its place among the operations is unknown
        return [], []
    after_a = info["index"] if info else -1
    after_b = info_b["index"] if info_b and info_b.get("index") is not None else after_a
    return ([o for o in summary.get("only_a") or [] if o[0] > after_a],
            [o for o in summary.get("only_b") or [] if o[0] > after_b])


def _inserted_output_origin(node: Node, previous: Node | None, chain: list, phase: schema.Phase,
                            params: list) -> schema.Origin | None:
    """The call's output differs after every operation both runs have agrees, and one run ran more operations
    after them (``_trailing_inserted``): those, named with their lines (a scale only one port applies)."""
    only_a, only_b = _trailing_inserted(node, previous)
    if not only_a and not only_b:
        return None
    origin = _origin_dict(node, "own_code", previous, None, chain, phase, params)
    side, (index, name, source) = ("b", only_b[0]) if only_b else ("a", only_a[0])
    origin["where"] = "op"
    origin["description"] = describe_inserted(node.row["path"], None, only_a, only_b)
    tensor = origin.get("tensor")
    op = _one_sided_op(side, index, name, source, None, tensor["metrics"] if tensor else None)
    op["only_a"], op["only_b"] = only_a, only_b
    origin["op"] = op
    return origin


def _made_inside(node: Node, chain: list, params: list) -> Node | None:
    """An origin whose inputs the candidate computes inside another module and never records (the input of an
    activation its Linear applies inside itself): when the call before it, which made those inputs in A, has
    parameters that differ, the divergence starts there (the weight of the Linear, not the activation)."""
    if not node.row.get("inputs_inside") or len(chain) < 2 or node not in chain[-2].children:
        return None
    siblings = chain[-2].children
    at = siblings.index(node)
    maker = siblings[at - 1] if at else None
    if maker is None or not maker.inputs_ok:
        return None
    return maker if any(p["module"] == maker.row["path"] and not p["passed"] for p in params) else None


# how much more than its inputs a call's output must have moved, within tolerance, for its differing parameter to
# be the origin rather than the code after it; and the least share of its tolerance that move must take
_MOVED = 4.0
_MOVED_SHARE = 0.1


def _moved(node: Node) -> tuple[float, Judged] | None:
    """(how many times more than its inputs, the output) where a call's output moved far more than its inputs,
    though within tolerance; None otherwise. Relative to each tensor's magnitude (max abs difference over the
    reference's max abs), so a statistics trace's min/max/mean/RMS are weighed as values are."""
    def relative(t: Judged) -> float:  # 0 where the reference is all zeros: no magnitude to weigh a move by
        m = t.get("metrics") or {}
        return relative_error(m) if m.get("ref_max_abs") else 0.0

    moved = [(relative(t), t) for t in node.outs]
    if not moved:
        return None
    out, tensor = max(moved, key=lambda pair: pair[0])
    given = max((relative(t) for t in node.ins), default=0.0)
    rtol = (tensor.get("tolerance") or {}).get("rtol") or 0.0
    if out <= 0 or out < _MOVED_SHARE * rtol or out <= _MOVED * given:
        return None
    return (out / given if given else math.inf), tensor


def _weight_before(node: Node, after: Node, chain: list, params: list, carried: str) -> schema.Origin | None:
    """An origin in a call's own code (``carried`` describes it: the code, or the operation in it), where a module
    that ran before that code (inside one of the children up to ``after``) has parameters that differ and an
    output that moved far more than its inputs, though within tolerance: the divergence starts at that weight, and
    the code after it only carried the change over tolerance. Why: a statistics trace of a port whose attention
    output projection was scaled by 1 + 1e-3 (a larger bias beside it) moved that projection's min/max/mean/RMS by
    2.7e-5 relative, under fp32's 2e-5 x magnitude, and named the decoder layer's residual add instead, while the
    parameters' comparison named the weight."""
    differing = {p["module"] for p in params if not p["passed"]}
    if not differing or after not in node.children:
        return None
    found = None
    for child in node.children[:node.children.index(after) + 1]:
        for module, path in _modules_under(child, [child]):
            moved = _moved(module) if module.row["path"] in differing and module.inputs_ok and \
                module.outputs_ok else None
            if moved is not None:
                found = module, path, moved  # the last one before the code: the nearest to it
    if found is None:
        return None
    module, path, (times, tensor) = found
    origin = _origin_dict(module, "module", None, None, chain + path, "forward", params)
    m = tensor.get("metrics") or {}
    how = "while its inputs are identical" if math.isinf(times) else \
        f"{times:.0f}x more than its inputs" if times >= 10 else f"{times:.2g}x more than its inputs"
    reason = f"moved {how}, though within tolerance (max abs diff {m.get('max_abs', 0):.3g}), and {carried} " \
        "carried it over tolerance"
    origin["tensor"] = schema.OriginTensor(role=tensor["role"], key=tensor["key"], reason=reason,
                                           metrics=tensor["metrics"], within_tolerance=True)
    return origin


def _modules_under(node: Node, path: list) -> Iterator[tuple[Node, list]]:
    """Every module call in ``node``'s subtree, in execution order, with the calls from ``node`` down to it (an
    operation's row carries its module's path: operations are left out)."""
    if node.kind != "module":
        return
    yield node, path
    for child in node.children:
        yield from _modules_under(child, path + [child])


def _first_over_tolerance(rows, phase):
    over = [r for r in rows if r["kind"] == "call" and r["phase"] == phase
            and any(not t["passed"] for t in r["tensors"])]
    if not over:
        return None
    first = min(over, key=lambda r: r["end"])  # completion order: the first result that was off
    return {"module": first["path"], "call": first["call"]}


def phase_result(rows: list[schema.Row], phase: schema.Phase, roots: list[Node], params: dict,
                 forward_origin: schema.Origin | None) -> schema.PhaseResult:
    present = any(r["kind"] == "call" and r["phase"] == phase for r in rows)
    failing: list[Judged] = [t for r in rows if r["kind"] == "call" and r["phase"] == phase for t in r["tensors"]
                             if not t["passed"]]
    if phase == "backward":
        failing += [p for kind in ("param_grad", "param_grad_use") for p in params.get(kind, []) if not p["passed"]]
    failing += [t for root in roots for t in root.ins if t.get("one_sided")]
    result: schema.PhaseResult = {
        "present": present, "status": "aligned" if present and not failing else ("divergent" if failing else "absent"),
        "failing_tensors": len(failing), "first_divergence": None,
        "first_over_tolerance": _first_over_tolerance(rows, phase)}
    carried = sum(1 for r in rows if r["phase"] == phase or (phase == "backward" and r["kind"].startswith(
        "param_grad")) for t in r["tensors"] if t.get("inherited"))
    if carried:
        result["inherited_tensors"] = carried
    if failing:
        origin = _origin(roots, phase, params)
        if phase == "backward" and forward_origin is not None and \
                (origin is None or origin.get("step", 0) >= forward_origin.get("step", 0)):
            # Once forward differs, every gradient is computed from differing activations, and small
            # differences grow through sums (weight gradients): backward is attributed to the forward origin;
            # what the backward descent alone would name is kept to look at after the forward fix. Not a
            # backward that went wrong in an earlier step (a gradient that the update then carried forward).
            inherited: schema.Origin = {
                **forward_origin, "where": "forward", "phase": "backward",
                "description": f"{forward_origin['description']} (inherited from the forward divergence)"}
            if origin is not None and origin["where"] != "inputs":
                inherited["backward_candidate"] = origin["description"]
            origin = inherited
        result["first_divergence"] = origin
    return result


def _origin(roots: list[Node], phase: schema.Phase, params: dict) -> schema.Origin | None:
    for root in roots:
        if not root.inputs_ok:
            what = "inputs" if phase == "forward" else "gradient of the loss w.r.t. the outputs"
            origin = _origin_dict(root, "inputs", None, None, [root], phase, [])
            origin["description"] = f"{root.row['path'] or '<root>'}: the runs were given different {what}"
            return origin
        found = _locate(root, [])
        if found:
            node, where, after, before, chain = found
            if node is root and _accumulated(root):
                return _accumulated_origin(root, phase)
            own_params = params.get("param" if phase == "forward" else "param_grad", [])
            if node.kind == "op":  # its inputs agree with their counterparts, its output does not
                module = chain[-2] if len(chain) > 1 else None
                row = node.row
                if _inserted_cast(node, row["op"], row.get("op_b") or {}, module.row if module else None) is None:
                    node = _dtype_change(node, module)
                op_origin = _op_origin(node, chain[:-1], phase, wrong_input=False)
                at = module.children.index(node) if module is not None and node in module.children else 0
                if phase == "forward" and module is not None and at:
                    weighed = _weight_before(module, module.children[at - 1], chain[:-1], own_params,
                                             op_origin["description"])
                    if weighed is not None:
                        return weighed
                return op_origin
            if where == "own_code" and before is not None and before.kind == "op":
                return _op_origin(before, chain, phase, wrong_input=True, module_row=node.row)
            if where == "own_code" and node.row.get("ops_gradient_changed"):
                return _inserted_gradient_origin(node, chain, phase)
            if where == "own_code" and before is None and phase == "forward":
                inserted = _inserted_output_origin(node, after, chain, phase, own_params)
                if inserted is not None:
                    return inserted
            if where == "own_code" and phase == "forward" and after is not None:
                weighed = _weight_before(node, after, chain, own_params,
                                         describe_origin(node, "own_code", after, before))
                if weighed is not None:
                    return weighed
            maker = _made_inside(node, chain, own_params)
            if maker is not None:
                node, where, after, before, chain = maker, "module", None, None, chain[:-1] + [maker]
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


def _accumulated(node: Node) -> bool:
    """Every output of the model over tolerance carries no more error than it was computed from
    (``judge.inherited``), and every call inside agrees."""
    failing = [t for t in node.outs if not t["passed"]]
    return bool(failing) and all(t.get("accumulated") for t in failing) and all(c.subtree_ok() for c in node.children)


def _accumulated_origin(root: Node, phase: schema.Phase) -> schema.Origin:
    """The model's output over tolerance while every call inside carries no more than 4x the error it was given
    (``judge.inherited``): named at the call whose error grew the most, which is where rounding grows fastest, or
    where a defect too small to tell from it (in this precision) lies."""
    def own(t: Judged) -> bool:  # error it grew itself (not an input's that its operation amplified, replayed)
        return bool(t.get("inherited")) and not t["inherited"].get("replayed")

    grown, node = max(((max(t["inherited"]["growth"] for t in n.outs if own(t)), n)
                       for n in _descendants(root) if any(own(t) for t in n.outs)),
                      key=lambda pair: pair[0], default=(None, root))
    origin = _origin_dict(node, "accumulated", None, None, [root] if node is root else [root, node], phase, [])
    where = f"{node.row['path']} ({grown:.2g}x what it was given)" if grown is not None else "no call"
    origin["description"] = (f"{root.row['path'] or '<root>'}'s output is over tolerance, and no call inside adds "
                             f"more than 4x the error it was given; the most: {where}. A change of precision grows "
                             "its rounding so, and so would a defect too small to tell from it in this precision")
    return origin


def _descendants(node: Node) -> Iterator[Node]:
    for child in node.children:
        yield child
        yield from _descendants(child)


def update_origin(rows: list[schema.Row], params: dict, origin: schema.Origin | None) -> schema.Origin | None:
    """The forward origin where the first step that differs begins with parameters that differ while everything
    before agrees (the earlier steps' forward, gradients and parameters): the update between the steps, outside the
    model's calls (the optimizer's settings, gradient clipping or scaling, code that sets weights between steps).

    Why: a training run with another learning rate was named at its first module with a weight ("model.embed_tokens
    ... parameter differs"), as if that module's code were wrong."""
    step = origin.get("step", 0) if origin is not None else 0
    if origin is None or not step or origin.get("where") in ("inputs", "raised"):
        return origin
    changed = [p for p in params.get("param", []) if p["step"] == step and not p["passed"]]
    earlier = [t for r in rows if r.get("step") is not None and r["step"] < step for t in r["tensors"]]
    if not changed or not earlier or not all(t["passed"] for t in earlier):
        return origin
    recorded = sum(1 for p in params.get("param", []) if p["step"] == step)
    first = changed[0]
    more = f" and {len(changed) - 1} more of the {recorded} parameters" if len(changed) > 1 else ""
    return {**origin, "module": first["module"], "where": "update", "tensor": None, "param_diffs": changed, "type": None,
            "call": None, "between": [None, None], "op": None, "hparam_diff": {}, "class_diff": None,
            "chain": [first["module"] or "<root>"],
            "description": f"the update before step {step + 1}: {first['name']}{more} differ at its start, though "
                           f"everything before agrees (the forward, gradients and parameters of step {step}): they "
                           "changed differently between the steps, outside the model's calls: the optimizer's update "
                           "(learning rate, betas, epsilon, weight decay, gradient clipping or scaling) or code that "
                           "sets weights between steps"}
