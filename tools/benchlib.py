"""Helpers shared by tools/bench.py and tools/bench_frameworks.py: the toy model's size, timing of steps, the
machine's load while a block runs, and the printing of profiles. Standard library only at import time."""
from __future__ import annotations

import os
import resource
import statistics
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
