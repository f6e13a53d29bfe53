"""Checksums of a trace: every index line, every stored tensor (block by block) and the run's metadata carry an
XXH3-64 digest, so a byte changed after writing (bit rot, a bad copy) is found where it is read, instead of being
read as a truncated file or compared as if it were a value.

Why XXH3: it hashes ~30-120 GB/s on one core (crc32c: ~30 GB/s, zlib's crc32: ~7), so hashing at write time stays
a small share of a full trace's write speed (``tools/bench_write.py``), and reading verifies for a few percent.

- An index line ends in ``,"checksum":"<16 hex digits>"}``: the digest of every byte before that suffix. The line
  stays one JSON object (``json.loads`` reads it, the key is skipped by readers that do not know it).
- A stored tensor's entry holds ``checksums``: the digests of its bytes in blocks of ``CHECK_BLOCK`` (the last one
  shorter), so a reader that reads part of a tensor (a worker's slice) verifies the blocks it touches.
- The root attribute ``meta_checksum`` is the digest of the ``meta`` attribute's UTF-8 text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import xxhash

from layerdiff.errors import TraceFormatError

ALGORITHM = "xxh3_64"
CHECK_BLOCK = 1 << 20  # bytes of a tensor per digest
_PREFIX = b',"checksum":"'
SUFFIX_LENGTH = len(_PREFIX) + 16 + 2  # ,"checksum":"0123456789abcdef"}
_HEX = frozenset(b"0123456789abcdef")


def digest(data) -> str:
    """The 16 hex digits of a buffer's XXH3-64."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def with_checksum(line: bytes) -> bytes:
    """A JSON object's line (``{...}`` and a newline) with its checksum as its last key. One copy of the line
    (formatted whole), not three: every record of a trace passes here (1.2 us a record before, 0.5 now)."""
    body = line[:-2] if line.endswith(b"}\n") else line.rstrip(b"\n")[:-1]  # without the closing brace
    return b'%s%s%016x"}\n' % (body, _PREFIX, xxhash.xxh3_64_intdigest(body))


def line_check(line: bytes) -> Optional[bool]:
    """True when a line (without its newline) ends in a checksum that matches, False when it does not (or its
    suffix is malformed), None when it carries none (a trace written before checksums)."""
    start = len(line) - SUFFIX_LENGTH
    if start > 0 and line[start:start + len(_PREFIX)] == _PREFIX and line.endswith(b'"}'):
        hex_digits = line[start + len(_PREFIX):-2]
        return _HEX.issuperset(hex_digits) and \
            xxhash.xxh3_64_intdigest(memoryview(line)[:start]) == int(hex_digits, 16)
    return False if _PREFIX in line else None


def split_joined(segment: bytes) -> list[bytes]:
    """A segment that fails its check may be two lines whose newline was damaged: the pieces that end in a
    checksum suffix, cut after it (one piece, the segment itself, when nothing can be cut)."""
    pieces, start = [], 0
    at = segment.find(_PREFIX)
    while at != -1:
        end = at + SUFFIX_LENGTH
        if end < len(segment) and segment[end - 2:end] == b'"}':
            pieces.append(segment[start:end])
            start = end + 1  # the byte that should have been a newline
        at = segment.find(_PREFIX, max(end, at + 1))
    if not pieces:
        return [segment]
    if start < len(segment):
        pieces.append(segment[start:])
    return pieces


def tensor_digests(stored: np.ndarray) -> list[str]:
    """The digests of a tensor's bytes (C order), block by block."""
    raw = _bytes_of(stored)
    return [digest(raw[start:start + CHECK_BLOCK]) for start in range(0, max(len(raw), 1), CHECK_BLOCK)]


class DamagedTensorError(TraceFormatError):
    """A stored tensor whose bytes do not match their checksum."""


