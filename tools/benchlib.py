"""Helpers shared by the benchmark tools: the toy model's size, timing of steps, the machine's load while a block
runs, the printing of profiles, and the JSON document every tool writes with ``--json PATH`` (``BenchRun``), from
which tools/bench_pages.py generates docs/benchmarks/. Standard library only at import time."""
from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL_KW = dict(layers=4, hidden=256, heads=8, kv_heads=8, vocab=32000, intermediate=688, batch=2, seq=128)
MB = 1e6
QUIET_CORES = 0.3  # a block is "quiet" when other processes kept less than this many cores busy


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def log(msg: str = ""):
    print(msg, flush=True)


def quiet_disk():
    """Write back all dirty pages so the next measurement does not pay for the previous one."""
    os.sync()


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def med(xs):
    return statistics.median(xs) if xs else float("nan")


class Load:
    """CPU cores kept busy by other processes during a block (machine busy time minus ours and our children's)."""

    def __init__(self):
        self.busy0, self.own0, self.t0 = self._busy(), self._own(), time.perf_counter()

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def others(self, extra_own: float = 0.0) -> float:
        """extra_own: CPU seconds of descendants not yet reaped by us (e.g. grandchildren)."""
        wall = time.perf_counter() - self.t0
        return max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0) - extra_own) / max(wall, 1e-9)


class QuietWaiter:
    """Before a measurement, wait (within a total time budget) until other processes leave the CPUs idle."""

    def __init__(self, budget: float):
        self.budget = budget
        self.waited = 0.0

    def wait(self, window: float = 0.25):
        while self.waited < self.budget:
            load = Load()
            time.sleep(window)
            if load.others() < QUIET_CORES:
                return
            self.waited += window


WAITER = QuietWaiter(0.0)


def timed_steps(step, n: int):
    walls, cpus = [], []
    for _ in range(n):
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus


@contextlib.contextmanager
def collector_time():
    """Seconds the garbage collector spent, per generation (0 young, 2 full passes over every object), while the
    block ran: ``{generation: [collections, seconds]}``, filled in as it runs."""
    spent: dict[int, list] = {}
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            entry = spent.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield spent
    finally:
        gc.callbacks.remove(callback)


def fmt_list(xs, unit="s"):
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]" + unit


def drop_cache(path):
    """Evict one file's pages from the page cache (after writing them back); other files are untouched."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def hot_functions(profile, top: int = 12) -> list[dict]:
    import pstats

    st = pstats.Stats(profile)
    total = st.total_tt or 1e-12
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        name = func if file == "~" else f"{'/'.join(Path(file).parts[-2:])}:{line}({func})"
        rows.append({"function": name, "ncalls": nc, "tottime": tt, "cumtime": ct, "share": tt / total})
    rows.sort(key=lambda r: r["tottime"], reverse=True)
    return [{"total_s": total}] + rows[:top]


def print_hot(title: str, rows: list[dict]):
    log(f"  {title}: {rows[0]['total_s']:.3f} s profiled; top functions by own time")
    log(f"    {'tottime s':>9} {'share':>6} {'cumtime s':>9} {'ncalls':>7}  function")
    for r in rows[1:]:
        log(f"    {r['tottime']:9.3f} {r['share']:6.1%} {r['cumtime']:9.3f} {r['ncalls']:7d}  {r['function']}")



def run_block(model, step, opts, k: int, path):
    import layerdiff

    quiet_disk()
    WAITER.wait()
    load = Load()
    if opts is None:
        walls, cpus = timed_steps(step, k)
        return {"walls": walls, "cpus": cpus, "others": load.others()}
    with layerdiff.trace(model, path, overwrite=True, **opts) as tracer:
        writer = tracer.session.writer
        first, _ = timed_steps(step, 1)
        bytes0, records0 = writer.tensor_bytes, writer.records_written
        walls, cpus = timed_steps(step, k)
        bytes_per_step = (writer.tensor_bytes - bytes0) / k
        records_per_step = (writer.records_written - records0) / k
        t_exit = time.perf_counter()
    out = {"walls": walls, "cpus": cpus, "others": load.others(), "first_step": first[0],
           "close_s": time.perf_counter() - t_exit, "steps": k + 1, "tensor_bytes": writer.tensor_bytes,
           "file_bytes": os.path.getsize(path), "tensor_bytes_per_step": bytes_per_step,
           "records_per_step": records_per_step}
    os.remove(path)
    return out


# ---------------------------------------------------------------------------------------------------------
# --json PATH: one document per run, read by tools/bench_pages.py
# ---------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "layerdiff-bench/1"
# re-running a tool rewrites its JSON here: that is not a change of the code being measured
OUTPUT_DIR = "docs/benchmarks"
# the import name -> its distribution's name, for the versions recorded with the machine
DISTRIBUTIONS = {"numpy": "numpy", "torch": "torch", "h5py": "h5py", "transformers": "transformers",
                 "paddle": "paddlepaddle", "mindspore": "mindspore"}


def command_line(argv: list[str] | None = None) -> str:
    """The command as run, ``python`` and the script's path relative to the repository (so is any absolute path
    inside it among the arguments)."""
    argv = list(sys.argv if argv is None else argv)

    def relative(arg: str, force: bool = False) -> str:
        path = Path(arg)
        if not (force or path.is_absolute()):
            return arg
        try:
            return path.resolve().relative_to(ROOT).as_posix()
        except (ValueError, OSError):
            return arg

    return shlex.join(["python", relative(argv[0], force=True), *(relative(a) for a in argv[1:])])


def git_commit() -> str:
    """``git rev-parse --short HEAD``, plus "+dirty" when tracked files outside docs/benchmarks/ have changes."""

    def git(*args: str) -> subprocess.CompletedProcess:
        # --no-optional-locks: a status must not take the index lock from someone committing meanwhile
        return subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True,
                              text=True, timeout=30, check=False)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown"
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){OUTPUT_DIR}")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.returncode != 0 or status.stdout.strip() else "")


def package_version(name: str) -> str | None:
    """The version of an importable package: the imported module's own, else its installed distribution's."""
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: how busy the machine was besides the benchmark."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def machine(packages=("numpy", "torch")) -> dict:
    """Cores, memory, CPU model, Python and the versions of ``packages`` that are installed."""
    info = {"cores": os.cpu_count(), "memory_gb": None, "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version()}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gb"] = round(int(line.split()[1]) * 1024 / 1e9, 1)
                    break
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info.update(_topology())
    info["stats_kernel"] = _stats_kernel()
    info["recorder"] = _recorder_build()
    for name in packages:
        version = package_version(name)
        if version:
            info[name] = version
    return info


def _stats_kernel() -> str:
    """Whether this install of layerdiff has its C statistics kernel (built where a C compiler was present at
    install): without it, statistics take numpy's four passes, and a traced step costs more (tools/bench_onepass.py)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("layerdiff.tracefile.fastmoments") is not None
    except ImportError:  # layerdiff itself is not importable here
        return "layerdiff not importable"
    return "built" if found else "not built (numpy's path)"


