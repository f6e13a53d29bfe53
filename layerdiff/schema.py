"""The shapes of layerdiff's JSON report, declared once: compared tensors, report rows and the report (a trace's
records are declared in ``tracefile/records.py``).

These are ``TypedDict``s, not classes with behaviour: a report row *is* the JSON object people script against
(``report["forward"]["first_divergence"]["module"]``), so the declared type and the wire format are the same
thing, with no conversion layer to keep in step. Type checkers read the
declarations; ``problem`` checks a value against one at run time (a report read back from a file), and
``dumps`` / ``loads`` are the one JSON (de)serializer (non-finite numbers as "nan", "inf", "-inf").

Keys not declared here are allowed (a newer layerdiff may add some); a key that is declared must have its type.
Adding a key is compatible; renaming or retyping one bumps ``REPORT_VERSION``.
"""
import functools
import json
import math
import typing
from typing import Annotated, Any, Dict, List, Literal, Optional, TypedDict, Union

import orjson

REPORT_VERSION = 1


# The leaves of the declarations: what a type checker reads as int, float and list, and ``problem`` checks more
# closely at run time (the string in ``Annotated`` says how)
Int64 = Annotated[int, "int64"]  # an integer within int64 (JSON's true/false are not integers)
Count = Annotated[int, "count"]  # a non-negative Int64: an index, a size, a position in a file
Number = Annotated[float, "number"]  # an int64 or a float: what arithmetic and "{:.3g}" accept
CallRef = Annotated[list, "call_ref"]  # [module path, call index]: a call's parent or ancestor
ParentRef = Annotated[list, "parent_ref"]  # a CallRef, or [] (a root call)


Phase = Literal["forward", "backward"]
# A call's inputs and outputs in each phase: backward takes the gradient w.r.t. the outputs and gives those w.r.t.
# the inputs and the module's own parameters
IN_ROLES = {"forward": ("input",), "backward": ("grad_output",)}
OUT_ROLES = {"forward": ("output",), "backward": ("grad_input", "param_grad")}


# -- comparison: one row per matched record, one tensor result per matched tensor pair ----------------------
class Metrics(TypedDict, total=False):
    """How two tensors differ, before any judgement (``layerdiff report`` re-judges these)."""
    basis: str  # data (values), stats (statistics only), shape (not comparable), declared
    identical: bool
    max_abs: Optional[Number]
    mean_abs: Optional[Number]
    max_rel: Optional[Number]
    cosine: Optional[Number]
    rel_l2: Number  # values: |A - B| / |A| (L2 norms), the error's size relative to the reference's, in any direction
    ref_max_abs: Optional[Number]
    numel: Int64
    mismatch: Any  # why the pair could not be compared (shape, dtype, one side absent)
    nonfinite_mismatch: Any
    l2_rel: Number  # statistics only: relative difference of the L2 norms
    note: str  # how the pair was compared: transposed, a part of a fused tensor, ...
    matched_by: str
    ranks: Dict[str, Any]  # per-rank metrics ("0", "1", ...) and "sum" of a run spread over ranks
    microbatches: Dict[str, Any]  # per-microbatch metrics ("0", "1", ...) of a step whose microbatches were joined
    damaged: str  # a side's stored bytes do not match their checksum: compared by statistics instead
    zero_mismatch: Int64  # values: positions zero in one run only (a mask that chose otherwise); absent when none
    rel_l2_elsewhere: Number  # values: ``rel_l2`` over the other positions (present with ``zero_mismatch``)
    own_error: Dict[str, Number]  # an output: each run's ("a", "b") against its operation replayed in float64 from
    # that run's own input, relative L2 (``compare.replayed``: a softmax, exp, sigmoid)


class Tolerance(TypedDict, total=False):
    atol: Number
    rtol: Number
    cos: Optional[Number]


class _TensorResultKeys(TypedDict):
    role: str
    key: str
    dtype_a: Optional[str]
    dtype_b: Optional[str]
    metrics: Metrics


class _InheritedKeys(TypedDict):
    growth: Number
    over: str


class Inherited(_InheritedKeys, total=False):
    """Under a change of precision, a tensor over its tolerance judged agreeing: its relative error is ``growth``
    times the largest among what it was computed from (``judge.inherited``); ``over``: how it was over;
    ``replayed``: each run computes it from its own input as its operation does (``Metrics.own_error``), so the
    error it grew is its input's, amplified, not its own."""
    replayed: bool


