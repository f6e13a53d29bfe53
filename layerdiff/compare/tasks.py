"""Where the units of work of an alignment run: in this process, in worker processes of our own, or on a Dask
cluster. The units are a function of plain data (trace paths, offsets, a rank number) that returns plain data
(running sums, a rank's verdict): the rank pairs of ``align RUN`` (``runs.desync``) and the slices of stored
tensors (``compare.workers``). Workers read the traces by path, so nothing big travels with a task.

``Workers`` is the option (``--workers``, ``--scheduler``), part of the ``Comparison``; ``Workers.pool()`` opens
a ``TaskPool`` and ``TaskPool.map`` runs a function over jobs, reporting each finished task to a progress
callback. Every pool retries a task whose worker died or which raised (``RETRIES`` times); a ``LayerdiffError``
in a task is bad input, raised at once, never retried. What the pools do then differs, and is their own business:
the local pool compares what is still failing in this process, as without workers (the traces are here), while
a Dask pool returns it as failed, with the reason, for the report to name (the traces may be terabytes that
this machine was never meant to read).

Worker processes of our own, not ``multiprocessing``: the caller's ``__main__`` is never imported again (a script
without a main guard would run twice) and no process that may hold threads (a progress bar's) is forked. They
speak one JSON line each way: the function and its shared argument first, then one job per line.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import selectors
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Protocol, Sequence, cast

from layerdiff.errors import LayerdiffError, first_line

SCHEDULER_ENV = "LAYERDIFF_SCHEDULER"  # the scheduler when --scheduler is not given (a cluster's job script sets it)
LOCAL_CLUSTER = "local"  # --scheduler local: a Dask LocalCluster of processes on this machine
RETRIES = 2  # a task that failed runs again this many times (on another worker, where there is one)
IN_FLIGHT = 2  # jobs sent ahead to each local worker, so it never waits for the parent
# bytes a side: below it, starting local worker processes (~0.3 s each to import what a task needs, more on a busy
# machine) costs more than they save
LOCAL_MIN_BYTES = 512 << 20
# scheme://host:port, host:port or [ipv6]:port: what a Dask scheduler listens on (tcp, tls, ucx, ws, wss, inproc)
_ADDRESS = re.compile(r"^(?:[a-z][a-z0-9+.-]*://)?(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


def scheduler_address(given: str | None) -> tuple[str | None, str]:
    """The scheduler to use and where it was named: ``given`` (``--scheduler``), else ``$LAYERDIFF_SCHEDULER``
    (an empty value is none)."""
    if given is not None:
        return given, "--scheduler"
    return os.environ.get(SCHEDULER_ENV) or None, f"${SCHEDULER_ENV}"


def worker_count(requested: int | None) -> int:
    """``requested`` processes, or one per core this process may run on (at most 8) when None."""
    if requested is not None:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))  # a container's or taskset's share, not the machine's
    except AttributeError:  # no affinity call on this system
        cores = os.cpu_count() or 1
    return min(cores, 8)


@dataclass(frozen=True)
class Workers:
    """Where the units of work run: ``count`` processes of this machine (None: one per core; 1: this process), or
    the Dask cluster whose scheduler is at ``scheduler`` (an address, a scheduler file, or "local" for a
    LocalCluster of ``count`` processes started for this comparison)."""

    count: int | None = 1
    scheduler: str | None = None

    @classmethod
    def of(cls, count: int | None = None, scheduler: str | None = None, source: str = "--scheduler") -> Workers:
        """Checked once (``source``: where ``scheduler`` was named, for the message); a bad value is a
        ``LayerdiffError`` naming the option."""
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise LayerdiffError(f"--workers must be a whole number >= 1, not {count!r}")
        if scheduler is None:
            return cls(count, None)
        if not isinstance(scheduler, str) or not scheduler.strip():
            raise LayerdiffError(f"{source} must name a Dask scheduler (tcp://HOST:PORT, a scheduler file, or "
                                 f"'{LOCAL_CLUSTER}'), not {scheduler!r}")
        scheduler = scheduler.strip()
        if scheduler != LOCAL_CLUSTER:
            if not (_ADDRESS.match(scheduler) or Path(scheduler).is_file()):
                raise LayerdiffError(f"{source} {scheduler!r} is not a Dask scheduler's address (tcp://HOST:PORT), "
                                     f"an existing scheduler file, or '{LOCAL_CLUSTER}'")
            if count is not None:
                raise LayerdiffError(f"--workers sets the processes of this machine; with {source} {scheduler} the "
                                     f"cluster's workers compare (--scheduler {LOCAL_CLUSTER} --workers N starts N)")
        return cls(count, scheduler)

    @property
    def parallel(self) -> bool:
        """Whether units go anywhere but this process."""
        return self.scheduler is not None or worker_count(self.count) > 1

    def sends(self, nbytes: int) -> bool:
        """Whether units that read ``nbytes`` (a side) go to workers: always to a cluster (it is given so that this
        machine does not read them), to processes of this machine from ``LOCAL_MIN_BYTES`` on."""
        if not self.parallel or nbytes <= 0:
            return False
        return self.scheduler is not None or nbytes >= LOCAL_MIN_BYTES

    @contextmanager
    def pool(self, most: int | None = None, nbytes: int | None = None) -> Iterator[TaskPool]:
        """The pool the units run in (``most``: how many tasks there are, so no idle process is started;
        ``nbytes``: what they read, a side, when this process should take them if that is too little to send)."""
        if self.scheduler is None:
            size = 1 if nbytes is not None and not self.sends(nbytes) else worker_count(self.count)
            yield LocalPool(min(size, most) if most is not None else size)
            return
        from layerdiff.compare.dask_pool import DaskPool  # Dask is imported only when a scheduler is given

        with DaskPool.connect(self.scheduler, self.count) as pool:
            yield pool


@dataclass
class TaskResults:
    """Each job's result, in job order (None where it failed), and why each failed job failed."""

    results: list[Any]
    failed: dict[int, str] = field(default_factory=dict)


