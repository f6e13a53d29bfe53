"""A trace killed right before each write to its file, HDF5's own ones included, stays a file plain h5py reads whole.

``test_kill_points`` kills the writer at random moments and at lines of its own Python; a moment inside HDF5's C code
comes up there only by chance (its flush lasts a millisecond). Here a library preloaded into a helper process
(``kill_before_write.c``) counts the writes and kills a forked child right before the n-th, for every n of a whole
run: deterministic, every write. It found the chunk index of the data array written to point at a node HDF5 had not
written yet (the first growth of an empty reserve; a node splitting; a compressed trace's first data chunk, found
after a random-moment kill failed CI once) and keeps that from coming back; a fast test checks the two things that
closed it in the file every trace starts as.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from test_kill_points import check_left_trace

_PRELOADS = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                               reason="needs Linux (LD_PRELOAD) and a C compiler")

HELPER = r'''
import ctypes, json, mmap, os, struct, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_kill_points import write_workload
shim = ctypes.CDLL(None)
if not hasattr(shim, "kill_before_write_arm"):  # the loader did not preload it (a noexec folder, another libc)
    sys.exit(77)
shim.kill_before_write_count.restype = ctypes.c_long
folder, mode = Path(sys.argv[1]), sys.argv[2]

def run(path, kill_at):
    """A forked child writes the trace, killed before its ``kill_at``-th write (0: never); returns the records it
    counted as written and, when it was not killed, how many writes it made."""
    shared = mmap.mmap(-1, 16)
    shared[:16] = struct.pack("qq", -1, -1)
    pid = os.fork()
    if pid == 0:
        shim.kill_before_write_arm(ctypes.c_long(kill_at))
        try:
            write_workload(path, shared, mode)
            shared[8:16] = struct.pack("q", shim.kill_before_write_count())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return struct.unpack("qq", shared[:16])

writes = run(folder / "whole.h5", 0)[1]
json.dump({"writes": writes, "written": {n: run(folder / f"k{n}.h5", n)[0] for n in range(1, writes + 1)}},
          open(folder / "runs.json", "w"))
'''


@pytest.mark.slow
@_PRELOADS
@pytest.mark.parametrize("mode", ["inline", "behind", "lzf"])
def test_killed_before_each_write(tmp_path, mode):
    shim = tmp_path / "kill_before_write.so"
    source = Path(__file__).parent / "kill_before_write.c"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"], check=True)
    env = dict(os.environ, LD_PRELOAD=str(shim))
    helper = subprocess.run([sys.executable, "-c", HELPER, str(tmp_path), mode, str(Path(__file__).parent)],
                            env=env, timeout=300)
    if helper.returncode == 77:
        pytest.skip("the dynamic loader did not preload the write-counting library")
    assert helper.returncode == 0
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs["writes"] > 40  # the run's writes were counted: HDF5's and the writer's own
    found = [check_left_trace(tmp_path / f"k{n}.h5", written) for n, written in runs["written"].items()]
    assert found.count("partial") > runs["writes"] // 2, found


@pytest.mark.parametrize("mode", ["inline", "behind", "lzf"])
def test_a_new_trace_has_large_index_nodes_and_its_first_data_node(tmp_path, mode):
    """What keeps a growth from writing a pointer to a node not yet written: the superblock (version 1) says the chunk
    indexes' nodes hold 4,096 chunks (HDF5's istore K 2048, bytes 24-25), and the data array has its first chunk, and
    so its index's first node, before any record is written (a compressed trace's: a chunk of zeros)."""
    from layerdiff.tracefile.writer import TraceWriter

    from test_kill_points import MODES

    path = tmp_path / "t.h5"
    writer = TraceWriter(path, {"case": "nodes"}, **MODES[mode])
    head = path.read_bytes()[:28]
    with h5py.File(path, "r", locking=False) as f:
        data_chunks = f["data"].id.get_num_chunks()
    writer.close({"kind": "end", "status": "complete"})
    assert head[8] == 1 and struct.unpack_from("<H", head, 24)[0] == 2048
    assert data_chunks == 1
