"""The framework-neutral half of tracing: call stack, call indices, records and backward pairing.

An adapter installs the framework's hooks and hands this session numpy views of tensors; the session decides
what a record is and writes it (as a plain dict of the shape ``tracefile.records`` declares: the hot path stays
cheap, and the reader checks every line against the declaration). Keeping this here is what makes the three adapters small and their traces
identical in shape."""
from __future__ import annotations

import threading
import time
import traceback
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from mypy_extensions import mypyc_attr

from layerdiff.capture.ops import OpFrame, OpName
from layerdiff.capture.options import MODES
from layerdiff.capture.recompute import Replay, StepCalls
from layerdiff.tracefile.records import OUTPUT_PLUS_BIAS, bias_beside
from layerdiff.tracefile.tensors import summarize
from layerdiff.tracefile.writer import TraceWriter

USE_DATA_LIMIT = 1 << 22  # elements: a tied weight's per-use gradient is stored whole up to this size


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _numel(t) -> int:
    n = 1
    for d in getattr(t, "shape", ()):
        n *= int(d)
    return n


@dataclass
class CallFrame:
    """One module call in flight (between its forward pre-hook and post-hook)."""

    path: str
    call: int
    type: str
    step: int
    begin: int
    parent: tuple | None
    hparams: dict
    inputs: list = field(default_factory=list)
    scalars: dict = field(default_factory=dict)
    tapped_inputs: bool = False
    # its differentiable inputs reach its code as they came, untapped (a module that works in place, or one seen
    # writing its input): an output may be one of them, made by its caller's autograd node
    inputs_as_given: bool = False
    full: bool = True  # store tensor values (False: statistics only, e.g. the root outside a --layers window)
    arg_names: tuple = ()  # the forward's positional parameter names: "args.0" is "hidden_states"
    versions: list = field(default_factory=list)  # adapter's in-place detection: (tensor, version)
    ops: int | None = None  # operations its own code ran so far (``ops`` tracing); None: not recorded here
    producers: dict = field(default_factory=dict)  # tensor key -> where it came from (``capture.ops.Producers``)
    micro: int | None = None  # its step's microbatch (a step of a pipeline schedule); None: a step of one root call
    stage: int | None = None  # the pipeline stage it runs in, on a rank that runs several (``ModelParts``)
    replay: Replay | None = None  # a call activation checkpointing recomputes: what the calls inside it replay


@dataclass
class PendingBackward:
    frame: CallFrame
    begin: int
    grad_outputs: list[dict]


class TensorAccess(Protocol):
    """What the session reads of a framework's tensors: a ``FrameworkAdapter`` provides it (``adapters.base``).

    ``to_stored(t)`` -> (numpy array of the tensor's bits, dtype name) or None if it cannot be stored;
    ``identify(t)`` -> a hashable key that is equal for two tensors only while they show the same bytes, or None;
    ``version(t)`` -> a counter that changes whenever the tensor object's bytes change in place, or None (where it is
    not None, a tensor object seen again in a step is known by it, without ``identify``);
    ``fast_stats(t)`` -> the statistics computed by the framework itself, or None to use numpy;
    ``describe(t)`` -> (dtype name, shape) of what ``fast_stats`` summarized: "stats" mode skips the host copy;
    ``placement(t)`` -> how a distributed tensor is spread over ranks, or None (the bytes are this rank's part);
    ``deferral()`` -> what leaves statistics on a device until read back in batches (``StatsDeferral``), or None;
    ``plus_bias(output, bias)`` -> their sum outside any gradient graph, or None where it cannot be taken.
    """

    def to_stored(self, t: Any) -> tuple[np.ndarray, str] | None: ...

    def identify(self, t: Any) -> Any: ...

    def version(self, t: Any) -> int | None: ...

    def fast_stats(self, t: Any) -> Any: ...

    def describe(self, t: Any) -> tuple[str, list[int]]: ...

    def placement(self, t: Any) -> dict | None: ...

    def deferral(self) -> StatsDeferral | None: ...

    def plus_bias(self, output: Any, bias: Any) -> Any: ...

    @property
    def gradients_keep_identity(self) -> bool: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # an adapter's own kind (a compiled build: layerdiff/native.py)
