"""Writing a trace: tensor bytes and index lines straight into chunks reserved ahead of them."""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from layerdiff.errors import LayerdiffError, TraceFormatError, first_line
from layerdiff.tracefile.index import encode_line
from layerdiff.tracefile.layout import (COMPRESSIONS, DATA_CHUNK, FORMAT_NAME, FORMAT_VERSION_WITHOUT_OPS, INDEX_CHUNK,
                                        load_h5py)
from layerdiff.tracefile.tensors import summarize
from layerdiff.tracefile.writebehind import BLOCK, WriteBehind


class _AppendOnlyBytes:
    """A growable 1-D uint8 dataset with a write-behind buffer: one resize per flush, not per tensor."""

    def __init__(self, dataset, buffer_limit: int):
        self.dataset = dataset
        self.buffer = bytearray()
        self.buffer_limit = buffer_limit
        self.on_disk = 0

    @property
    def size(self) -> int:
        return self.on_disk + len(self.buffer)

    def append(self, buffers) -> int:
        """Append byte buffers one after the other; return the first one's offset."""
        offset = self.size
        for raw in buffers:
            view = memoryview(raw).cast("B")
            if len(view) >= self.buffer_limit:  # big tensors skip the copy into the buffer
                self.drain()
                self._write(np.frombuffer(view, dtype=np.uint8))
            else:
                self.buffer += view
                if len(self.buffer) >= self.buffer_limit:
                    self.drain()
        return offset

    def drain(self):
        if self.buffer:
            self._write(np.frombuffer(self.buffer, dtype=np.uint8))
            self.buffer = bytearray()

    def _write(self, arr: np.ndarray):
        start = self.on_disk
        self.dataset.resize((start + arr.size,))
        self.dataset[start:start + arr.size] = arr
        self.on_disk += arr.size

    def flush(self):
        self.drain()
        self.dataset.flush()


