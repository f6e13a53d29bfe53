"""An align report as one self-contained HTML file: no script, no network, readable in any browser.

The page leads with the verdict and each direction's origin with its explanation (the same lines the terminal
shows), then how the error grows along the run (an inline SVG plot, forward and backward), the module tree with a
verdict per call and every tensor's metrics folded under it, the runs' settings that differ, and the module
mapping, layouts and rules used.
"""
from __future__ import annotations

import math
from html import escape

from rich.text import Text

from layerdiff.report.ops_view import code_at, is_origin_row, module_ops, origin_hints, row_status, short_source
from layerdiff.report.terminal import (View, fmt_number, origin_lines, recompute_explains, recompute_lines,
                                       row_passed, step_count)

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.bad{color:#b00020} .ok{color:#137333} .dim{color:#777}
.origin{border-left:4px solid #b00020;background:#fff4f4;padding:8px 12px;margin:8px 0}
.origin.clean{border-color:#137333;background:#f3fbf5}
table{border-collapse:collapse;margin:6px 0} td,th{padding:2px 10px;text-align:left;vertical-align:top}
th{border-bottom:1px solid #ccc} td.num{text-align:right;font-variant-numeric:tabular-nums}
details{margin-left:18px} summary{cursor:pointer} .tree>details{margin-left:0}
.is-origin>summary{font-weight:bold;background:#ffe3e3}
code{background:#f4f4f4;padding:0 3px}
tr.is-origin-op{background:#ffe3e3;font-weight:bold} h3{font-size:15px}
"""


def _plain(markup: str) -> str:
    return Text.from_markup(markup).plain


def _number(x) -> str:
    return escape(x) if isinstance(x, str) else fmt_number(float(x) if isinstance(x, int) else x)


def _rel(row: View) -> float | None:
    """A record's largest relative error over its tensors (max abs diff / the reference's max |value|); inf where a
    value is NaN or infinite in one run only (its other metrics are over the finite values)."""
    worst = None
    for t in row.get("tensors", ()):
        m = t.get("metrics") or {}
        if m.get("nonfinite_mismatch"):
            return math.inf
        diff, ref = m.get("max_abs"), m.get("ref_max_abs")
        if isinstance(diff, (int, float)) and isinstance(ref, (int, float)) and math.isfinite(diff):
            rel = diff / ref if ref > 0 else (0.0 if diff == 0 else 1.0)
            worst = rel if worst is None else max(worst, rel)
    return worst


def _series(report: View, phase: str) -> list[tuple[str, float, bool]]:
    """(module, relative error, is the origin) of each call record of ``phase`` in execution order."""
    origin = (report.get(phase) or {}).get("first_divergence") or {}
    rows = sorted((r for r in report.get("records", ()) if r.get("kind") == "call" and r.get("phase") == phase),
                  key=lambda r: (r.get("step", 0), r.get("begin", 0)))
    out = []
    for r in rows:
        rel = _rel(r)
        if rel is not None:
            out.append((r["path"] or "<root>", rel, r["path"] == origin.get("module") and
                        r.get("step", 0) == origin.get("step", 0)))
    return out


def error_plot(report: View, width: int = 1000, height: int = 260) -> str:
    """An SVG line plot of each call's relative error (log scale) in execution order, forward and backward."""
    pad_l, pad_b, pad_t = 60, 28, 14
    series = {phase: _series(report, phase) for phase in ("forward", "backward")}
    values = [rel for s in series.values() for _, rel, _ in s if 0 < rel < math.inf]
    nonfinite = any(rel == math.inf for s in series.values() for _, rel, _ in s)
    if not values and not nonfinite:
        return "<p class='dim'>no tensor differs: nothing to plot</p>"
    low = math.floor(math.log10(max(min(values), 1e-12))) if values else -6
    high = max(math.ceil(math.log10(max(values))), low + 1) if values else 0
    n = max(len(s) for s in series.values())
    nan_row = pad_t + 4  # NaN/Inf in one run only: a row of their own, above the scale
    pad_t += 22 if nonfinite else 0
    plot_w, plot_h = width - pad_l - 10, height - pad_b - pad_t

    def xy(i, rel):
        x = pad_l + plot_w * (i / max(n - 1, 1))
        if rel == math.inf:
            return x, nan_row
        y = math.log10(max(rel, 10.0 ** low))
        return x, pad_t + plot_h * (1 - (y - low) / (high - low))

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
             "aria-label='relative error by module call'>"]
    if nonfinite:
        parts.append(f"<text x='{pad_l - 6}' y='{nan_row + 4}' font-size='11' text-anchor='end'>NaN/Inf</text>")
    for e in range(low, high + 1):
        _, y = xy(0, 10.0 ** e)
        parts.append(f"<line x1='{pad_l}' x2='{width - 10}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eee'/>"
                     f"<text x='{pad_l - 6}' y='{y + 4:.1f}' font-size='11' text-anchor='end'>1e{e}</text>")
    colors = {"forward": "#1a73e8", "backward": "#e37400"}
    for phase, points in series.items():
        if not points:
            continue
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, rel) for i, (_, rel, _) in enumerate(points)))
        parts.append(f"<polyline fill='none' stroke='{colors[phase]}' stroke-width='1.5' points='{coords}'>"
                     f"<title>{phase}</title></polyline>")
        for i, (module, rel, is_origin) in enumerate(points):
            x, y = xy(i, rel)
            r, fill = (5, "#b00020") if is_origin else (2, colors[phase])
            value = "NaN/Inf in one run only" if rel == math.inf else f"{rel:.3g}"
            parts.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{r}' fill='{fill}'><title>{escape(phase)} "
                         f"{escape(module)}: {value}</title></circle>")
    parts.append(f"<text x='{pad_l}' y='{height - 6}' font-size='11'>module calls in execution order "
                 "(blue: forward, orange: backward; red dot: origin); y: max abs diff / max |A|</text></svg>")
    return "".join(parts)


def _origin_block(report: View, phase: str, steps: int) -> str:
    res = report.get(phase) or {}
    origin = res.get("first_divergence")
    if res.get("status") == "absent":
        return f"<div class='origin clean'><b>{phase.upper()}</b> not in both traces</div>"
    if not origin:
        return f"<div class='origin clean'><b>{phase.upper()}</b> <span class='ok'>{escape(res.get('status', ''))}</span></div>"
    lines = [_plain(line) for line in origin_lines(origin, steps)]
    body = "<br>".join(escape(line) for line in lines[1:])
    ops = _ops_block(report, origin) if origin.get("op") and origin.get("where") != "forward" else ""
    hint = "".join(f"<br><span class='dim'>{escape(line)}</span>" for line in origin_hints(report, origin))
    if phase == "backward" and origin.get("where") != "forward":
        hint += "".join(f"<br><b class='bad'>{escape(line)}</b>"
                        for line in recompute_explains(report.get("recompute") or {}))
    return (f"<div class='origin' id='{phase}-origin'><b>{phase.upper()}</b> "
            f"<span class='bad'>divergent ({res.get('failing_tensors', '?')} tensors over tolerance)</span><br>"
            f"origin: <b class='bad'>{escape(lines[0])}</b><br>{body}{hint}</div>{ops}")


def _ops_block(report: View, origin: View) -> str:
    """The origin module's operations around the origin's: both runs side by side, each with its line of code."""
    rows = module_ops(report, origin)
    if not rows:
        return ""
    op = origin.get("op") or {}

    def where(info: View) -> str:
        if not info:
            return ""
        code = code_at(info.get("source"))
        return (f"<code>{escape(short_source(info.get('source')))}</code>"
                + (f"<br><code class='dim'>{escape(code)}</code>" if code else ""))

    cells = ["<table class='ops'><tr><th>#</th><th>A</th><th>line A</th><th>B</th><th>line B</th><th>max rel</th>"
             "<th></th></tr>"]
    for r in rows:
        a, b = r.get("op") or {}, r.get("op_b") or {}
        rel = max((t["metrics"].get("max_rel") or 0 for t in r.get("tensors", ()) if t.get("metrics")
                   and t["role"] in ("output", "grad_input")), default=None)
        status = row_status(r)
        here = is_origin_row(r, op)
        mark = "&larr; origin" if here else ("" if status == "ok" else escape(status))
        cells.append(f"<tr{' class=is-origin-op' if here else ''}><td class='num'>{a.get('index', '')}</td>"
                     f"<td>{escape(str(a.get('name', '')))}</td><td>{where(a)}</td>"
                     f"<td>{escape(str(b.get('name', '')))}</td>"
                     f"<td>{where(b)}</td><td class='num'>{_number(rel) if rel is not None else '-'}</td>"
                     f"<td class='{'bad' if status != 'ok' else 'ok'}'>{mark}</td></tr>")
    cells.append("</table>")
    return (f"<h3>Operations of <code>{escape(origin.get('module') or '<root>')}</code> "
            f"({escape(str(origin.get('phase')))}), A | B</h3>" + "".join(cells))


def _tensor_table(row: View) -> str:
    cells = ["<table><tr><th>role</th><th>key</th><th>shape A / B</th><th>max abs</th><th>rel</th>"
             "<th>cosine</th><th>judged</th></tr>"]
    for t in row.get("tensors", ()):
        m = t.get("metrics") or {}
        ref = m.get("ref_max_abs")
        rel = m.get("max_abs") / ref if isinstance(m.get("max_abs"), (int, float)) and ref else None
        mark = "<span class='ok'>ok</span>" if t.get("passed", True) else f"<span class='bad'>{escape(str(t.get('reason', 'x')))}</span>"
        cells.append(f"<tr><td>{escape(t['role'])}</td><td><code>{escape(t['key'])}</code></td>"
                     f"<td>{escape(str(t.get('shape_a')))} / {escape(str(t.get('shape_b')))}</td>"
                     f"<td class='num'>{_number(m.get('max_abs'))}</td><td class='num'>{_number(rel)}</td>"
                     f"<td class='num'>{_number(m.get('cosine'))}</td><td>{mark}</td></tr>")
    return "".join(cells) + "</table>"


def _tree(report: View, phase: str) -> str:
    """Each call of ``phase`` under its parent call, with its verdict and (folded) its tensors."""
    origin = (report.get(phase) or {}).get("first_divergence") or {}
    rows = [r for r in report.get("records", ()) if r.get("kind") == "call" and r.get("phase") == phase]
    children: dict = {}
    for r in sorted(rows, key=lambda r: (r.get("step", 0), r.get("begin", 0))):
        parent = tuple(r["parent"]) if r.get("parent") else None
        children.setdefault((r.get("step", 0), parent), []).append(r)

    def node(r) -> tuple[str, bool]:
        """The call's HTML, and whether it and every call inside it agree."""
        ok = row_passed(r)
        is_origin = r["path"] == origin.get("module") and r.get("step", 0) == origin.get("step", 0)
        inside = [node(c) for c in children.get((r.get("step", 0), (r["path"], r["call"])), ())]
        whole = ok and all(agree for _, agree in inside)
        # a call whose own tensors agree but a call inside it differs (backward's root: the loss's gradient is 1)
        mark = ("<span class='ok'>ok</span>" if whole else "<span class='bad'>differs inside</span>") if ok \
            else "<span class='bad'>differs</span>"
        label = escape(r["path"] or "<root>") + (f" #{r['call']}" if r.get("call") else "")
        kids = "".join(html for html, _ in inside)
        return (f"<details class='{'is-origin' if is_origin else ''}'{' open' if is_origin or not whole else ''}>"
                f"<summary>{label} <span class='dim'>{escape(str(r.get('type_a') or ''))}</span> {mark}"
                f"{' <b class=bad>&larr; origin</b>' if is_origin else ''}</summary>{_tensor_table(r)}{kids}</details>",
                whole)

    roots = [r for (step, parent), rs in children.items() if parent is None for r in rs]
    return "<div class='tree'>" + "".join(node(r)[0] for r in roots) + "</div>"


def _settings(report: View) -> str:
    out = ["<table><tr><th></th><th>A</th><th>B</th></tr>"]
    for key in ("path", "framework", "framework_version", "model_class", "mode", "param_dtypes", "autocast_dtypes",
                "devices", "target", "target_args", "status"):
        a, b = (report.get("a") or {}).get(key), (report.get("b") or {}).get(key)
        cls = " class='bad'" if a != b and key not in ("path",) else ""
        out.append(f"<tr><td>{escape(key)}</td><td{cls}>{escape(str(a))}</td><td{cls}>{escape(str(b))}</td></tr>")
    for d in (report.get("settings") or {}).get("differ", []):
        out.append(f"<tr><td>{escape(d['key'])}</td><td class='bad'>{escape(str(d['a']))}</td>"
                   f"<td class='bad'>{escape(str(d['b']))}</td><td class='dim'>{escape(d['why'])}</td></tr>")
    return "".join(out) + "</table>"


def _mapping(report: View) -> str:
    rows = report.get("mapping") or []
    out = [f"<p>{len(rows)} modules renamed (B &rarr; A); layouts: {escape(str(report.get('layouts') or 'none'))}; "
           f"rules: {escape(str(report.get('rules') or 'built-in'))}</p>"]
    if rows:
        out.append("<table><tr><th>B</th><th>A</th><th>confidence</th><th>evidence</th></tr>")
        out += [f"<tr><td>{escape(str(m.get('b')))}</td><td>{escape(str(m.get('a')))}</td>"
                f"<td class='num'>{_number(m.get('confidence'))}</td><td>{escape(str(m.get('reason', '')))}</td></tr>"
                for m in rows]
        out.append("</table>")
    return "".join(out)


def report_html(report: View) -> str:
    """The whole page for a two-run align report."""
    steps = step_count(report)
    verdict = report.get("verdict", "?")
    problems = (report.get("trust") or {}).get("problems", [])
    head = (f"<h1>layerdiff: <span class='{'ok' if verdict == 'aligned' else 'bad'}'>{escape(verdict)}</span></h1>"
            f"<p>A <code>{escape(str(report['a'].get('path')))}</code> &nbsp; B "
            f"<code>{escape(str(report['b'].get('path')))}</code></p>"
            + "".join(f"<p class='bad'>WARNING: {escape(p)}</p>" for p in problems)
            + "".join(f"<p>note: {escape(n)}</p>" for n in (report.get("trust") or {}).get("notes", []))
            + "".join(f"<p class='bad'>the models' own configs differ: {escape(d['key'])} {escape(str(d['a']))} (A) "
                      f"vs {escape(str(d['b']))} (B)</p>" for d in report.get("config_diff") or ())
            + "".join(f"<p class='{'bad' if 'differ' in line else 'note'}'>{escape(line)}</p>"
                      for line in recompute_lines(report.get("recompute") or {})))
    body = [head, _origin_block(report, "forward", steps), _origin_block(report, "backward", steps),
            "<h2>How the error grows</h2>", error_plot(report),
            "<h2>Module tree (forward)</h2>", _tree(report, "forward"),
            "<h2>Module tree (backward)</h2>", _tree(report, "backward"),
            "<h2>Runs and their settings</h2>", _settings(report),
            "<h2>Mapping, layouts and rules</h2>", _mapping(report)]
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>layerdiff: {escape(verdict)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")