class TensorResult(_TensorResultKeys, total=False):
    """A tensor pair of a row: measured (``metrics``), then judged (``passed``, ``reason``, ``tolerance``)."""
    shape_a: List[Int64]
    shape_b: List[Int64]
    key_b: str  # B's key, where it differs
    nonfinite_a: Int64
    nonfinite_b: Int64
    value_a: Optional[Number]  # a one-element tensor (the loss): its value, shown step by step
    value_b: Optional[Number]
    passed: bool
    reason: str
    tolerance: Tolerance
    ranks: Optional[List[Int64]]  # the ranks whose shard or copy is off, or the only ranks that ran the module
    hint: str
    one_sided: bool
    inherited: Inherited  # over its tolerance, with no more error than it was computed from (a precision change)
    accumulated: Inherited  # the model's own output over its tolerance, with no more error than it was computed from


class _RowKeys(TypedDict):
    kind: str
    phase: Optional[Phase]
    path: str
    call: Int64
    step: Int64
    begin: Number
    end: Number
    parent: Optional[ParentRef]
    tensors: List[TensorResult]


class ProducerRef(TypedDict, total=False):
    """Where a tensor an operation took came from, in its module call's code (``tracefile.records.Producer``)."""
    kind: str  # op, input, call, param, buffer, outer, unknown
    index: Int64
    key: str
    path: str
    call: Int64
    name: str


class _OpInfoKeys(TypedDict):
    index: Int64
    name: str
    kind: str


class OpInfo(_OpInfoKeys, total=False):
    """One run's operation of an "op" row: the ``index``-th of its module call, ``name`` as the code called it,
    ``kind`` framework-neutral, the line of model code (``source`` "FILE:LINE", in ``function``), its non-tensor
    ``args`` and where each tensor input came from (``producers``)."""
    source: Optional[str]
    function: Optional[str]
    args: Dict[str, Any]
    producers: Dict[str, ProducerRef]
    in_place: bool


class _OpsSummaryKeys(TypedDict):
    a: Int64
    b: Int64
    only_a: List[Any]
    only_b: List[Any]


class OpsSummary(_OpsSummaryKeys, total=False):
    """A module call's operations, recorded by both runs: how many each ran, and those without a counterpart
    ([index, name, source]; casts and views one side adds are usual). ``gradient_changed`` ({"a": [...], "b":
    [...]}, [index, name, source, function] each): those among them that pass their values through unchanged but
    not their gradient (a wrong hand-written backward), where there are any."""
    gradient_changed: Dict[str, List[Any]]
    unmatched_inside: Dict[str, List[str]]  # per run: modules with no counterpart, their operations the call's own
    not_in_run: List[str]  # runs ("a", "b") whose call recorded operations that the run read holds none of


class OpsNotCompared(TypedDict, total=False):
    """Why operations recorded in a module's own code were not compared where the origin is that code: ``side``'s
    ("a" or "b") run holds none of them (``why`` "not_in_run": a run of several ranks that split the module's work
    keeps them per rank); ``without_counterpart``: how many of the other run's operations there found none."""
    side: str
    why: str
    without_counterpart: Int64


class Row(_RowKeys, total=False):
    """One matched record: A's call or parameter and B's counterpart (``path_b``: ``"X + Y"`` for a fused
    module); ``only_a``/``only_b`` its tensors without a partner."""
    path_b: Optional[str]
    type_a: Optional[str]
    type_b: Optional[str]
    family_a: Optional[str]
    family_b: Optional[str]
    ancestors: Optional[List[CallRef]]
    module: Optional[str]
    hparams_a: Optional[Dict[str, Any]]
    hparams_b: Optional[Dict[str, Any]]
    error_a: Optional[str]
    error_b: Optional[str]
    only_a: Optional[List[str]]
    only_b: Optional[List[str]]
    tied: Optional[List[str]]
    skipped: List[str]
    op: OpInfo  # kind "op": A's operation (path and call are its module call's)
    op_b: OpInfo  # ... and B's
    ops: OpsSummary  # a module call whose operations both runs recorded
    ops_gradient_changed: Dict[str, List[Any]]  # backward: ``OpsSummary.gradient_changed`` of the call, if any
    args_diff: Dict[str, Any]  # an operation's row: the non-tensor arguments the runs set differently
    held_a: List[Int64]  # the only ranks of run A that ran this module (a pipeline stage, an expert's rank)
    held_b: List[Int64]  # ... of run B
    inputs_inside: str  # B's module that computes this call's inputs inside itself and does not record them
    dropped: List[str]  # of only_a/only_b, the inputs its caller got in both runs: handed on in one run only


