"""The units of work on a Dask cluster (``--scheduler``): a LocalCluster of worker processes on this machine, the
tasks seen running in them, reports equal to the local pool's byte for byte (two traces' tensor slices, a run's
rank pairs), a worker killed for real mid-run (the report complete and unchanged; or, when the scheduler gives up
on the task, exit 3 with the missing ranks named), a file the workers cannot read (named, exit 3), bad input in a
task (one line, never retried). One cluster serves the file: starting one costs seconds."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

distributed = pytest.importorskip("distributed")

from layerdiff import api  # noqa: E402
from layerdiff.compare import tasks as compare_tasks  # noqa: E402
from layerdiff.compare.dask_pool import environment_restored  # noqa: E402
from layerdiff.compare.spec import Comparison  # noqa: E402
from layerdiff.compare.tasks import LocalPool, Workers  # noqa: E402
from layerdiff.compare.workers import StoredPair, compare_pairs, compare_slices  # noqa: E402
from layerdiff.errors import LayerdiffError  # noqa: E402
from layerdiff.judge.evaluate import align  # noqa: E402
from layerdiff.runs.desync import rank_against_rank0  # noqa: E402
from layerdiff.tracefile.reader import open_trace  # noqa: E402

from builders import data_parallel_run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes (with their nannies) and a client of our own to watch them. The environment is put back
    after (Dask's nanny leaves ``PYTHONHASHSEED`` in it, and the warm CLI interpreter of ``conftest.run_cli`` serves
    only an unchanged one)."""
    with environment_restored(), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                     scheduler_kwargs={"dashboard_address": ":0"},
                                     silence_logs=logging.CRITICAL) as local, \
            distributed.Client(local, set_as_default=False) as client:
        client.wait_for_workers(2)
        yield local.scheduler_address, client


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    """Eight data-parallel ranks whose rank 5 fell out of step in block 3 (real trace files)."""
    return data_parallel_run(tmp_path_factory.mktemp("dask") / "run8", 8, layers=6, hidden=384, batch=384,
                             desync=(5, 3))


def _worker_pids(client) -> dict:
    return client.run(os.getpid)


def _kill_when_busy(client, prefix: str, killed: list, deadline_s: float = 60):
    """Kill, for real (SIGKILL), the first worker process seen holding a task whose key starts with ``prefix``."""
    pids = _worker_pids(client)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for worker, keys in client.processing().items():
            if any(str(key).startswith(prefix) for key in keys):
                os.kill(pids[worker], 9)
                killed.append(worker)
                return
        time.sleep(0.005)


