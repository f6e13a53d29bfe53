"""The index of a trace: one JSON line per record, written by ``encode_line`` and read back by ``parse_index``,
which checks every line before anything else reads it."""
from __future__ import annotations

import json
import math

import numpy as np
import orjson

from layerdiff import schema
from layerdiff.tracefile.tensors import storage_dtype


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


def parse_index(raw: bytes, data_size: int) -> tuple[list[schema.TraceRecord], schema.TraceRecord | None]:
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
