"""Where NaN and Inf are born in one trace: the first call whose inputs are finite and whose outputs are not, and,
where the trace recorded the operations inside it (``--ops``), the first such operation: with its line."""
from __future__ import annotations

from typing import Iterable, Sequence

from layerdiff.schema import IN_ROLES, OUT_ROLES, NonfiniteOp, NonfiniteOrigin
from layerdiff.tracefile.records import CallRecord, OpRecord, Record, TensorEntry


def _bad(t: TensorEntry) -> int:
    """NaN and Inf values in the tensor (none in memory allocated and not yet written: its bytes mean nothing)."""
    return 0 if t.undefined else t.stats.get("nan", 0) + t.stats.get("inf", 0)


def first_nonfinite(records: Iterable[Record], phase: str | None = None, ops: Sequence[OpRecord] = ()
                    ) -> NonfiniteOrigin | None:
    """The first module call (execution order; forward before backward unless ``phase`` picks one) whose
    outputs hold NaN/Inf while its inputs are finite: where the NaN was born, not where it was first seen. With
    ``ops``, the operation inside that call where it was born (``op``)."""
    calls = sorted((r for r in records if isinstance(r, CallRecord) and phase in (None, r.phase)),
                   key=lambda r: (r.phase != "forward", r.end))
    for rec in calls:
        ins = [t for t in rec.tensors if t.role in IN_ROLES[rec.phase]]
        outs = [t for t in rec.tensors if t.role in OUT_ROLES[rec.phase]]
        bad_outs = [t for t in outs if _bad(t)]
        if bad_outs and not any(_bad(t) for t in ins):
            t = bad_outs[0]
            origin: NonfiniteOrigin = {"module": rec.path, "call": rec.call, "phase": rec.phase, "tensor": t.key,
                                       "nan": t.stats.get("nan", 0), "inf": t.stats.get("inf", 0)}
            op = _first_op(rec, ops)
            if op is not None:
                origin["op"] = op
            return origin
    return None


def _first_op(call: CallRecord, ops: Sequence[OpRecord]) -> NonfiniteOp | None:
    """The first operation of ``call``'s own code (in the order it ran) whose inputs are finite and whose output
    is not."""
    own = sorted((op for op in ops if op.path == call.path and op.call == call.call and op.phase == call.phase),
                 key=lambda op: op.begin)
    for op in own:
        ins = [t for t in op.tensors if t.role in IN_ROLES[op.phase]]
        outs = [t for t in op.tensors if t.role in OUT_ROLES[op.phase] and _bad(t)]
        if outs and not any(_bad(t) for t in ins):
            return {"name": op.name, "kind": op.op, "index": op.index, "source": op.source,
                    "function": op.function, "tensor": outs[0].key}
    return None
