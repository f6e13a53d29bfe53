"""Reading a trace: metadata and the record index without touching tensor bytes, tensors on demand."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from layerdiff.errors import LayerdiffError, TraceFormatError, first_line
from layerdiff.tracefile.chunks import DataLocation, LengthenedFile, RawChunkReader, stored_pieces
from layerdiff.tracefile.checksums import (ALGORITHM, DamagedTensorError, TensorCheck, meta_digest, verified_pieces,
                                           verify_bytes)
from layerdiff.tracefile.index import Damage, parse_index
from layerdiff.tracefile.layout import FORMAT_NAME, FORMAT_VERSION, load_h5py
from layerdiff.tracefile.records import OpRecord, Record, TensorEntry
from layerdiff.tracefile.tensors import storage_dtype


class TraceReader:
    """Reads a trace: metadata and the record index without touching tensor bytes, tensors on demand.

    Every index line and every tensor read is checked against its checksum (format 3): ``damage`` lists what was
    written whole and reads otherwise (the records after a damaged line are read), a tensor whose bytes do not
    match raises ``DamagedTensorError``; ``crashed`` says the writer did not finish (no end record);
    ``unverified`` counts records without a checksum (a trace written before checksums)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise TraceFormatError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise TraceFormatError(f"{self.path}: is a directory, not a trace")
        h5py = load_h5py()
        if not h5py.is_hdf5(str(self.path)):
            raise TraceFormatError(f"{self.path}: not an HDF5 file (is it a layerdiff trace?)")
        self.crashed = False
        try:  # no HDF5 file lock: a trace can be read while its writer runs (the writer holds its own lock)
            self._file = h5py.File(self.path, "r", locking=False)
        except PermissionError:
            raise TraceFormatError(f"{self.path}: permission denied (cannot read it)") from None
        except Exception as exc:  # h5py raises OSError, RuntimeError, ... for damaged files
            if "already open for write" not in str(exc):  # truncated or damaged (SWMR would retry for ever)
                raise TraceFormatError(f"{self.path}: damaged HDF5 file ({first_line(exc)})") from None
            try:  # a format-1 writer that died left the "open for writing" flag; SWMR read mode accepts it
                self._file = h5py.File(self.path, "r", swmr=True, libver="latest", locking=False)
                self.crashed = True
            except Exception as exc2:
                raise TraceFormatError(f"{self.path}: damaged HDF5 file ({first_line(exc2)})") from None
        self._lengthened = None  # the file seen with its real length (a writer killed while the file grew)
        try:
            raw = self._load()
        except TraceFormatError:
            self._file.close()
            raise
        except Exception as exc:
            self._file.close()
            try:
                self._lengthened = LengthenedFile.open(self.path)
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
                raise TraceFormatError(f"{self.path}: damaged trace ({first_line(exc)})") from None
        scan = parse_index(raw, self._data.shape[0], self.checksummed)
        self.end = scan.end
        # module calls and parameters (what every pass reads), and the operations inside calls (``ops`` tracing);
        # the forward calls and operations activation checkpointing ran again in backward, apart
        self.records: list[Record] = []
        self.ops: list[OpRecord] = []
        self.recomputed: list[Record | OpRecord] = []
        for r in scan.records:
            if getattr(r, "recompute", False):
                self.recomputed.append(r)
            elif isinstance(r, OpRecord):
                self.ops.append(r)
            else:
                self.records.append(r)
        self.damage: list[Damage] = self._meta_damage + scan.damage  # what was written whole and reads otherwise
        self.unverified = scan.unverified  # records without a checksum (a trace written before checksums)
        if self.end is None:
            self.crashed = True
        self._raw = RawChunkReader.open(self.path, self._data)
        self._location: DataLocation | None = None  # made on first use (None: not available)
        self._located = False

    def _load(self) -> bytes:
        """Checks the format, reads the metadata and returns the index's bytes."""
        attrs = self._file.attrs
        if attrs.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{self.path}: an HDF5 file but not a layerdiff trace")
        version = int(attrs.get("format_version", -1))
        if version > FORMAT_VERSION:
            raise TraceFormatError(f"{self.path}: trace format {version} is newer than this layerdiff "
                                   f"reads ({FORMAT_VERSION}); upgrade layerdiff")
        self.format_version = version
        self.checksummed = attrs.get("checksum") == ALGORITHM
        self.meta, self._meta_damage = _read_meta(attrs, self.checksummed)
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
        except Exception as exc:  # h5py's errors on a damaged chunk index, bytes past the end of a cut file
            raise DamagedTensorError(f"{self.path}: damaged tensor data ({first_line(exc)})") from None

    def tensor(self, entry: TensorEntry) -> np.ndarray:
        """The stored bits of a tensor (decode with ``tensors.as_float``), checked against its checksums
        (``DamagedTensorError`` when they do not match)."""
        start, length = self._span(entry)
        raw = self._read(start, length)
        try:
            verify_bytes(TensorCheck.of(entry), raw, start)
        except DamagedTensorError as exc:
            raise self._damaged(entry, exc) from None
        return raw.view(storage_dtype(entry.dtype)).reshape(entry.shape)

    def _damaged(self, entry: TensorEntry, exc: DamagedTensorError) -> DamagedTensorError:
        return DamagedTensorError(f"{self.path}: {entry.role} {entry.key} ({entry.dtype} {entry.shape}): {exc}")

    def _span(self, entry: TensorEntry) -> tuple[int, int]:
        """(offset, nbytes) of a tensor's bytes in /data."""
        if entry.offset is None or entry.nbytes is None:
            raise LayerdiffError(f"{self.path}: tensor data not stored (trace made in 'stats' mode)")
        return entry.offset, entry.nbytes

    def tensor_chunks(self, entry: TensorEntry, chunk_elems: int):
        """The stored bits of a tensor, flattened, in pieces of ``chunk_elems`` (bounded memory).

        Each piece is valid until the next one. Where the file's chunks sit back to back, a piece is a read-only
        view of the file mapped into memory: no copy out of the page cache, the pages of the next few MB are asked
        for ahead (``MADV_WILLNEED``) and those compared are let go (``MADV_DONTNEED``): resident memory stays flat.
        """
        raw = self._raw if self._raw is not None and self._raw.mapped is not None else None
        start, length = self._span(entry)
        pieces = stored_pieces(raw, self._read, start, length, storage_dtype(entry.dtype), chunk_elems)
        return self._verified(verified_pieces(pieces, TensorCheck.of(entry), start, length, self._read), entry)

    def _verified(self, pieces, entry: TensorEntry):
        try:
            yield from pieces
        except DamagedTensorError as exc:
            raise self._damaged(entry, exc) from None

    def data_location(self, entry: TensorEntry) -> DataLocation | None:
        """Where the tensor's bytes lie in the file, for a reader in another process (``MappedData``); None when
        HDF5 did not report every chunk's address (compressed or damaged data, an older HDF5)."""
        raw = self._raw
        if raw is None or raw.mapped is None or entry.offset is None:
            return None
        if not self._located:
            count = -(-self._data.shape[0] // raw.chunk)
            addresses = tuple(raw.addresses.get(i) for i in range(count))
            self._location = DataLocation(str(self.path), raw.chunk, addresses) if None not in addresses else None
            self._located = True
        return self._location

    def data_segments(self, entry: TensorEntry) -> list | None:
        """[(DataLocation, byte offset, elements, TensorCheck or None)]: where a tensor's flat values lie and what
        verifies them, for worker processes (one segment here; a run of ranks may give several); None where
        ``data_location`` gives none."""
        location = self.data_location(entry)
        return None if location is None else [(location, entry.offset, math.prod(entry.shape), TensorCheck.of(entry))]

    def size_bytes(self) -> int:
        """Bytes the file takes on disk: the unused reserve of a finished trace is a hole (no blocks)."""
        info = os.stat(self.path)
        blocks = getattr(info, "st_blocks", None)
        return info.st_size if blocks is None else min(info.st_size, blocks * 512)

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


def _read_meta(attrs, checksummed: bool) -> tuple[dict, list[Damage]]:
    """The run's metadata and, where it does not read as written, its damage (the metadata is then what could be
    read of it, or nothing)."""
    text = attrs.get("meta")
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if not isinstance(text, str):
        return {}, [Damage("the run's metadata (attribute meta)", "missing")]
    damage = []
    expected = attrs.get("meta_checksum")
    if checksummed and (not isinstance(expected, str) or meta_digest(text) != expected):
        damage.append(Damage("the run's metadata (attribute meta)", "its checksum does not match"))
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        return {}, damage or [Damage("the run's metadata (attribute meta)", "not JSON")]
    if not isinstance(meta, dict):
        return {}, damage or [Damage("the run's metadata (attribute meta)", "not a JSON object")]
    return meta, damage


def open_trace(path) -> TraceReader:
    return TraceReader(path)
