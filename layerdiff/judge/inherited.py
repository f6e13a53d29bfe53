"""Error inherited through a change of precision: a tensor over its tolerance whose error its inputs already carry.

Against a run in another precision (float32 against bfloat16 weights, or autocast), every tensor differs by the
rounding of the less precise run, and that error travels: each tensor carries its inputs' and adds its own. A
tensor's own tolerance does not know what it was given. A norm whose input used 90% of bfloat16's allowance comes
out at 117% of it with no fault of its own (Gemma2's post-feedforward norm), and a gradient w.r.t. a bias, the sum of
its output gradient's rows, is judged by its angle where that gradient, all within the absolute tolerance of zero,
was not (OPT's fc1: both at cosine 0.9986). Each was named the origin of a divergence no module made.

The measure is the relative error ``|A - B| / |A|`` (``rel_l2``), which does not depend on scale and sees an error
that turns a tensor as well as one that scales it. Under a change of precision a tensor over its tolerance still
agrees when its relative error is at most ``GROWTH`` times the largest among what it was computed from and agrees:
for a call's outputs, its inputs, its own parameters and what its children computed (in backward also the forward
activations and weights that the gradients are computed with); for a call's inputs, which come from code before
it, any tensor of the phase complete before the call began. A defect adds an error of its own (SiLU swapped for
GELU in a bfloat16 Llama: about 17x what its input carries); the inherited ones above carry about 1x, and the most
measured is 3.8x (the input gradient of OLMo2's ``rsqrt`` under autocast: a gradient weighs most the rows whose
variance is smallest, and rounded least precisely). A defect whose own error is within 4x the rounding it is given
is below what a comparison in the lower precision can tell: compare in one precision for it.

Not inherited: the model's own outputs (its logits, its loss: the parity the user checks, judged by their
tolerance; where they fail while nothing inside is at fault, ``accumulated`` says so); anything after the first
tensor that fails on its own, in forward, and all of backward then (a defect's error travels on as rounding does,
and what follows it is its consequence); tensors compared by statistics only (``stats`` traces: no ``rel_l2``).

Pure functions over judged rows."""
from __future__ import annotations

import bisect
import math
from typing import Any, Iterable, Mapping

from layerdiff import schema
from layerdiff.schema import IN_ROLES

GROWTH = 4.0  # how many times the relative error of what it was computed from a tensor may carry
_GRADIENTS = ("grad_output", "grad_input", "param_grad")


def relative_error(tensor: Mapping[str, Any]) -> float | None:
    """|A - B| / |A| of a compared tensor, L2 norms (``rel_l2``; None where its values were not compared): the
    error's size relative to the reference's, whether it turns the tensor or scales it."""
    value = (tensor.get("metrics") or {}).get("rel_l2")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def _largest(tensors: Iterable[Mapping[str, Any]]) -> float:
    """The largest relative error among the tensors that agree: an error that is a defect's (a tensor over
    tolerance that did not inherit it) is no rounding for others to inherit."""
    return max((e for t in tensors if t["passed"] and (e := relative_error(t)) is not None), default=0.0)


def _inherited(tensor: schema.TensorResult, carried: float) -> schema.TensorResult:
    """``tensor`` judged again: agreeing, with why, when over its tolerance by no more error than it carries."""
    if tensor["passed"] or tensor["metrics"].get("mismatch") or tensor["metrics"].get("nonfinite_mismatch"):
        return tensor
    own = relative_error(tensor)
    if own is None or carried <= 0.0 or own > GROWTH * carried:
        return tensor
    growth = own / carried
    return {**tensor, "passed": True, "inherited": {"growth": growth, "over": tensor["reason"]},
            "reason": f"{tensor['reason']}, but {growth:.2g}x the error of what it was computed from (inherited "
                      "through the change of precision)"}


def _accumulated(tensor: schema.TensorResult, carried: float) -> schema.TensorResult:
    """The model's own output, over its tolerance: still failing, but marked where its error is no more than it was
    computed from carries (``accumulated``: rounding grown through the whole model, no call's fault)."""
    again = _inherited(tensor, carried)
    if again is tensor:
        return tensor
    return {**tensor, "accumulated": again["inherited"]}