@dataclass(frozen=True)
class TensorCheck:
    """What verifies a stored tensor's bytes: where they start in /data, how many, and their block digests."""
    offset: int
    nbytes: int
    digests: tuple

    @classmethod
    def of(cls, entry) -> Optional[TensorCheck]:
        """The check of a tensor entry (None: it carries no checksums, or holds no data)."""
        if entry.checksums is None or entry.offset is None or entry.nbytes is None:
            return None
        return cls(entry.offset, entry.nbytes, tuple(entry.checksums))

    def as_list(self) -> list:
        return [self.offset, self.nbytes, list(self.digests)]

    @classmethod
    def from_list(cls, value) -> Optional[TensorCheck]:
        return None if value is None else cls(value[0], value[1], tuple(value[2]))

    def around(self, start: int, length: int) -> TensorCheck:
        """The check of the blocks that bytes ``start``..``start + length`` of /data touch (what a worker needs
        for its slice of a large tensor)."""
        blocks = self.blocks(start, length)
        if not blocks:
            return self
        begin = self.span(blocks.start)[0]
        last_begin, last_length = self.span(blocks[-1])
        return TensorCheck(begin, last_begin + last_length - begin, self.digests[blocks.start:blocks.stop])

    def blocks(self, start: int, length: int) -> range:
        """The blocks that bytes ``start``..``start + length`` of /data touch (positions in /data)."""
        first = (start - self.offset) // CHECK_BLOCK
        last = (start + length - self.offset - 1) // CHECK_BLOCK if length else first - 1
        return range(first, last + 1)

    def span(self, block: int) -> tuple[int, int]:
        """(start in /data, length) of one block."""
        begin = self.offset + block * CHECK_BLOCK
        return begin, min(CHECK_BLOCK, self.offset + self.nbytes - begin)

    def failed(self, block: int) -> DamagedTensorError:
        return DamagedTensorError(f"tensor bytes at {self.offset}..{self.offset + self.nbytes} of /data do not match "
                                  f"their checksum (block {block} of {len(self.digests)}): damaged after writing")


def verify_bytes(check: Optional[TensorCheck], raw: np.ndarray, start: int) -> None:
    """Check bytes read from /data at ``start`` that cover whole blocks of the tensor (a whole tensor read)."""
    if check is None:
        return
    view = _bytes_of(raw)
    if len(check.digests) != count_blocks(check.nbytes):
        raise check.failed(0)
    for block in check.blocks(start, len(view)):
        begin, length = check.span(block)
        if digest(view[begin - start:begin - start + length]) != check.digests[block]:
            raise check.failed(block)


def verified_pieces(pieces: Iterable[np.ndarray], check: Optional[TensorCheck], start: int, length: int,
                    read: Callable[[int, int], np.ndarray]) -> Iterator[np.ndarray]:
    """``pieces`` (the bytes ``start``..``start + length`` of /data, in order, as arrays) passed on while their blocks
    are hashed; the bytes of the first and last block outside that range are read with ``read(start, length)``.
    A block that does not match raises ``DamagedTensorError`` once its last byte has passed."""
    if check is None:
        yield from pieces
        return
    if len(check.digests) != count_blocks(check.nbytes):
        raise check.failed(0)
    blocks = check.blocks(start, length)
    if not blocks:
        yield from pieces
        return
    hasher = _BlockHasher(check, blocks.start)
    head_start, _ = check.span(blocks.start)
    if head_start < start:
        hasher.feed(read(head_start, start - head_start))
    for piece in pieces:
        hasher.feed(piece)  # before the piece is handed on: the block that fails is never used whole
        yield piece
    end = start + length
    tail_start, tail_length = check.span(blocks[-1])
    if tail_start + tail_length > end:
        hasher.feed(read(end, tail_start + tail_length - end))


class _BlockHasher:
    """Bytes fed in order from the start of block ``block``; each block's digest compared once it is whole."""

    def __init__(self, check: TensorCheck, block: int):
        self.check, self.block = check, block
        self.left = check.span(block)[1]
        self.hash = xxhash.xxh3_64()

    def feed(self, array: np.ndarray) -> None:
        view = _bytes_of(array)
        while len(view):
            take = min(self.left, len(view))
            self.hash.update(view[:take])
            view, self.left = view[take:], self.left - take
            if self.left == 0:
                if f"{self.hash.intdigest():016x}" != self.check.digests[self.block]:
                    raise self.check.failed(self.block)
                self.block += 1
                if self.block >= len(self.check.digests):
                    return
                self.left = self.check.span(self.block)[1]
                self.hash.reset()


def _bytes_of(array: np.ndarray) -> memoryview:
    """An array's bytes in C order, as a flat view (a copy only where it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def count_blocks(nbytes: int) -> int:
    """How many digests a tensor of ``nbytes`` has (one for an empty tensor)."""
    return max(-(-nbytes // CHECK_BLOCK), 1)


def meta_digest(meta_text: str) -> str:
    return digest(meta_text.encode())
