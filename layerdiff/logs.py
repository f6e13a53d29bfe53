"""``layerdiff logs diff``: compare the loss, learning rate and gradient norm of two training logs.

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

Default tolerances, chosen for "the first training steps of the same model give the same numbers" across frameworks
(|a - b| > atol + rtol * |a| is over; A is the reference):

* loss: rtol 1e-3 (MindSpore prints 3 decimals; bf16 runs of the same model on the same data agree to ~1e-4),
* lr: rtol 1e-5 (a schedule is deterministic; Megatron prints 7 significant digits, MindSpore a float32),
* grad_norm: rtol 5e-2 (reductions in a different order; the most sensitive of the three).

All atol default to 0. Override per metric: ``--tol loss:rtol=1e-3,atol=0`` (repeatable).
"""
from __future__ import annotations

import codecs
import csv
import html
import io
import json
import math
import re
from pathlib import Path

import numpy as np

from .core.report import fmt_number
from .errors import LayerdiffError

EXIT_OK, EXIT_DIFFERENT = 0, 1
METRICS = ("loss", "lr", "grad_norm")
DEFAULT_TOLERANCES = {"loss": {"atol": 0.0, "rtol": 1e-3},
                      "lr": {"atol": 0.0, "rtol": 1e-5},
                      "grad_norm": {"atol": 0.0, "rtol": 5e-2}}
_MAX_BYTES_SNIFF = 1 << 16

# ---------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------
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


def _alias(name) -> str | None:
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
            metric = _alias(k) if k is not None else None
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
    rows = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, nested too deeply, an integer of over 4300 digits
            continue
        if isinstance(obj, dict):
            rows.append((n, obj))
    return _from_rows(rows)


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
        fields = [_alias(f) for f in (reader.fieldnames or [])]
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
        raise LogLineError(where, f"malformed CSV ({_first_line(exc)})") from None
    return _from_rows(rows)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


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
    counts = {}
    for name in ("megatron", "mindspore"):
        rx = _MEGATRON_RE if name == "megatron" else _MS_RE
        counts[name] = sum(1 for ln in sample if rx.search(ln))
    best = max(counts, key=counts.get)
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
    if not data:
        raise LayerdiffError(f"no training-log lines recognised in {path} "
                             "(expected Megatron-LM, MindSpore Transformers, CSV or JSONL)")
    return fmt, dict(sorted(data.items()))


# ---------------------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------------------
def parse_tolerance(text: str, into: dict | None = None) -> dict:
    """``METRIC:atol=..,rtol=..`` -> updated copy of the tolerance table."""
    table = {k: dict(v) for k, v in (into or DEFAULT_TOLERANCES).items()}
    metric, sep, spec = text.partition(":")
    metric = _alias(metric) or metric.strip()
    if not sep or metric not in METRICS:
        raise LayerdiffError(f"bad tolerance {text!r}: expected METRIC:atol=..,rtol=.. with METRIC one of "
                             f"{', '.join(METRICS)}")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("atol", "rtol"):
            raise LayerdiffError(f"bad tolerance {text!r}: {item!r} is not atol=.. or rtol=..")
        try:
            v = float(value)
        except ValueError:
            raise LayerdiffError(f"bad tolerance {text!r}: {value.strip()!r} is not a number") from None
        if not math.isfinite(v) or v < 0:
            raise LayerdiffError(f"bad tolerance {text!r}: {key} must be a finite number >= 0")
        table[metric][key] = v
    return table


def _ranges(its) -> list[list[int]]:
    out = []
    for i in its:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def _ranges_text(rs, limit=4) -> str:
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in rs[:limit]]
    return ", ".join(parts) + (f", ... ({len(rs) - limit} more ranges)" if len(rs) > limit else "")


def _float(x):
    return None if x is None else float(x)


