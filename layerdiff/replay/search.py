"""The binary search over top-level blocks, for candidates too expensive to replay module by module: splice the
reference's activation into one block boundary per run and watch whether the blocks after it recover."""
from __future__ import annotations

from layerdiff import schema
from layerdiff.compare.tolerance import TolerancePolicy
from layerdiff.judge.tree import judge_rows
from layerdiff.match.modules import find_blocks as blocks_of
from layerdiff.tracefile.records import CallRecord


# ---------------------------------------------------------------------------------------------------------
# Binary search over top-level blocks
# ---------------------------------------------------------------------------------------------------------
def find_blocks(records, container: str | None = None) -> tuple[str, list[str]]:
    """The ordered top-level blocks among a trace's forward calls (see ``modules.find_blocks``)."""
    return blocks_of([r.path for r in records if isinstance(r, CallRecord) and r.phase == "forward"], container)


def observe(measurements: schema.Report, policy: TolerancePolicy, blocks: list[str], spliced: int | None) -> dict:
    """What one splice run shows: whether B's input to the first block, B's own value at the splice boundary
    (before A's replaced it), the last block's output and the model's final output agree with A's."""
    calls = {r["path"]: r for r in judge_rows(measurements, policy) if r["kind"] == "call"
             and r["phase"] == "forward" and r["call"] == 0}

    def ok(path, role):
        row = calls.get(path)
        if row is None:
            return None
        tensors = [t for t in row["tensors"] if t["role"] == role]
        return bool(tensors) and all(t["passed"] for t in tensors) and not row.get("error_b")

    final = ""  # the model itself
    return {"spliced": spliced, "splice_block": blocks[spliced] if spliced is not None else None,
            "first_input_ok": ok(blocks[0], "input"),
            "arrival_ok": ok(blocks[spliced], "input") if spliced is not None else None,
            "last_output_ok": ok(blocks[-1], "output"), "final_ok": ok(final, "output"), "final_module": final}


def next_splice(n_blocks: int, runs: list[dict]) -> tuple[int | None, dict | None]:
    """Given the runs so far (the baseline, spliced=None, first), the next block to splice at, or the answer.

    The defect block d is the one after which the candidate's blocks stop recovering: splicing the reference's
    activation at block k gives a correct last-block output exactly when k > d. The baseline (no splice)
    says whether any block is at fault at all; then each run halves [lo, hi]: log2(N) splice runs.
    """
    baseline = runs[0]
    if baseline["last_output_ok"] and baseline["final_ok"]:
        return None, {"where": "none", "description": "the candidate's final output agrees with the reference"}
    if baseline["last_output_ok"]:
        return None, {"where": "after", "description": "the blocks agree; the divergence is after the last block"}
    lo, hi = 0, n_blocks - 1
    if not baseline["first_input_ok"]:  # B's prefix already differs: block 0 must be tested on A's input too
        splice0 = next((r for r in runs[1:] if r["spliced"] == 0), None)
        if splice0 is None:
            return 0, None
        if splice0["last_output_ok"]:
            return None, {"where": "before", "description": "the blocks recover on the reference's input: "
                          "the divergence is before the first block"}
    for run in runs[1:]:
        k = run["spliced"]
        if k is None or not lo <= k <= hi:
            continue
        if run["last_output_ok"]:
            hi = k - 1
        else:
            lo = k
    if lo >= hi:
        return None, {"where": "block", "block": lo, "description": f"block {lo} is the first whose output does "
                      "not recover"}
    return (lo + hi + 1) // 2, None
