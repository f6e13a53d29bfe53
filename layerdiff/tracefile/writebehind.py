"""Write-behind for a full trace: the step copies tensor bytes into a ring and goes on; a thread of its own
writes them, then the index lines that point at them, in order.

Why: a full trace of a 0.5B model writes gigabytes per step. Written inline through the page cache, the step
waits for every byte and the kernel spends seconds of CPU per gigabyte on it (on 2 cores, measured: 4 s of
system time per GB), time taken from the model. Here the ring mirrors the trace's data stream (byte ``p`` of
the stream sits at ``p % capacity``), so the writer sends whole aligned blocks straight from it with
``O_DIRECT`` where the filesystem allows: no page-cache copy, a fraction of the kernel's CPU, and the writer
waits for the disk while the model computes. The ring bounds the memory (backpressure: the step waits when it
is full) and grows only as far as the writes fall behind (below).

On a small model it costs what writing inline costs (since buffered writes go out in 64 KB pieces, inline
writes cost far less than the figure above): the toy of ``tools/bench_ops.py`` traced in full mode on 2 cores,
1.85x to 2.01x the untraced step with write-behind, 1.87x to 1.97x without (``--write-behind 0``); a step that
writes 438 MB, 1.48x against 2.14x. docs/limits.md has the measurements.

What a crash costs: an exception in the model, Ctrl-C or a normal exit drains the queue (the trace is closed
by its context manager). A process killed outright (SIGKILL, a segfault, the OOM killer) loses the records
still queued, at most the ring's bytes, never more: an index line is written only after the bytes it points
at. Trace with ``write_behind=0`` (CLI ``--write-behind 0``) to hunt such a crash: every record is then in
the file before the step goes on.
"""
from __future__ import annotations

import mmap
import threading
from typing import Callable

import numpy as np

BLOCK = 4096  # O_DIRECT's alignment of memory, file offsets and lengths (safe for every common device)
BATCH = 1 << 20  # with no index line waiting, the writer waits for this much data before a write
FIRST_RING = 8 << 20  # the ring's size at first; it doubles, up to the capacity asked for, when the step waits