def inherit(rows: list[schema.Row]) -> list[schema.Row]:
    """``rows`` (judged, under a change of precision) with each tensor over tolerance that inherited its error
    judged agreeing (see the module docstring); parameter values are left as judged."""
    params: dict[tuple, float] = {}  # (module, step) -> the largest relative error among its weights' values
    for row in rows:
        if row["kind"] == "param":
            key = (row.get("module"), row.get("step"))
            params[key] = max(params.get(key, 0.0), _largest(row["tensors"]))
    judged: dict[int, schema.Row] = {}
    defect_at: float | None = None  # where (the end counter) the first tensor failed on its own, in forward
    forward: dict[tuple, float] = {}  # a call or operation -> the largest relative error among its forward tensors
    backward: dict[tuple, float] = {}  # (module, step) -> what its backward calls' outputs were computed from
    for phase in ("forward", "backward"):
        calls = [r for r in rows if r["kind"] in ("call", "op") and r["phase"] == phase]
        inside = _inside(sorted(calls, key=lambda r: r.get("begin", 0)))
        floor = max(params.values(), default=0.0)
        if phase == "backward":
            floor = max(floor, max(forward.values(), default=0.0))
        ends: list[float] = []
        carried_by: list[float] = []  # the largest relative error among the rows that ended so far, in the order they ended
        # in the order they ended: a call's children are judged before it, and so is all that ended before it began
        for row in sorted(calls, key=lambda r: r.get("end", 0)):
            if defect_at is not None:  # after a defect: its consequences, judged by their tolerance
                judged[id(row)] = row
                continue
            done = bisect.bisect_left(ends, row.get("begin", 0))
            before = max(floor, carried_by[done - 1] if done else 0.0)
            ins = [t for t in row["tensors"] if t["role"] in IN_ROLES[phase]]
            inputs = [_inherited(t, before) for t in ins]
            carried = max(_largest(inputs), params.get((row["path"], row.get("step")), 0.0),
                          max((_largest(judged[id(c)]["tensors"]) for c in inside.get(id(row), ())
                               if id(c) in judged), default=0.0))
            if phase == "backward":
                carried = max(carried, forward.get(_call(row), 0.0))
                key = (row["path"], row.get("step"))
                backward[key] = max(backward.get(key, 0.0), carried)
            root_output = row.get("parent") is None and row["kind"] == "call" and phase == "forward"
            given = iter(inputs)
            tensors = [next(given) if t["role"] in IN_ROLES[phase] else _accumulated(t, carried) if root_output
                       else _inherited(t, carried) for t in row["tensors"]]
            done_row: schema.Row = {**row, "tensors": tensors}
            judged[id(row)] = done_row
            if any(not t["passed"] and not t.get("accumulated") for t in tensors):
                defect_at = row.get("end", 0)
            if phase == "forward":
                forward[_call(row)] = _largest(tensors)
            ends.append(row.get("end", 0))
            carried_by.append(max(carried_by[-1] if carried_by else 0.0, _largest(done_row["tensors"])))
    if defect_at is not None:
        return [judged.get(id(row), row) for row in rows]
    for row in rows:  # a weight's gradient in each use, from what that use's backward was computed from
        if row["kind"] == "param_grad_use":
            carried = backward.get((row.get("module"), row.get("step")), 0.0)
            judged[id(row)] = {**row, "tensors": [_inherited(t, carried) for t in row["tensors"]]}
    uses: dict[tuple, float] = {}  # (a tied weight's name, step) -> the largest relative error among its uses' gradients
    for row in rows:
        if row["kind"] == "param_grad_use":
            key = (row["path"], row.get("step"))
            uses[key] = max(uses.get(key, 0.0), _largest(judged[id(row)]["tensors"]))
    for row in rows:  # a weight's whole gradient, from its module's backward, or, tied, from each of its users'
        if row["kind"] == "param_grad":
            names = row.get("tied") or [row["path"]]
            carried = max([backward.get((row.get("module"), row.get("step")), 0.0),
                           *(backward.get((name.rpartition(".")[0], row.get("step")), 0.0) for name in names),
                           *(uses.get((name, row.get("step")), 0.0) for name in names)])
            judged[id(row)] = {**row, "tensors": [_inherited(t, carried) for t in row["tensors"]]}
    return [judged.get(id(row), row) for row in rows]


def _call(row: schema.Row) -> tuple:
    """A call (or an operation inside one) of a step, the same in forward and backward."""
    op = row.get("op") if row["kind"] == "op" else None
    return row["path"], row["call"], row.get("step"), op["index"] if op else None


def _inside(calls: list[schema.Row]) -> dict[int, list[schema.Row]]:
    """id(call row) -> the rows that ran within it (its children and their operations, at any depth)."""
    out: dict[int, list[schema.Row]] = {}
    open_rows: list[schema.Row] = []
    for row in calls:
        while open_rows and open_rows[-1].get("end", 0) < row.get("begin", 0):
            open_rows.pop()
        for outer in open_rows:
            out.setdefault(id(outer), []).append(row)
        open_rows.append(row)
    return out
