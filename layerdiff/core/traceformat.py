"""The layerdiff trace file: one HDF5 file per run, streamed and crash-safe.

Layout (readable with plain h5py, see docs/trace-format.md):

    /            attrs: format="layerdiff-trace", format_version, meta (JSON: run metadata)
    /index       uint8, JSON lines: one line per record (module call, parameter, end marker)
    /data        uint8, the bytes of every tensor stored in "full" mode, C order, back to back

A tensor entry in a record names ``offset``/``nbytes`` into /data plus ``dtype`` and ``shape``, so
``np.frombuffer(f["data"][off:off + n], dtype).reshape(shape)`` reads it back (bfloat16 is stored as uint16).

The file is written in HDF5's single-writer/multiple-reader (SWMR) mode: whatever the writer has flushed is
consistent on disk, so a run killed mid-way (even kill -9) leaves a file that holds every record completed
before the last flush. Readers open such a file with ``h5py.File(path, "r", swmr=True)``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..errors import LayerdiffError, TraceFormatError
from .tensors import storage_dtype, summarize

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

    def append(self, raw) -> int:
        """Append bytes (any buffer); return their offset."""
        offset = self.size
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


class TraceWriter:
    """Streams records and tensor bytes into a trace; memory use does not grow with the trace.

    Thread-safe: autograd may call back from its own thread.
    """

    def __init__(self, path, meta: dict, *, overwrite: bool = False, compression: str | None = None,
                 flush_interval: float = 1.0, buffer_bytes: int = 8 << 20):
        if compression not in COMPRESSIONS:
            raise LayerdiffError(f"unknown compression {compression!r}; choose gzip or lzf")
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise LayerdiffError(f"{self.path} exists; pass overwrite=True (CLI: --force) to replace it")
        if self.path.parent and not self.path.parent.exists():
            raise LayerdiffError(f"directory {self.path.parent} does not exist")
        h5py = _h5py()
        self._file = h5py.File(self.path, "w", libver="latest")
        self._file.attrs["format"] = FORMAT_NAME
        self._file.attrs["format_version"] = FORMAT_VERSION
        self._file.attrs["meta"] = json.dumps(meta, default=str)
        data = self._file.create_dataset("data", shape=(0,), maxshape=(None,), dtype="u1",
                                         chunks=(DATA_CHUNK,), compression=compression)
        index = self._file.create_dataset("index", shape=(0,), maxshape=(None,), dtype="u1",
                                          chunks=(INDEX_CHUNK,))
        self._file.swmr_mode = True
        self._data = _AppendOnlyBytes(data, buffer_bytes)
        self._index = _AppendOnlyBytes(index, 1 << 20)
        self._lock = threading.RLock()
        self.flush_interval = flush_interval
        self._last_flush = time.perf_counter()
        self.records_written = 0
        self.tensor_bytes = 0
        self.closed = False

    def write_tensor(self, stored: np.ndarray, dtype: str, *, store_data: bool, stats: dict | None = None) -> dict:
        """Summarize a tensor (and in full mode append its bytes); return its entry for a record."""
        entry = self.summary_entry(dtype, stored.shape, stats or summarize(stored, dtype))
        if store_data:
            contiguous = np.ascontiguousarray(stored)
            with self._lock:
                entry["offset"] = self._data.append(contiguous)
                entry["nbytes"] = contiguous.nbytes
                self.tensor_bytes += contiguous.nbytes
        return entry

    @staticmethod
    def summary_entry(dtype: str, shape, stats: dict) -> dict:
        """A tensor entry without data: what every record keeps, in both modes."""
        return {"dtype": dtype, "shape": list(shape), "stats": stats}

    def write_record(self, record: dict):
        line = (json.dumps(record, separators=(",", ":"), default=_json_default) + "\n").encode()
        with self._lock:
            self._index.append(line)
            self.records_written += 1
            if time.perf_counter() - self._last_flush >= self.flush_interval:
                self.flush()

    def flush(self):
        """Make everything written so far durable against a crash of this process."""
        with self._lock:
            if self.closed:
                return
            self._data.flush()  # data before the index lines that point into it
            self._index.flush()
            self._last_flush = time.perf_counter()

    def close(self, end_record: dict):
        with self._lock:
            if self.closed:
                return
            self.write_record(end_record)
            self.flush()
            self._file.close()
            self.closed = True


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
        try:
            self._file = h5py.File(self.path, "r")
        except Exception:  # h5py raises OSError, RuntimeError, ... for damaged files
            try:  # a writer that died leaves the "open for writing" flag; SWMR read mode accepts it
                self._file = h5py.File(self.path, "r", swmr=True, libver="latest")
                self.crashed = True
            except Exception as exc:
                raise TraceFormatError(f"{self.path}: damaged HDF5 file ({_first_line(exc)})") from None
        try:
            attrs = self._file.attrs
            if attrs.get("format") != FORMAT_NAME:
                raise TraceFormatError(f"{self.path}: an HDF5 file but not a layerdiff trace")
            version = int(attrs.get("format_version", -1))
            if version > FORMAT_VERSION:
                raise TraceFormatError(f"{self.path}: trace format {version} is newer than this layerdiff "
                                       f"reads ({FORMAT_VERSION}); upgrade layerdiff")
            self.meta = json.loads(attrs["meta"])
            self._data = self._file["data"]
            raw = bytes(self._file["index"][:])
        except TraceFormatError:
            self._file.close()
            raise
        except Exception as exc:
            self._file.close()
            raise TraceFormatError(f"{self.path}: damaged trace ({_first_line(exc)})") from None
        self.records, self.end = _parse_index(raw, self._data.shape[0])
        if self.end is None:
            self.crashed = True
        self._raw = _RawChunkReader.open(self.path, self._data)
        self._executor = None

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

        Pieces share one buffer (no fresh pages to fault in per read): each is valid until the next one.
        """
        dt = storage_dtype(entry["dtype"])
        start, n = entry["offset"], entry["nbytes"]
        step = chunk_elems * dt.itemsize
        pieces = [(pos, min(step, start + n - pos)) for pos in range(start, start + n, step)]
        if len(pieces) < 2 or self._raw is None:
            scratch = np.empty(min(step, n), dtype=np.uint8)
            for pos, length in pieces:
                yield self._read(pos, length, scratch[:length]).view(dt)
            return
        # double buffering: the next piece is read (preadv releases the GIL) while this one is compared
        buffers = (np.empty(step, dtype=np.uint8), np.empty(step, dtype=np.uint8))
        pending = self._prefetcher().submit(self._read, *pieces[0], buffers[0][:pieces[0][1]])
        for i in range(len(pieces)):
            current = pending.result()
            if i + 1 < len(pieces):
                pos, length = pieces[i + 1]
                pending = self._prefetcher().submit(self._read, pos, length, buffers[(i + 1) % 2][:length])
            yield current.view(dt)

    def _prefetcher(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerdiff-read")
        return self._executor

    def size_bytes(self) -> int:
        return os.path.getsize(self.path)

    def close(self):
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._raw is not None:
            self._raw.close()
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _RawChunkReader:
    """Reads /data straight from the file with ``os.preadv``, chunk by chunk.

    For an unfiltered chunked dataset HDF5 stores each chunk's bytes as they are, at an address HDF5 itself
    reports (``get_chunk_info_by_coord``); reading them directly skips h5py's per-read selection machinery
    (~2x faster). Compressed data, or a chunk HDF5 does not report, goes through h5py.
    """

    def __init__(self, path, dataset, fd):
        self.dataset = dataset
        self.chunk = dataset.chunks[0]
        self.fd = fd
        self.addresses: dict[int, int | None] = {}

    @classmethod
    def open(cls, path, dataset):
        try:
            if dataset.chunks is None or dataset.id.get_create_plist().get_nfilters() != 0:
                return None
            return cls(path, dataset, os.open(path, os.O_RDONLY))
        except (OSError, AttributeError, ValueError):
            return None

    def _address(self, index: int):
        if index not in self.addresses:
            try:
                info = self.dataset.id.get_chunk_info_by_coord((index * self.chunk,))
                ok = info.byte_offset is not None and info.size == self.chunk and info.filter_mask == 0
                self.addresses[index] = info.byte_offset if ok else None
            except Exception:
                self.addresses[index] = None
        return self.addresses[index]

    def read(self, start: int, length: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(length, dtype=np.uint8) if out is None else out
        view = memoryview(out)
        done = 0
        while done < length:
            index, inner = divmod(start + done, self.chunk)
            take = min(self.chunk - inner, length - done)
            address = self._address(index)
            if address is None:
                out[done:done + take] = self.dataset[start + done:start + done + take]
            elif os.preadv(self.fd, [view[done:done + take]], address + inner) != take:
                raise TraceFormatError("tensor data ends early (truncated file)")
            done += take
        return out

    def close(self):
        os.close(self.fd)


def _parse_index(raw: bytes, data_size: int):
    """Records up to the last complete, consistent line; a torn tail (crash mid-write) is dropped."""
    records, end = [], None
    for line in raw.split(b"\n"):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
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
_TENSOR_FIELDS = ("role", "key", "dtype", "shape", "stats")


def _valid_record(rec) -> bool:
    """A structural check, so a damaged line ends the readable part instead of crashing a later pass."""
    if not isinstance(rec, dict) or rec.get("kind") not in _RECORD_FIELDS:
        return False
    if any(k not in rec for k in _RECORD_FIELDS[rec["kind"]]):
        return False
    tensors = rec.get("tensors", [])
    return isinstance(tensors, list) and all(isinstance(t, dict) and all(k in t for k in _TENSOR_FIELDS)
                                             for t in tensors)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_trace(path) -> TraceReader:
    return TraceReader(path)