class DeferredStats:
    """Statistics a framework has started to reduce on its device (an accelerator), read back later together with
    the others of a batch: one synchronization per batch instead of one per tensor. The reductions are queued on
    the device at once, so they see the tensor's values as they are now, whatever runs after."""

    __slots__ = ("values", "result")

    def __init__(self, values: Any):
        self.values = values  # the framework's device tensor of the statistics, still on the device
        self.result: dict | None = None  # the statistics, once read back (``StatsDeferral.read``)


class StatsDeferral(Protocol):
    """A framework's statistics left on its device: ``add(t)`` queues a tensor's (None: the tensor is summarized
    otherwise), ``read(pending)`` reads a batch back at once, filling each one's ``result``."""

    def add(self, t: Any) -> DeferredStats | None: ...

    def read(self, pending: list[DeferredStats]) -> None: ...


DEFERRED_RECORDS = 4096  # records held while their statistics are still on the device, at most


def settled_stats(stats: Any) -> Any:
    """Statistics as read back, where they were left on the device (``DeferredStats``) and have been read."""
    return stats.result if isinstance(stats, DeferredStats) else stats


def _settled(record: dict) -> dict:
    """The record with the statistics read back from the device in place (entries made earlier in the step,
    held by calls still open or seen again, may still point at them)."""
    for entry in record.get("tensors", ()):
        stats = entry.get("stats")
        if isinstance(stats, DeferredStats) and stats.result is not None:
            entry["stats"] = stats.result
    return record


