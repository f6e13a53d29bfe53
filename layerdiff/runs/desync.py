"""Ranks of one run against each other: where a data-parallel replica stops agreeing with rank 0.

``layerdiff align RUN`` (one run directory) compares every rank with the first of its replicas (rank 0 where the
whole run replicates; the first rank of its pipeline stage in a Megatron layout) on what
replicas must agree on (``ranks.RankView``: shards and partial sums left out; the weights alone where each
data-parallel rank ran its own share of the batch), with the usual origin rule, so it names the first module
whose inputs still agree across ranks and whose outputs do not, and the rank. Ranks are compared in parallel, one
process per rank pair, each holding only its two traces' indexes (flat memory per worker).
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

from layerdiff.compare.spec import Comparison
from layerdiff.compare.tolerance import TolerancePolicy
from layerdiff.errors import LayerdiffError
from layerdiff.judge.evaluate import align
from layerdiff.match.rules import ruleset
from layerdiff.runs.ranks import RankedRun, RankView, open_run
from layerdiff.tracefile.records import CallRecord


def check_run(path, how: Comparison | None = None, workers: int | None = None, progress=None) -> dict:
    """A report of every rank against rank 0 (see the module docstring): by ``how``'s tolerances and rules (the
    ranks of one run share their names, so no renames or layouts apply)."""
    how = how or Comparison()
    policy = how.policy
    with open_run(path, how.rules) as run:
        if not isinstance(run, RankedRun):
            raise LayerdiffError(f"{path}: a single trace; align it with another one (layerdiff align A B), or "
                                 "give a run directory of several ranks to compare its ranks")
        world, order = run.world_size, _execution_order(run)
        groups = run.replica_groups()
    jobs = [(str(path), group[0], rank, policy.describe(), list(how.rule_files))
            for group in groups for rank in group[1:]]
    if not jobs:
        raise LayerdiffError(f"{path}: each of its {world} ranks is a pipeline stage of its own: no two hold the "
                             "same layers to compare; align the run with a reference (layerdiff align REF RUN)")
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_rank_against_rank0, *zip(*jobs)))
    else:
        results = [_rank_against_rank0(*job) for job in jobs]
    if progress is not None:
        progress(f"compared {len(results)} rank(s) with rank 0")
    divergent = [r for r in results if r["verdict"] != "aligned"]
    first = None
    for phase in ("forward", "backward"):
        found = [(order.get((r[phase] or {}).get("module"), len(order)), r) for r in divergent if r[phase]]
        if found:
            place, _ = min(found, key=lambda f: f[0])
            ranks = [r["rank"] for p, r in found if p == place]
            first = {**min(found, key=lambda f: f[0])[1][phase], "ranks": ranks, "phase": phase}
            break
    return {"kind": "ranks", "path": str(path), "world_size": world, "ranks": results, "first_divergence": first,
            "tolerances": policy.describe(), "verdict": "divergent" if divergent else "aligned"}


def _execution_order(run: RankedRun) -> dict:
    order: dict[str, int] = {}
    calls = [r for r in run.records if isinstance(r, CallRecord)]
    for rec in sorted(calls, key=lambda r: (r.phase != "forward", r.begin)):
        order.setdefault(rec.path, len(order))
    return order


def _rank_against_rank0(path: str, first: int, rank: int, policy: dict, rule_files: list) -> dict:
    """``rank`` against ``first``, the first rank of its replicas (rank 0 where the whole run replicates)."""
    how = Comparison(policy=TolerancePolicy.from_description(policy), rules=ruleset(rule_files),
                     rule_files=tuple(rule_files))
    with open_run(path, how.rules) as run:
        report = align(RankView(run, first), RankView(run, rank), how)
    return {"rank": rank, "against": first, "verdict": report["verdict"],
            "forward": report["forward"]["first_divergence"],
            "backward": report["backward"]["first_divergence"],
            "failing_tensors": report["forward"]["failing_tensors"] + report["backward"]["failing_tensors"],
            "params_differ": report["params"]["differ"]}
