#!/usr/bin/env python
"""The units of work on a Dask cluster (``--scheduler``) against the local pool: what a task costs, how fast an
8-rank run is compared on this machine's workers, and whether a worker's memory stays flat. Prints numbers;
asserts nothing.

    python tools/bench_dask.py                 # ~2 min on 2 cores
    python tools/bench_dask.py --quick         # smaller and fewer (checks the tool)
    python tools/bench_dask.py --json docs/benchmarks/data/bench_dask.json

Needs layerdiff[dask]. On this 2-core machine a cluster of 2 workers measures overhead, not scaling: the work is
the local pool's, and the figures say what sending it through a scheduler adds.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # builders: the synthetic run of ranks
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib
import benchlib  # noqa: E402

TITLE = "Comparing on a Dask cluster: overhead per task, an 8-rank run, memory per worker"
METHOD = """A LocalCluster of 2 worker processes (1 thread each, with their nannies) on this machine, against the
local pool (`--workers 2`, processes of layerdiff's own, the driving process taking tasks too) and against one
process. Overhead per task: tasks that
compare one tiny slice (1024 float32 a side, read from a trace file), run in batches of N and 4N; the marginal
wall time per task (the difference of the two batches over 3N tasks, so fixed costs such as starting the local
pool's processes cancel), best of 3, for each pool. An 8-rank run: a data-parallel run written by
tests/builders.py (8 rank files of a model of linear layers and norms, rank 5 out of step in one block), compared
rank against rank 0 (`layerdiff align RUN`, 7 rank pairs, each a task that opens its two rank files), median of 3:
in one process, in the local pool, on the running cluster (the client's connection included), and with
`--scheduler local` (starting and closing the LocalCluster included). Memory per worker: each worker's resident
set (RSS) and peak (VmHWM) after each of several repeats of the 8-rank comparison on the cluster, and a worker's
peak after comparing runs of 8 and 32 ranks of small rank files (workers restarted before each)."""


def worker_memory() -> dict:
    """Runs on a worker (pickled by value): its resident set and peak, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def tiny_jobs(path: Path, n: int) -> list:
    """``n`` slice tasks of 1024 float32 a side, from one tensor of a real trace file."""
    from layerdiff.compare.workers import StoredPair, slices_job
    from layerdiff.tracefile.reader import open_trace

    with open_trace(path) as reader:
        entry = next(t for r in reader.records for t in r.tensors if t.offset is not None)
        location = reader.data_location(entry)
    pair = StoredPair(location, entry.offset, entry.dtype, location, entry.offset, entry.dtype, 1024)
    return [slices_job([(0, pair, 0, 1024, pair.nbytes())]) for _ in range(n)]


def per_task(pool, jobs_small: list, jobs_large: list, repeat: int) -> tuple[float, float]:
    """(marginal seconds per task, wall of the large batch), best of ``repeat``."""
    from layerdiff.compare.workers import compare_slices

    marginal, wall = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        pool.map(compare_slices, None, jobs_small)
        t1 = time.perf_counter()
        pool.map(compare_slices, None, jobs_large)
        t2 = time.perf_counter()
        marginal.append(((t2 - t1) - (t1 - t0)) / (len(jobs_large) - len(jobs_small)))
        wall.append(t2 - t1)
    return min(marginal), min(wall)


def timed(fn, repeat: int) -> tuple[float, list]:
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), walls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run and fewer repeats")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--quiet-budget", type=float, metavar="SECONDS",
                        help="wait up to this long in all for other processes to leave the CPUs idle before each "
                             "measurement (default 180; --quick: 0)")
    args = parser.parse_args(argv)
    benchlib.WAITER.budget = args.quiet_budget if args.quiet_budget is not None else (0 if args.quick else 180)
    import distributed

    from builders import data_parallel_run
    from layerdiff import api
    from layerdiff.compare.tasks import LOCAL_MIN_BYTES, LocalPool, Workers

    run = benchlib.BenchRun("bench_dask", TITLE, METHOD, packages=("numpy", "h5py", "dask", "distributed"))
    repeat, n_tasks, memory_repeats = (1, 100, 3) if args.quick else (3, 500, 10)
    hidden, batch, layers = (256, 256, 4) if args.quick else (768, 512, 8)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = data_parallel_run(Path(tmp) / "run8", 8, layers=layers, hidden=hidden, batch=batch, desync=(5, 3))
        rank_bytes = os.path.getsize(ranks / "rank0.h5")
        benchlib.log(f"8-rank run: {rank_bytes / 1e6:.0f} MB per rank file, {layers} blocks, hidden {hidden}, "
                     f"batch {batch}")
        small, large = tiny_jobs(ranks / "rank0.h5", n_tasks), tiny_jobs(ranks / "rank0.h5", 4 * n_tasks)

        benchlib.WAITER.wait()
        t0 = time.perf_counter()
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                           scheduler_kwargs={"dashboard_address": ":0"}, silence_logs=logging.CRITICAL)
        client = distributed.Client(cluster, set_as_default=False)
        client.wait_for_workers(2)
        cluster_start = time.perf_counter() - t0
        address = cluster.scheduler_address
        try:
            overhead = {}
            for name, pool_of in (("one process", lambda: nullcontext(LocalPool(1))),
                                  ("local pool, 2 processes", lambda: nullcontext(LocalPool(2))),
                                  ("Dask, 2 workers", lambda: Workers(scheduler=address).pool())):
                benchlib.WAITER.wait()
                with pool_of() as pool:
                    overhead[name] = per_task(pool, small, large, repeat)
                benchlib.log(f"{name:26} {overhead[name][0] * 1e3:7.3f} ms per task "
                             f"({len(large)} tasks in {overhead[name][1]:.2f} s)")

            throughput = {}
            for name, kwargs in (("one process", {"workers": 1}), ("--workers 2 (the local pool)", {"workers": 2}),
                                 ("Dask, 2 workers (running cluster)", {"scheduler": address}),
                                 ("--scheduler local (cluster started)", {"scheduler": "local", "workers": 2})):
                report = api.align(ranks, **kwargs)
                assert report.data["first_divergence"]["ranks"] == [5], name  # the same answer everywhere
                benchlib.WAITER.wait()
                throughput[name] = timed(lambda kwargs=kwargs: api.align(ranks, **kwargs), repeat)
                benchlib.log(f"{name:38} {throughput[name][0]:6.2f} s for 7 rank pairs "
                             f"({7 / throughput[name][0]:5.1f} pairs/s)")

            memory = []
            for i in range(memory_repeats):
                api.align(ranks, scheduler=address)
                memory.append(client.run(worker_memory))
            workers = sorted(memory[0])
            rss = {w: [m[w]["VmRSS"] for m in memory] for w in workers}
            hwm = {w: [m[w]["VmHWM"] for m in memory] for w in workers}
            for n, w in enumerate(workers):
                benchlib.log(f"worker {n}: RSS after each of {memory_repeats} runs "
                             + " ".join(f"{x / 1e6:.0f}" for x in rss[w]) + f" MB; peak {max(hwm[w]) / 1e6:.0f} MB")

            by_world = {}  # a worker's peak against the number of ranks (small rank files, fresh worker processes)
            for world in (8, 32) if not args.quick else (4, 8):
                small_run = data_parallel_run(Path(tmp) / f"small{world}", world, layers=4, hidden=256, batch=256,
                                              desync=(1, 2))
                client.restart()
                client.wait_for_workers(2)
                api.align(small_run, scheduler=address)
                by_world[world] = max(m["VmHWM"] for m in client.run(worker_memory).values())
                benchlib.log(f"{world} ranks: a worker's peak {by_world[world] / 1e6:.0f} MB")
        finally:
            client.close()
            cluster.close()

    base = overhead["local pool, 2 processes"][0]
    dask_overhead = overhead["Dask, 2 workers"][0]
    results = {
        "rank_file_bytes": rank_bytes, "ranks": 8, "rank_pairs": 7, "cluster_start_s": cluster_start,
        "per_task_s": {name: v[0] for name, v in overhead.items()},
        "dask_minus_local_per_task_s": dask_overhead - base,
        "rank_run_s": {name: v[0] for name, v in throughput.items()},
        "rank_run_walls_s": {name: v[1] for name, v in throughput.items()},
        "worker_rss_bytes": [rss[w] for w in workers], "worker_peak_bytes": [hwm[w] for w in workers],
        "worker_rss_growth_bytes": [rss[w][-1] - rss[w][0] for w in workers],
        "worker_peak_by_ranks_bytes": by_world,
        "waited_for_quiet_s": benchlib.WAITER.waited,
    }
    benchlib.log(f"Dask adds {(dask_overhead - base) * 1e3:.2f} ms per task over the local pool; "
                 f"starting a LocalCluster of 2 took {cluster_start:.2f} s")
    if args.json:
        dask_run = throughput["Dask, 2 workers (running cluster)"][0]
        growth = max(abs(g) for g in results["worker_rss_growth_bytes"]) / 1e6
        headline = (f"{dask_overhead * 1e3:.1f} ms per task on Dask vs {base * 1e3:.2f} ms in the local pool; "
                    f"8 ranks in {dask_run:.2f} s on 2 Dask workers vs "
                    f"{throughput['--workers 2 (the local pool)'][0]:.2f} s locally; worker memory flat "
                    f"(within {growth:.1f} MB over {memory_repeats} runs)")
        tables = [
            benchlib.table("Overhead per task (tiny slices: the cost of a task, not of its arithmetic)",
                           ["where", "per task", f"{len(large)} tasks"],
                           [[name, f"{v[0] * 1e3:.3f} ms", f"{v[1]:.2f} s"] for name, v in overhead.items()],
                           note=f"Marginal wall time per task, best of {repeat}. Starting the LocalCluster of 2 "
                                f"took {cluster_start:.2f} s (not included)."),
            benchlib.table("An 8-rank run (`align RUN`: 7 rank pairs)",
                           ["where", "wall (median)", "rank pairs/s", "walls"],
                           [[name, f"{v[0]:.2f} s", f"{7 / v[0]:.1f}", benchlib.fmt_list(v[1])]
                            for name, v in throughput.items()],
                           note=f"Rank files of {rank_bytes / 1e6:.0f} MB each; 2 cores: overhead, not scaling. "
                                "`--workers 2` sends rank pairs to its processes when they read over 512 MB a "
                                "side (here: " + ("yes" if 7 * rank_bytes >= LOCAL_MIN_BYTES else "no, all in one "
                                "process") + "); the process that drives them takes rank pairs too."),
            benchlib.table("Memory per Dask worker over repeated 8-rank runs",
                           ["worker", "RSS after each run (MB)", "peak (MB)", "growth after the first run"],
                           [[str(n), " ".join(f"{x / 1e6:.0f}" for x in rss[w]), f"{max(hwm[w]) / 1e6:.0f}",
                             f"{results['worker_rss_growth_bytes'][n] / 1e6:+.1f} MB"]
                            for n, w in enumerate(workers)]),
            benchlib.table("A worker's peak memory against the number of ranks",
                           ["ranks", "rank pairs", "a worker's peak (MB)"],
                           [[world, world - 1, f"{peak / 1e6:.0f}"] for world, peak in by_world.items()],
                           note="The same small rank files (4 blocks, hidden 256), workers restarted before each: a "
                                "task opens its two rank files only."),
        ]
        run.write(args.json, quick=args.quick, headline=headline, tables=tables, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
