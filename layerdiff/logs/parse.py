"""Reading training logs into {iteration: {"loss", "lr", "grad_norm"}}.

Formats (detected from the content, never the file name):

* Megatron-LM training log lines::

    [2024-01-01 00:00:00] iteration       10/    1000 | consumed samples: 640 | ... | learning rate: 1.000000E-04 |
    global batch size:    64 | lm loss: 1.023456E+01 | loss scale: 1.0 | grad norm: 3.456 |
    number of skipped iterations:   0 | number of nan iterations:   0 |

* MindSpore Transformers (``MFLossMonitor``) lines, sink mode ``loss: 10.123`` or non-sink ``loss:[10.123/10.100]``
  (current/average: the current value is used), ``global_norm`` / ``lr`` bracketed or plain::

    ... - INFO - { Epoch:[  1/  2], step:[    5/  100], loss: 10.123, per_step_time: 1234ms, lr: 1e-05,
    overflow cond: False, loss_scale: 1.0, global_norm: [3.456]

  The global iteration is ``(epoch - 1) * steps_per_epoch + step`` (steps_per_epoch: the N of ``step:[x/ N]``).

* CSV with a header naming the iteration (``iteration``/``step``/``iter``) and any of loss (``loss``, ``lm loss``,
  ``lm_loss``), lr (``lr``, ``learning rate``, ``learning_rate``) and grad_norm (``grad_norm``, ``grad norm``,
  ``global_norm``, ``global norm``).
* JSONL: one JSON object per line with the same keys.

A later line for an iteration replaces an earlier one (a restarted run re-logs the iterations after its checkpoint).
Skipped iterations (Megatron ``number of skipped/nan iterations`` > 0, MindSpore ``overflow cond: True``) record loss
and grad_norm as NaN. Two NaNs compare equal; NaN against a number exceeds any tolerance.
"""
from __future__ import annotations

import codecs
import csv
import io
import json
import math
import re
from pathlib import Path

from layerdiff.errors import LayerdiffError, first_line

METRICS = ("loss", "lr", "grad_norm")
_MAX_BYTES_SNIFF = 1 << 16

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf|infinity)"
# "key: [value" with the bracket optional: (?:\s*\[)?\s* rather than \s*\[?\s*, whose two adjacent \s* make a
# long run of spaces with no number after it quadratic (a hostile line would hang the parser)
_VALUE = r"(?:\s*\[)?\s*(" + _NUM + r")"

_MEGATRON_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_MEGATRON_KEYS = {"lm loss": "loss", "loss": "loss", "learning rate": "lr", "lr": "lr", "grad norm": "grad_norm"}

_MS_RE = re.compile(r"Epoch:\[\s*(\d+)\s*/\s*(\d+)\s*\],\s*step:\[\s*(\d+)\s*/\s*(\d+)\s*\],(.*)$")
_MS_LOSS_RE = re.compile(r"(?<![\w])loss:" + _VALUE, re.I)
_MS_LR_RE = re.compile(r"(?<![\w])lr:" + _VALUE, re.I)
_MS_NORM_RE = re.compile(r"global[_ ]norm:" + _VALUE, re.I)
_MS_OVERFLOW_RE = re.compile(r"overflow cond:\s*(True|False)", re.I)

_ALIASES = {
    "iteration": "iteration", "iter": "iteration", "step": "iteration", "global_step": "iteration",
    "loss": "loss", "lm loss": "loss", "lm_loss": "loss", "train_loss": "loss",
    "lr": "lr", "learning rate": "lr", "learning_rate": "lr",
    "grad_norm": "grad_norm", "grad norm": "grad_norm", "global_norm": "grad_norm", "global norm": "grad_norm",
    "gradnorm": "grad_norm",
}
_MAX_ITERATION = 1 << 53  # exact as a float (plots, JSON); no run takes that many steps
_MAX_CSV_LINE = 1 << 16  # characters; a CSV log line holds a few numbers
_MAX_DIGITS = 15  # an iteration, epoch or step count of more digits is a corrupt or hostile line