def _compare_metric(its, a, b, tol) -> dict:
    """Statistics over pairs where both values are finite; a NaN/inf on one side only (or different infs) is a
    "nonfinite mismatch" and always over tolerance. Two NaNs (both runs skipped the iteration) are equal."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    finite = np.isfinite(a) & np.isfinite(b)
    same_nonfinite = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
    mismatch = ~finite & ~same_nonfinite
    with np.errstate(invalid="ignore", divide="ignore"):
        absdiff = np.where(finite, np.abs(a - b), 0.0)
        rel = np.where(absdiff == 0, 0.0, absdiff / np.abs(np.where(finite, a, 1.0)))
        over = mismatch | (finite & (absdiff > tol["atol"] + tol["rtol"] * np.abs(np.where(finite, a, 0.0))))
    idx = np.flatnonzero(over)
    first = int(its[idx[0]]) if idx.size else None
    k = int(np.argmax(absdiff))
    identical = not absdiff.any() and not mismatch.any()
    return {
        "compared": int(a.size),
        "max_abs": float(absdiff.max()), "max_abs_at": int(its[k]),
        "max_rel": float(rel.max()),
        "mean_abs": float(absdiff[finite].mean()) if finite.any() else 0.0,
        "nonfinite_mismatch": int(mismatch.sum()),
        "first_over": first,
        "first_over_values": [float(a[idx[0]]), float(b[idx[0]])] if idx.size else None,
        "over": int(idx.size),
        "identical": bool(identical),
        "atol": tol["atol"], "rtol": tol["rtol"],
        "verdict": "identical" if identical else ("within tolerance" if not idx.size else "different"),
    }


def diff(a: dict, b: dict, tolerances: dict | None = None) -> dict:
    """Compare two parsed logs ({iteration: {metric: value}}) aligned by iteration."""
    tol = {k: dict(v) for k, v in DEFAULT_TOLERANCES.items()}
    for k, v in (tolerances or {}).items():
        tol.setdefault(k, {}).update(v)
    ia, ib = set(a), set(b)
    common = sorted(ia & ib)
    only_a, only_b = sorted(ia - ib), sorted(ib - ia)
    metrics, series = {}, {}
    for m in METRICS:
        its = [i for i in common if a[i].get(m) is not None and b[i].get(m) is not None]
        in_a = any(r.get(m) is not None for r in a.values())
        in_b = any(r.get(m) is not None for r in b.values())
        if not its:
            if in_a or in_b:
                metrics[m] = {"compared": 0, "verdict": "not compared",
                              "note": f"only in {'A' if in_a else 'B'}" if in_a != in_b else "no common iteration"}
            continue
        va = [a[i][m] for i in its]
        vb = [b[i][m] for i in its]
        metrics[m] = _compare_metric(its, va, vb, tol[m])
        series[m] = {"iterations": its, "a": va, "b": vb}
    judged = [r["verdict"] for r in metrics.values() if r["compared"]]
    if not common or not judged:
        verdict = "nothing compared"
    elif "different" in judged:
        verdict = "different"
    elif all(v == "identical" for v in judged):
        verdict = "identical"
    else:
        verdict = "within tolerance"
    return {
        "report_kind": "logs_diff",
        "verdict": verdict,
        "compared": len(common),
        "common_range": [common[0], common[-1]] if common else None,
        "only_a": {"count": len(only_a), "ranges": _ranges(only_a)},
        "only_b": {"count": len(only_b), "ranges": _ranges(only_b)},
        "tolerances": {m: tol[m] for m in METRICS},
        "metrics": metrics,
        "series": series,
    }


# ---------------------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------------------
_COLORS = {"a": "#1f77b4", "b": "#d62728", "diff": "#2ca02c"}


def _nice(x) -> str:
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    return f"{x:.4g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def _svg_panel(its, curves, title, ylabel, width=760, height=240) -> str:
    """One SVG chart: curves = [(label, values, color)], NaN/inf points left out (gaps)."""
    ml, mr, mt, mb = 80, 20, 28, 44
    pw, ph = width - ml - mr, height - mt - mb
    xs = np.asarray(its, dtype=float)
    finite = [v for _, vals, _ in curves for v in vals if v is not None and math.isfinite(v)]
    y0, y1 = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if not y1 - y0 > 0:  # one value (or values too close to tell apart): a band around it
        pad = abs(y0) * 0.05
        y0, y1 = (y0 - pad, y1 + pad) if y1 + pad - (y0 - pad) > 0 else (y0 - 1.0, y1 + 1.0)
    x0, x1 = (xs.min(), xs.max()) if xs.size else (0.0, 1.0)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    x_step = max(1, math.ceil((x1 - x0) / 4))  # iterations are integers: integer ticks, none repeated
    x_ticks = list(range(math.ceil(x0), math.floor(x1) + 1, x_step))

    def px(x):
        return ml + (x - x0) / (x1 - x0) * pw

    def py(y):
        return mt + (1 - (y - y0) / (y1 - y0)) * ph

    e = html.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{e(title)}</text>',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ml - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{_nice(yv)}</text>')
    for xv in x_ticks:
        out.append(f'<text x="{px(xv):.1f}" y="{mt + ph + 14}" text-anchor="middle">{xv}</text>')
    out.append(f'<text x="{ml + pw / 2}" y="{height - 6}" text-anchor="middle">iteration</text>')
    out.append(f'<text x="14" y="{mt + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {mt + ph / 2})">{e(ylabel)}</text>')
    for n, (label, vals, color) in enumerate(curves):
        segs, cur = [], []
        for x, v in zip(xs, vals):
            if v is None or not math.isfinite(v):
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append(f"{px(x):.1f},{py(v):.1f}")
        if cur:
            segs.append(cur)
        dash = ' stroke-dasharray="5,3"' if n == 1 else ""
        for seg in segs:
            if len(seg) == 1:
                cx, cy = seg[0].split(",")
                out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}" data-series="{e(label)}"/>')
            else:
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} '
                           f'data-series="{e(label)}" points="{" ".join(seg)}"><title>{e(label)}</title></polyline>')
        lx, ly = ml + 10 + n * 220, mt + 14
        out.append(f'<line x1="{lx}" x2="{lx + 20}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/><text x="{lx + 24}" y="{ly}">{e(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def render_html(report: dict, label_a: str, label_b: str) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>layerdiff logs diff</title>',
             "<style>body{font-family:sans-serif;margin:20px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px}</style></head><body>",
             f"<h1>layerdiff logs diff: {e(report['verdict'])}</h1>",
             f"<p>A: {e(label_a)}<br>B: {e(label_b)}<br>{report['compared']} common iterations; "
             f"{report['only_a']['count']} only in A; {report['only_b']['count']} only in B</p>"]
    for m, s in report["series"].items():
        r = report["metrics"][m]
        its = s["iterations"]
        d = [(vb - va) if (math.isfinite(va) and math.isfinite(vb)) else math.nan for va, vb in zip(s["a"], s["b"])]
        parts.append(f"<h2>{e(m)}: {e(r['verdict'])}</h2>")
        parts.append(_svg_panel(its, [(f"A: {label_a}", s["a"], _COLORS["a"]),
                                      (f"B: {label_b}", s["b"], _COLORS["b"])], m, m))
        parts.append(_svg_panel(its, [("B - A", d, _COLORS["diff"])], f"{m}: B - A", f"{m} difference", height=180))
    parts.append("</body></html>")
    return "\n".join(parts)


def _write_text_atomic(path: Path, text: str):
    import os

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None


def _plot_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".html", ".htm"):
        return "html"
    if suffix == ".png":
        return "png"
    raise LayerdiffError(f"--plot {path}: unknown plot type {suffix or '(no suffix)'!r}; use .html or .png")


def write_plot(report: dict, path, label_a: str, label_b: str, *, overwrite: bool = False):
    path = Path(path)
    kind = _plot_kind(path)
    if path.exists() and not overwrite:
        raise LayerdiffError(f"{path} exists; pass --force to replace it")
    if kind == "html":
        _write_text_atomic(path, render_html(report, label_a, label_b))
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise LayerdiffError(f"--plot {path}: PNG needs matplotlib, which is not installed; "
                             "use an .html plot or pip install matplotlib") from None
    names = list(report["series"])
    fig, axes = plt.subplots(2, max(1, len(names)), figsize=(5 * max(1, len(names)), 6), squeeze=False)
    for col, m in enumerate(names):
        s = report["series"][m]
        its, va, vb = s["iterations"], np.asarray(s["a"], float), np.asarray(s["b"], float)
        axes[0][col].plot(its, va, label=f"A: {label_a}")
        axes[0][col].plot(its, vb, "--", label=f"B: {label_b}")
        axes[0][col].set(title=m, xlabel="iteration", ylabel=m)
        axes[0][col].legend(fontsize="small")
        axes[1][col].plot(its, vb - va, color=_COLORS["diff"], label="B - A")
        axes[1][col].set(title=f"{m}: B - A", xlabel="iteration", ylabel=f"{m} difference")
        axes[1][col].legend(fontsize="small")
        for row in (0, 1):  # iterations are integers: no 1.5 between 1 and 2
            axes[row][col].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise LayerdiffError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# terminal
# ---------------------------------------------------------------------------------------------------------
def verdict_line(report: dict) -> str:
    bits = []
    for m, r in report["metrics"].items():
        if not r["compared"]:
            bits.append(f"{m} not compared ({r['note']})")
        elif r["first_over"] is not None:
            bits.append(f"{m} over tolerance from iteration {r['first_over']} ({r['over']} of {r['compared']})")
        else:
            bits.append(f"{m} {r['verdict']}")
    extra = ""
    if report["only_a"]["count"] or report["only_b"]["count"]:
        extra = f"; {report['only_a']['count']} iterations only in A, {report['only_b']['count']} only in B"
    return f"{report['verdict']}: {report['compared']} common iterations; " + "; ".join(bits) + extra


def render(report: dict, console=None):
    from rich.table import Table

    from .core.report import make_console

    console = console or make_console()
    a, b = report.get("a", {}), report.get("b", {})
    if a:
        console.print(f"[bold]A[/] {a['path']}  ({a['format']}, {a['iterations']} iterations)")
        console.print(f"[bold]B[/] {b['path']}  ({b['format']}, {b['iterations']} iterations)")
    table = Table(show_header=True, header_style="bold")
    for col in ("metric", "iterations compared", "max abs", "max rel", "first over tolerance", "tolerance", "verdict"):
        table.add_column(col, justify="right" if col not in ("metric", "verdict") else "left")
    colors = {"identical": "green", "within tolerance": "green", "different": "red"}
    for m, r in report["metrics"].items():
        if not r["compared"]:
            table.add_row(m, "0", "-", "-", "-", "-", f"[yellow]{r['note']}[/]")
            continue
        first = "-" if r["first_over"] is None else (
            f"{r['first_over']} ({fmt_number(r['first_over_values'][0])} vs "
            f"{fmt_number(r['first_over_values'][1])})")
        table.add_row(m, str(r["compared"]), fmt_number(r["max_abs"]), fmt_number(r["max_rel"]), first,
                      f"atol={fmt_number(r['atol'])} rtol={fmt_number(r['rtol'])}",
                      f"[{colors.get(r['verdict'], 'yellow')}]{r['verdict']}[/]")
    console.print(table)
    for m, r in report["metrics"].items():
        if r.get("nonfinite_mismatch"):
            console.print(f"{m}: {r['nonfinite_mismatch']} iterations NaN/inf in one run only "
                          "(a skipped step; not counted in max abs / max rel)")
    for side in ("only_a", "only_b"):
        o = report[side]
        if o["count"]:
            console.print(f"{o['count']} iterations only in {side[-1].upper()}: {_ranges_text(o['ranges'])}")
    color = colors.get(report["verdict"], "yellow")
    console.print(f"[bold {color}]{report['verdict']}[/]")


# ---------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------
def add_parser(subparsers, parser_class=None):
    """Add the ``diff`` action to a ``logs`` command's subparsers."""
    kw = {"help": "compare loss, learning rate and grad norm of two training logs by iteration"}
    d = subparsers.add_parser("diff", **kw)
    d.add_argument("a", help="reference log (Megatron-LM, MindSpore Transformers, CSV or JSONL; auto-detected)")
    d.add_argument("b", help="candidate log")
    d.add_argument("--json", metavar="FILE", help="write the full JSON report (refuses to overwrite; see --force)")
    d.add_argument("--plot", metavar="FILE", help="write curves and differences: .html (self-contained SVG) or "
                                                  ".png (needs matplotlib)")
    d.add_argument("--tol", action="append", default=[], metavar="METRIC:atol=..,rtol=..",
                   help="tolerance for loss, lr or grad_norm (repeatable; defaults: loss rtol=1e-3, "
                        "lr rtol=1e-5, grad_norm rtol=5e-2, atol=0)")
    d.add_argument("--force", action="store_true", help="overwrite existing --json / --plot files")
    d.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line")
    return d


