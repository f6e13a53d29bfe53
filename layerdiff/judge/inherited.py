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
from layerdiff.compare.tolerance import dtype_class
from layerdiff.schema import IN_ROLES

GROWTH = 4.0  # how many times the relative error of what it was computed from a tensor may carry
# a tensor within its tolerance passes on its error to what is computed from it where that error is at most this
# many times what it was computed from: a tensor near zero passes by the absolute tolerance whatever its relative
# error; the gradient through a ReLU, whose mask flips where its input rounds across zero, measured 10x that (OPT's,
# in bfloat16), while a tiny MLP output scaled by 1.25, a defect that passes its tolerance, is 30x
PASSED_GROWTH = 16.0


def computes_as_replayed(tensor: Mapping[str, Any]) -> bool | None:
    """Whether each run computed this output from its own input as the reference's operation does (``own_error``:
    replayed in float64, within ``GROWTH`` roundings of that run's dtype); None where it was not replayed."""
    errors = (tensor.get("metrics") or {}).get("own_error")
    if not errors:
        return None
    return all(isinstance(errors.get(side), (int, float)) and
               errors[side] <= GROWTH * UNIT_ROUNDOFF.get(str(tensor.get(f"dtype_{side}")), 0.0)
               for side in ("a", "b"))


def _mask_flips(metrics: Mapping[str, Any], carried: float) -> float | None:
    """The relative error of a tensor away from the positions that are zero in one run only (``zero_mismatch``),
    where those are few enough to be a mask's flips that rounding explains, and that error is inherited; else None.
    A value within its error of zero rounds across it; for values spread smoothly around zero, their share is of
    the order of the relative error carried, so at most ``GROWTH`` times it may flip (OPT's ReLU in bfloat16: 2
    positions of 768, 0.26%, against 0.45% carried; its input gradient 13x the error it was given, 1.0x elsewhere)."""
    flips, numel, elsewhere = metrics.get("zero_mismatch"), metrics.get("numel"), metrics.get("rel_l2_elsewhere")
    if not flips or not numel or not isinstance(elsewhere, (int, float)) or not math.isfinite(elsewhere):
        return None
    return float(elsewhere) if flips / numel <= GROWTH * carried and elsewhere <= GROWTH * carried else None


def relative_l2(tensor: Mapping[str, Any]) -> float | None:
    """|A - B| / |A| of a compared tensor, L2 norms (``rel_l2``; None where its values were not compared): the
    error's size relative to the reference's, whether it turns the tensor or scales it."""
    value = (tensor.get("metrics") or {}).get("rel_l2")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


# a dtype's unit roundoff: the relative error one rounding gives, what a value computed from exact inputs carries
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "float8": 2.0 ** -3}


class _Carried:
    """Each judged tensor's error as others may inherit it (``effective``, by the identity of its judged dict): its
    relative error where that is explained by rounding, none where it is a defect's. A tensor over tolerance is
    explained when it is inherited; one within tolerance when its error is within ``PASSED_GROWTH`` of what it was
    computed from (a tiny MLP output scaled by 1.25 passes by the absolute tolerance, and its 25% is no rounding to
    inherit)."""

    def __init__(self, floor: float):
        self.floor = floor  # one rounding of the lower precision: what any computed value may carry
        self.effective: dict[int, float] = {}

    def largest(self, tensors: Iterable[Mapping[str, Any]]) -> float:
        return max((self.effective.get(id(t), 0.0) for t in tensors), default=0.0)

    def judge(self, tensor: schema.TensorResult, carried: float, may_inherit: bool = True) -> schema.TensorResult:
        """``tensor`` judged again against the error ``carried`` by what it was computed from (``may_inherit``:
        False for the model's own outputs, marked ``accumulated`` instead)."""
        own = relative_l2(tensor)
        base = max(carried, self.floor)
        metrics = tensor["metrics"]
        comparable = own is not None and not (metrics.get("mismatch") or metrics.get("nonfinite_mismatch"))
        flipped = _mask_flips(metrics, base) if dtype_class(tensor.get("dtype_a"), tensor.get("dtype_b")) != "exact" \
            else None  # integers that differ are a choice, not a mask (``tree.DISCRETE_HINT``)
        growth = own / base if own is not None else math.inf
        replayed = computes_as_replayed(tensor) is True
        explained = comparable and (growth <= GROWTH or flipped is not None or replayed)
        out = tensor
        if not tensor["passed"] and explained and own is not None:
            amplified = growth > GROWTH and replayed  # its input's error, which its operation amplifies
            if amplified:
                errors = metrics.get("own_error") or {}
                how = (f"each run computes it from its own input as the operation does (replayed in float64: "
                       f"{errors.get('a', 0):.2g} and {errors.get('b', 0):.2g} off), so its error, "
                       f"{growth:.2g}x what it was computed from, is that input's, amplified")
            elif growth > GROWTH and flipped is not None:
                growth, how = flipped / base, (
                    f"it differs where one run holds zero and the other not ({metrics.get('zero_mismatch')} of "
                    f"{metrics.get('numel')} positions: a mask, as a ReLU's, that flips where its input rounds "
                    f"across zero), and elsewhere carries {flipped / base:.2g}x the error of what it was computed "
                    "from")
            else:
                how = f"{growth:.2g}x the error of what it was computed from"
            marked: schema.Inherited = {"growth": growth, "over": tensor["reason"]}
            if amplified:
                marked["replayed"] = True
            out = {**tensor, "accumulated": marked} if not may_inherit else {
                **tensor, "passed": True, "inherited": marked,
                "reason": f"{tensor['reason']}, but {how} (inherited through the change of precision)"}
        if own is not None and out["passed"] and own <= PASSED_GROWTH * base:
            self.effective[id(out)] = own
        return out


