"""Where NaN and Inf are born in one trace: the first call whose inputs are finite and whose outputs are not."""
from __future__ import annotations

from typing import Iterable

from layerdiff.schema import IN_ROLES, OUT_ROLES, NonfiniteOrigin
from layerdiff.tracefile.records import CallRecord, Record, TensorEntry


def first_nonfinite(records: Iterable[Record], phase: str | None = None) -> NonfiniteOrigin | None:
    """The first module call (execution order; forward before backward unless ``phase`` picks one) whose
    outputs hold NaN/Inf while its inputs are finite: where the NaN was born, not where it was first seen."""
    def bad(t: TensorEntry) -> int:
        return t.stats.get("nan", 0) + t.stats.get("inf", 0)

    calls = sorted((r for r in records if isinstance(r, CallRecord) and phase in (None, r.phase)),
                   key=lambda r: (r.phase != "forward", r.end))
    for rec in calls:
        ins = [t for t in rec.tensors if t.role in IN_ROLES[rec.phase]]
        outs = [t for t in rec.tensors if t.role in OUT_ROLES[rec.phase]]
        bad_outs = [t for t in outs if bad(t)]
        if bad_outs and not any(bad(t) for t in ins):
            t = bad_outs[0]
            origin: NonfiniteOrigin = {"module": rec.path, "call": rec.call, "phase": rec.phase, "tensor": t.key,
                                       "nan": t.stats.get("nan", 0), "inf": t.stats.get("inf", 0)}
            return origin
    return None
