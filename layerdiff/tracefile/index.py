"""The index of a trace: one JSON line per record, written by ``encode_line`` and read back by ``parse_index``
into typed records (``records``), every line checked before anything else reads it."""
from __future__ import annotations

import json
import math
from typing import Any, Iterable

import numpy as np
import orjson

from layerdiff.tracefile.records import EndRecord, Indexed, decode_line


def encode_line(record: dict[str, Any]) -> bytes:
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


def _has_nonfinite(value: object) -> bool:
    """A NaN or infinite float anywhere in a record's values (leaves are looked at in their container: most are
    strings and integers, and a call per leaf doubled the cost of a checked line)."""
    values: Iterable[Any]
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


def _json_default(obj: object) -> int | float | str:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return repr(obj)


def parse_index(raw: bytes, data_size: int) -> tuple[list[Indexed], EndRecord | None]:
    """Records up to the last complete, consistent line; a torn tail (crash mid-write) is dropped, and so is
    everything from the first line that is not a record (``records.decode_line``: not JSON, nested too deeply,
    of the wrong shape or types) or that points past the end of /data."""
    records: list[Indexed] = []
    end = None
    for line in raw.rstrip(b"\x00").split(b"\n"):  # a killed writer's reserve ends in zeros
        if not line:
            continue
        rec = decode_line(line)
        if rec is None:
            break
        if isinstance(rec, EndRecord):
            end = rec
            continue
        if any((t.offset or 0) + (t.nbytes or 0) > data_size for t in rec.tensors):
            break
        records.append(rec)
    return records, end