# -- the report --------------------------------------------------------------------------------------------
class Failure(TypedDict, total=False):
    module: Optional[str]
    call: Optional[Int64]
    error: Optional[str]
    module_stack: List[Optional[str]]


class _RunSummaryKeys(TypedDict):
    path: str


class RunSummary(_RunSummaryKeys, total=False):
    """One run of the pair ("a" is the reference): what the header lines and the trust check read."""
    framework: Optional[str]
    framework_version: Optional[str]
    model_class: Optional[str]
    mode: Optional[str]
    records: Int64
    complete: bool
    status: Optional[str]
    failure: Optional[Failure]
    warnings: List[Any]
    target: Optional[str]
    target_args: Optional[Dict[str, Any]]
    param_dtypes: Optional[List[Any]]
    autocast_dtypes: List[str]  # what automatic mixed precision computed in (torch.autocast): empty when off
    devices: Optional[List[Any]]
    damage: List[str]  # what was written whole and reads otherwise: index lines, metadata, tensor bytes
    unverified: Int64  # records without a checksum (a trace written before checksums): not verified


class _ShortRecordKeys(TypedDict):
    path: str


class ShortRecord(_ShortRecordKeys, total=False):
    """A record of one run without a counterpart in the other."""
    kind: str
    phase: Optional[Phase]
    call: Int64


class _NonfiniteOriginKeys(TypedDict):
    module: Any
    phase: Any
    tensor: Any
    nan: Any
    inf: Any


class NonfiniteOp(TypedDict, total=False):
    """The operation, inside the call, whose inputs are finite and whose output holds NaN or Inf (``--ops``)."""
    name: str
    kind: str
    index: Int64
    source: Optional[str]
    function: Optional[str]
    tensor: str


class NonfiniteOrigin(_NonfiniteOriginKeys, total=False):
    """The first call whose inputs are finite and whose outputs (or input gradients) hold NaN or Inf."""
    call: Int64
    op: Optional[NonfiniteOp]  # with operations recorded: the one where it was born


class FirstNonfinite(TypedDict):
    """Where each run first produced NaN or Inf (None: it never did)."""
    a: Optional[NonfiniteOrigin]
    b: Optional[NonfiniteOrigin]


class _ModuleMatchKeys(TypedDict):
    a: str
    b: str
    confidence: Number
    reason: Any  # the evidence


class ModuleMatch(_ModuleMatchKeys, total=False):
    rule: Optional[str]
    a_parts: Optional[List[str]]
    b_parts: Optional[List[str]]
    inside: Optional[str]  # B's module that runs ``b`` inside itself (a Linear that applies its activation)


class Unmatched(TypedDict, total=False):
    a: Optional[List[str]]
    b: Optional[List[str]]


class OriginTensor(TypedDict, total=False):
    """The origin's first failing tensor: which one, why, and its metrics (for a module whose parameter differs and
    whose output moved within tolerance, before the code that carried it over: that output, and why it is named)."""
    role: str
    key: str
    reason: str
    metrics: Metrics
    within_tolerance: bool  # present (true) where that output is within its tolerance: named for its weight


class OriginOp(TypedDict, total=False):
    """The operation a divergence starts at (``ops`` tracing): A's ``name``, ``kind``, ``index`` in its module
    call, ``source`` ("FILE:LINE") and ``function``; the non-tensor arguments the runs set differently (``args_diff``: {argument: [A, B]}); the ``metrics`` of its first
    failing tensor; B's counterpart (``name_b``, ``index_b``, ``source_b``, ``function_b``).
    ``wrong_input``: the operation's inputs differ while what made them agrees: the code passed it another tensor;
    ``unknown_maker``: that input was made where nothing was recorded (so nothing says what made it agrees)."""
    name: str
    kind: str
    index: Optional[Int64]  # None: an operation only B runs (``only_b``)
    source: Optional[str]
    function: Optional[str]
    args_diff: Dict[str, Any]
    metrics: Optional[Metrics]
    name_b: Optional[str]
    index_b: Optional[Int64]
    source_b: Optional[str]
    function_b: Optional[str]
    wrong_input: bool
    unknown_maker: bool
    dtype_diff: List[Optional[str]]
    only_a: List[Any]
    only_b: List[Any]