class TaskPool(Protocol):
    """Runs ``function(shared, job)`` for every job; ``progress(i)`` is called as job ``i`` finishes."""

    where: str  # in words, for messages: "2 local processes", "the Dask cluster at tcp://10.0.0.5:8786"

    def map(self, function: Callable[[Any, Any], Any], shared: Any, jobs: Sequence[Any],
            progress: Callable[[int], None] | None = None) -> TaskResults: ...


def function_name(function: Callable) -> str:
    """``module:qualname``, how a worker process finds a task's function (only layerdiff's own)."""
    name = f"{function.__module__}:{function.__qualname__}"
    if not name.startswith("layerdiff.") or "<" in name:
        raise ValueError(f"{name}: a task's function must be a module-level function of layerdiff")
    return name


def run_task(function: Callable[[Any, Any], Any], shared: Any, job: Any) -> tuple[str, Any]:
    """One task, where it runs: ("ok", result), or ("bad_input", message) for a ``LayerdiffError`` (bad input is
    the same on every worker: it is not retried but raised by the caller)."""
    try:
        return "ok", function(shared, job)
    except LayerdiffError as exc:
        return "bad_input", str(exc)


class LocalPool:
    """``size`` worker processes of our own (this process itself when 1), fed jobs as they finish earlier ones.
    This process takes jobs too, from the other end of the queue, whenever no reply is waiting: a new interpreter
    takes ~0.3 s to import what a task needs, so a few small jobs are done here before the workers are up, and
    workers only ever add. A job whose worker died (a new one takes its place) or which raised is sent again,
    ``RETRIES`` times; what still fails then is run in this process, so the results are always complete (or this
    process raises, as it would without workers)."""

    def __init__(self, size: int):
        self.size = max(size, 1)
        self.where = "this process" if self.size == 1 else f"{self.size} local processes"

    def map(self, function, shared, jobs, progress=None) -> TaskResults:
        results: list[Any] = [None] * len(jobs)

        def here(i: int):
            results[i] = function(shared, jobs[i])
            if progress is not None:
                progress(i)

        todo = list(range(len(jobs)))
        if self.size > 1 and len(jobs) > 1:
            todo = _Processes(function_name(function), shared, min(self.size, len(jobs))).run(jobs, results,
                                                                                               progress, here)
        for i in todo:  # without workers, or what the workers could not do
            here(i)
        return TaskResults(results)