def _recorder_build() -> str:
    """Whether the recording's hot modules run compiled (mypyc, at install where a compiler was present) or from
    their sources, and why (``layerdiff/native.py``); the modes run in subprocesses that inherit this process's
    environment."""
    try:
        from layerdiff import native
    except ImportError:
        return "layerdiff not importable"
    why = native.why_sources()
    return "compiled (mypyc)" if why is None else f"sources ({why})"


def _topology() -> dict:
    """Threads per core and L2 cache per core (Linux), so that figures from different machines can be told apart:
    the same toy step, about 40 ms untraced on both, traced with operations at 2.25x on a 2-vCPU AMD EPYC and at
    3.47x on a 2-core Intel Xeon with an L2 cache per core (tools/bench_ops.py). There, statistics of fresh
    activations took twice as long as on data already in the cache: torch's other thread had written half of it."""
    out: dict = {}
    cpu = "/sys/devices/system/cpu/cpu0"
    try:
        with open(f"{cpu}/topology/thread_siblings_list") as f:
            siblings = f.read().strip()
        out["threads_per_core"] = sum(int(b) - int(a) + 1 if "-" in part else 1
                                      for part in siblings.split(",") for a, _, b in [part.partition("-")])
        for index in sorted(os.listdir(f"{cpu}/cache")):
            if not index.startswith("index"):
                continue
            with open(f"{cpu}/cache/{index}/level") as f:
                level = f.read().strip()
            with open(f"{cpu}/cache/{index}/size") as f:
                size = f.read().strip()
            if level == "2":
                out["l2_per_core"] = size
    except (OSError, ValueError):
        pass
    return out


class BenchRun:
    """One run of a benchmark tool, for ``--json PATH``. Made when the tool starts (the command, the commit and the
    date are those of the start); ``write`` adds the machine and the figures and writes one JSON document:

    schema, tool, title, command, commit, date, duration_s, quick, other_cores (CPU cores that other processes kept
    busy, on average over the run: the machine's busy time minus this process's and its children's),
    load_average ({"start", "end"}), machine, method, headline, tables, results,
    then ``extra``: the tool's own top-level keys (those its JSON had before these stay, for whoever reads them).

    ``tables`` is how tools/bench_pages.py shows the figures (each {"title", "columns", "rows", "note"?}, the cells
    formatted as the tool prints them); ``results`` holds the same figures as numbers."""

    def __init__(self, tool: str, title: str, method: str, packages=("numpy", "torch")):
        self.tool, self.title, self.method, self.packages = tool, title, " ".join(method.split()), tuple(packages)
        self.command = command_line()
        self.commit = git_commit()
        self.date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.load_start = load_average()
        try:
            self.others = Load()
        except (OSError, ValueError, IndexError):  # no /proc/stat
            self.others = None
        self.t0 = time.perf_counter()

    def document(self, *, quick: bool, headline: str, tables: list[dict], results, extra: dict | None = None,
                 unreaped_cpu: float = 0.0) -> dict:
        """unreaped_cpu: CPU seconds of grandchildren whose parent is still running (not yet in our children's)."""
        try:
            others = round(self.others.others(extra_own=unreaped_cpu), 2) if self.others else None
        except (OSError, ValueError, IndexError):
            others = None
        doc = {"schema": SCHEMA, "tool": self.tool, "title": self.title, "command": self.command,
               "commit": self.commit, "date": self.date, "duration_s": round(time.perf_counter() - self.t0, 1),
               "quick": bool(quick), "other_cores": others,
               "load_average": {"start": self.load_start, "end": load_average()},
               "machine": machine(self.packages), "method": self.method, "headline": headline,
               "tables": tables, "results": results}
        for key, value in (extra or {}).items():
            if key in doc:
                raise ValueError(f"{self.tool}: the JSON key {key!r} is taken by the run's metadata")
            doc[key] = value
        return doc

    def write(self, path, **kwargs) -> dict:
        doc = self.document(**kwargs)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return doc


def table(title: str, columns, rows, note: str | None = None) -> dict:
    """One table of a benchmark page: cells as printed (strings; numbers are shown with str())."""
    out = {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}
    if note:
        out["note"] = note
    return out