class LogLineError(LayerdiffError):
    """A line recognised as a log record whose content is unusable; ``load_log`` adds the file's name."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line, self.detail = line, message


def alias(name) -> str | None:
    key = re.sub(r"[\s\-]+", " ", str(name).strip().lower())
    return _ALIASES.get(key) or _ALIASES.get(key.replace(" ", "_"))


def _num(text) -> float | None:
    """A metric value: a float (an integer too large for one is +-inf), or None when not a number."""
    if text is None:
        return None
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        try:
            return float(text)
        except OverflowError:
            return math.inf if text > 0 else -math.inf
    if isinstance(text, float):
        return text
    if not isinstance(text, str):  # a list or object in a JSON record
        return None
    text = text.strip().strip("[]").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _count(text: str, line: int, what: str) -> int:
    """A run of digits matched by a log-line regex: bounded before ``int()`` (which refuses more than 4300)."""
    if len(text) > _MAX_DIGITS:
        raise LogLineError(line, f"{what} {text[:20]}... has {len(text)} digits, not a plausible {what}")
    return int(text)


def _iteration(value, line: int) -> int | None:
    """A CSV/JSONL row's iteration: None when absent or not a number (the row is skipped, as a NaN is); a
    number beyond 2**53 or infinite is an error naming the line."""
    number = _num(value)
    if number is None or math.isnan(number):
        return None
    if not abs(number) <= _MAX_ITERATION:
        try:
            text = str(value)
        except ValueError:  # an integer of more than 4300 digits
            text = "of over 4300 digits"
        shown = text if len(text) <= 20 else f"{text[:20]}... ({len(text)} characters)"
        raise LogLineError(line, f"iteration {shown} is out of range")
    return int(number)


def _record(loss=None, lr=None, grad_norm=None) -> dict:
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm}


def parse_megatron(lines) -> dict:
    out = {}
    for n, line in enumerate(lines, 1):
        m = _MEGATRON_RE.search(line)
        if not m:
            continue
        fields = {}
        for part in m.group(3).split("|"):
            if ":" in part:
                k, _, v = part.rpartition(":")
                fields[k.strip().lower()] = v.strip()
        rec = _record()
        for key, metric in _MEGATRON_KEYS.items():
            if key in fields and rec[metric] is None:
                rec[metric] = _num(fields[key])
        skipped = (_num(fields.get("number of skipped iterations")) or 0) > 0
        nan = (_num(fields.get("number of nan iterations")) or 0) > 0
        if skipped or nan:
            rec["loss"] = rec["grad_norm"] = math.nan
        out[_count(m.group(1), n, "iteration")] = rec
    return out


def parse_mindspore(lines) -> dict:
    out = {}
    for n, line in enumerate(lines, 1):
        m = _MS_RE.search(line)
        if not m:
            continue
        epoch, step = _count(m.group(1), n, "epoch"), _count(m.group(3), n, "step")
        steps_per_epoch, rest = _count(m.group(4), n, "steps per epoch"), m.group(5)
        iteration = (epoch - 1) * steps_per_epoch + step
        if abs(iteration) > _MAX_ITERATION:
            raise LogLineError(n, f"iteration (epoch {epoch} - 1) x {steps_per_epoch} + {step} is out of range")

        def grab(rx):
            g = rx.search(rest)
            return _num(g.group(1)) if g else None

        rec = _record(grab(_MS_LOSS_RE), grab(_MS_LR_RE), grab(_MS_NORM_RE))
        o = _MS_OVERFLOW_RE.search(rest)
        if o and o.group(1).lower() == "true":
            rec["loss"] = rec["grad_norm"] = math.nan
        out[iteration] = rec
    return out


def _from_rows(rows) -> dict:
    """``rows``: (line number, {column: value}) pairs."""
    out = {}
    for n, row in rows:
        named = {}
        for k, v in row.items():
            metric = alias(k) if k is not None else None
            if metric and metric not in named:
                named[metric] = v
        it = _iteration(named.get("iteration"), n)
        if it is None:
            continue
        rec = _record(*(_num(named.get(m)) for m in METRICS))
        if all(v is None for v in rec.values()):
            continue
        out[it] = rec
    return out


def parse_jsonl(lines) -> dict:
    """A JSONL log: its object lines read as rows. In a log that has such rows, a line that starts an object and
    cannot be read (nested too deeply, not JSON, an integer of over 4300 digits) is an error naming it: skipped,
    it would read as iterations one run lacks. Only a last line cut short (a log still being written) is let go."""
    lines = list(lines)
    rows, malformed = [], None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except RecursionError:
            why = "nested too deeply"
        except ValueError as exc:
            if n == len(lines):
                continue
            why = f"not JSON ({first_line(exc, 120)})"
        else:
            if isinstance(obj, dict):
                rows.append((n, obj))
            continue
        malformed = malformed or (n, why)
    data = _from_rows(rows)
    if data and malformed:
        raise LogLineError(malformed[0], f"a JSON log line that cannot be read: {malformed[1]}")
    return data


def parse_csv(lines) -> dict:
    body = [(n, ln) for n, ln in enumerate(lines, 1) if ln.strip() and not ln.lstrip().startswith("#")]
    if not body or len(body[0][1]) > _MAX_CSV_LINE:
        return {}
    header = body[0][1]
    delim = max([",", "\t", ";"], key=header.count)
    if header.count(delim) == 0:
        return {}
    reader = csv.DictReader(io.StringIO("\n".join(ln for _, ln in body)), delimiter=delim)
    try:
        fields = [alias(f) for f in (reader.fieldnames or [])]
    except csv.Error:  # the first line is not a CSV header
        return {}
    if "iteration" not in fields or not any(f in METRICS for f in fields):
        return {}
    # csv's own field limit is process-wide (another library may have raised it): bound lines here
    n, long = next(((n, ln) for n, ln in body if len(ln) > _MAX_CSV_LINE), (0, None))
    if long is not None:
        raise LogLineError(n, f"{len(long)} characters, too long for a CSV log line (at most {_MAX_CSV_LINE})")
    rows = []
    try:
        for row in reader:
            n = body[min(reader.line_num, len(body)) - 1][0]
            if any(len(v) > _MAX_CSV_LINE for v in row.values() if isinstance(v, str)):  # quoted over many lines
                raise LogLineError(n, f"a field of over {_MAX_CSV_LINE} characters, too long for a CSV log")
            rows.append((n, row))
    except csv.Error as exc:  # over csv's own field limit, ...
        where = body[min(reader.line_num, len(body) - 1)][0]  # line_num counts the lines parsed before it
        raise LogLineError(where, f"malformed CSV ({first_line(exc, 200)})") from None
    return _from_rows(rows)


PARSERS = {"megatron": parse_megatron, "mindspore": parse_mindspore, "jsonl": parse_jsonl, "csv": parse_csv}
FORMAT_NAMES = {"megatron": "Megatron-LM", "mindspore": "MindSpore Transformers", "jsonl": "JSONL", "csv": "CSV"}
_EXPECTED = "expected Megatron-LM, MindSpore Transformers, CSV or JSONL"


def _read_text(path: Path) -> str:
    """The log as text: UTF-8 (a BOM is skipped, and so is a multi-byte character cut off at the very end of a
    log still being written); a binary or otherwise encoded file is one error naming it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LayerdiffError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LayerdiffError(f"{path}: is a directory, not a training log") from None
    except OSError as exc:
        raise LayerdiffError(f"cannot read {path}: {exc.strerror or exc}") from None
    if b"\0" in data[:_MAX_BYTES_SNIFF]:
        raise LayerdiffError(f"{path}: binary file, not a training log ({_EXPECTED})")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.end == len(data) and exc.reason == "unexpected end of data":  # a torn last character
            return data[:exc.start].decode("utf-8")
        line = data.count(b"\n", 0, exc.start) + 1
        raise LayerdiffError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02X}); training logs are "
                             f"read as UTF-8 ({_EXPECTED})") from None


