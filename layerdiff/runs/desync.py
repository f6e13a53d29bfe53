"""Ranks of one run against each other: where a data-parallel replica stops agreeing with rank 0.

``layerdiff align RUN`` (one run directory) compares every rank with the first of its replicas (rank 0 where the
whole run replicates; the first rank of its pipeline stage in a Megatron layout; with tensor and data parallelism
both, the first replica of its tensor-parallel rank, and the first tensor-parallel rank of its replica on the
weights that are not sharded) on what replicas must agree on
(``ranks.RankView``: shards and partial sums left out; the weights alone where each data-parallel rank ran its own
share of the batch), with the usual origin rule, so it names the first module whose inputs still agree across
ranks and whose outputs do not, and the rank. Each rank pair is a task for the comparison's workers
(``compare.tasks``: processes of this machine, or a Dask cluster's): it opens the two ranks' traces by path and
nothing else, so a worker's memory does not grow with the number of ranks. A rank pair a cluster could not
compare is named in the report (``missing``), never left out silently.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from layerdiff.compare.spec import Comparison
from layerdiff.compare.tolerance import TolerancePolicy
from layerdiff.errors import LayerdiffError
from layerdiff.judge.evaluate import align
from layerdiff.match.rules import ruleset
from layerdiff.runs.ranks import RankedRun, RankView, open_run, rank_files, replica_exempt
from layerdiff.tracefile.reader import TraceReader
from layerdiff.tracefile.records import CallRecord


def check_run(path, how: Comparison | None = None, progress=None) -> dict:
    """A report of every rank against rank 0 (see the module docstring): by ``how``'s tolerances and rules (the
    ranks of one run share their names, so no renames or layouts apply), on ``how.workers``. ``progress``: a bar
    (``start(total)``, ``advance(1)`` as each rank pair is done)."""
    how = how or Comparison()
    policy = how.policy
    with open_run(path, how.rules) as run:
        if not isinstance(run, RankedRun):
            raise LayerdiffError(f"{path}: a single trace; align it with another one (layerdiff align A B), or "
                                 "give a run directory of several ranks to compare its ranks")
        world, order = run.world_size, _execution_order(run)
        # HSDP's copies of one shard (``copies``) hold the same bytes of every weight: nothing is left out
        exempt = {"replicas": replica_exempt(run), "peers": replica_exempt(run, peers=True), "copies": []}
        own_shares = run.own_shares and any((layout.get("dp") or 1) > 1 for layout in run.layouts)
        groups = [(group, "replicas") for group in run.replica_groups()] + \
            [(group, "peers") for group in run.peer_groups()] + [(group, "copies") for group in run.copy_groups()]
        # a rank that ran several pipeline stages is one reader per stage: its file is compared once
        files_of = {tuple(dict.fromkeys(run.file_of[r] for r in group)): kind for group, kind in groups}
        groups = [(list(group), kind) for group, kind in files_of.items()]
    files = [os.path.abspath(f) for f in rank_files(path) or ()]  # workers open them by path: absolute
    shared = {"exempt": exempt, "own_shares": own_shares, "policy": policy.describe(),
              "rule_files": [os.path.abspath(f) for f in how.rule_files]}  # read where the task runs
    jobs = [{"first": files[group[0]], "against": group[0], "other": files[rank], "rank": rank, "exempt": kind}
            for group, kind in groups for rank in group[1:]]
    if not jobs:
        raise LayerdiffError(f"{path}: each of its {world} ranks holds pipeline stages of its own: no two hold the "
                             "same layers to compare; align the run with a reference (layerdiff align REF RUN)")
    if progress is not None:
        progress.start(len(jobs))
    with how.workers.pool(most=len(jobs), nbytes=sum(os.path.getsize(f) for f in files[1:])) as pool:
        done = pool.map(rank_against_rank0, shared, jobs,
                        progress=None if progress is None else lambda i: progress.advance(1))
    results = [r for r in done.results if r is not None]
    missing = [{"rank": jobs[i]["rank"], "reason": f"{reason} ({pool.where})"}
               for i, reason in sorted(done.failed.items())]
    divergent = [r for r in results if r["verdict"] != "aligned"]
    first = None
    for phase in ("forward", "backward"):
        found = [(order.get((r[phase] or {}).get("module"), len(order)), r) for r in divergent if r[phase]]
        if found:
            place, _ = min(found, key=lambda f: f[0])
            ranks = [r["rank"] for p, r in found if p == place]
            first = {**min(found, key=lambda f: f[0])[1][phase], "ranks": ranks, "phase": phase}
            break
    return {"kind": "ranks", "path": str(path), "world_size": world, "own_shares": own_shares,
            "ranks": results, "first_divergence": first,
            "missing": missing, "tolerances": policy.describe(), "verdict": "divergent" if divergent else "aligned"}


def against_rank0(result: Mapping[str, Any]) -> bool:
    """Whether every rank of a ``check_run`` report was compared with rank 0 (else with the first of its
    replicas: a pipeline stage's, a tensor-parallel rank's)."""
    return {r.get("against", 0) for r in result["ranks"]} <= {0}


def missing_line(missing: list[dict], named: int = 8) -> str:
    """The rank pairs that could not be compared, as one line."""
    ranks = ", ".join(str(m["rank"]) for m in missing[:named]) + (f" and {len(missing) - named} more"
                                                                   if len(missing) > named else "")
    return (f"{len(missing)} rank(s) not compared with rank 0, so the result is incomplete: rank(s) {ranks}: "
            f"{missing[0]['reason']}")


def _execution_order(run: RankedRun) -> dict:
    order: dict[str, int] = {}
    calls = [r for r in run.records if isinstance(r, CallRecord)]
    for rec in sorted(calls, key=lambda r: (r.phase != "forward", r.begin)):
        order.setdefault(rec.path, len(order))
    return order


def rank_against_rank0(shared: dict[str, Any], job: dict[str, Any]) -> dict:
    """A task, where it runs: one rank against the first of its replicas (rank 0 where the whole run
    replicates), from those two ranks' traces alone."""
    how = Comparison(policy=TolerancePolicy.from_description(shared["policy"]), rules=ruleset(shared["rule_files"]),
                     rule_files=tuple(shared["rule_files"]))
    exempt = shared["exempt"]
    if isinstance(exempt, dict):  # by the kind of group: data-parallel replicas, or a replica's TP ranks
        exempt = exempt[job.get("exempt", "replicas")]
    with TraceReader(job["first"]) as first, TraceReader(job["other"]) as other:
        own_shares = shared.get("own_shares", True)
        report = align(RankView(first, exempt, own_shares), RankView(other, exempt, own_shares), how)
    return {"rank": job["rank"], "against": job["against"], "verdict": report["verdict"],
            "forward": report["forward"]["first_divergence"],
            "backward": report["backward"]["first_divergence"],
            "failing_tensors": report["forward"]["failing_tensors"] + report["backward"]["failing_tensors"],
            "params_differ": report["params"]["differ"]}