class WriteBehind:
    """A byte stream written by a thread of its own, with lines that follow the data they describe.

    ``write_data(start, view)`` receives whole blocks of the stream: ``start`` is a multiple of ``BLOCK`` and so
    is ``len(view)``; the last block of a batch may run past the stream's end (its tail is not data yet and is
    written again, complete, later). ``write_lines(lines)`` receives the lines put since the last call, after
    every byte put before them is written. One producer at a time (the trace writer's lock).

    The ring starts at ``FIRST_RING`` bytes and doubles, up to ``capacity``, each time the step finds it full.
    Why: a ring's pages are touched (faulted in and zeroed by the kernel) the first time the stream passes over
    them, and a ring of the whole capacity was passed over whole in a trace's first steps. The benchmark toy's
    full trace (77 MB a step) took 3.01x its untraced step with a 256 MB ring, 1.91x with that ring's pages
    touched beforehand, 1.98x with no write-behind at all (measured 2026-12-05, docs/limits.md). Where the disk
    keeps up, the ring stays small and its pages are reused; where it falls behind, the ring grows to absorb it.
    """

    def __init__(self, capacity: int, write_data: Callable[[int, memoryview], None],
                 write_lines: Callable[[list], None]):
        self.max_capacity = max(capacity // BLOCK, 2 * BATCH // BLOCK + 2) * BLOCK
        self.capacity = min(self.max_capacity, FIRST_RING)
        self._map = mmap.mmap(-1, self.capacity)  # page-aligned, as O_DIRECT needs; touched on first use
        self.ring = np.frombuffer(self._map, dtype=np.uint8)
        self.waiting_for_room = False  # the step waits for the writer to free some of the ring
        self.write_data, self.write_lines = write_data, write_lines
        self.produced = 0  # the stream's end: bytes copied into the ring
        self.done = 0  # bytes written to the file
        self.lines: list = []
        self.busy = self.flushing = self.stopping = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="layerdiff-writer", daemon=True)
        self.thread.start()

    # -- the step's side --------------------------------------------------------------------------------------
    def put_bytes(self, array: np.ndarray):
        """Append the array's bytes (C order) to the stream; returns once they are copied into the ring."""
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        copied = 0
        while copied < flat.size:
            with self.cond:
                while True:
                    self._raise_error()
                    released = self.done // BLOCK * BLOCK  # the block being filled stays until it is whole
                    room = released + self.capacity - self.produced
                    if room > 0:
                        break
                    self.waiting_for_room = True  # the writer grows the ring after its write (``_grow``)
                    self.cond.wait()
                self.waiting_for_room = False
                start = self.produced % self.capacity
                n = min(flat.size - copied, room, self.capacity - start)
            self.ring[start:start + n] = flat[copied:copied + n]  # outside the lock: the writer works meanwhile
            copied += n
            with self.cond:
                self.produced += n
                self.cond.notify_all()

    def put_line(self, line: bytes):
        """Queue a line; it is written after every byte put so far."""
        self.put_lines([line])

    def put_lines(self, lines: list):
        """Queue lines, in order; they are written after every byte put so far (one wake of the writer for all)."""
        with self.cond:
            self._raise_error()
            self.lines += lines
            self.cond.notify_all()

    def drain(self):
        """Wait until everything put is in the file; raise the first error the writer met."""
        with self.cond:
            self.flushing = True
            self.cond.notify_all()
            try:
                while (self.lines or self.busy or self.done < self.produced) and self.error is None:
                    self.cond.wait()
            finally:
                self.flushing = False
            self._raise_error()

    def close(self):
        """Stop the thread once everything put is written (an error is raised by ``drain``, not here)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
        del self.ring, self._map  # unmapped once no view of it is left (an error's traceback may hold one)

    def _raise_error(self):
        if self.error is not None:
            raise self.error

    # -- the writer's side ----------------------------------------------------------------------------------
    def _run(self):
        while True:
            with self.cond:
                while not self._work_ready():
                    if self.stopping:
                        return
                    self.cond.wait()
                whole = bool(self.lines) or self.flushing or self.stopping  # write the partial last block too
                target = self.produced if whole else self.produced // BLOCK * BLOCK
                lines, self.lines = self.lines, []
                self.busy = True
            try:
                if self.error is None:  # after an error the rest is dropped: the file keeps what came before
                    self._write_stream(self.done // BLOCK * BLOCK, target)
                    if lines:
                        self.write_lines(lines)
            except BaseException as exc:  # noqa: BLE001 - handed to the step's thread, raised there
                self.error = exc
            with self.cond:
                self.done = max(self.done, target) if self.error is None else self.produced
                self.busy = False
                if self.waiting_for_room and self.capacity < self.max_capacity and self.error is None:
                    try:
                        self._grow()
                    except (OSError, MemoryError):  # no memory for a larger ring: the step waits for the disk
                        self.max_capacity = self.capacity
                self.cond.notify_all()

    def _grow(self):
        """The ring twice as large (at most ``max_capacity``), holding the bytes not yet written where the new size
        puts them. Run by the writer with the lock held, between its writes, while the step waits for room: neither
        thread is reading or copying into the ring then."""
        capacity = min(2 * self.capacity, self.max_capacity)
        grown = mmap.mmap(-1, capacity)
        ring = np.frombuffer(grown, dtype=np.uint8)
        position = self.done // BLOCK * BLOCK  # the partial block the writer has not finished is kept too
        while position < self.produced:
            at = position % self.capacity
            n = min(self.produced - position, self.capacity - at, capacity - position % capacity)
            ring[position % capacity:position % capacity + n] = self.ring[at:at + n]
            position += n
        self.ring, self._map, self.capacity = ring, grown, capacity

    def _work_ready(self) -> bool:
        if self.error is not None:
            return bool(self.lines) or self.done < self.produced
        pending = self.produced - self.done
        return bool(self.lines) or pending >= BATCH or ((self.flushing or self.stopping) and pending > 0)

    def _write_stream(self, start: int, end: int):
        """Write stream bytes [start, end) rounded out to whole blocks, split where the ring wraps."""
        end = -(-end // BLOCK) * BLOCK
        while start < end:
            at = start % self.capacity
            n = min(end - start, self.capacity - at)
            self.write_data(start, memoryview(self._map)[at:at + n])
            start += n
