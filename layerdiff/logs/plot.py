"""Curves of two training logs and their difference: a self-contained HTML page (inline SVG) or a PNG."""
from __future__ import annotations

import html
import math
from pathlib import Path

import numpy as np

from layerdiff.errors import LayerdiffError
from layerdiff.files import refuse_existing, write_atomically
from layerdiff.report.terminal import fmt_number

_COLORS = {"a": "#1f77b4", "b": "#d62728", "diff": "#2ca02c"}


def _nice(x) -> str:
    return fmt_number(float(x), digits=4)


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
        segs: list = []
        cur: list = []
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


def plot_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".html", ".htm"):
        return "html"
    if suffix == ".png":
        return "png"
    raise LayerdiffError(f"--plot {path}: unknown plot type {suffix or '(no suffix)'!r}; use .html or .png")


def write_plot(report: dict, path, label_a: str, label_b: str, *, overwrite: bool = False):
    path = Path(path)
    kind = plot_kind(path)
    refuse_existing(path, overwrite)
    if kind == "html":
        write_atomically(path, render_html(report, label_a, label_b), overwrite=True)
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