class _Processes:
    """The worker processes of a ``LocalPool`` and the lines they exchange with it, for one ``map``."""

    def __init__(self, function: str, shared: Any, size: int):
        self.header = json.dumps({"function": function, "shared": shared})
        self.size = size
        self.restarts = size * RETRIES  # replacements for workers that died, over the whole map
        self.procs: dict[int, subprocess.Popen] = {}
        self.ready: set[int] = set()  # workers that said they can take jobs
        self.given: dict[int, list[int]] = {}  # worker pid -> the jobs it holds
        self.buffers: dict[int, bytes] = {}
        self.queue: list[int] = []  # jobs waiting for a worker
        self.attempts: list[int] = []  # failed attempts of each job
        self.left: list[int] = []  # jobs that failed every attempt: this process runs them
        self.selector = selectors.DefaultSelector()
        package_root = str(Path(__file__).resolve().parents[2])  # this very layerdiff, installed or not
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                               os.environ.get("PYTHONPATH")]))}

    def _start(self):
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, env=self.env)
        except OSError:  # no process can start here: this process does the work
            return
        self.procs[proc.pid], self.given[proc.pid], self.buffers[proc.pid] = proc, [], b""
        self.selector.register(cast(IO[bytes], proc.stdout), selectors.EVENT_READ, proc)
        self._send(proc, self.header)  # a worker that died at once is found by its output's end

    @staticmethod
    def _send(proc: subprocess.Popen, line: str) -> bool:
        try:
            assert proc.stdin is not None
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def run(self, jobs: Sequence[Any], results: list[Any], progress, here: Callable[[int], None]) -> list[int]:
        """Fill ``results`` with what the workers computed (``here(i)`` runs job ``i`` in this process while no
        reply is waiting); returns the jobs left to run in this process."""
        self.queue, self.attempts = list(range(len(jobs))), [0] * len(jobs)
        try:
            for _ in range(self.size):
                self._start()
            while self.queue or any(self.given.values()):
                if self.queue and not self.procs:
                    break  # no worker left: this process does the rest
                events = self.selector.select(timeout=0 if self.queue else None)
                if self.queue and not events:
                    here(self.queue.pop())  # from the end: workers take from the front
                    continue
                for key, _ in events:
                    proc = key.data
                    if proc.pid in self.procs:
                        self._read(proc, jobs, results, progress)
            return sorted(self.left + self.queue)
        finally:
            self.close()

    def _read(self, proc: subprocess.Popen, jobs, results, progress):
        assert proc.stdout is not None
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        *lines, self.buffers[proc.pid] = (self.buffers[proc.pid] + chunk).split(b"\n")
        try:
            replies = [json.loads(line) for line in lines]
            held = self.given[proc.pid]
            if not all(isinstance(done, dict) and (done.get("id") in held or done.get("ready")) for done in replies):
                raise ValueError("a reply to no job it holds")
        except ValueError:  # not a line this protocol writes: the worker is not sane, and is let go
            chunk, replies = b"", []
        for done in replies:
            if done.get("ready"):
                self.ready.add(proc.pid)
                continue
            i = done["id"]
            self.given[proc.pid].remove(i)
            if "bad_input" in done:
                raise LayerdiffError(done["bad_input"])
            if "error" in done:
                self._again(i)
                continue
            results[i] = done["result"]
            if progress is not None:
                progress(i)
        if not chunk:  # the worker died: what it held goes to the others, and a new one takes its place
            self.selector.unregister(cast(IO[bytes], proc.stdout))
            del self.procs[proc.pid]
            self.ready.discard(proc.pid)
            _stop(proc)
            for i in self.given.pop(proc.pid):
                self._again(i)
            if self.restarts > 0:
                self.restarts -= 1
                self._start()
        self._feed_all(jobs)

    def _again(self, i: int):
        """A failed attempt: once more on the pool, or in this process at the end."""
        self.attempts[i] += 1
        if self.attempts[i] <= RETRIES:
            self.queue.insert(0, i)
        else:
            self.left.append(i)

    def _feed_all(self, jobs):
        for pid in sorted(self.ready):
            proc = self.procs[pid]
            while self.queue and len(self.given[pid]) < IN_FLIGHT:
                i = self.queue.pop(0)
                self.given[pid].append(i)
                if not self._send(proc, json.dumps({"id": i, "job": jobs[i]})):
                    break  # it died: its output's end gives its jobs back

    def close(self):
        for proc in self.procs.values():
            _stop(proc)
        self.procs = {}
        self.selector.close()


def _stop(proc: subprocess.Popen):
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def main():
    """A local worker: the function and its shared argument on the first line, then one job per line; a line
    {"ready": true} once it can take jobs, then one line back per job ({"id", "result"}, {"id", "bad_input"} or
    {"id", "error"})."""
    lines = sys.stdin.buffer
    header = json.loads(lines.readline())
    module, _, name = header["function"].partition(":")
    if not module.startswith("layerdiff."):
        raise SystemExit(f"not a layerdiff function: {header['function']}")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    function: Callable[[Any, Any], Any] = found
    shared, out = header["shared"], sys.stdout.buffer
    sys.stdout = sys.stderr  # what a task prints must not mix with the replies
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in lines:
        task = json.loads(line)
        try:
            kind, value = run_task(function, shared, task["job"])
            reply = {"id": task["id"], "result" if kind == "ok" else kind: value}
        except Exception as exc:  # noqa: BLE001  (sent back: the parent retries the job, then runs it itself)
            reply = {"id": task["id"], "error": f"{type(exc).__name__}: {first_line(exc)}"}
        out.write(json.dumps(reply).encode() + b"\n")  # json: keeps inf/nan
        out.flush()


if __name__ == "__main__":
    main()