def inherit(rows: list[schema.Row], dtype: str) -> list[schema.Row]:
    """``rows`` (judged, under a change of precision to ``dtype``) with each tensor over tolerance that inherited
    its error judged agreeing (see the module docstring); parameter values are left as judged."""
    carry = _Carried(UNIT_ROUNDOFF.get(dtype, 0.0))
    params: dict[tuple, float] = {}  # (module, step) -> the largest error among its weights' values
    judged: dict[int, schema.Row] = {}
    for row in rows:
        if row["kind"] == "param":  # a weight: rounded once, or a defect where it fails
            tensors = [carry.judge(t, 0.0) if t["passed"] else t for t in row["tensors"]]
            judged[id(row)] = {**row, "tensors": tensors}
            key = (row.get("module"), row.get("step"))
            params[key] = max(params.get(key, 0.0), carry.largest(tensors))
    defect = False  # whether a tensor failed on its own: what follows is judged by its tolerance
    forward: dict[tuple, float] = {}  # a call or operation -> the largest error among its forward tensors
    backward: dict[tuple, float] = {}  # (module, step) -> what its backward calls' outputs were computed from
    for phase in ("forward", "backward"):
        calls = [r for r in rows if r["kind"] in ("call", "op") and r["phase"] == phase]
        inside = _inside(sorted(calls, key=lambda r: r.get("begin", 0)))
        floor = max(params.values(), default=0.0)
        if phase == "backward":
            floor = max(floor, max(forward.values(), default=0.0))
        ends: list[float] = []
        carried_by: list[float] = []  # the largest error among the rows that ended so far, in the order they ended
        # in the order they ended: a call's children are judged before it, and so is all that ended before it began
        defect_end: float | None = None  # where the call that holds this phase's first defect ended
        for row in sorted(calls, key=lambda r: r.get("end", 0)):
            if defect and (defect_end is None or row.get("begin", 0) > defect_end):
                continue  # after a defect: its consequences, judged by their tolerance
            done = bisect.bisect_left(ends, row.get("begin", 0))
            before = max(floor, carried_by[done - 1] if done else 0.0)
            inputs = {id(t): carry.judge(t, before) for t in row["tensors"] if t["role"] in IN_ROLES[phase]}
            if defect:  # a call around the defect: its inputs came before it, its outputs are the defect's doing
                judged[id(row)] = {**row, "tensors": [inputs.get(id(t), t) for t in row["tensors"]]}
                continue
            carried = max(carry.largest(inputs.values()), params.get((row["path"], row.get("step")), 0.0),
                          max((carry.largest(judged[id(c)]["tensors"]) for c in inside.get(id(row), ())
                               if id(c) in judged), default=0.0))
            if phase == "backward":
                carried = max(carried, forward.get(_call(row), 0.0))
                key = (row["path"], row.get("step"))
                backward[key] = max(backward.get(key, 0.0), carried)
            root_output = row.get("parent") is None and row["kind"] == "call" and phase == "forward"
            tensors = [inputs[id(t)] if id(t) in inputs else carry.judge(t, carried, may_inherit=not root_output)
                       for t in row["tensors"]]
            judged[id(row)] = {**row, "tensors": tensors}
            if any(not t["passed"] and not t.get("accumulated") for t in tensors):
                defect, defect_end = True, row.get("end", 0)
            if phase == "forward":
                forward[_call(row)] = carry.largest(tensors)
            ends.append(row.get("end", 0))
            carried_by.append(max(carried_by[-1] if carried_by else 0.0, carry.largest(tensors)))
    if not defect:
        _inherit_parameter_gradients(rows, carry, backward, judged)
    return [judged.get(id(row), row) for row in rows]


def _inherit_parameter_gradients(rows: list[schema.Row], carry: _Carried, backward: dict[tuple, float],
                                 judged: dict[int, schema.Row]) -> None:
    """A weight's gradient in each use, from what that use's backward was computed from; its whole gradient from its
    module's backward, or, tied, from each of its users' and their uses' gradients."""
    uses: dict[tuple, float] = {}  # (a tied weight's name, step) -> the largest error among its uses' gradients
    for row in rows:
        if row["kind"] == "param_grad_use":
            carried = _backward_of(backward, row.get("module"), row.get("step"))
            tensors = [carry.judge(t, carried) for t in row["tensors"]]
            judged[id(row)] = {**row, "tensors": tensors}
            key = (row["path"], row.get("step"))
            uses[key] = max(uses.get(key, 0.0), carry.largest(tensors))
    for row in rows:
        if row["kind"] == "param_grad":
            names = row.get("tied") or [row["path"]]
            carried = max([_backward_of(backward, row.get("module"), row.get("step")),
                           *(_backward_of(backward, name.rpartition(".")[0], row.get("step")) for name in names),
                           *(uses.get((name, row.get("step")), 0.0) for name in names)])
            judged[id(row)] = {**row, "tensors": [carry.judge(t, carried) for t in row["tensors"]]}


def _backward_of(backward: dict[tuple, float], module: str | None, step: object) -> float:
    """What the backward of ``module``'s calls in ``step`` was computed from; for a module that made no call, that
    of the nearest module around it that did: its weights were used by that module's own code (transformers'
    Mamba2 mixer convolves with its ``conv1d``'s weight itself, Gemma 3n's decoder layer calls its AltUp module's
    methods, not the module)."""
    path = module
    while path is not None:
        if (path, step) in backward:
            return backward[(path, step)]
        path = path.rpartition(".")[0] if path else None
    return 0.0


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
