"""The layerdiff trace file: one HDF5 file per run, streamed and crash-safe.

Layout (readable with plain h5py, see docs/trace-format.md):

    /            attrs: format="layerdiff-trace", format_version, meta (JSON: run metadata)
    /index       uint8, JSON lines: one line per record (module call, parameter, end marker)
    /data        uint8, the bytes of every tensor stored in "full" mode, C order, back to back

A tensor entry in a record names ``offset``/``nbytes`` into /data plus ``dtype`` and ``shape``, so
``np.frombuffer(f["data"][off:off + n], dtype).reshape(shape)`` reads it back (bfloat16 is stored as uint16).

Both datasets have their chunks reserved ahead of the data and the writer puts bytes straight into them, so a run
killed mid-way (even kill -9) leaves a file that opens normally and holds every record completed before the kill
(the index ends in zeros where the reserve was not used). Read a live or killed trace with
``h5py.File(path, "r", locking=False)``.
"""
from __future__ import annotations

import errno
import fcntl
import io
import json
import math
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from ..errors import LayerdiffError, TraceFormatError
from . import schema
from .tensors import storage_dtype, summarize
from .writebehind import BLOCK, WriteBehind

FORMAT_NAME = "layerdiff-trace"
FORMAT_VERSION = 2  # 2: param_grad_use records (a tied weight's gradient per use), arg_names, tied
DATA_CHUNK = 1 << 20
INDEX_CHUNK = 1 << 16
COMPRESSIONS = (None, "gzip", "lzf")


