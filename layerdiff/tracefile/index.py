"""The index of a trace: one JSON line per record, written by ``encode_line`` (its checksum added by
``checksums.with_checksum``) and read back by ``parse_index`` into typed records (``records``), every line checked
before anything else reads it; a damaged line is named (``Damage``) and the lines after it are still read."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np
import orjson

from layerdiff.tracefile.checksums import line_check, split_joined
from layerdiff.tracefile.records import AnyRecord, CallRecord, EndRecord, Indexed, OpRecord, decode_line


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


@dataclass(frozen=True)
class Damage:
    """A part of a trace that was written whole and no longer reads as written: ``where`` it is (an index line and
    its bytes, the metadata), what it still reads as (``reads_as``: a record's kind and path, when the damaged line
    still decodes; None otherwise) and ``why`` it is not used."""
    where: str
    why: str
    reads_as: Optional[str] = None

    def describe(self) -> str:
        return f"{self.where}" + (f" (reads as {self.reads_as})" if self.reads_as else "") + f": {self.why}"


@dataclass
class IndexScan:
    """What an index holds: the records that read back as written, the end record, the damaged lines (skipped:
    the records after them are read), how many lines carried a checksum that matched (``verified``) or none at all
    (``unverified``: a trace written before checksums), and whether it ends in a line cut short (``torn``: its
    writer was killed while writing it)."""
    records: list[Indexed] = field(default_factory=list)
    end: Optional[EndRecord] = None
    damage: list[Damage] = field(default_factory=list)
    verified: int = 0
    unverified: int = 0
    torn: bool = False


def describe_record(record: AnyRecord) -> str:
    """A record as a damage report names it: kind, phase, path and call."""
    if isinstance(record, EndRecord):
        return "the end record"
    if isinstance(record, (CallRecord, OpRecord)):
        op = f" operation {record.index} ({record.name})" if isinstance(record, OpRecord) else ""
        return f"{record.kind} {record.phase} {record.path or '<root>'} call {record.call}{op}"
    return f"{record.kind} {record.path} (#{record.call}, step {record.step})"


def parse_index(raw: bytes, data_size: int, checksummed: bool = False) -> IndexScan:
    """Every line of an index checked (its checksum, then ``records.decode_line``: JSON of the right shape and types,
    tensors inside /data). A line that fails is reported as damage and skipped, and the lines after it are read:
    damage is told apart from an interrupted writer, whose index ends in a line cut short followed by the zeros of
    its unused reserve. ``checksummed``: the trace says every line carries a checksum (format 3), so a line
    without one is damaged too."""
    scan = IndexScan()
    body = raw.rstrip(b"\x00")  # a killed writer's reserve ends in zeros
    reserve_left = len(body) < len(raw)
    segments = body.split(b"\n")
    position, number, last_good = 0, 0, "the start of the index"
    for i, segment in enumerate(segments):
        start, position = position, position + len(segment) + 1
        if not segment:
            continue
        number += 1
        check = line_check(segment)
        pieces = split_joined(segment) if check is False else [segment]
        unterminated = i == len(segments) - 1
        for piece in pieces:
            piece_check = check if len(pieces) == 1 else line_check(piece)
            record = decode_line(piece)  # also a damaged line: what it reads as names it
            if piece_check is True or (piece_check is None and not checksummed):
                why = _unusable(record, data_size)
                if why is None:
                    assert record is not None
                    if piece_check:
                        scan.verified += 1
                    else:
                        scan.unverified += 1
                    if isinstance(record, EndRecord):
                        scan.end = record
                    else:
                        scan.records.append(record)
                        last_good = describe_record(record)
                    continue
            else:
                why = "its checksum does not match" if piece_check is False else "it carries no checksum"
            if unterminated and piece is pieces[-1] and scan.end is None and (reserve_left or not checksummed):
                scan.torn = True  # the line its writer was killed in: interrupted, not damaged
                break
            reads_as = describe_record(record) if record is not None else _reads_as(piece)
            scan.damage.append(Damage(f"index line {number} (bytes {start}-{start + len(segment)}, after "
                                      f"{last_good})", why, reads_as))
    return scan


def _unusable(record: AnyRecord | None, data_size: int) -> Optional[str]:
    """Why a line whose checksum matches (or that has none) is not used, or None."""
    if record is None:
        return "not a record of this format"
    if not isinstance(record, EndRecord) and any((t.offset or 0) + (t.nbytes or 0) > data_size for t in record.tensors):
        return "its tensor bytes lie past the end of /data (the file was cut short)"
    return None


def _reads_as(line: bytes) -> Optional[str]:
    """What a damaged line that no longer decodes seems to be, from its text: its kind, phase, path and call."""
    found = {key: text or number for key, text, number in _FIELD.findall(line[:400].decode("utf-8", "replace"))}
    words = [found[k] or "<root>" for k in ("kind", "phase", "path") if k in found]
    return " ".join(words + ([f"call {found['call']}"] if "call" in found else [])) or None


_FIELD = re.compile(r'"(kind|phase|path|call)":(?:"([^"]{0,120})"|(\d{1,12})\b)')