class Origin(TypedDict, total=False):
    """Where a divergence starts: a call whose inputs agree and whose outputs do not (``where``: module,
    own_code, inputs, forward = inherited from forward, raised, param_grad, update = the parameters a step
    begins with differ while every earlier step agrees: the optimizer's update; with ``ops`` tracing also op, an
    operation inside ``module``'s own code, and op_input, a tensor the code passed to an operation)."""
    module: Optional[str]
    call: Optional[Int64]
    step: Int64
    type: Optional[str]
    where: str
    between: List[Any]
    description: str
    tensor: Optional[OriginTensor]
    ranks: Optional[List[Int64]]
    hint: Optional[str]
    hparam_diff: Dict[str, Any]
    param_diffs: List[Any]
    error: Optional[str]
    class_diff: Optional[List[Optional[str]]]
    chain: List[str]
    phase: Phase
    path_b: Optional[str]
    unpaired: Dict[str, List[str]]  # the origin's tensors without a partner, per run
    backward_candidate: str  # an inherited backward origin: what the backward descent alone would name
    op: Optional[OriginOp]  # ``ops`` tracing: the operation inside ``module``'s own code where it starts
    ops_not_compared: List[OpsNotCompared]  # ``ops`` tracing, origin in own code and no operation named: why


class PhaseResult(TypedDict, total=False):
    present: bool
    status: Literal["aligned", "divergent", "failed", "absent"]
    failing_tensors: Int64
    first_divergence: Optional[Origin]
    first_over_tolerance: Optional[Dict[str, Any]]
    inherited_tensors: Int64  # over tolerance but judged agreeing: error inherited through a change of precision
    failure: Optional[Failure]
    failure_a: Optional[Failure]


class NotCompared(TypedDict):
    """A tensor pair whose comparison tasks failed on a Dask cluster after their retries."""
    phase: Optional[str]
    path: str
    call: Int64
    tensor: str
    reason: str


class _RecomputedCallKeys(TypedDict):
    path: str
    call: Count
    step: Count
    tensor: str
    max_abs: Number
    basis: str  # data (stored values) or stats
    inputs_agree: bool  # its inputs were the forward's: the recomputation departs here


class RecomputedCall(_RecomputedCallKeys, total=False):
    """A call that activation checkpointing recomputed in backward with another output than its forward gave."""
    rank: Int64  # in a run of ranks: the rank (file) that recomputed it


class _RecomputeCheckKeys(TypedDict):
    calls: Count  # recomputed calls in the trace
    compared: Count  # of those, matched to their forward call and compared
    differ: List[RecomputedCall]  # in the order they ran: the first is where the recomputation departs


class RecomputeCheck(_RecomputeCheckKeys, total=False):
    """A trace's recomputed calls against the forward calls they replay (``compare.recompute``)."""
    damaged: List[str]  # stored bytes that do not match their checksum: those tensors compared by statistics


class _TrustKeys(TypedDict):
    ok: bool
    problems: List[str]


class Trust(_TrustKeys, total=False):
    """Why an "aligned" verdict could still be wrong (``problems``: exit 3), and what was not checked but does not
    make it wrong (``notes``: a trace written before checksums cannot be verified)."""
    notes: List[str]


class _ReportKeys(TypedDict):
    report_version: Int64
    a: RunSummary
    b: RunSummary
    records: List[Row]
    only_a: List[ShortRecord]
    only_b: List[ShortRecord]
    first_nonfinite: FirstNonfinite


class Report(_ReportKeys, total=False):
    """``layerdiff align --json``. ``measure`` fills the measured part; ``evaluate`` adds the judged part
    (``forward``, ``backward``, ``verdict``, ``trust``, ``params``, ``growth``, ``tolerances``)."""
    basis: str  # data, stats, mixed, none
    structure: Literal["same_model", "ported"]
    phases: Dict[str, Dict[str, Any]]
    same_file: bool
    map: List[Any]
    layouts: List[Any]
    rules: List[Any]
    mapping: Optional[List[ModuleMatch]]
    unmatched_modules: Optional[Unmatched]
    settings: Optional[Dict[str, Any]]
    config_diff: Optional[List[Dict[str, Any]]]
    not_compared: List[NotCompared]
    recompute: Dict[str, Optional[RecomputeCheck]]  # "a", "b": None for a trace that recomputed nothing
    forward: PhaseResult
    backward: PhaseResult
    verdict: Literal["aligned", "divergent"]
    trust: Trust
    next_pass: Optional[Dict[str, Any]]
    tolerances: Any
    params: Dict[str, Any]
    growth: List[Dict[str, Any]]