def _h5py():
    import h5py  # core dependency; imported late so `layerdiff --help` stays fast

    return h5py


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
        h5py = _h5py()
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((chunk,))
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # no timestamps to update in the object header
        space = h5py.h5s.create_simple((reserve,), (h5py.h5s.UNLIMITED,))
        self.dataset = h5py.Dataset(h5py.h5d.create(h5file.id, name.encode(), h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl))
        self.h5file, self.fd, self.chunk = h5file, fd, chunk
        self.size = 0
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
                 flush_interval: float = 1.0, buffer_bytes: int = 8 << 20, write_behind: int = 0):
        if compression not in COMPRESSIONS:
            raise LayerdiffError(f"unknown compression {compression!r}; choose gzip or lzf")
        if not (isinstance(flush_interval, (int, float)) and math.isfinite(flush_interval) and flush_interval >= 0):
            raise LayerdiffError(f"flush interval must be a finite number of seconds >= 0, not {flush_interval!r}")
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            raise LayerdiffError(f"directory {self.path.parent} does not exist")
        self._fd = _open_exclusively(self.path, overwrite)
        try:
            h5py = _h5py()
            behind = write_behind > 0 and compression is None
            aligned = dict(alignment_threshold=DATA_CHUNK, alignment_interval=BLOCK) if behind else {}
            self._file = h5py.File(self.path, "w", libver="earliest", locking=False, **aligned)
            self._file.attrs["format"] = FORMAT_NAME
            self._file.attrs["format_version"] = FORMAT_VERSION
            self._file.attrs["meta"] = json.dumps(meta, default=str)
            if compression is None:
                self._data = _ReservedBytes(self._file, "data", self._fd, DATA_CHUNK, 0)  # none until a tensor
            else:
                data = self._file.create_dataset("data", shape=(0,), maxshape=(None,), dtype="u1",
                                                 chunks=(DATA_CHUNK,), compression=compression)
                self._data = _AppendOnlyBytes(data, buffer_bytes)
            self._index = _ReservedBytes(self._file, "index", self._fd, INDEX_CHUNK, 4 * INDEX_CHUNK)
            self._file.flush()
        except OSError as exc:
            self._release()
            raise LayerdiffError(f"cannot write {self.path}: {exc.strerror or _first_line(exc)}") from None
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
                     stats: schema.Stats | None = None) -> schema.TensorEntry:
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
        """The writer thread's data: whole blocks, with O_DIRECT while the file and filesystem allow it."""
        if self._direct_fd is not None and self._data.aligned(BLOCK):
            try:
                self._data.write_at(start, [view], self._direct_fd)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no direct I/O after all
                    raise _write_error(exc) from None
            self._close_direct()
        try:
            self._data.write_at(start, [view], self._fd)
        except OSError as exc:
            raise _write_error(exc) from None

    def _write_behind_lines(self, lines: list):
        self._index.append(lines)
        self.records_written += len(lines)

    @staticmethod
    def summary_entry(dtype: str, shape, stats: schema.Stats) -> schema.TensorEntry:
        """A tensor entry without data: what every record keeps, in both modes."""
        return {"dtype": dtype, "shape": list(shape), "stats": stats}

    def write_record(self, record: schema.TraceRecord):
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
            if self.compressed:
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
                if not self.compressed:
                    self._data.size = self.tensor_bytes  # the written stream's end (whole blocks may pass it)
                    self._data.finish()
                self._index.finish()
                self._file.close()
            except OSError as exc:  # a full disk: what was written before stays readable
                raise LayerdiffError(f"cannot finish {self.path}: {exc.strerror or _first_line(exc)}; the "
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
        if self._fd is not None:
            os.close(self._fd)  # also drops the lock
            self._fd = None


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


def encode_line(record: dict) -> bytes:
    """A record as one JSON line of the index.

    orjson writes it (about a tenth of the standard library's time: at ~100 records per step of a small model,
    the JSON was a sixth of the tracer's cost) whenever its text reads back the same. Not when a float is NaN or
    infinite: orjson writes those as null (``json`` writes NaN/Infinity, which ``json.loads`` reads back), so a
    line with a null in it is checked; and not for what orjson refuses (integers beyond 64 bits, keys that are
    not strings).
    """
    try:
        line = orjson.dumps(record, default=_json_default, option=orjson.OPT_APPEND_NEWLINE)
        if b"null" not in line or not _has_nonfinite(record):
            return line
    except TypeError:
        pass
    return (json.dumps(record, separators=(",", ":"), default=_json_default) + "\n").encode()


def _has_nonfinite(value) -> bool:
    """A NaN or infinite float anywhere in a record's values (leaves are looked at in their container: most are
    strings and integers, and a call per leaf doubled the cost of a checked line)."""
    if isinstance(value, dict):
        values = value.values()
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        return isinstance(value, (float, np.floating)) and not math.isfinite(value)
    for item in values:
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return True
        elif kind is str or kind is int or kind is bool or item is None:
            continue
        elif _has_nonfinite(item):
            return True
    return False


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return repr(obj)


class TraceReader:
    """Reads a trace: metadata and the record index without touching tensor bytes, tensors on demand."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise TraceFormatError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise TraceFormatError(f"{self.path}: is a directory, not a trace")
        h5py = _h5py()
        if not h5py.is_hdf5(str(self.path)):
            raise TraceFormatError(f"{self.path}: not an HDF5 file (is it a layerdiff trace?)")
        self.crashed = False
        try:  # no HDF5 file lock: a trace can be read while its writer runs (the writer holds its own lock)
            self._file = h5py.File(self.path, "r", locking=False)
        except PermissionError:
            raise TraceFormatError(f"{self.path}: permission denied (cannot read it)") from None
        except Exception as exc:  # h5py raises OSError, RuntimeError, ... for damaged files
            if "already open for write" not in str(exc):  # truncated or damaged (SWMR would retry for ever)
                raise TraceFormatError(f"{self.path}: damaged HDF5 file ({_first_line(exc)})") from None
            try:  # a format-1 writer that died left the "open for writing" flag; SWMR read mode accepts it
                self._file = h5py.File(self.path, "r", swmr=True, libver="latest", locking=False)
                self.crashed = True
            except Exception as exc2:
                raise TraceFormatError(f"{self.path}: damaged HDF5 file ({_first_line(exc2)})") from None
        self._lengthened = None  # the file seen with its real length (a writer killed while the file grew)
        try:
            raw = self._load()
        except TraceFormatError:
            self._file.close()
            raise
        except Exception as exc:
            self._file.close()
            try:
                self._lengthened = _LengthenedFile.open(self.path)
                if self._lengthened is None:
                    raise
                self._file = h5py.File(self._lengthened, "r")
                raw = self._load()
                self.crashed = True
            except TraceFormatError:
                self.close()
                raise
            except Exception:
                self.close()
                raise TraceFormatError(f"{self.path}: damaged trace ({_first_line(exc)})") from None
        self.records, self.end = _parse_index(raw, self._data.shape[0])
        if self.end is None:
            self.crashed = True
        self._raw = _RawChunkReader.open(self.path, self._data)
        self._location: DataLocation | None | bool = None  # made on first use (False: not available)

    def _load(self) -> bytes:
        """Checks the format, reads the metadata and returns the index's bytes."""
        attrs = self._file.attrs
        if attrs.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{self.path}: an HDF5 file but not a layerdiff trace")
        version = int(attrs.get("format_version", -1))
        if version > FORMAT_VERSION:
            raise TraceFormatError(f"{self.path}: trace format {version} is newer than this layerdiff "
                                   f"reads ({FORMAT_VERSION}); upgrade layerdiff")
        self.meta = json.loads(attrs["meta"])
        self._data = self._file["data"]
        return bytes(self._file["index"][:])

    @property
    def mode(self) -> str:
        return self.meta.get("mode", "full")

    def _read(self, start: int, length: int, out: np.ndarray | None = None) -> np.ndarray:
        try:
            if self._raw is not None:
                return self._raw.read(start, length, out)
            return self._data[start:start + length]
        except TraceFormatError:
            raise
        except Exception as exc:
            raise TraceFormatError(f"{self.path}: damaged tensor data ({_first_line(exc)})") from None

    def tensor(self, entry: dict) -> np.ndarray:
        """The stored bits of a tensor (decode with ``tensors.as_float``)."""
        if "offset" not in entry:
            raise LayerdiffError(f"{self.path}: tensor data not stored (trace made in 'stats' mode)")
        raw = self._read(entry["offset"], entry["nbytes"])
        return raw.view(storage_dtype(entry["dtype"])).reshape(entry["shape"])

    def tensor_chunks(self, entry: dict, chunk_elems: int):
        """The stored bits of a tensor, flattened, in pieces of ``chunk_elems`` (bounded memory).

        Each piece is valid until the next one. Where the file's chunks sit back to back, a piece is a read-only
        view of the file mapped into memory: no copy out of the page cache, the pages of the next few MB are asked
        for ahead (``MADV_WILLNEED``) and those compared are let go (``MADV_DONTNEED``): resident memory stays flat.
        """
        raw = self._raw if self._raw is not None and self._raw.mapped is not None else None
        return _pieces(raw, self._read, entry["offset"], entry["nbytes"], storage_dtype(entry["dtype"]), chunk_elems)

    def data_location(self, entry: dict) -> DataLocation | None:
        """Where the tensor's bytes lie in the file, for a reader in another process (``MappedData``); None when
        HDF5 did not report every chunk's address (compressed or damaged data, an older HDF5)."""
        raw = self._raw
        if raw is None or raw.mapped is None or "offset" not in entry:
            return None
        if self._location is None:
            count = -(-self._data.shape[0] // raw.chunk)
            addresses = tuple(raw.addresses.get(i) for i in range(count))
            self._location = DataLocation(str(self.path), raw.chunk, addresses) if None not in addresses else False
        return self._location or None

    def data_segments(self, entry: dict) -> list | None:
        """[(DataLocation, byte offset, elements)]: where a tensor's flat values lie, for worker processes (one
        segment here; a run of ranks may give several); None where ``data_location`` gives none."""
        location = self.data_location(entry)
        return None if location is None else [(location, entry["offset"], math.prod(entry["shape"]))]

    def size_bytes(self) -> int:
        return os.path.getsize(self.path)

    def close(self):
        if getattr(self, "_raw", None) is not None:
            self._raw.close()
        self._file.close()
        if self._lengthened is not None:
            self._lengthened.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pieces(raw, read, start: int, n: int, dt: np.dtype, chunk_elems: int):
    """Bytes ``start``..``start + n`` as arrays of ``dt`` of ``chunk_elems`` each: views of the mapped file through
    ``raw`` where its chunks sit back to back (pages asked for ahead, let go after), else ``read`` into a buffer."""
    step = chunk_elems * dt.itemsize
    pieces = [(pos, min(step, start + n - pos)) for pos in range(start, start + n, step)]
    scratch = None
    ahead = max(_READ_AHEAD // step, 1)
    if raw is not None:
        for piece in pieces[:ahead]:
            raw.will_need(*piece)
    for i, piece in enumerate(pieces):
        if raw is not None and i + ahead < len(pieces):
            raw.will_need(*pieces[i + ahead])
        view = raw.view(*piece) if raw is not None else None
        if view is None:
            scratch = np.empty(min(step, n), dtype=np.uint8) if scratch is None else scratch
            view = read(*piece, scratch[:piece[1]])
        yield view.view(dt)
        if raw is not None:
            raw.let_go(*piece)


@dataclass(frozen=True)
class DataLocation:
    """Where a trace's tensor bytes lie in its file: the file address of every chunk of /data, in order. Enough
    for another process to read them without HDF5 (``MappedData``)."""
    path: str
    chunk: int
    addresses: tuple


class MappedData:
    """A trace's tensor bytes read straight from its file at the chunk addresses of a ``DataLocation`` (no HDF5,
    no index): how worker processes read the slices they compare."""

    def __init__(self, location: DataLocation):
        fd = os.open(location.path, os.O_RDONLY)
        self._raw = _RawChunkReader(fd, location.chunk, dict(enumerate(location.addresses)))

    def pieces(self, offset: int, first: int, count: int, dtype: str, chunk_elems: int):
        """Elements ``first``..``first + count`` of the tensor stored at ``offset``, as stored bits, in pieces."""
        dt = storage_dtype(dtype)
        return _pieces(self._raw if self._raw.mapped is not None else None, self._raw.read,
                       offset + first * dt.itemsize, count * dt.itemsize, dt, chunk_elems)

    def close(self):
        self._raw.close()


_FAULT_AROUND = 64 << 10  # Linux's fault_around_bytes default
_READ_AHEAD = 8 << 20  # how far ahead of the compared piece the disk is asked to read


class _LengthenedFile(io.RawIOBase):
    """A trace file, read-only, as if its superblock recorded the file's real length as its end.

    HDF5 records where the file ends (the superblock's end-of-file address) when it flushes. A writer killed
    after HDF5 grew the file (new chunks, a new node of a chunk index) but before that flush leaves metadata that
    points past the recorded end, at bytes that are on disk, and HDF5 refuses to read them ("addr overflow"; seen
    once in the SIGKILL test). This view changes those 8 bytes in what HDF5 reads, never in the file. Only
    superblock versions 0 and 1 (what the writer makes) keep the address without a checksum.
    """

    def __init__(self, f, position: int, length: int):
        self._f = f
        self._patch = (position, struct.pack("<Q", length))

    @classmethod
    def open(cls, path: Path):
        """The view, or None when the file's recorded end is not short of its length (nothing to lengthen)."""
        f = open(path, "rb")
        try:
            head = f.read(64)
            length = os.fstat(f.fileno()).st_size
            if head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (0, 1) or head[13] != 8:
                f.close()
                return None
            position = 40 if head[8] == 0 else 44  # version 1 has 4 more bytes before the addresses
            base, _, end = struct.unpack_from("<QQQ", head, position - 16)
            if base != 0 or end >= length:
                f.close()
                return None
        except (OSError, struct.error, IndexError):
            f.close()
            return None
        return cls(f, position, length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer) -> int:
        start = self._f.tell()
        n = self._f.readinto(buffer)
        at, data = self._patch
        low, high = max(start, at), min(start + n, at + len(data))
        if low < high:
            memoryview(buffer).cast("B")[low - start:high - start] = data[low - at:high - at]
        return n

    def close(self):
        self._f.close()
        super().close()


def _all_addresses(dataset) -> dict[int, int | None]:
    """Every chunk's file address, from one walk of HDF5's chunk index (``chunk_iter``, HDF5 >= 1.14): a lookup
    per chunk costs ~35 us on a 4 GB trace (0.3 s of a 0.5B model's align). Empty where this HDF5 has no such
    walk; chunks are then looked up one by one as they are read."""
    addresses: dict[int, int | None] = {}
    chunk = dataset.chunks[0]

    def visit(info):
        ok = info.byte_offset is not None and info.size == chunk and info.filter_mask == 0
        addresses[info.chunk_offset[0] // chunk] = info.byte_offset if ok else None

    try:
        dataset.id.chunk_iter(visit)
    except Exception:  # noqa: BLE001  (an older h5py or HDF5: no walk, or a damaged index)
        return {}
    return addresses


class _RawChunkReader:
    """Reads /data straight from the file with ``os.preadv``, chunk by chunk.

    For an unfiltered chunked dataset HDF5 stores each chunk's bytes as they are, at an address HDF5 itself
    reports (``get_chunk_info_by_coord``); reading them directly skips h5py's per-read selection machinery
    (~2x faster). Compressed data, or a chunk HDF5 does not report, goes through h5py.
    """

    def __init__(self, fd: int, chunk: int, addresses: dict, dataset=None):
        self.dataset = dataset  # None: only the chunks in ``addresses`` can be read (a worker's ``MappedData``)
        self.chunk = chunk
        self.fd = fd
        self.addresses: dict[int, int | None] = addresses
        self.file_size = os.fstat(fd).st_size
        try:  # no madvise (not Linux/BSD): pieces are read with preadv
            advice = ("MADV_WILLNEED", "MADV_DONTNEED", "MADV_SEQUENTIAL")
            usable = self.file_size and all(hasattr(mmap, name) for name in advice)
            self.mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if usable else None
            if self.mapped is not None:
                self.mapped.madvise(mmap.MADV_SEQUENTIAL)  # the kernel reads ahead further on a fault
        except (OSError, ValueError):
            self.mapped = None

    @classmethod
    def open(cls, path, dataset):
        try:
            if dataset.chunks is None or dataset.id.get_create_plist().get_nfilters() != 0:
                return None
            fd = os.open(path, os.O_RDONLY)
        except (OSError, AttributeError, ValueError):
            return None
        return cls(fd, dataset.chunks[0], _all_addresses(dataset), dataset)

    def _address(self, index: int):
        if index not in self.addresses and self.dataset is not None:
            try:
                info = self.dataset.id.get_chunk_info_by_coord((index * self.chunk,))
                ok = info.byte_offset is not None and info.size == self.chunk and info.filter_mask == 0
                self.addresses[index] = info.byte_offset if ok else None
            except Exception:
                self.addresses[index] = None
        return self.addresses.get(index)

    def read(self, start: int, length: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(length, dtype=np.uint8) if out is None else out
        view = memoryview(out)
        done = 0
        while done < length:
            index, inner = divmod(start + done, self.chunk)
            take = min(self.chunk - inner, length - done)
            address = self._address(index)
            if address is None:
                if self.dataset is None:
                    raise TraceFormatError("tensor data outside the chunks located")
                out[done:done + take] = self.dataset[start + done:start + done + take]
            elif os.preadv(self.fd, [view[done:done + take]], address + inner) != take:
                raise TraceFormatError("tensor data ends early (truncated file)")
            done += take
        return out

    def _file_range(self, start: int, length: int) -> tuple[int, int] | None:
        """(file address, length) of logical bytes that sit back to back in the file, or None."""
        first, last = start // self.chunk, (start + length - 1) // self.chunk
        a, b = self._address(first), self._address(last)
        if a is None or b is None or b - a != (last - first) * self.chunk:
            return None
        address = a + start - first * self.chunk
        return (address, length) if address + length <= self.file_size else None

    def view(self, start: int, length: int) -> np.ndarray | None:
        """A read-only view of logical bytes in the mapped file (None where they are not back to back)."""
        where = self._file_range(start, length)
        if where is None:
            return None
        return np.frombuffer(self.mapped, dtype=np.uint8, count=length, offset=where[0])

    def _advise(self, advice: int, start: int, length: int, margin: int):
        """madvise the file pages of logical bytes, widened to multiples of ``margin`` (a multiple of the page)."""
        where = self._file_range(start, length)
        if where is not None:
            first = where[0] // margin * margin
            end = min(-(-(where[0] + where[1]) // margin) * margin, self.file_size)
            self.mapped.madvise(advice, first, end - first)

    def will_need(self, start: int, length: int):
        self._advise(mmap.MADV_WILLNEED, start, length, mmap.PAGESIZE)

    def let_go(self, start: int, length: int):
        """Unmap pages already compared (the page cache keeps them): resident memory does not grow. The kernel
        maps pages around each fault (up to 64 KB, neighbouring tensors' too), so the window is widened to that;
        unmapping a page still in use is harmless, it is faulted in again from the page cache."""
        self._advise(mmap.MADV_DONTNEED, start, length, _FAULT_AROUND)

    def close(self):
        if self.mapped is not None:
            try:
                self.mapped.close()
            except BufferError:  # a caller still holds a piece; the mapping goes with it
                pass
        os.close(self.fd)


def _parse_index(raw: bytes, data_size: int) -> tuple[list[schema.TraceRecord], schema.TraceRecord | None]:
    """Records up to the last complete, consistent line; a torn tail (crash mid-write) is dropped, and so is
    everything from the first line that is not JSON (or is nested too deeply to decode), fails
    ``_valid_record`` or points past the end of /data."""
    records, end = [], None
    for line in raw.rstrip(b"\x00").split(b"\n"):  # a killed writer's reserve ends in zeros
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # also UnicodeDecodeError, integers over 4300 digits
            break
        if not _valid_record(rec):
            break
        if any(t.get("offset", 0) + t.get("nbytes", 0) > data_size for t in rec.get("tensors", ())):
            break
        if rec.get("kind") == "end":
            end = rec
            continue
        records.append(rec)
    return records, end


_RECORD_FIELDS = {"call": ("phase", "path", "call", "tensors"), "param": ("path", "call", "tensors"),
                  "param_grad": ("path", "call", "tensors"), "end": (),
                  "param_grad_use": ("path", "module", "call", "tensors")}  # format 2


def _valid_record(rec) -> bool:
    """A check of each line as it is read, so a damaged line ends the readable part instead of crashing a later
    pass: the declared shape (``schema.TraceRecord``: types, non-negative counts, ``phase`` forward/backward,
    ``parent`` null or [path, call]), the fields its ``kind`` needs, and what types alone do not say: an end
    record holds no tensors; a tensor's ``dtype`` is one this reader knows, its ``shape`` has at most 64
    dimensions and an element count that fits int64, its ``stats`` are numbers, and in full mode ``offset`` and
    ``nbytes`` come together with nbytes = elements x itemsize (at most 32 dimensions: numpy's limit)."""
    if schema.problem(rec, schema.TraceRecord) is not None:
        return False
    if any(k not in rec for k in _RECORD_FIELDS[rec["kind"]]):
        return False
    if rec["kind"] == "end":  # read by show / align: status, failure {module, error, module_stack}, warnings
        return rec.get("tensors", []) == []
    return all(_valid_entry(t) for t in rec["tensors"])


def _valid_entry(t: schema.TensorEntry) -> bool:
    try:
        itemsize = storage_dtype(t["dtype"]).itemsize
    except ValueError:  # a dtype name this reader does not know
        return False
    shape = t["shape"]
    if len(shape) > 64:
        return False
    numel = 1
    for d in shape:
        numel *= d
        if numel > (1 << 63) - 1:
            return False
    if not all(v is None or type(v) in (int, float) for v in t["stats"].values()):
        return False
    stored = ("offset" in t, "nbytes" in t)
    if stored == (True, True):
        return t["nbytes"] == numel * itemsize and len(shape) <= 32
    return stored == (False, False)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_trace(path) -> TraceReader:
    return TraceReader(path)