class TraceSession:
    """Turns hook callbacks into trace records. One session per trace; no state outside it.

    A tensor seen again within a step (a layer's output is the next layer's input; a head's output is the
    model's) is summarized and stored once: later records point at the same bytes.
    """

    def __init__(self, writer: TraceWriter, tensors: TensorAccess, mode: str = "full"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.writer = writer
        self.tensors = tensors
        self.seen: dict = {}  # identity -> ([weakrefs to tensors with that identity], entry); per step
        # id(tensor object) -> (weakref to it, its version, entry), per step: the same object seen again is known by
        # two lookups (the identity costs a dozen attribute reads; most tensors a step records are seen again)
        self.seen_objects: dict[int, tuple[Any, Any, dict]] = {}
        self.store_data = mode == "full"
        self.stack: list[CallFrame] = []
        self.call_counts: dict[str, int] = {}
        self.step_calls = StepCalls()  # what a recomputation (activation checkpointing) replays
        self.param_counts: dict[tuple, int] = {}
        self.pending_backward: dict[int, PendingBackward] = {}
        self.pending_ops: dict[int, OpFrame] = {}  # operations whose input gradients are still to come
        self.seq = 0
        self.step = -1
        self.scope: Any = None  # what makes one step of several root calls (a pipeline schedule's call), while it lasts
        self.micro: int | None = None  # the microbatch of the step in progress (None: not a scheduled step)
        # the microbatches of the step in progress so far, per pipeline stage (None: a rank's only stage)
        self.micros: dict[int | None, int] = {}
        self.failure: dict | None = None
        self.warnings: list[str] = []
        self.autocast: set[str] = set()  # dtypes automatic mixed precision computed in, in any call
        self.random_drawn: bool | None = None  # whether a root call's forward drew random numbers (None: not known)
        self.started = time.time()
        self.deferred: list[DeferredStats] = []  # statistics still on the device ...
        self.queued: list[dict] = []  # ... and the records that wait for them, in order
        self.deferred_any = False  # whether any statistic was ever left on a device (records may point at one)
        self._deferring = threading.RLock()  # autograd may call back from a thread of its own
        self.deferral = tensors.deferral()

    # -- helpers -------------------------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        """A record to the writer, in order: after the records that wait for statistics still on the device."""
        with self._deferring:
            if not self.deferred:
                self.writer.write_record(_settled(record) if self.deferred_any else record)
                return
            self.queued.append(record)
            if len(self.queued) >= DEFERRED_RECORDS:
                self.flush_deferred()

    def flush_deferred(self) -> None:
        """Reads back every statistic left on the device (one synchronization) and writes the records waiting."""
        with self._deferring:
            if not self.deferred:
                return
            if self.deferral is not None:
                self.deferral.read(self.deferred)
            queued, self.queued, self.deferred = self.queued, [], []
            for record in queued:
                self.writer.write_record(_settled(record))

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _entries(self, role: str, tensors, full: bool = True) -> list[dict]:
        """Entries for (key, framework tensor) pairs; tensors that cannot be stored are skipped."""
        out = []
        known = self.tensors.gradients_keep_identity or not role.startswith("grad")
        for key, t in tensors:
            entry = self._tensor_entry(t, self.store_data and full, known=known)
            if entry is not None:
                out.append({**entry, "role": role, "key": key})
        return out

    def _tensor_entry(self, t, store: bool, same_values: dict | None = None, known: bool = True) -> dict | None:
        """``same_values``: the entry of a tensor with the same values in another layout (a view, a transpose):
        without stored data, its statistics are taken over, not computed again. ``known``: whether its identity
        can be trusted (gradients in some frameworks' backward: ``gradients_keep_identity``)."""
        if known:
            again = self.seen_objects.get(id(t))
            if again is not None and again[0]() is t and (not store or "offset" in again[2]) and \
                    again[1] == self.tensors.version(t):
                return again[2]
        identity = self.tensors.identify(t) if known else None
        if identity is not None:
            hit = self.seen.get(identity)
            if hit is not None and (not store or "offset" in hit[1]) and \
                    any(self._same(ref(), identity) for ref in hit[0]):
                hit[0].append(weakref.ref(t))
                self._seen_object(t, hit[1])
                return hit[1]
        if same_values is not None and not store:
            dtype, shape = self.tensors.describe(t)
            if dtype == same_values["dtype"] and _count(shape) == _count(same_values["shape"]):
                entry = self.writer.summary_entry(dtype, shape, same_values["stats"])
                if identity is not None:
                    self.seen[identity] = ([weakref.ref(t)], entry)
                    self._seen_object(t, entry)
                return entry
        stats: Any = self.deferral.add(t) if self.deferral is not None and not store else None
        if stats is not None:
            self.deferred.append(stats)
            self.deferred_any = True
        else:
            stats = self.tensors.fast_stats(t)
        if stats is not None and not store:
            entry = self.writer.summary_entry(*self.tensors.describe(t), stats)  # no copy to the host
        else:
            stored = self.tensors.to_stored(t)
            if stored is None:
                return None
            entry = self.writer.write_tensor(*stored, store_data=store, stats=stats)
        place = self.tensors.placement(t)
        if place is not None:
            entry["placement"] = place
        if identity is not None:
            self.seen[identity] = ([weakref.ref(t)], entry)
            self._seen_object(t, entry)
        return entry

    def _seen_object(self, t, entry: dict) -> None:
        version = self.tensors.version(t)
        if version is not None:
            self.seen_objects[id(t)] = (weakref.ref(t), version, entry)

    def peek_stats(self, t) -> dict | None:
        """``t``'s statistics as a record would hold them, computed now and recorded nowhere (None: it cannot be
        summarized)."""
        stats = self.tensors.fast_stats(t)
        if stats is not None:
            return dict(stats)
        stored = self.tensors.to_stored(t)
        return summarize(*stored) if stored is not None else None

    def forget(self, t) -> None:
        """``t``'s bytes were written where the framework's in-place counter does not see it (a collective such as
        ``all_reduce`` writes into the tensor it is given): what was remembered of it, under any of its names, is
        dropped, and it is summarized anew when met again. Before, a Megatron embedding's output, recorded as a
        partial sum by the operation that made it, was taken over by the module's output after the all-reduce."""
        self.seen_objects.pop(id(t), None)
        identity = self.tensors.identify(t)
        hit = self.seen.pop(identity, None) if identity is not None else None
        for ref in hit[0] if hit is not None else ():  # the other tensor objects known to show those bytes
            other = ref()
            if other is not None:
                self.seen_objects.pop(id(other), None)

    def _same(self, obj, identity) -> bool:
        """A remembered tensor still alive with the same identity: its bytes cannot have been reused."""
        return obj is not None and self.tensors.identify(obj) == identity

    def remember_alias(self, original, alias):
        """``alias`` shows the same bytes as ``original`` (a gradient tap's output): keep dedup working."""
        hit = self.seen.get(self.tensors.identify(original))
        if hit is not None:
            hit[0].append(weakref.ref(alias))
            self._seen_object(alias, hit[1])

    def saw_random(self, drawn: bool) -> None:
        """A root call's forward ended having drawn from the framework's random generators, or not
        (``FrameworkAdapter.random_state``): the end record says whether any did (``rng_drawn``)."""
        self.random_drawn = bool(self.random_drawn) or drawn

    def warn(self, message: str):
        if message not in self.warnings:
            self.warnings.append(message)

    def learn_layout(self, layout: dict) -> None:
        """A parallel layout found only once the model runs (a pipeline schedule knows the stage it runs), kept in
        the trace's metadata as one found at its start is: its keys over those."""
        self.writer.amend_meta(lambda meta: {**meta, "parallel": {**(meta.get("parallel") or {}), **layout}})

    # -- forward -------------------------------------------------------------------------------------------
    def starts_step(self, scope: Any = None) -> bool:
        """Whether a root call made now within ``scope`` opens a new step: every root call does, but those made
        inside one call of a pipeline schedule (``scope``, its frame: ``FrameworkAdapter.step_scope``), which are
        that step's microbatches."""
        return scope is None or scope is not self.scope

    def _open_step(self, scope: Any, stage: int | None = None) -> None:
        """``stage``: the pipeline stage the root call runs, on a rank that runs several: its microbatches are
        counted on their own (an interleaved schedule runs stage 0's microbatch 1 before stage 2's 0)."""
        if not self.starts_step(scope):
            self.micro = self.micros[stage] = self.micros.get(stage, -1) + 1
            return
        self.flush_deferred()  # a step's records are in the file before the next step begins
        previous, self.scope = self.scope, scope  # held, so that no later call can reuse its identity
        if previous is not None:
            try:
                previous.clear()  # a finished schedule's locals (its microbatches' tensors) are let go
            except RuntimeError:  # still running: it lets them go itself
                pass
        self.micro = 0 if scope is not None else None
        self.micros = {stage: 0} if scope is not None else {}
        self.step += 1
        self.seen.clear()
        self.seen_objects.clear()
        self.step_calls.clear()

    def begin_call(self, path: str, module_type: str, hparams: dict, inputs, scalars: dict,
                   full: bool = True, arg_names: tuple = (), scope: Any = None,
                   stage: int | None = None, recompute: bool = False) -> CallFrame:
        """Inputs are written now, before the module runs, so in-place ops inside it cannot alter them.
        ``scope``: for a root call, what says which step it belongs to (``starts_step``); ``stage``: for a root
        call, the pipeline stage it runs on a rank that runs several (every call inside it runs in it too);
        ``recompute``: for a root call, activation checkpointing recomputing this step's calls in its backward
        (``capture.recompute``; the calls inside it are too)."""
        caller = self.stack[-1] if self.stack else None
        micro, replay, replayed = self.micro, None, None
        if caller is not None:  # a call inside a recomputed one is recomputed too
            stage, replay = caller.stage, caller.replay
            recompute = replay is not None
            if replay is not None:
                replayed = self.step_calls.replay_next(replay, path)
        elif recompute:
            root = self.step_calls.replay_root(path, (self.tensors.identify(t) for _, t in inputs), self._same)
            replayed, replay = (root[:2], root[2]) if root is not None else (None, Replay())
        else:
            self._open_step(scope, stage)
            micro = self.micro
        if replayed is not None:
            call, micro = replayed
        else:  # a call of its own (or one recomputed that no call of this step matches: a number of its own)
            call = self.call_counts.get(path, 0)
            self.call_counts[path] = call + 1
        parent = (caller.path, caller.call) if caller is not None else None
        if not recompute:
            self.step_calls.add(path, call, len(self.stack), self.micro, parent,
                                ((self.tensors.identify(t), t) for _, t in inputs))
        frame = CallFrame(path, call, module_type, self.step, self._next_seq(), parent, hparams,
                          scalars=scalars, full=full, arg_names=tuple(arg_names), micro=micro, stage=stage,
                          replay=replay)
        frame.inputs = self._entries("input", inputs, full)
        self.stack.append(frame)
        return frame

    def _pop(self, frame: CallFrame):
        if self.stack and self.stack[-1] is frame:
            self.stack.pop()
        elif frame in self.stack:  # a hook of an inner module did not run; drop it with this one
            del self.stack[self.stack.index(frame):]

    def _call_record(self, frame: CallFrame, phase: str, begin: int, tensors: list[dict],
                     **extra) -> dict:
        rec = {"kind": "call", "phase": phase, "path": frame.path, "call": frame.call, "step": frame.step,
               "type": frame.type, "begin": begin, "end": self._next_seq(),
               "parent": list(frame.parent) if frame.parent else None, "tensors": tensors}
        if frame.arg_names and any(t["key"].startswith("args.") for t in tensors):
            rec["arg_names"] = list(frame.arg_names)
        if frame.micro is not None:
            rec["micro"] = frame.micro
        if frame.stage is not None:
            rec["stage"] = frame.stage
        if phase == "forward":
            if frame.replay is not None:
                rec["recompute"] = True
            if frame.ops is not None:
                rec["ops"] = frame.ops
            if frame.producers:
                rec["producers"] = frame.producers
        rec.update(extra)
        return rec

    def end_call(self, frame: CallFrame, outputs, scalars: dict) -> list[dict]:
        """Writes the call's record; returns its output entries."""
        self._pop(frame)
        entries = self._entries("output", outputs, frame.full)
        self._write(self._call_record(
            frame, "forward", frame.begin, frame.inputs + entries + self._output_plus_bias(outputs, entries, frame),
            hparams=frame.hparams, scalars={**frame.scalars, **scalars}))
        return entries

    def _output_plus_bias(self, outputs, entries: list[dict], frame: CallFrame) -> list[dict]:
        """A call that returned ``(output, bias)``, a bias of the output's last size for its caller to add
        (Megatron's linears, attention and MLP with linear biases), in a statistics trace: the statistics of their
        sum, which do not follow from the two's, recorded beside them (``OUTPUT_PLUS_BIAS``). A run whose module
        returns the sum (transformers') is compared with it. A full trace holds the values: nothing more."""
        if len(entries) != 2 or len(outputs) != 2 or (self.store_data and frame.full):
            return []
        out, bias = entries
        if (out["key"], bias["key"]) != ("out.0", "out.1") or \
                not bias_beside(out["shape"], out["dtype"], bias["shape"], bias["dtype"]):
            return []
        total = self.tensors.plus_bias(outputs[0][1], outputs[1][1])
        entry = self._tensor_entry(total, False, known=False) if total is not None else None
        return [] if entry is None else [{**entry, "role": OUTPUT_PLUS_BIAS, "key": "out.0"}]

    def fail_call(self, frame: CallFrame, exc: BaseException):
        """The module raised: keep its inputs and the error; the innermost failing call is the failure."""
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        if self.failure is None:
            self.failure = {"module": frame.path, "call": frame.call, "error": message,
                            "module_stack": [f.path for f in self.stack],
                            "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:]}
        self._end_incomplete(frame, error=message)

    def stop_call(self, frame: CallFrame):
        """A recomputed call that activation checkpointing stopped before it returned (it had recomputed what
        backward needs): its inputs are kept, marked incomplete, and the run has not failed."""
        self._end_incomplete(frame)

    def _end_incomplete(self, frame: CallFrame, **extra):
        self._pop(frame)
        self._write(self._call_record(frame, "forward", frame.begin, frame.inputs, hparams=frame.hparams,
                                      scalars=frame.scalars, incomplete=True, **extra))

    # -- backward ------------------------------------------------------------------------------------------
    def grad_outputs(self, frame: CallFrame, grads):
        """Gradient w.r.t. the call's outputs: arrives first; waits for the input side when there is one."""
        begin = self._next_seq()
        entries = self._entries("grad_output", grads, frame.full)
        if not frame.tapped_inputs:
            self._write(self._call_record(frame, "backward", begin, entries))
            return
        earlier = self.pending_backward.pop(id(frame), None)
        if earlier is not None:  # a second backward through the same call before the first finished
            self._emit_pending(earlier)
        self.pending_backward[id(frame)] = PendingBackward(frame, begin, entries)

    def grad_inputs(self, frame: CallFrame, grads):
        pending = self.pending_backward.pop(id(frame), None)
        entries = self._entries("grad_input", grads, frame.full)
        if pending is None:  # outputs carried no gradient (unused); inputs still did
            self._write(self._call_record(frame, "backward", self._next_seq(), entries))
            return
        self._write(self._call_record(frame, "backward", pending.begin,
                                                   pending.grad_outputs + entries))

    def _emit_pending(self, pending: PendingBackward):
        self._write(self._call_record(pending.frame, "backward", pending.begin,
                                                   pending.grad_outputs))

    # -- operations inside a call (``ops`` tracing; see ``capture.ops``) ------------------------------------
    def begin_op(self, frame: CallFrame, name: OpName, args: dict, inputs, producers: dict, source: str | None,
                 function: str | None, undefined_inputs: Collection[str] = ()) -> OpFrame:
        """The operation's inputs are written now, before it runs (it may modify them in place).
        ``undefined_inputs``: the keys of those whose values are no evidence (allocated and not yet written; what
        ``uniform_`` or ``fill_`` overwrites without reading it): their entries say so."""
        index = frame.ops or 0
        frame.ops = index + 1
        entries = self._entries("input", inputs, frame.full)
        if undefined_inputs:
            for entry in entries:
                if entry["key"] in undefined_inputs:
                    entry["undefined"] = True  # a fresh dict: the tensor's own entry, shared, is left as it was
        return OpFrame(frame, index, name, self._next_seq(), entries, args, producers, source, function)

    def _op_record(self, op: OpFrame, phase: str, begin: int, tensors: list[dict], **extra) -> dict:
        frame = op.frame
        rec = {"kind": "op", "phase": phase, "path": frame.path, "call": frame.call, "index": op.index,
               "step": frame.step, "name": op.name.name, "op": op.name.kind, "begin": begin, "end": self._next_seq(),
               "tensors": tensors}
        if frame.micro is not None:
            rec["micro"] = frame.micro
        if frame.stage is not None:
            rec["stage"] = frame.stage
        if phase == "forward":
            if frame.replay is not None:
                rec["recompute"] = True
            if op.args:
                rec["args"] = op.args
            if op.producers:
                rec["producers"] = op.producers
            if op.name.in_place:
                rec["in_place"] = True
        if op.source is not None:
            rec["source"], rec["function"] = op.source, op.function
        rec.update(extra)
        return rec

    def end_op(self, op: OpFrame, outputs, same_values: bool = False, undefined: bool = False) -> list[dict]:
        """``same_values``: the operation only lays out its one input anew (a view, a transpose, a copy).
        ``undefined``: it allocates its outputs without writing them (``torch.empty_like``); their entries say so,
        and so do the entries of the same tensors met again before anything writes them (they are shared)."""
        like = op.inputs[0] if same_values and len(op.inputs) == 1 and len(outputs) == 1 else None
        entries = []
        for key, t in outputs:
            entry = self._tensor_entry(t, self.store_data and op.frame.full, like)
            if entry is not None:
                if undefined:
                    entry["undefined"] = True
                entries.append({**entry, "role": "output", "key": key})
        self._write(self._op_record(op, "forward", op.begin, op.inputs + entries))
        # what only the forward record holds is let go: the operation waits for its backward, and so would they
        op.inputs, op.args, op.producers = [], {}, {}
        return entries

    def op_grads(self, op: OpFrame, grad_outputs, grad_inputs, same_values: bool = False):
        """An operation's backward, both sides at once (the framework reported them together)."""
        begin = self._next_seq()
        store = self.store_data and op.frame.full
        entries = self._entries("grad_output", grad_outputs, op.frame.full)
        like = entries[0] if same_values and len(entries) == 1 and len(grad_inputs) == 1 else None
        known = self.tensors.gradients_keep_identity
        for key, g in grad_inputs:
            entry = self._tensor_entry(g, store, like, known=known)
            if entry is not None:
                entries.append({**entry, "role": "grad_input", "key": key})
        self._write(self._op_record(op, "backward", begin, entries))

    def fail_op(self, op: OpFrame, exc: BaseException):
        """The operation raised: its inputs and the error are kept (the module call's record follows)."""
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        self._write(self._op_record(op, "forward", op.begin, op.inputs, error=message))

    def op_grad_outputs(self, op: OpFrame, grads, waits: bool):
        """Gradients w.r.t. the operation's outputs; ``waits``: those w.r.t. its inputs come next."""
        begin = self._next_seq()
        entries = self._entries("grad_output", grads, op.frame.full)
        if not waits:
            self._write(self._op_record(op, "backward", begin, entries))
            return
        earlier = self.pending_ops.pop(id(op), None)
        if earlier is not None and earlier.grad_outputs is not None:  # a second backward through it
            self._write(self._op_record(earlier, "backward", earlier.backward_begin,
                                                     earlier.grad_outputs))
        op.grad_outputs, op.backward_begin = entries, begin
        self.pending_ops[id(op)] = op

    def op_grad_inputs(self, op: OpFrame, grads):
        entries = self._entries("grad_input", grads, op.frame.full)
        pending = self.pending_ops.pop(id(op), None)
        grad_outputs = pending.grad_outputs if pending is not None and pending.grad_outputs is not None else []
        begin = pending.backward_begin if pending is not None else self._next_seq()
        self._write(self._op_record(op, "backward", begin, grad_outputs + entries))
        op.grad_outputs = None

    # -- parameters ----------------------------------------------------------------------------------------
    def param(self, kind: str, name: str, module_path: str, tensor, module_type: str | None = None,
              tied: list | None = None, placement: dict | None = None, increment: bool = False,
              stage: int | None = None) -> list[dict]:
        """kind is "param" (value) or "param_grad" (gradient after accumulation). ``tied``: every name of a
        parameter that several modules own (an embedding tied to the LM head); it is recorded under each.
        ``placement``: how the gradient is spread over ranks when its tensor cannot say (a partial sum);
        ``increment``: the gradient is this backward's contribution alone (added up elsewhere), not the total;
        ``stage``: the pipeline stage that holds it, on a rank that runs several. Returns the entries recorded
        (none for a tensor that cannot be stored)."""
        entries = self._entries(kind, [("value", tensor)])
        if not entries:
            return []
        if placement is not None:
            entries = [{**entry, "placement": placement} for entry in entries]
        count = self.param_counts.get((kind, name, stage), 0)  # per stage: model chunks may name theirs alike
        self.param_counts[(kind, name, stage)] = count + 1
        # values are taken just before the root call opens a step: they belong to that step
        step = self.step + 1 if kind == "param" and not self.stack else max(self.step, 0)
        record = {"kind": kind, "path": name, "module": module_path, "module_type": module_type, "call": count,
                  "step": step, "seq": self._next_seq(), "tensors": entries}
        if tied:
            record["tied"] = list(tied)
        if increment:
            record["increment"] = True
        if stage is not None:
            record["stage"] = stage
        self._write(record)
        return entries

    def param_use(self, name: str, frame: CallFrame, grad, tied: list):
        """One call's own contribution to a tied parameter's gradient (before it is summed with the other
        users'): what localizes a gradient defect in one user of a shared weight."""
        small = _numel(grad) <= USE_DATA_LIMIT  # a vocabulary-sized tied embedding: its statistics suffice
        entries = self._entries("param_grad", [("value", grad)], frame.full and small)
        if entries:
            record = {"kind": "param_grad_use", "path": name, "module": frame.path, "module_type": frame.type,
                      "call": frame.call, "step": frame.step, "seq": self._next_seq(), "tensors": entries,
                      "tied": list(tied)}
            if frame.stage is not None:
                record["stage"] = frame.stage
            self._write(record)

    # -- end -----------------------------------------------------------------------------------------------
    def close(self, exc: BaseException | None = None):
        for pending in list(self.pending_backward.values()):
            self._emit_pending(pending)
        self.pending_backward.clear()
        for op in list(self.pending_ops.values()):
            if op.grad_outputs is not None:
                self._write(self._op_record(op, "backward", op.backward_begin, op.grad_outputs))
        self.pending_ops.clear()
        if exc is not None and self.failure is None:
            message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
            self.failure = {"module": self.stack[-1].path if self.stack else None, "call": None,
                            "error": message, "module_stack": [f.path for f in self.stack]}
        self.flush_deferred()
        end = {"kind": "end", "status": "error" if exc is not None else "complete",
               "failure": self.failure if exc is not None else None,
               "records": self.writer.records_handed, "tensor_bytes": self.writer.tensor_bytes,
               "steps": self.step + 1, "seconds": round(time.time() - self.started, 3),
               "warnings": self.warnings}
        if self.autocast:
            end["autocast_dtypes"] = sorted(self.autocast)
        if self.random_drawn is not None:
            end["rng_drawn"] = self.random_drawn
        self.writer.close(end)
