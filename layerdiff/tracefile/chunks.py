"""A trace's tensor bytes read straight from the file at the chunk addresses HDF5 reports: in this process (mapped,
read ahead, let go) and in worker processes that never open HDF5 (``MappedData``)."""
from __future__ import annotations

import io
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerdiff.errors import TraceFormatError
from layerdiff.tracefile.checksums import TensorCheck, verified_pieces
from layerdiff.tracefile.tensors import storage_dtype
from layerdiff.tracefile.layout import SUPERBLOCK_HEAD, end_address_at


def stored_pieces(raw, read, start: int, n: int, dt: np.dtype, chunk_elems: int):
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

    def chunks_of(self, start: int, length: int) -> dict[int, int]:
        """{chunk number: file address} of the chunks that hold bytes ``start``..``start + length`` of /data: all a
        worker needs to read them (a task carries these, not a terabyte file's every address)."""
        if length <= 0:
            return {}
        first, last = start // self.chunk, (start + length - 1) // self.chunk
        return {i: self.addresses[i] for i in range(first, min(last + 1, len(self.addresses)))}


class MappedData:
    """A trace's tensor bytes read straight from its file at known chunk addresses (no HDF5, no index): how worker
    processes read the slices they compare. ``chunks``: {chunk number: file address} of the chunks it may read
    (``DataLocation.chunks_of``)."""

    def __init__(self, path: str, chunk: int, chunks: dict[int, int]):
        fd = os.open(path, os.O_RDONLY)
        self._raw = RawChunkReader(fd, chunk, dict(chunks))

    def pieces(self, offset: int, first: int, count: int, dtype: str, chunk_elems: int,
               check: TensorCheck | None = None):
        """Elements ``first``..``first + count`` of the tensor stored at ``offset``, as stored bits, in pieces,
        verified against ``check`` (the tensor's checksums: the blocks the slice touches are hashed whole, reading
        the bytes of its first and last block outside the slice; ``DamagedTensorError`` when one differs)."""
        dt = storage_dtype(dtype)
        start, length = offset + first * dt.itemsize, count * dt.itemsize
        pieces = stored_pieces(self._raw if self._raw.mapped is not None else None, self._raw.read, start, length, dt,
                               chunk_elems)
        return verified_pieces(pieces, check, start, length, self._raw.read)

    def close(self):
        self._raw.close()


_FAULT_AROUND = 64 << 10  # Linux's fault_around_bytes default
_READ_AHEAD = 8 << 20  # how far ahead of the compared piece the disk is asked to read


class LengthenedFile(io.RawIOBase):
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
            head = f.read(SUPERBLOCK_HEAD)
            length = os.fstat(f.fileno()).st_size
            position = end_address_at(head)
            if position is None or struct.unpack_from("<Q", head, position)[0] >= length:
                f.close()
                return None
        except OSError:
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


class RawChunkReader:
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
        view = out.data
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
        if where is None or self.mapped is None:
            return None
        return np.frombuffer(self.mapped, dtype=np.uint8, count=length, offset=where[0])

    def _advise(self, advice: int, start: int, length: int, margin: int):
        """madvise the file pages of logical bytes, widened to multiples of ``margin`` (a multiple of the page)."""
        where = self._file_range(start, length)
        if where is not None and self.mapped is not None:
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