def register(sub, parser_class=None):
    """Add ``logs`` (with its ``diff`` action) to the top-level subparsers ``sub``; dispatch with ``run(args)``."""
    kwargs = {"parser_class": parser_class} if parser_class else {}
    logs = sub.add_parser("logs", help="compare training logs (loss, lr, grad norm) of two runs")
    actions = logs.add_subparsers(dest="logs_command", metavar="ACTION", required=True, **kwargs)
    add_parser(actions, parser_class)
    return logs


def compare_files(path_a, path_b, tolerances: dict | None = None) -> dict:
    fa, la = load_log(path_a)
    fb, lb = load_log(path_b)
    report = diff(la, lb, tolerances)
    for key, path, fmt, data in (("a", path_a, fa, la), ("b", path_b, fb, lb)):
        its = list(data)
        report[key] = {"path": str(path), "format": FORMAT_NAMES[fmt], "iterations": len(its),
                       "range": [its[0], its[-1]]}
    if report["verdict"] == "nothing compared" and report["compared"]:
        raise LayerdiffError(f"{path_a} and {path_b} share iterations but no metric (loss, lr, grad_norm) logged in both")
    if not report["compared"]:
        raise LayerdiffError(f"{path_a} and {path_b} share no iteration (A: {_ranges_text(_ranges(list(la)))}; "
                             f"B: {_ranges_text(_ranges(list(lb)))})")
    return report


def tolerances(texts=()) -> dict:
    """The default tolerances with ``--tol`` overrides applied in order."""
    tol = {k: dict(v) for k, v in DEFAULT_TOLERANCES.items()}
    for text in texts or ():
        tol = parse_tolerance(text, tol)
    return tol


def run(args) -> int:
    """``layerdiff logs diff``: 0 identical or within tolerance, 1 different; LayerdiffError for bad input."""
    if getattr(args, "logs_command", "diff") != "diff":
        raise LayerdiffError(f"unknown logs action {args.logs_command!r}")
    tol = tolerances(args.tol)
    outputs = [p for p in (args.json, args.plot) if p]
    if args.plot:
        _plot_kind(Path(args.plot))
    for out in outputs:
        if Path(out).exists() and not args.force:
            raise LayerdiffError(f"{out} exists; pass --force to replace it")
    report = compare_files(args.a, args.b, tol)
    if args.plot:
        write_plot(report, args.plot, Path(args.a).name, Path(args.b).name, overwrite=args.force)
    from .core.report import publish

    publish(report, json_path=args.json, overwrite=args.force, quiet=args.quiet, line=verdict_line, render=render)
    return EXIT_DIFFERENT if report["verdict"] == "different" else EXIT_OK