def detect_format(lines) -> str | None:
    """The format whose parser recognises the most lines (log formats first: a log may contain stray JSON)."""
    sample = list(lines)
    counts: dict[str, int] = {}
    for name in ("megatron", "mindspore"):
        rx = _MEGATRON_RE if name == "megatron" else _MS_RE
        counts[name] = sum(1 for ln in sample if rx.search(ln))
    best = max(counts, key=lambda name: counts[name])
    if counts[best]:
        return best
    if parse_jsonl(sample[:200]):
        return "jsonl"
    if parse_csv(sample[:200]):
        return "csv"
    return None


def load_log(path, fmt: str | None = None) -> tuple[str, dict]:
    """(format, {iteration: {"loss", "lr", "grad_norm"}}) of a training log; LayerdiffError if none recognised."""
    path = Path(path)
    lines = _read_text(path).splitlines()
    try:
        fmt = fmt or detect_format(lines)
        data = PARSERS[fmt](lines) if fmt else {}
    except LogLineError as exc:
        raise LayerdiffError(f"{path}: line {exc.line}: {exc.detail}") from None
    if not data or fmt is None:
        raise LayerdiffError(f"no training-log lines recognised in {path} "
                             "(expected Megatron-LM, MindSpore Transformers, CSV or JSONL)")
    return fmt, dict(sorted(data.items()))

