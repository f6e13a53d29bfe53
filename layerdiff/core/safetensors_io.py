"""A small safetensors reader/writer over numpy storage arrays (bfloat16 travels as its 16-bit pattern).

Format: 8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets"}, and
"__metadata__": {str: str}}, then the raw bytes. Nothing is unpickled, ever.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import LayerdiffError
from .tensors import storage_dtype

_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
          "float8_e5m2": "F8_E5M2"}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
_MAX_HEADER = 100 << 20


def save(path, tensors: dict, metadata: dict | None = None, *, overwrite: bool = False):
    """``tensors``: name -> (storage array, dtype name). Written to a temp file, then renamed."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise LayerdiffError(f"{path} exists; pass --force to replace it")
    header, offset, arrays = {}, 0, []
    for name, (array, dtype) in sorted(tensors.items()):
        array = np.ascontiguousarray(array)
        header[name] = {"dtype": _TO_ST[dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for array in arrays:
                f.write(memoryview(array).cast("B"))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_header(path) -> tuple[dict, dict]:
    """name -> (dtype name, shape, absolute byte offset, nbytes), and the metadata; every entry is checked
    against the file size before anything is trusted, so callers can read tensors one at a time."""
    path = Path(path)
    if not path.is_file():
        raise LayerdiffError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LayerdiffError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise LayerdiffError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise LayerdiffError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise LayerdiffError(f"{path}: not a safetensors file (header is not an object)")
    metadata = header.pop("__metadata__", {}) or {}
    entries = {}
    for name, info in header.items():
        try:
            dtype = _FROM_ST[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise LayerdiffError(f"{path}: bad or unsupported safetensors entry {name!r}") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * storage_dtype(dtype).itemsize
        if begin < 0 or end - begin != nbytes or 8 + n + end > size:
            raise LayerdiffError(f"{path}: entry {name!r} does not fit the file (truncated?)")
        entries[name] = (dtype, shape, 8 + n + begin, nbytes)
    return entries, metadata


def load(path) -> tuple[dict, dict]:
    """name -> (storage array, dtype name), and the metadata."""
    entries, metadata = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, (dtype, shape, offset, nbytes) in entries.items():
            f.seek(offset)
            out[name] = (np.frombuffer(f.read(nbytes), dtype=storage_dtype(dtype)).reshape(shape), dtype)
    return out, metadata
