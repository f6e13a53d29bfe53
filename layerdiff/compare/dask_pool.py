"""The units of work of an alignment as tasks on a ``dask.distributed`` cluster (``--scheduler``).

Imported only when a scheduler is given: Dask is an optional extra (``pip install 'layerdiff[dask]'``). The
client submits one task per job, keyed by the function's name, with the shared argument sent once as a task of its
own; the workers open the traces by the paths in the jobs (a filesystem they share with this machine) and send
back running sums or a rank's verdict. A task that raised runs again (``RETRIES``); a task whose worker died is
rescheduled by the scheduler on another worker (up to its ``distributed.scheduler.allowed-failures``). A task that
still fails is returned as failed, with the reason: the caller names it in the report, never silently.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from layerdiff.compare.tasks import LOCAL_CLUSTER, RETRIES, TaskResults, run_task, worker_count
from layerdiff.errors import LayerdiffError, first_line
from layerdiff.version import __version__

WAIT_FOR_WORKERS_S = 60  # a cluster with no worker yet (an HPC job still queued): how long to wait for the first


def worker_version(_: Any = None) -> str:
    """The version of layerdiff a worker runs (it must be this one: the task functions and their results are)."""
    return __version__


@contextmanager
def environment_restored() -> Iterator[None]:
    """The process's environment variables put back as they were on exit. Dask's nanny sets its pre-spawn variables
    (``PYTHONHASHSEED=6640``) in the environment of the process that starts a local cluster, before each worker it
    spawns, and never takes them back: an ``align(..., scheduler="local")`` left them in the caller's process (and
    every process it started later inherited them)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in [key for key in os.environ if key not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


class DaskPool:
    """Tasks on the Dask cluster a ``Client`` is connected to."""

    def __init__(self, client, where: str):
        self.client = client
        self.where = where

    @classmethod
    @contextmanager
    def connect(cls, scheduler: str, count: int | None) -> Iterator[DaskPool]:
        """A pool on the scheduler at ``scheduler`` (an address or a scheduler file), or on a LocalCluster of
        ``count`` processes (one per core when None) started here and closed after, for "local". The caller's
        environment is as it was afterwards (``environment_restored``)."""
        with environment_restored(), cls._connected(scheduler, count) as pool:
            yield pool

    @classmethod
    @contextmanager
    def _connected(cls, scheduler: str, count: int | None) -> Iterator[DaskPool]:
        try:
            import distributed
        except ImportError:
            raise LayerdiffError("--scheduler needs Dask: pip install 'layerdiff[dask]'") from None
        cluster = None
        try:
            if scheduler == LOCAL_CLUSTER:
                processes = worker_count(count)
                cluster = distributed.LocalCluster(
                    n_workers=processes, threads_per_worker=1, processes=True, dashboard_address=None,
                    scheduler_kwargs={"dashboard_address": ":0"},  # its HTTP server on a free port: 8787 may be taken
                    silence_logs=logging.CRITICAL)
                where = f"a local Dask cluster of {processes} processes"
                client = distributed.Client(cluster, set_as_default=False)
            elif Path(scheduler).is_file():
                client = distributed.Client(scheduler_file=scheduler, set_as_default=False)
                where = f"the Dask cluster of {scheduler}"
            else:
                _check_host(scheduler)
                client = distributed.Client(scheduler, set_as_default=False)
                where = f"the Dask cluster at {scheduler}"
        except (OSError, TimeoutError, ValueError, TypeError, RuntimeError) as exc:
            if cluster is not None:
                cluster.close()
            if scheduler == LOCAL_CLUSTER:  # its workers import the caller's script again (multiprocessing's spawn)
                raise LayerdiffError(f"cannot start a local Dask cluster: {first_line(exc, 200)} (a script that asks "
                                     "for scheduler='local' needs if __name__ == '__main__':)") from None
            raise LayerdiffError(f"cannot reach a Dask scheduler at {scheduler}: {first_line(exc, 200)}") from None
        try:
            _check_workers(client, where)
            yield cls(client, where)
        finally:
            client.close()
            if cluster is not None:
                cluster.close()

    def map(self, function: Callable[[Any, Any], Any], shared: Any, jobs: Sequence[Any],
            progress: Callable[[int], None] | None = None) -> TaskResults:
        from distributed import as_completed

        results: list[Any] = [None] * len(jobs)
        failed: dict[int, str] = {}
        if not jobs:
            return TaskResults(results)
        run = uuid.uuid4().hex[:12]
        # the shared argument goes to the scheduler once (not with every task), as a task of its own: if the worker
        # holding its result dies, the scheduler computes it again. Scattered data could not be: Dask's active
        # memory manager drops a broadcast's extra copies, and the one left may be on the worker that dies.
        shared_ref = self.client.submit(_same, shared, key=f"shared-{run}", pure=False) \
            if shared is not None else None
        futures = [self.client.submit(run_task, function, shared_ref, job, key=f"{function.__name__}-{run}-{i}",
                                      retries=RETRIES, pure=False) for i, job in enumerate(jobs)]
        number = {future.key: i for i, future in enumerate(futures)}
        try:
            for future in as_completed(futures, loop=self.client.loop):
                i = number[future.key]
                if future.status == "error":
                    failed[i] = _reason(future.exception())
                elif future.status != "finished":  # cancelled: the scheduler lost it (restarted, closed)
                    failed[i] = f"the task was {future.status} by the scheduler"
                else:
                    kind, value = future.result()
                    if kind == "bad_input":
                        raise LayerdiffError(value)
                    results[i] = value
                future.release()  # its result is here now: the cluster may forget it
                if progress is not None:
                    progress(i)
        finally:
            self.client.cancel([f for f in futures if not f.done()])
            if shared_ref is not None:
                shared_ref.release()
        return TaskResults(results, failed)


def _same(value: Any) -> Any:
    return value


def _check_host(address: str):
    """A host name that does not resolve is one line at once (Dask would retry it until its connect timeout)."""
    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, location = parse_address(address)
    if scheme not in ("tcp", "tls", "ws", "wss"):
        return
    host, _ = parse_host_port(location)
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise LayerdiffError(f"cannot reach a Dask scheduler at {address}: host {host!r} not found "
                             f"({first_line(exc, 100)})") from None


def _check_workers(client, where: str):
    """The cluster has a worker, and its workers run this layerdiff: otherwise one line now, not a failure per
    task later."""
    try:
        client.wait_for_workers(1, timeout=WAIT_FOR_WORKERS_S)
    except TimeoutError:
        raise LayerdiffError(f"{where} has no workers (none joined in {WAIT_FOR_WORKERS_S} s)") from None
    try:
        theirs = client.submit(worker_version, key=f"worker_version-{uuid.uuid4().hex[:12]}", pure=False).result()
    except Exception as exc:  # noqa: BLE001  (whatever a worker that cannot run layerdiff raises)
        raise LayerdiffError(f"the workers of {where} cannot run layerdiff ({_reason(exc)}): install layerdiff "
                             f"{__version__} where they run") from None
    if theirs != __version__:
        raise LayerdiffError(f"the workers of {where} run layerdiff {theirs}, this is {__version__}: install the "
                             "same version on both")


def _reason(exc: BaseException | None) -> str:
    """Why a task failed, in one line: a worker that died every time it ran it, or what it raised."""
    name = type(exc).__name__
    if name == "KilledWorker":
        return "its worker died each time it ran it (KilledWorker)"
    return f"{name}: {first_line(exc, 200)}" if exc is not None else "failed"