def test_two_traces_on_the_cluster_give_the_local_pools_report_byte_for_byte(cluster, recipe_trace, monkeypatch,
                                                                              tmp_path):
    pytest.importorskip("torch")
    address, client = cluster
    a, b = recipe_trace(), recipe_trace("eps")
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # small traces: send them to the local pool all the same
    local = api.align(a, b, workers=2).to_json()
    with distributed.get_task_stream(client=client) as stream:
        on_cluster = api.align(a, b, scheduler=address).to_json()
    assert on_cluster == local
    assert json.loads(local)["verdict"] == "divergent"
    slices = [task for task in stream.data if task["key"].startswith("compare_slices")]
    pids = _worker_pids(client)
    assert slices and {task["worker"] for task in slices} <= set(pids)  # the work ran in the worker processes
    assert os.getpid() not in pids.values()

    # the CLI, the scheduler taken from the environment: the same JSON report, byte for byte
    env = {**os.environ, "LAYERDIFF_SCHEDULER": address}
    done = subprocess.run([sys.executable, "-m", "layerdiff", "align", a, b, "-q", "--json", tmp_path / "r.json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    assert (tmp_path / "r.json").read_text() == local


def test_slices_of_large_tensors_merge_to_the_same_bits_wherever_they_ran(cluster, run8):
    """Tensors cut into many slices (1 MB each here) on the cluster and in the local pool: equal metrics."""
    address, _ = cluster
    with open_trace(run8 / "rank0.h5") as ra, open_trace(run8 / "rank5.h5") as rb:
        pairs = [StoredPair(ra.data_location(x), x.offset, x.dtype, rb.data_location(y), y.offset, y.dtype,
                            x.stats["numel"])
                 for rx, ry in zip(ra.records, rb.records) for x, y in zip(rx.tensors, ry.tensors)]
        local = compare_pairs(pairs, LocalPool(2), slice_bytes=1 << 18)
        with Workers(scheduler=address).pool() as pool:
            remote = compare_pairs(pairs, pool, slice_bytes=1 << 18)
    assert not remote.failed and remote.metrics == local.metrics
    assert any(not m["identical"] for m in local.metrics)


def test_ranks_on_the_cluster_survive_a_worker_killed_mid_run(cluster, run8, monkeypatch):
    """A worker process killed while it holds rank pairs: the scheduler runs them on the other worker, and the
    report is the local pool's, byte for byte."""
    address, client = cluster
    monkeypatch.setattr(compare_tasks, "LOCAL_MIN_BYTES", 0)  # a small run: to the local pool all the same
    local = api.align(run8, workers=2).to_json()
    killed: list = []
    killer = threading.Thread(target=_kill_when_busy, args=(client, "rank_against_rank0", killed))
    killer.start()
    on_cluster = api.align(run8, scheduler=address)
    killer.join()
    assert killed
    assert on_cluster.to_json() == local
    assert on_cluster.data["first_divergence"]["ranks"] == [5] and on_cluster.exit_code == 1
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it


def _kill_the_only_holder(client, prefix: str, killed: list, deadline_s: float = 60):
    """Kill (SIGKILL) the worker holding the only copy of the shared argument (the one key that is not a task
    ``prefix`` names) while it runs such a task."""
    pids = _worker_pids(client)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        held = [holders for key, holders in client.who_has().items() if not str(key).startswith(prefix)]
        if len(held) == 1 and len(held[0]) == 1:
            holder = held[0][0]
            if any(str(key).startswith(prefix) for key in client.processing().get(holder, ())):
                os.kill(pids[holder], 9)
                killed.append(holder)
                return
        time.sleep(0.01)


def test_the_shared_argument_outlives_the_worker_that_held_it(cluster):
    """The worker holding the only copy of the argument every task shares, killed while it runs a task: the task
    runs again elsewhere with the argument computed again, and every result is there. (A copy scattered to every
    worker was not enough: Dask's active memory manager drops the extra copies once one task is left waiting, so
    the run's last task was lost with its worker.)"""
    address, client = cluster

    def offset_by_base(shared, job):
        time.sleep(job["seconds"])
        return shared["base"] + job["n"]

    jobs = [{"n": n, "seconds": 0.1} for n in range(6)] + [{"n": 6, "seconds": 4.0}]  # the memory manager: every 2 s
    killed: list = []
    killer = threading.Thread(target=_kill_the_only_holder, args=(client, "offset_by_base", killed))
    killer.start()
    with Workers(scheduler=address).pool() as pool:
        done = pool.map(offset_by_base, {"base": 100}, jobs)
    killer.join()
    assert killed
    assert not done.failed and done.results == [100 + n for n in range(7)]
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it


def test_a_rank_the_cluster_gives_up_on_is_named_exit_3(cluster, tmp_path):
    """With the scheduler told to give up on a task whose worker died once, a worker killed mid-run leaves rank
    pairs uncompared: exit 3, the ranks named in one line, the others compared."""
    address, client = cluster
    run = data_parallel_run(tmp_path / "run", 6, layers=6, hidden=384, batch=384)

    def allowed_failures(dask_scheduler, value):
        old, dask_scheduler.allowed_failures = dask_scheduler.allowed_failures, value
        return old

    before = client.run_on_scheduler(allowed_failures, value=0)
    try:
        killed: list = []
        killer = threading.Thread(target=_kill_when_busy, args=(client, "rank_against_rank0", killed))
        killer.start()
        done = subprocess.run([sys.executable, "-m", "layerdiff", "align", run, "--scheduler", address, "-q",
                               "--json", tmp_path / "r.json"], capture_output=True, text=True, timeout=300)
        killer.join()
    finally:
        client.run_on_scheduler(allowed_failures, value=before)
    assert killed
    assert done.returncode == 3, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    missing = [m["rank"] for m in report["missing"]]
    assert missing and len(report["ranks"]) + len(missing) == 5
    assert all("KilledWorker" in m["reason"] and address in m["reason"] for m in report["missing"])
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aligned: all ")
    assert f"{len(missing)} rank(s) not compared with rank 0" in lines[0]
    assert f"rank(s) {', '.join(map(str, missing))}:" in lines[0]
    client.wait_for_workers(2, timeout=60)


def test_a_trace_the_workers_cannot_read_is_named_exit_3(cluster, recipe_trace, tmp_path):
    """The client reads B (its file is open here) but the workers, opening it by path, find no file: each tensor
    pair they could not compare is named, with the reason, and the aligned verdict is not trusted."""
    pytest.importorskip("torch")
    address, _ = cluster
    copy = tmp_path / "b.h5"
    shutil.copyfile(recipe_trace(), copy)
    with open_trace(recipe_trace()) as ra, open_trace(copy) as rb:
        copy.unlink()  # gone from the filesystem the workers see
        report = api.Report(align(ra, rb, Comparison(workers=Workers(scheduler=address))))
    missing = report.data["not_compared"]
    assert missing and all("FileNotFoundError" in m["reason"] and address in m["reason"] for m in missing)
    assert report.verdict == "aligned" and report.exit_code == 3
    assert report.problems[0].startswith(f"{len(missing)} tensor comparison(s) did not complete")
    assert missing[0]["path"] in report.problems[0] and "FileNotFoundError" in report.problems[0]
    row = next(r for r in report.records if r["path"] == missing[0]["path"] and r["call"] == missing[0]["call"])
    assert any("not compared: FileNotFoundError" in s for s in row["skipped"])


def test_bad_input_in_a_task_is_raised_at_once_and_other_failures_after_retries(cluster, tmp_path):
    address, client = cluster
    (tmp_path / "not_a_trace.h5").write_bytes(b"no HDF5 here")
    job = {"first": str(tmp_path / "not_a_trace.h5"), "other": str(tmp_path / "not_a_trace.h5"), "rank": 1,
           "against": 0}
    shared = {"exempt": [], "policy": Comparison().policy.describe(), "rule_files": []}
    with Workers(scheduler=address).pool() as pool:
        with pytest.raises(LayerdiffError, match="not_a_trace.h5"):
            pool.map(rank_against_rank0, shared, [job])
        done = pool.map(compare_slices, None, [{"files": [[str(tmp_path / "gone.h5"), 1 << 20, []]], "slices": []}])
    assert done.results == [None] and "FileNotFoundError" in done.failed[0]

    def attempts(dask_scheduler):  # how often the scheduler sent each task that ended in error to a worker
        log = list(dask_scheduler.transition_log)
        erred = {t[0] for t in log if t[2] == "erred"}
        return {key: sum(1 for t in log if t[0] == key and t[1:3] == ("waiting", "processing")) for key in erred}

    tries = [n for key, n in client.run_on_scheduler(attempts).items() if str(key).startswith("compare_slices")]
    assert tries and set(tries) == {3}  # each failing task: run, then retried twice


def test_an_unreachable_scheduler_is_one_line_exit_2(tmp_path, recipe_trace):
    pytest.importorskip("torch")
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s"}
    for address, said in (("tcp://127.0.0.1:9", "Timed out"), ("tcp://no-such-host.invalid:8786", "not found")):
        done = subprocess.run([sys.executable, "-m", "layerdiff", "align", recipe_trace(), recipe_trace(),
                               "--scheduler", address, "--json", tmp_path / "r.json"], capture_output=True,
                              text=True, env=env, timeout=120)
        assert done.returncode == 2 and not done.stdout, done.stdout + done.stderr
        assert done.stderr.startswith(f"layerdiff: error: cannot reach a Dask scheduler at {address}")
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "r.json").exists()
