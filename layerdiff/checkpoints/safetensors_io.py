"""A small safetensors reader/writer over numpy storage arrays (bfloat16 travels as its 16-bit pattern).

Format: 8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets"}, and
"__metadata__": {str: str}}, then the raw bytes. Nothing is unpickled, ever.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from layerdiff.errors import LayerdiffError
from layerdiff.files import atomic_output
from layerdiff.tracefile.tensors import storage_dtype

_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
          "float8_e5m2": "F8_E5M2"}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
STORABLE_DTYPES = frozenset(_TO_ST)  # layerdiff dtype names a safetensors file can hold
_MAX_HEADER = 100 << 20


def save(path, tensors: dict, metadata: dict | None = None, *, overwrite: bool = False):
    """``tensors``: name -> (storage array, dtype name). Written to a temp file, then renamed."""
    header, offset, arrays = {}, 0, []
    for name, (array, dtype) in sorted(tensors.items()):
        header[name] = {"dtype": _TO_ST[dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_output(path, overwrite=overwrite) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in arrays:  # a non-contiguous array is copied only while it is written
            f.write(np.ascontiguousarray(array).data.cast("B"))


def read_header(path) -> tuple[dict, dict]:
    """name -> (dtype name, shape, absolute byte offset, nbytes), and the metadata.

    The file may be hostile: every number is checked before it is trusted, as the safetensors format
    prescribes: the header length against the file (and at most 100 MB), the header as UTF-8 JSON starting with
    ``{`` (no duplicate keys, no NaN/Infinity, nesting bounded), each entry's dtype, shape (non-negative
    integers whose byte size fits int64) and ``data_offsets`` (``0 <= begin <= end``, ``end - begin`` = shape x
    dtype size), and the ranges together: they must index the whole data region, with no overlap and no hole
    ("the byte buffer needs to be entirely indexed, and cannot contain holes"). Callers can then read tensors
    one at a time."""
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LayerdiffError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise LayerdiffError(f"{path}: not a safetensors file (header length {n} is over the "
                                     f"{_MAX_HEADER >> 20} MB limit)")
            if n > size - 8:
                raise LayerdiffError(f"{path}: not a safetensors file, or truncated (header length {n} is more than "
                                     f"the {size - 8} bytes after it)")
            raw = f.read(n)
    except OSError as exc:
        raise LayerdiffError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) != n:
        raise LayerdiffError(f"{path}: truncated while reading its header")
    header = _parse_header_json(path, raw)
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise LayerdiffError(f"{path}: bad safetensors header (__metadata__ must map strings to strings)")
    data_size = size - 8 - n
    entries, ranges = {}, []
    for name, info in header.items():
        dtype, shape, begin, end = _check_entry(path, name, info)
        ranges.append((begin, end, name))
        entries[name] = (dtype, shape, 8 + n + begin, end - begin)
    expected, previous = 0, ""
    for begin, end, name in sorted(ranges):
        if begin < expected:
            raise LayerdiffError(f"{path}: tensors {_show(previous)!r} and {_show(name)!r} overlap (data bytes "
                                 f"{begin} to {min(end, expected)})")
        if begin > expected:
            raise LayerdiffError(f"{path}: data bytes {expected} to {begin} belong to no tensor (the safetensors "
                                 "format allows no holes)")
        expected, previous = end, name
    if expected > data_size:
        raise LayerdiffError(f"{path}: truncated: the header indexes {expected} data bytes, the file holds "
                             f"{data_size}")
    if expected < data_size:
        raise LayerdiffError(f"{path}: {data_size - expected} bytes after the last tensor belong to no tensor "
                             "(the safetensors format allows no holes)")
    return entries, metadata


_INT64_MAX = (1 << 63) - 1
_MAX_DIMS = 32  # numpy's limit


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _parse_header_json(path, raw: bytes) -> dict:
    """The header object; JSON only (UTF-8, ``{`` first, trailing spaces allowed), every problem one error."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LayerdiffError(f"{path}: not a safetensors file (header is not UTF-8 text)") from None
    if not text.startswith("{"):
        raise LayerdiffError(f"{path}: not a safetensors file (header does not start with '{{')")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as exc:
        raise LayerdiffError(f"{path}: bad safetensors header (key {_show(exc.args[0])!r} appears twice)") from None
    except RecursionError:
        raise LayerdiffError(f"{path}: bad safetensors header (JSON nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, an integer of more than 4300 digits, NaN/Infinity
        raise LayerdiffError(f"{path}: not a safetensors file (header is not JSON: {str(exc)[:100]})") from None
    if not isinstance(header, dict):
        raise LayerdiffError(f"{path}: not a safetensors file (header is not an object)")
    return header


def _show(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(path, name: str, info) -> tuple:
    """(dtype name, shape, begin, end) of one header entry, every field checked."""
    def bad(what):
        return LayerdiffError(f"{path}: bad safetensors entry {_show(name)!r}: {what}")

    if not isinstance(info, dict) or any(k not in info for k in ("dtype", "shape", "data_offsets")):
        raise bad("expected an object with dtype, shape and data_offsets")
    st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(st_dtype, str) or st_dtype not in _FROM_ST:
        shown_dtype = st_dtype[:20] if isinstance(st_dtype, str) else type(st_dtype).__name__
        raise bad(f"dtype {shown_dtype!r} is not one layerdiff reads ({', '.join(sorted(_FROM_ST))})")
    dtype = _FROM_ST[st_dtype]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape must be a list of non-negative integers")
    if len(shape) > _MAX_DIMS:
        raise bad(f"shape has {len(shape)} dimensions (at most {_MAX_DIMS})")
    nbytes = storage_dtype(dtype).itemsize
    for d in shape:
        nbytes *= d
        if nbytes > _INT64_MAX:
            raise bad("shape x dtype size overflows 64 bits")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
        raise bad("data_offsets must be two integers [begin, end]")
    begin, end = offsets
    if begin > _INT64_MAX or end > _INT64_MAX:
        raise bad("data_offsets beyond the 64-bit range")
    if begin < 0 or end < begin:
        raise bad(f"data_offsets [{begin}, {end}] are negative or inverted")
    if end - begin != nbytes:
        raise bad(f"data_offsets [{begin}, {end}] hold {end - begin} bytes, shape {shape} of {st_dtype} needs "
                  f"{nbytes}")
    return dtype, [int(d) for d in shape], begin, end


def load(path) -> tuple[dict, dict]:
    """name -> (storage array, dtype name), and the metadata."""
    entries, metadata = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, (dtype, shape, offset, nbytes) in entries.items():
            f.seek(offset)
            out[name] = (np.frombuffer(f.read(nbytes), dtype=storage_dtype(dtype)).reshape(shape), dtype)
    return out, metadata