# -- checking a value against a declaration -----------------------------------------------------------------
def _is_int(x) -> bool:
    return type(x) is int and -(1 << 63) <= x < (1 << 63)


def _is_count(x) -> bool:
    return _is_int(x) and x >= 0


def _is_call_ref(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _is_count(x[1])


_LEAVES = {
    Int64: (_is_int, "an integer"),
    Count: (_is_count, "a non-negative integer"),
    Number: (lambda x: type(x) is float or _is_int(x), "a number"),
    CallRef: (_is_call_ref, "[path, call]"),
    ParentRef: (lambda x: x == [] or _is_call_ref(x), "[path, call] or []"),
    str: (lambda x: isinstance(x, str), "a string"),
    bool: (lambda x: type(x) is bool, "true or false"),
    dict: (lambda x: isinstance(x, dict), "an object"),
    list: (lambda x: isinstance(x, list), "a list"),
    type(None): (lambda x: x is None, "null"),
    Any: (lambda x: True, "anything"),
}


def _is_typeddict(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def _name(tp) -> str:
    if tp in _LEAVES:
        return _LEAVES[tp][1]
    if _is_typeddict(tp):
        return "an object"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:  # "a number or null", each alternative once, null last
        names = dict.fromkeys(n for a in args for n in _name(a).split(" or "))
        return " or ".join([n for n in names if n != "null"] + ["null"] * ("null" in names))
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    return _LEAVES.get(origin, (None, "a value"))[1]


# A checker takes a value and returns None, or (the place below it as a list of path parts, reversed; what is
# wrong). Places are spelled out only on failure: a report of 100k tensors is checked at a few us per tensor.
@functools.lru_cache(maxsize=None)
def _checker(tp):
    """The checking function of one declared type, built once per type."""
    if _is_typeddict(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        fields = [(key, _checker(hint)) for key, hint in hints.items()]
        required = [k for k in hints if k in tp.__required_keys__]

        def check_object(value):
            if not isinstance(value, dict):
                return [], "is not an object"
            for key in required:
                if key not in value:
                    return [], f"has no {key}"
            for key, check in fields:
                if key in value:
                    found = check(value[key])
                    if found:
                        found[0].append(f".{key}")
                        return found
            return None
        return check_object
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    message = f"is not {_name(tp)}"
    if origin is Union:
        alternatives = [_checker(a) for a in args]
        return lambda value: None if any(check(value) is None for check in alternatives) else ([], message)
    if origin is Literal:
        allowed = args
        return lambda value: None if isinstance(value, str) and value in allowed else ([], message)
    if origin in (list, dict):
        item_check = _checker(args[-1])

        def check_container(value):
            if not isinstance(value, origin):
                return [], message
            for key, item in (value.items() if origin is dict else enumerate(value)):
                found = item_check(item)
                if found:
                    found[0].append(f".{key}" if origin is dict else f"[{key}]")
                    return found
            return None
        return check_container
    test = _LEAVES[tp][0]
    return lambda value: None if test(value) else ([], message)


def problem(value, schema, where: str = "value") -> Optional[str]:
    """What is wrong with ``value`` as a ``schema`` (a declaration above), as one line naming the place
    (``records[3].tensors[0].metrics.max_abs is not a number``); None when nothing is."""
    found = _checker(schema)(value)
    if found is None:
        return None
    parts, message = found
    return f"{where}{''.join(reversed(parts))} {message}"


# -- JSON --------------------------------------------------------------------------------------------------
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def json_safe(obj):
    """``obj`` with non-finite floats as the strings "nan", "inf", "-inf" (strict JSON has no such numbers)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def from_json_safe(obj):
    """The inverse of ``json_safe``: "nan", "inf", "-inf" strings back to floats."""
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: from_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_safe(v) for v in obj]
    return obj


def dumps(obj) -> str:
    """Standard JSON text of a report (or any of the values declared here), indented.

    orjson writes it (a 0.5B model's 2 MB report: 0.4 s with ``json``, a tenth of its align); ``json`` takes what
    orjson refuses (integers beyond 64 bits, keys that are not strings, unknown types: those then fail as they
    always did). Either text parses to the same values."""
    safe = json_safe(obj)
    try:
        return orjson.dumps(safe, option=orjson.OPT_INDENT_2).decode()
    except TypeError:
        return json.dumps(safe, indent=1)


def loads(text: str):
    """Parsed JSON with non-finite numbers restored (no checking: see ``problem``)."""
    return from_json_safe(json.loads(text))
