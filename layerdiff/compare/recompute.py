"""Activation checkpointing's recomputation against the forward pass it replays, within one trace.

Backward runs a checkpointed region's forward again (``capture.recompute``) and differentiates what that gives.
A recomputation that does not reproduce the forward (a random state not restored for dropout, a module that
changes state when it runs, a kernel that is not deterministic) gives gradients of another forward than the one
the loss came from: the backward diverges while every forward output agrees. Each recomputed call's outputs are
compared with those of the call it replays, bit for bit where the trace stored the values, else by their
statistics.
"""
from __future__ import annotations

from typing import Any

from layerdiff import schema
from layerdiff.compare.metrics import CHUNK_ELEMS, compare_data, compare_stats
from layerdiff.tracefile.checksums import DamagedTensorError
from layerdiff.tracefile.records import CallRecord, TensorEntry


def recompute_check(reader: Any) -> schema.RecomputeCheck | None:
    """The trace's recomputed calls against the forward calls they replay; None when it recomputed none. The
    calls that differ are listed in the order they began; ``inputs_agree`` marks those whose inputs were the
    forward's: where the recomputation departs (the others differ because what they were given does). A run of
    ranks: each rank's file checked on its own, the calls that differ named with their ``rank``."""
    files = getattr(reader, "files", None)
    if files is not None:
        checks = [(rank, _check(f)) for rank, f in enumerate(files)]
        found = [(rank, check) for rank, check in checks if check is not None]
        if not found:
            return None
        differ: list[schema.RecomputedCall] = []
        for rank, check in found:
            for d in check["differ"]:
                differ.append({**d, "rank": rank})
        joined: schema.RecomputeCheck = {"calls": sum(c["calls"] for _, c in found),
                                         "compared": sum(c["compared"] for _, c in found), "differ": differ}
        damaged = [what for _, check in found for what in check.get("damaged", [])]
        if damaged:
            joined["damaged"] = damaged
        return joined
    return _check(reader)


def _check(reader: Any) -> schema.RecomputeCheck | None:
    recomputed = sorted((r for r in getattr(reader, "recomputed", ()) if isinstance(r, CallRecord)),
                        key=lambda r: r.begin)
    if not recomputed:
        return None
    forward = {(r.path, r.call): r for r in reader.records if isinstance(r, CallRecord) and r.phase == "forward"}
    compared = 0
    differ: list[schema.RecomputedCall] = []
    damaged: list[str] = []
    for again in recomputed:
        first = forward.get((again.path, again.call))
        if first is None:
            continue
        compared += 1
        found = _first_difference(reader, first, again, "output", damaged)
        if found is not None:
            key, metrics = found
            differ.append({"path": again.path, "call": again.call, "step": again.step, "tensor": f"output:{key}",
                           "max_abs": float(metrics.get("max_abs") or 0.0), "basis": str(metrics.get("basis")),
                           "inputs_agree": _first_difference(reader, first, again, "input", damaged) is None})
    check: schema.RecomputeCheck = {"calls": len(recomputed), "compared": compared, "differ": differ}
    if damaged:
        check["damaged"] = list(dict.fromkeys(damaged))
    return check


def _first_difference(reader: Any, first: CallRecord, again: CallRecord, role: str,
                      damaged: list[str]) -> tuple[str, dict] | None:
    """(key, metrics) of the first of ``role``'s tensors in which the recomputed call ``again`` differs from the
    forward call ``first``; None when none does. Tensors whose bytes are damaged are compared by their statistics
    and named in ``damaged``."""
    before = {t.key: t for t in first.tensors if t.role == role}
    for t in again.tensors:
        if t.role == role and t.key in before:
            metrics = _metrics(reader, before[t.key], t)
            if "damaged" in metrics:
                damaged.append(metrics["damaged"])
            if not metrics.get("identical"):
                return t.key, metrics
    return None


def _metrics(reader: Any, first: TensorEntry, again: TensorEntry) -> dict:
    if first.shape != again.shape or first.dtype != again.dtype:
        return {"identical": False, "max_abs": float("inf"), "basis": "shape"}
    if first.offset is not None and again.offset is not None:
        try:
            return dict(compare_data(reader.tensor_chunks(first, CHUNK_ELEMS),
                                     reader.tensor_chunks(again, CHUNK_ELEMS), first.dtype, again.dtype))
        except DamagedTensorError as exc:  # judged by the statistics its (verified) index line keeps
            return {**compare_stats(first.stats, again.stats), "damaged": str(exc)}
    return dict(compare_stats(first.stats, again.stats))
