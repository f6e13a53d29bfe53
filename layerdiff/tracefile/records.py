"""The records of a trace as typed objects: decoded once, at the reader, from the index's JSON lines.

One JSON line per record (docs/trace-format.md), told apart by ``kind``: a module call (``CallRecord``), an
operation that a module's own code ran (``OpRecord``, with ``ops`` tracing), a parameter's value, its gradient
after accumulation, or a tied weight's gradient per use (``ParamRecord`` and its two kinds), and the end of the
trace (``EndRecord``). ``msgspec`` decodes each line straight into these structs
and checks its types on the way (what ``tools/bench_decode.py`` measured against decoding to dicts and checking
them after); ``check`` adds what types alone do not say. Keys a newer layerdiff adds are skipped, never an error.

Records are frozen: a pass that needs another view of one (a run of ranks joined, a fused module's output) makes a
new one with ``msgspec.structs.replace``. ``msgspec.to_builtins(record)`` gives the dict of its JSON line back.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Optional, TypedDict, Union

import msgspec

from layerdiff.tracefile.checksums import count_blocks
from layerdiff.tracefile.tensors import FLOAT_DTYPES, storage_dtype

Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # an index, a size, a position in a file
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Number = Union[Int64, float]  # what arithmetic and "{:.3g}" accept
Phase = Literal["forward", "backward"]
PARAM_KINDS = ("param", "param_grad", "param_grad_use")
MICROBATCHES = "microbatches"  # ``Merge.over``: the parts are one step's microbatches, not ranks


class Stats(TypedDict, total=False):
    """Summary statistics of one tensor, kept in every mode: NaN and Inf are counted and left out of the rest
    (None when no finite value is left)."""
    numel: Int64
    min: Optional[Number]
    max: Optional[Number]
    mean: Optional[Number]
    l2: Optional[Number]
    nan: Int64
    inf: Int64


class Merge(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a tensor of a run of ranks was joined from each rank's part: concatenated on ``dim`` ("concat"; part
    by part, ``parts`` of them, "concat_parts"), one rank's copy ("replicate"), partial sums added ("sum"), or
    left per rank until compared with another run ("ranks"). ``ranks``: the rank each part comes from, in order
    (None: every rank of the run, 0 first). ``over``: what the parts are, ranks or the microbatches of one step
    (then "batches": joined along the batch axis, which the other run's shape decides)."""
    how: str
    dim: Optional[int] = None
    parts: Optional[int] = None
    ranks: Optional[tuple[int, ...]] = None
    over: str = "ranks"
    scale: Optional[float] = None  # "sum": the sum is scaled by this (a data-parallel mean: 1 / ranks)

    def rank_of(self, part: int) -> int:
        """The rank that holds the ``part``-th part."""
        return part if self.ranks is None else self.ranks[part]

    @property
    def axis(self) -> int:
        """The axis the shards are joined on ("concat", "concat_parts")."""
        if self.dim is None:
            raise ValueError(f"a {self.how!r} join has no axis")
        return self.dim

    @property
    def part_count(self) -> int:
        """How many parts each shard holds a slice of ("concat_parts")."""
        if self.parts is None:
            raise ValueError(f"a {self.how!r} join has no parts")
        return self.parts


# the role of a derived entry: the statistics of a module's output plus the bias it returned beside it (``(output,
# bias)``, a bias of the output's last size), recorded in statistics traces, where they cannot be derived from the
# two's; compared with another run's module that returns the sum (Megatron's linears against transformers')
OUTPUT_PLUS_BIAS = "output_plus_bias"


def bias_beside(output_shape: list[int], output_dtype: str, bias_shape: list[int], bias_dtype: str) -> bool:
    """Whether a call's second output is a bias of its first's last size, left for the caller to add (Megatron's
    ``(output, bias)``): what capture records their sum's statistics for and matching adds back."""
    return len(bias_shape) == 1 and bool(output_shape) and output_shape[-1] == bias_shape[0] and \
        output_dtype in FLOAT_DTYPES and bias_dtype in FLOAT_DTYPES


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tensor of a record: what it is (``role``: input, output, grad_output, grad_input, param, param_grad;
    ``key``: "args.0", "kwargs.hidden_states", "out.0", "value"), its dtype, shape and statistics, and where its
    bytes are (``offset``/``nbytes`` into /data, full mode only) and their ``checksums`` (one per
    ``checksums.CHECK_BLOCK`` bytes; format 3). ``placement``: how a distributed tensor is spread over ranks.
    ``merge`` and ``parts`` are never in a file: a run of ranks joined sets them."""
    role: str
    key: str
    dtype: str
    shape: list[Count]
    stats: Stats
    offset: Optional[Int64] = None  # a joined tensor of a run of ranks has a negative (virtual) offset
    nbytes: Optional[Count] = None
    checksums: Optional[list[str]] = None
    placement: Optional[dict[str, Any]] = None
    undefined: bool = False  # allocated and not yet written (``torch.empty_like``): its values are no evidence
    merge: Optional[Merge] = None
    parts: tuple[TensorEntry, ...] = ()

    @property
    def stored(self) -> bool:
        """Its values are in the trace (full mode), not only its statistics."""
        return self.offset is not None


class Producer(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a tensor that model code handed on came from, found by tensor identity inside the enclosing module
    call: ``op`` (an earlier operation of that call: ``index``, its output ``key``), ``input`` (the call's own
    input ``key``), ``call`` (a child module call ``path``/``call``: its output ``key``), ``param`` or ``buffer``
    (``name``), ``outer`` (a tensor of an enclosing call ``path``/``call``, reached without being passed in: an
    attribute or a closure), or ``unknown`` (made where nothing was recorded)."""
    kind: Literal["op", "input", "call", "param", "buffer", "outer", "unknown"]
    index: Optional[Count] = None
    key: Optional[str] = None
    path: Optional[str] = None
    call: Optional[Count] = None
    name: Optional[str] = None


class CallRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind", tag="call"):
    """One module call, forward or backward. ``begin``/``end`` order calls in time; ``parent`` is the enclosing
    call ([path, call]); ``arg_names`` name the positional arguments ("args.0" is "hidden_states")."""
    kind: ClassVar[str] = "call"
    # what a call record lacks of a parameter's, so that a pass reads any record the same way
    module: ClassVar[None] = None
    module_type: ClassVar[None] = None
    tied: ClassVar[None] = None
    phase: Phase
    path: str
    call: Count
    tensors: list[TensorEntry]
    step: Count = 0
    type: Optional[str] = None
    begin: Count = 0
    end: Count = 0
    parent: Optional[tuple[str, Count]] = None
    hparams: Optional[dict[str, Any]] = None
    scalars: Optional[dict[str, Any]] = None
    arg_names: Optional[list[str]] = None
    incomplete: bool = False
    error: Optional[str] = None
    ops: Optional[Count] = None  # operations recorded inside this call (``ops`` tracing); None: not recorded
    producers: Optional[dict[str, Producer]] = None  # inputs: in the caller's call; outputs: in this call
    micro: Optional[Count] = None  # the microbatch of a step run by a pipeline schedule (None: a step of one call)
    stage: Optional[Count] = None  # its pipeline stage, on a rank that runs several (``meta.parallel.pp_stages``)
    recompute: bool = False  # forward: activation checkpointing ran it again in backward (``capture.recompute``)
    absorbed: Optional[str] = None  # never in a file: a module of B read with a child it runs inside itself
    ranks_missing: Optional[list[int]] = None  # never in a file: ranks of a run that lack this record
    ranks_held: Optional[list[int]] = None  # never in a file: the only ranks of a run that ran it (a pipeline stage)

    @property
    def module_path(self) -> str:
        return self.path


class OpRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind", tag="op"):
    """One operation that a module's own code ran (a framework function, tensor method or operator, or a custom
    autograd function), forward or backward: the ``index``-th of module call ``path``/``call``. ``name`` is what
    the code called (``torch.matmul``, ``Tensor.mul``), ``op`` a framework-neutral kind (``matmul``); ``args`` its
    non-tensor arguments; ``producers`` where each tensor input came from; ``source`` the line of model code that
    called it (``FILE:LINE``, in ``function``). In backward, its tensors are the gradients w.r.t. its outputs
    (``grad_output``) and inputs (``grad_input``)."""
    kind: ClassVar[str] = "op"
    module: ClassVar[None] = None
    module_type: ClassVar[None] = None
    tied: ClassVar[None] = None
    hparams: ClassVar[None] = None
    arg_names: ClassVar[None] = None
    phase: Phase
    path: str
    call: Count
    index: Count
    name: str
    op: str
    tensors: list[TensorEntry]
    step: Count = 0
    begin: Count = 0
    end: Count = 0
    args: Optional[dict[str, Any]] = None
    producers: Optional[dict[str, Producer]] = None
    source: Optional[str] = None
    function: Optional[str] = None
    in_place: bool = False
    error: Optional[str] = None
    micro: Optional[Count] = None  # as its module call's
    stage: Optional[Count] = None  # as its module call's
    recompute: bool = False  # as its module call's

    @property
    def parent(self) -> tuple[str, int]:
        """The module call whose own code ran it."""
        return self.path, self.call

    @property
    def type(self) -> str:
        return self.op


class ParamRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind", tag="param"):
    """A parameter's value at the start of a step in which it changed. ``module``: the module that owns it;
    ``tied``: every name of a weight several modules own (recorded under each); ``call``: the how-manieth
    record of this parameter (of a tied weight's per-use gradient: the using module's call)."""
    kind: ClassVar[str] = "param"
    # what a parameter record lacks of a call's, so that a pass reads any record the same way
    phase: ClassVar[None] = None
    type: ClassVar[None] = None
    parent: ClassVar[None] = None
    arg_names: ClassVar[None] = None
    hparams: ClassVar[None] = None
    error: ClassVar[None] = None
    path: str
    call: Count
    tensors: list[TensorEntry]
    step: Count = 0
    seq: Count = 0
    module: Optional[str] = None
    module_type: Optional[str] = None
    tied: Optional[list[str]] = None
    increment: bool = False  # a gradient that is one backward's contribution (a step's microbatches add up)
    stage: Optional[Count] = None  # the pipeline stage that holds it, on a rank that runs several
    ranks_missing: Optional[list[int]] = None
    ranks_held: Optional[list[int]] = None

    @property
    def module_path(self) -> str:
        """The owning module (traces that did not record it: the parameter name's prefix)."""
        return self.path.rpartition(".")[0] if self.module is None else self.module


class ParamGradRecord(ParamRecord, frozen=True, tag="param_grad"):
    """A parameter's gradient once accumulated (after the backward pass)."""
    kind: ClassVar[str] = "param_grad"


class ParamUseRecord(ParamRecord, frozen=True, tag="param_grad_use"):
    """A tied weight's gradient from one of its uses (``module``'s call ``call``), before the uses are summed."""
    kind: ClassVar[str] = "param_grad_use"


class EndRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind", tag="end"):
    """The trace's last line: how the run ended (``status`` "complete" or "error", the ``failure`` with the
    module that raised and the modules active), its warnings and totals. A trace without one was interrupted."""
    kind: ClassVar[str] = "end"
    status: Optional[str] = None
    failure: Optional[dict[str, Any]] = None
    warnings: list[Any] = []
    autocast_dtypes: list[str] = []  # what automatic mixed precision computed in (torch.autocast), in any call
    # whether the model's forward drew from the framework's random generators in any call (None: not known)
    rng_drawn: Optional[bool] = None
    steps: Optional[Count] = None
    records: Optional[Count] = None
    tensor_bytes: Optional[Count] = None
    seconds: Optional[Number] = None
    tensors: list[Any] = []  # an end record holds none (``check``)


Record = Union[CallRecord, ParamRecord, ParamGradRecord, ParamUseRecord]
Indexed = Union[CallRecord, OpRecord, ParamRecord, ParamGradRecord, ParamUseRecord]  # every record but the end
AnyRecord = Union[CallRecord, OpRecord, ParamRecord, ParamGradRecord, ParamUseRecord, EndRecord]
_DECODER = msgspec.json.Decoder(AnyRecord)


def decode_line(line: bytes) -> AnyRecord | None:
    """One index line as its record, or None when it is not one: not JSON, of the wrong shape or types, or
    failing ``check``. A line with NaN or Infinity in it (JSON has no such numbers; the writer writes them as
    Python's json does) is read by ``json`` and converted with the same checks."""
    try:
        record = _DECODER.decode(line)
    except (ValueError, RecursionError):  # msgspec's DecodeError and ValidationError; bytes that are not UTF-8
        try:
            record = msgspec.convert(json.loads(line), AnyRecord)
        except (ValueError, RecursionError, TypeError, msgspec.ValidationError):
            return None
    return record if check(record) else None


def check(record: AnyRecord) -> bool:
    """What types alone do not say: an end record holds no tensors; a tensor's dtype is one this reader knows, its
    shape has at most 64 dimensions and an element count that fits int64, and in full mode ``offset`` and
    ``nbytes`` come together with nbytes = elements x itemsize (at most 32 dimensions: numpy's limit)."""
    if isinstance(record, EndRecord):
        return not record.tensors
    if isinstance(record, ParamUseRecord) and record.module is None:
        return False
    return all(_valid_entry(t) for t in record.tensors)


def _valid_entry(t: TensorEntry) -> bool:
    try:
        itemsize = storage_dtype(t.dtype).itemsize
    except ValueError:  # a dtype name this reader does not know
        return False
    if len(t.shape) > 64 or t.merge is not None or t.parts or (t.offset is not None and t.offset < 0):
        return False  # (joined entries are made by the reader of a run of ranks, never read from a file)
    numel = 1
    for d in t.shape:
        numel *= d
        if numel > (1 << 63) - 1:
            return False
    if (t.offset is None) != (t.nbytes is None):
        return False
    if t.checksums is not None and (t.nbytes is None or len(t.checksums) != count_blocks(t.nbytes)):
        return False
    return t.nbytes is None or (t.nbytes == numel * itemsize and len(t.shape) <= 32)