class _ReservedBytes:
    """A growable 1-D byte dataset written straight into the file.

    Its chunks are allocated ahead of the data (early allocation, never filled: the reserve is a hole in the file
    and costs no disk blocks), and bytes go to their place with ``pwrite``. Once ``pwrite`` returns they are in
    the operating system's page cache, so a process killed right after keeps them, with no HDF5 flush per record.
    HDF5's own metadata changes only when the reserve grows (rarely: by an eighth or more at a time), and is
    flushed then. A reader sees the reserve's unused tail as zeros.
    """

    def __init__(self, h5file, name: str, fd: int, chunk: int, reserve: int):
        _preallocate(fd, reserve)
        h5py = load_h5py()
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((chunk,))
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # no timestamps to update in the object header
        space = h5py.h5s.create_simple((reserve,), (h5py.h5s.UNLIMITED,))
        self.dataset = h5py.Dataset(h5py.h5d.create(h5file.id, name.encode(), h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl))
        self.h5file, self.fd, self.chunk = h5file, fd, chunk
        self.size = 0
        self.runs: list[list[int]] = []  # [logical start, file address, length] of consecutive chunks
        self._map()

    def _map(self, since: int = 0):
        """File addresses of the chunks from logical offset ``since`` on, added to the runs of consecutive chunks
        (logical start, address, length). Chunks allocated together usually sit back to back: the first and
        last chunk tell, and only when they do not is every chunk asked."""
        runs = [] if since == 0 else self.runs
        self.capacity = self.dataset.shape[0]
        starts = range(since, self.capacity, self.chunk)
        if not starts:
            self.runs = runs
            return
        first = self.dataset.id.get_chunk_info_by_coord((starts[0],)).byte_offset
        last = self.dataset.id.get_chunk_info_by_coord((starts[-1],)).byte_offset
        if last - first == starts[-1] - starts[0]:
            pieces = [(starts[0], first, self.capacity - since)]
        else:
            pieces = [(s, self.dataset.id.get_chunk_info_by_coord((s,)).byte_offset, self.chunk) for s in starts]
        for start, address, length in pieces:
            if runs and runs[-1][0] + runs[-1][2] == start and runs[-1][1] + runs[-1][2] == address:
                runs[-1][2] += length
            else:
                runs.append([start, address, length])
        self.runs = runs

    def _reserve(self, needed: int):
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity += max(capacity // 8 // self.chunk * self.chunk, 2 * self.chunk)
        _preallocate(self.fd, capacity - self.capacity)  # a full disk fails here, before HDF5 writes anything
        old = self.capacity
        self.dataset.resize((capacity,))
        self.h5file.flush()  # the grown dataset's metadata is on disk before any byte is written into it
        self._map(old)

    def append(self, buffers) -> int:
        """Write ``buffers`` (contiguous byte buffers) one after the other; return the first one's offset."""
        start = self.size
        line = buffers[0] if len(buffers) == 1 and type(buffers[0]) is bytes else None
        try:
            if line is not None and self._in_last_run(start, len(line)):  # an index line: one pwrite, no more
                done = os.pwrite(self.fd, line, self.runs[-1][1] + start - self.runs[-1][0])
                if done < len(line):  # a short write (rare): the rest the general way
                    self.write_at(start + done, [memoryview(line)[done:]], self.fd)
                self.size = start + len(line)
                return start
            views = [memoryview(b).cast("B") for b in buffers]
            self.write_at(start, views, self.fd)
        except OSError as exc:
            raise _write_error(exc) from None
        self.size = start + sum(len(v) for v in views)
        return start

    def _in_last_run(self, start: int, length: int) -> bool:
        """Bytes ``start``..``start + length`` lie in the last run of reserved chunks (the usual case)."""
        if not self.runs:
            return False
        run_start, _, run_length = self.runs[-1]
        return run_start <= start and start + length <= run_start + run_length

    def write_at(self, start: int, views, fd: int):
        """Write byte views back to back from logical offset ``start`` through ``fd`` (OSError as raised)."""
        self._reserve(start + sum(len(v) for v in views))
        position = start
        for view in views:
            done = 0
            while done < len(view):
                address, room = self._address(position + done)
                n = min(room, len(view) - done)
                done += os.pwrite(fd, view[done:done + n], address)
            position += len(view)

    def aligned(self, block: int) -> bool:
        """Every run of chunks starts at a file address that is a multiple of ``block`` (for O_DIRECT)."""
        return all(address % block == 0 for _, address, _ in self.runs)

    def _address(self, logical: int) -> tuple[int, int]:
        """(file address, bytes left in that run of chunks) of a logical offset."""
        for start, address, length in self.runs:  # few runs: the file grows at its end
            if start <= logical < start + length:
                return address + logical - start, start + length - logical
        raise TraceFormatError("internal: offset outside the reserved chunks")

    def finish(self):
        """Give the reserve's unused tail back (the dataset's length becomes what was written)."""
        self.dataset.resize((self.size,))


class TraceWriter:
    """Streams records and tensor bytes into a trace; memory use does not grow with the trace.

    Crash safety: tensor bytes and each record's index line are written straight into chunks reserved ahead of
    them (``_ReservedBytes``), tensors before the line that points at them, so a process killed at any moment
    leaves a file holding every record completed before it; only the record being written is lost. A compressed
    trace cannot be written that way (its chunks go through HDF5's filters): it is buffered and flushed at least
    every ``flush_interval`` seconds instead.

    With ``write_behind`` > 0 (bytes), tensor bytes and index lines are written by a thread of their own
    (``WriteBehind``), in the same order, while the step goes on; a process killed outright then loses the
    records still queued. ``records_written`` counts the records in the file either way.

    The file is created exclusively and locked for the whole run: a second writer on the same path is refused
    before it writes anything. Thread-safe: autograd may call back from its own thread.
    """

    def __init__(self, path, meta: dict, *, overwrite: bool = False, compression: str | None = None,
                 flush_interval: float = 1.0, buffer_bytes: int = 8 << 20, write_behind: int = 0,
                 format_version: int = FORMAT_VERSION_WITHOUT_OPS):
        if compression not in COMPRESSIONS:
            raise LayerdiffError(f"unknown compression {compression!r}; choose gzip or lzf")
        if not (isinstance(flush_interval, (int, float)) and math.isfinite(flush_interval) and flush_interval >= 0):
            raise LayerdiffError(f"flush interval must be a finite number of seconds >= 0, not {flush_interval!r}")
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            raise LayerdiffError(f"directory {self.path.parent} does not exist")
        self._fd = _open_exclusively(self.path, overwrite)
        self._released = False  # the descriptor (and with it the lock) given back
        try:
            h5py = load_h5py()
            behind = write_behind > 0 and compression is None
            aligned = dict(alignment_threshold=DATA_CHUNK, alignment_interval=BLOCK) if behind else {}
            self._file = h5py.File(self.path, "w", libver="earliest", locking=False, **aligned)
            self._file.attrs["format"] = FORMAT_NAME
            self._file.attrs["format_version"] = format_version
            self._file.attrs["meta"] = json.dumps(meta, default=str)
            self._data: _ReservedBytes | _AppendOnlyBytes
            self._reserved: _ReservedBytes | None = None  # the data of an uncompressed trace, written in place
            if compression is None:
                self._data = self._reserved = _ReservedBytes(self._file, "data", self._fd, DATA_CHUNK, 0)
            else:
                data = self._file.create_dataset("data", shape=(0,), maxshape=(None,), dtype="u1",
                                                 chunks=(DATA_CHUNK,), compression=compression)
                self._data = _AppendOnlyBytes(data, buffer_bytes)
            self._index = _ReservedBytes(self._file, "index", self._fd, INDEX_CHUNK, 4 * INDEX_CHUNK)
            self._file.flush()
        except OSError as exc:
            self._release()
            raise LayerdiffError(f"cannot write {self.path}: {exc.strerror or first_line(exc)}") from None
        self._lock = threading.RLock()
        self._pending: list[bytes] = []
        self.compressed = compression is not None
        self._direct_fd = None
        self._behind = None
        if behind:
            self._direct_fd = _open_direct(self.path)
            self._behind = WriteBehind(write_behind, self._write_behind_data, self._write_behind_lines)
        self.flush_interval = flush_interval
        self._last_flush = time.perf_counter()
        self.records_written = 0
        self.tensor_bytes = 0
        self.closed = False

    def write_tensor(self, stored: np.ndarray, dtype: str, *, store_data: bool,
                     stats: Mapping[str, Any] | None = None) -> dict:
        """Summarize a tensor (and in full mode append its bytes); return its entry for a record."""
        entry = self.summary_entry(dtype, stored.shape, stats or summarize(stored, dtype))
        if store_data:
            with self._lock:
                entry["offset"], entry["nbytes"] = self.tensor_bytes, stored.nbytes  # the data's end: all it holds
                if self._behind is None:
                    self._data.append([np.ascontiguousarray(stored)])
                else:
                    self._behind.put_bytes(stored)
                self.tensor_bytes += stored.nbytes
        return entry

    def _write_behind_data(self, start: int, view: memoryview):
        """The writer thread's data: whole blocks, with O_DIRECT while the file and filesystem allow it (a trace
        written behind is uncompressed: its data is reserved in place)."""
        data = self._reserved
        if data is None:
            raise TraceFormatError("internal: write-behind without reserved data")
        if self._direct_fd is not None and data.aligned(BLOCK):
            try:
                data.write_at(start, [view], self._direct_fd)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no direct I/O after all
                    raise _write_error(exc) from None
            self._close_direct()
        try:
            data.write_at(start, [view], self._fd)
        except OSError as exc:
            raise _write_error(exc) from None

    def _write_behind_lines(self, lines: list):
        self._index.append(lines)
        self.records_written += len(lines)

    @staticmethod
    def summary_entry(dtype: str, shape, stats: Mapping[str, Any]) -> dict:
        """A tensor entry without data: what every record keeps, in both modes."""
        return {"dtype": dtype, "shape": list(shape), "stats": stats}

    def write_record(self, record: dict):
        """One record (a dict of the shape ``records`` declares) as the index's next line."""
        line = encode_line(record)
        with self._lock:
            if self.compressed:  # the index may only point at data that is on disk: lines wait for a flush
                self._pending.append(line)
                self.records_written += 1
                if time.perf_counter() - self._last_flush >= self.flush_interval:
                    self.flush()
                return
            if self._behind is not None:
                self._behind.put_line(line)
                return
            self._index.append([line])
            self.records_written += 1  # counted once its line is in the file

    def flush(self):
        """Make everything written so far durable against a crash of this process (uncompressed traces are
        already: their bytes go straight into the file)."""
        with self._lock:
            if self.closed:
                return
            if self._behind is not None:
                self._behind.drain()
            if isinstance(self._data, _AppendOnlyBytes):  # compressed
                self._data.flush()  # data before the index lines that point into it
                pending, self._pending = self._pending, []
                if pending:
                    self._index.append(pending)
                self._file.flush()
            self._last_flush = time.perf_counter()

    def close(self, end_record: dict):
        with self._lock:
            if self.closed:
                return
            try:
                self.write_record(end_record)
                self.flush()  # drains the writer thread; it stays idle (the lock is held) until stopped below
                if self._reserved is not None:  # uncompressed
                    self._reserved.size = self.tensor_bytes  # the written stream's end (whole blocks may pass it)
                    self._reserved.finish()
                self._index.finish()
                self._file.close()
            except OSError as exc:  # a full disk: what was written before stays readable
                raise LayerdiffError(f"cannot finish {self.path}: {exc.strerror or first_line(exc)}; the "
                                     "records written before are readable") from None
            finally:
                self.closed = True
                self._stop_writer()
                self._release()

    def _stop_writer(self):
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.close()
        self._close_direct()

    def _close_direct(self):
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None

    def _release(self):
        if not self._released:
            os.close(self._fd)  # also drops the lock
            self._released = True


_METADATA_ROOM = 1 << 17  # room past the reserved chunks for HDF5's own metadata (chunk index nodes)


def _preallocate(fd: int, nbytes: int):
    """Claim disk space for ``nbytes`` more at the end of the file (and room for HDF5's metadata) before HDF5
    is told about it: a full disk or a file-size limit is then one clear error while the file still describes
    only what it holds, instead of a half-written HDF5 structure."""
    end = os.fstat(fd).st_size
    try:
        os.posix_fallocate(fd, end, nbytes + _METADATA_ROOM)
    except OSError as exc:
        raise LayerdiffError(f"cannot grow the trace by {(nbytes + _METADATA_ROOM) / 1e6:.0f} MB: "
                             f"{exc.strerror or exc} (disk full, or a file-size limit)") from None


def _open_exclusively(path: Path, overwrite: bool) -> int:
    """A descriptor of the trace file, locked for this writer: an existing file is refused unless
    ``overwrite``, and a file another process is writing is refused always. Nothing is truncated here."""
    flags = os.O_RDWR | os.O_CREAT | (0 if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise LayerdiffError(f"{path} exists; pass overwrite=True (CLI: --force) to replace it") from None
    except IsADirectoryError:
        raise LayerdiffError(f"{path} is a directory; name a trace file") from None
    except OSError as exc:
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise LayerdiffError(f"{path} is being written by another process; choose another path") from None
    return fd


def _write_error(exc: OSError) -> LayerdiffError:
    return LayerdiffError(f"cannot write the trace: {exc.strerror or exc}")


def _open_direct(path: Path) -> int | None:
    """A second descriptor of the trace that bypasses the page cache, or None where the system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:  # tmpfs and some other filesystems refuse O_DIRECT: buffered writes then
        return None
