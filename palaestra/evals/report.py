"""``palaestra report RUN``: one self-contained ``report.html`` for any run folder (docs/harness.md); a
Content-Security-Policy forbids every fetch, ``report.js`` inserts text with ``textContent`` only, and the
charts are inline SVG drawn by hand (no plotting library)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from palaestra.evals.runs import Chart, Rollout, RunView, StepCounts, load_run, num
from palaestra.evals.show import extra_text, tool_call_lines, visible_lines
from palaestra.evals.taxonomy import display_order
from palaestra.trajectories.io import PathLike, atomic_write_text

MAX_ROLLOUTS = 3000
PAGE_SIZE = 50
MAX_CHARS = 4000
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


CATEGORY_COLORS = {
    "ok": "#2e9e5b",
    "model_math": "#d9730d",
    "model_format": "#8a55c9",
    "data_invalid": "#6b7280",
    "verifier_suspect": "#c23b3b",
    "unmapped": "#111827",
    "-": "#cbd5e1",
}

W, H = 760, 250
ML, MR, MT, MB = 56, 16, 30, 34  # margins: left, right, top (legend), bottom (x ticks)


def nice_ticks(lo: float, hi: float, n: int = 5, *, integer: bool = False) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]`` (whole numbers only when ``integer``)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = 2.0 if step == 2.5 else max(1.0, float(math.ceil(step)))
    out, t = [], math.ceil(lo / step - 1e-9) * step
    while t <= hi + 1e-9 * step:
        out.append(round(t, 12))
        t += step
    return out


def _fmt(v: float) -> str:
    return f"{v:.6g}" if abs(v) >= 1e-4 or v == 0 else f"{v:.2e}"


def _num(v: float) -> str:
    return f"{v:.1f}"


def _frame(attrs: str, title: str, width: int, height: int) -> list[str]:
    """The opening ``<svg>`` tag (``attrs`` first) and the plot area's background."""
    return [
        f'<svg {attrs} viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<rect x="{ML}" y="{MT}" width="{width - ML - MR}" height="{height - MT - MB}" class="plot-bg"/>',
    ]


def line_chart(chart: Chart, *, width: int = W, height: int = H) -> str:
    """One chart as an ``<svg>`` element: axes, ticks, a legend, one polyline per series (gaps where a
    series has no point), dots where asked, vertical stop/best markers with their labels."""
    pts = [p for s in chart.series for p in s.points]
    xs = [x for x, _ in pts] + [m.x for m in chart.markers]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x1 <= x0:
        x1 = x0 + 1.0
    if chart.y_range is not None:
        y0, y1 = chart.y_range
    else:
        ys = [y for _, y in pts] or [0.0, 1.0]
        y0, y1 = min(ys), max(ys)
        pad = (y1 - y0) * 0.08 or max(abs(y1) * 0.1, 1e-3)
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - ML - MR, height - MT - MB

    def sx(x: float) -> float:
        return ML + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return MT + (1 - (y - y0) / (y1 - y0)) * ph

    out = _frame(f'class="chart" data-chart="{escape(chart.key)}"', chart.title, width, height)
    for t in nice_ticks(y0, y1, 5):
        ty = _num(sy(t))
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{ty}" y2="{ty}" class="grid"/>')
        out.append(f'<text x="{ML - 6}" y="{ty}" class="tick" text-anchor="end" dy="0.32em">{_fmt(t)}</text>')
    for t in nice_ticks(x0, x1, 8, integer=True):
        tx = _num(sx(t))
        out.append(f'<line x1="{tx}" x2="{tx}" y1="{MT + ph}" y2="{MT + ph + 4}" class="axis"/>')
        out.append(f'<text x="{tx}" y="{MT + ph + 16}" class="tick" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text x="{ML + pw / 2}" y="{height - 3}" class="label" text-anchor="middle">step</text>')
    out.append(
        f'<text transform="translate(12 {MT + ph / 2}) rotate(-90)" class="label" '
        f'text-anchor="middle">{escape(chart.y_label)}</text>'
    )
    out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{MT + ph}" y2="{MT + ph}" class="axis"/>')
    out.append(f'<line x1="{ML}" x2="{ML}" y1="{MT}" y2="{MT + ph}" class="axis"/>')
    for m in chart.markers:
        mx = _num(sx(m.x))
        out.append(
            f'<g class="marker marker-{escape(m.kind)}"><title>{escape(m.label)} (step {_fmt(m.x)})</title>'
            f'<line x1="{mx}" x2="{mx}" y1="{MT}" y2="{MT + ph}"/>'
            f'<text x="{mx}" y="{MT + 11}" dx="-4" text-anchor="end">{escape(m.label)}</text></g>'
        )
    for s in chart.series:
        ordered = sorted(s.points)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        coords = " ".join(f"{_num(sx(x))},{_num(sy(y))}" for x, y in ordered)
        out.append(
            f'<g class="series" data-series="{escape(s.name)}"><title>{escape(s.name)}</title>'
            f'<polyline points="{coords}" fill="none" stroke="{s.color}" stroke-width="1.6"{dash}/>'
        )
        if s.dots or len(ordered) == 1:
            for x, y in ordered:
                out.append(
                    f'<circle cx="{_num(sx(x))}" cy="{_num(sy(y))}" r="3" fill="{s.color}">'
                    f"<title>{escape(s.name)} at step {_fmt(x)}: {_fmt(y)}</title></circle>"
                )
        out.append("</g>")
    lx: float = ML
    for s in chart.series:
        out.append(
            f'<g class="legend"><rect x="{lx}" y="8" width="12" height="4" fill="{s.color}"/>'
            f'<text x="{lx + 16}" y="14">{escape(s.name)}</text></g>'
        )
        lx += 24 + 6.5 * len(s.name)
    out.append("</svg>")
    return "\n".join(out)


def stacked_bars(
    title: str, labels: Sequence[str], rows: Sequence[Mapping[str, int]], order: Sequence[str]
) -> str:
    """Per label (a step), one bar split by category shares (each bar sums to 100%). Legend entries are
    buttons of the rollout browser's category filter (``data-filter-category``)."""
    width, height = W, 170
    pw, ph = width - ML - MR, height - MT - MB
    n = max(len(labels), 1)
    band = pw / n
    gap = band * 0.15 if band > 4 else 0.0
    out = _frame('class="bars"', title, width, height)
    for pct in (0, 50, 100):
        ty = _num(MT + (1 - pct / 100) * ph)
        out.append(f'<text x="{ML - 6}" y="{ty}" class="tick" text-anchor="end" dy="0.32em">{pct}%</text>')
    every = max(1, math.ceil(n / 12))
    numeric = [int(x) for x in labels if x.lstrip("-").isdigit()]
    marks: set[str] | None = None
    if len(numeric) == len(labels) and len(labels) > 12:  # label round step numbers only
        marks = {str(int(t)) for t in nice_ticks(min(numeric), max(numeric), 10, integer=True)}
    for i, (label, counts) in enumerate(zip(labels, rows)):
        total = sum(counts.values())
        x = ML + i * band
        shares = ", ".join(
            f"{c} {counts[c]} ({100 * counts[c] / total:.0f}%)" for c in order if counts.get(c)
        )
        tip = f"{label}: {shares or 'none'}"
        out.append(f'<g class="bar" data-label="{escape(label)}"><title>{escape(tip)}</title>')
        y = float(MT + ph)
        for cat in (c for c in order if counts.get(c)):
            h = counts[cat] / total * ph
            y -= h
            out.append(
                f'<rect x="{_num(x + gap / 2)}" y="{_num(y)}" width="{_num(max(band - gap, 0.6))}" '
                f'height="{_num(h)}" fill="{CATEGORY_COLORS.get(cat, "#999")}"/>'
            )
        out.append("</g>")
        if (label in marks) if marks is not None else (i % every == 0):
            out.append(
                f'<text x="{_num(x + band / 2)}" y="{MT + ph + 14}" class="tick" text-anchor="middle">'
                f"{escape(label)}</text>"
            )
    out += [f'<text x="{ML}" y="14" class="label">{escape(title)}</text>', "</svg>"]
    legend = "".join(
        f'<button type="button" class="chip legend-chip" data-filter-category="{escape(c)}">'
        f'<span class="swatch" style="background:{CATEGORY_COLORS.get(c, "#999")}"></span>'
        f"{escape(c)}</button>"
        for c in order
    )
    return "\n".join(out) + f'\n<div class="legend-row">{legend}</div>'


def allocate(sizes: Mapping[Any, int], budget: int) -> dict[Any, int]:
    """How many to take from each bucket to share ``budget`` evenly (a small bucket's unused share goes to the
    others); the total is ``min(budget, sum(sizes))``."""
    take: dict[Any, int] = {}
    left = max(budget, 0)
    order = sorted(sizes, key=lambda k: sizes[k])
    for i, key in enumerate(order):
        take[key] = min(sizes[key], left // (len(order) - i))
        left -= take[key]
    return take


def _display(role: str, text: str, max_chars: int) -> str:
    cut = ""
    if max_chars and len(text) > max_chars:
        cut, text = f"\n...(+{len(text) - max_chars} chars not embedded)", text[:max_chars]
    return "\n".join(visible_lines(role, text)) + cut


def report_data(view: RunView, max_rollouts: int, max_chars: int, page_size: int) -> dict[str, Any]:
    """The JSON the report's script reads (message texts deduplicated, rollouts with short keys)."""
    sizes = {key: view.count_rollouts(key) for key in view.files}
    take = allocate(sizes, max_rollouts)
    index: dict[str, int] = {}  # each distinct message text once, by first appearance
    out_rows = [_row(r, index, max_chars) for key in view.file_keys() for r in view.head(key, take[key])]
    totals = [{"s": key[0], "src": key[1], "n": sizes[key], "e": take[key]} for key in view.file_keys()]
    steps = sorted({r["s"] for r in out_rows if r["s"] is not None})
    diff_pool = val_steps if len(val_steps := view.steps("val")) >= 2 else steps
    diff = view.kind == "train" and bool(steps)
    return {
        "kind": view.kind,
        "page_size": page_size,
        "texts": list(index),
        "rollouts": out_rows,
        "totals": totals,
        "steps": steps,
        "sources": view.sources(),
        "outcomes": sorted({r["o"] if r["o"] is not None else "-" for r in out_rows}),
        "categories": display_order(r["c"] if r["c"] is not None else "-" for r in out_rows),
        "diff": diff,
        "diff_default": [diff_pool[0], diff_pool[-1]] if diff and diff_pool else [],
    }


MAX_TOKENS_EMBEDDED = 200


def _round(v: Any) -> float | None:
    return None if (x := num(v)) is None else round(x, 4)


def _tokens(m: Mapping[str, Any]) -> list[list[Any]] | None:
    toks = m.get("tokens") or []
    return [
        [str(t.get("t", "")), _round(t.get("lp")), _round(t.get("h"))] for t in toks[:MAX_TOKENS_EMBEDDED]
    ] or None


def _row(r: Rollout, index: dict[str, int], max_chars: int) -> dict[str, Any]:
    """One embedded rollout; each message is ``[role, text id in index, calls, tokens, turn reward]``."""
    msgs = []
    for m in r.messages:
        calls = tool_call_lines(m)
        if m.get("tool_call_id"):
            name = f" {m['tool_name']}" if m.get("tool_name") else ""
            calls.insert(0, f"(result of tool call{name} {m['tool_call_id']})")
        text_id = index.setdefault(_display(m["role"], m["content"], max_chars), len(index))
        msgs.append([m["role"], text_id, "\n".join(calls) or None, _tokens(m), _round(m.get("turn_reward"))])
    return {
        "u": r.uid,
        "s": r.step,
        "src": r.source,
        "id": r.example_id,
        "r": r.reward,
        "o": r.outcome,
        "c": r.category,
        "a": r.advantage,
        "g": r.group,
        "i": r.index,
        "m": msgs,
        "x": ", ".join(extra_text(r, 12)),
        "n": r.note,
    }


def _value(v: Any, limit: int = 160) -> str:
    text = json.dumps(v, sort_keys=True, default=str) if isinstance(v, (dict, list)) else str(v)
    short = text if len(text) <= limit else text[: limit - 3] + "..."
    return f'<code title="{escape(text)}">{escape(short)}</code>'


def _details(name: str, obj: Any) -> str:
    text = escape(json.dumps(obj, indent=2, sort_keys=True, default=str))
    return f"<details><summary>{name}</summary><pre>{text}</pre></details>"


def _table(rows: Mapping[str, Any]) -> str:
    body = "".join(f"<tr><td>{escape(str(k))}</td><td>{_value(v)}</td></tr>" for k, v in rows.items())
    return f'<table class="facts">{body}</table>'


_TRAIN_KEYS = ("metric", "wall_seconds", "restored_best", "groups_dropped_fraction", "faults", "judge_usage")
_RESULT_KEYS = (
    "n",
    "n_ids",
    "samples_per_id",
    "pass_rate",
    "mean_reward",
    "pass@1",
    "pass@N",
    "suspect",
    "scorer",
    "selector",
)


def _numbers(view: RunView) -> dict[str, Any]:
    s, out = view.summary, {}
    if view.kind == "lab":
        return dict(view.manifest.get("numbers") or {})
    if view.kind == "train":
        out["steps"] = view.history[-1]["step"] if view.history else 0
        for name, key in (("base val", "base_val"), ("best val", "best_val")):
            if val := s.get(key):
                out[name] = {k: val[k] for k in ("greedy_accuracy", "sampled_accuracy", "step") if k in val}
    out.update({k: s[k] for k in (_TRAIN_KEYS if view.kind == "train" else _RESULT_KEYS) if k in s})
    return out


def _stop_html(view: RunView) -> str:
    if view.kind != "train":
        return ""
    if not (stop := view.stop):
        return '<p class="stop" id="stop">No summary.json: the run is still going, or was killed.</p>'
    best = stop.get("best_step")
    return (
        f'<p class="stop" id="stop"><b>Stopped at step {escape(str(stop.get("step")))}: '
        f"{escape(str(stop.get('reason')))}</b> &mdash; {escape(str(stop.get('message') or ''))}"
        f"{'' if best is None else ' (best step ' + escape(str(best)) + ')'}</p>"
    )


def _breakdown_html(counts: Sequence[StepCounts]) -> str:
    if not counts:
        return "<p class='muted'>No rollouts saved.</p>"
    order = display_order(c for sc in counts for c in sc.categories)
    parts = []
    for src in sorted({sc.source for sc in counts}, key=lambda x: (x != "train", x)):
        mine = [sc for sc in counts if sc.source == src]
        labels = [("all" if sc.step is None else str(sc.step)) for sc in mine]
        partial = "" if all(sc.complete for sc in mine) else " (from the saved samples of each step)"
        title = f"{src} rollouts: category shares per step{partial}"
        parts.append(stacked_bars(title, labels, [sc.categories for sc in mine], order))
    head = "".join(f"<th>{escape(c)}</th>" for c in order)
    body = []
    for sc in counts:
        step = "all" if sc.step is None else str(sc.step)
        cells = "".join(f'<td class="num">{sc.categories.get(c, 0)}</td>' for c in order)
        top = ", ".join(f"{o} {n}" for o, n in sorted(sc.outcomes.items(), key=lambda kv: -kv[1])[:4])
        mean = "" if sc.reward_mean is None else f"{sc.reward_mean:.4g}"
        goto = step
        if sc.step is not None:
            goto = (
                f'<button type="button" class="chip" data-goto-step="{escape(step)}" '
                f'data-goto-source="{escape(sc.source)}">{escape(step)}</button>'
            )
        body.append(
            f"<tr><td>{goto}</td><td>{escape(sc.source)}{'' if sc.complete else '*'}</td>"
            f'<td class="num">{sc.n}</td><td class="num">{mean}</td>{cells}<td>{escape(top)}</td></tr>'
        )
    table = (
        f'<div class="scroll"><table id="breakdown-table"><tr><th>step</th><th>source</th><th>n</th>'
        f"<th>mean reward</th>{head}<th>top outcomes</th></tr>{''.join(body)}</table></div>"
    )
    note = (
        "<p class='muted'>* counted over the saved samples of the step (the trainer keeps "
        "<code>samples_per_step</code> per step); val rows cover the whole validation set.</p>"
    )
    return "\n".join(parts) + table + (note if any(not sc.complete for sc in counts) else "")


def _options(values: Sequence[Any], all_label: str = "all") -> str:
    opts = [f'<option value="">{escape(all_label)}</option>'] if all_label else []
    return "".join(opts + [f'<option value="{escape(str(v))}">{escape(str(v))}</option>' for v in values])


def _browser_html(view: RunView, data: Mapping[str, Any]) -> str:
    total = sum(t["n"] for t in data["totals"])
    embedded = len(data["rollouts"])
    note = f"{embedded} of {total} rollout(s) embedded"
    if embedded < total:
        note += (
            f" (shared evenly across steps; <code>palaestra show {escape(str(view.root))}</code>"
            " reads them all)"
        )
    steps = data["steps"]
    html = f"""<section id="rollouts"><h2>Rollouts</h2><p class="muted" id="embed-note">{note}</p>
<div class="controls">
<label>source <select id="f-source">{_options(data["sources"])}</select></label>
<label>step <select id="f-step">{_options(steps)}</select></label>
<label>order <select id="f-order"><option value="file">file order</option>
<option value="top">top K by reward</option>
<option value="bottom">bottom K by reward</option></select></label>
<label>K <input id="f-k" type="number" min="1" value="10"></label>
<label>id or text <input id="f-q" type="search" placeholder="a17, Final: 4"></label>
<button type="button" id="f-reset">reset filters</button></div>
<div class="chips" id="chips-category"></div><div class="chips" id="chips-outcome"></div>
<p id="match-count" data-n="0"></p><div class="pager" id="pager-top"></div><div id="list"></div>
<div class="pager" id="pager-bottom"></div>
<noscript><p>The rollout browser needs JavaScript; <code>palaestra show</code> prints the same.</p></noscript>
</section>"""
    if data["diff"]:
        html += f"""<section id="diff"><h2>Same prompts at two steps</h2>
<p class="muted">Pairs the embedded rollouts of each prompt (example id) at step A and step B:
improved, regressed, changed (same reward, other text), same.</p><div class="controls">
<label>step A <select id="d-diffa">{_options(steps, "")}</select></label>
<label>step B <select id="d-diffb">{_options(steps, "")}</select></label>
<label>source <select id="d-diffsrc">{_options(data["sources"], "auto")}</select></label></div>
<p id="diff-summary"></p><div class="pager" id="diff-pager"></div><div id="diff-list"></div></section>"""
    return html


def report_html(
    view: RunView, *, max_rollouts: int = MAX_ROLLOUTS, max_chars: int = MAX_CHARS, page_size: int = PAGE_SIZE
) -> str:
    """The whole report as one HTML string."""
    data = report_data(view, max_rollouts, max_chars, page_size)
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False, default=str)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    css, js = (
        (Path(__file__).parent / name).read_text(encoding="utf-8") for name in ("report.css", "report.js")
    )
    m = view.manifest
    sub = f"{view.kind} run &middot; <code>{escape(str(view.root))}</code>"
    if created := m.get("created"):
        sub += f" &middot; created {escape(str(created))}"
    cmd = m.get("command_line") or m.get("command")
    width, height = (540, 210) if len(view.charts) > 3 else (760, 250)
    charts = "".join(line_chart(c, width=width, height=height) for c in view.charts)
    charts = f"<div class='charts'>{charts}</div>" if charts else ""
    sections = [
        f"<header><h1>{escape(view.title)}</h1><p class='muted'>{sub}</p>",
        f"<p class='muted'>command: {_value(cmd, 300)}</p>" if cmd else "",
        "<nav><a href='#facts'>locked room</a>"
        + ("<a href='#curves'>curves</a>" if charts else "")
        + "<a href='#breakdown'>breakdown</a><a href='#rollouts'>rollouts</a>"
        + ("<a href='#diff'>diff</a>" if data["diff"] else "")
        + "</nav></header>",
        _stop_html(view),
        "<section id='numbers'><h2>Numbers</h2>" + _table(_numbers(view)) + "</section>",
        "<section id='facts'><h2>Locked-room facts</h2><p class='muted'>Two runs may be compared only when "
        "these match.</p>"
        + _table(view.locked_room())
        + _details("manifest.json", m)
        + (_details("config.json", view.config) if view.config else "")
        + "</section>",
        f"<section id='curves'><h2>Curves</h2>{charts}</section>" if charts else "",
        "<section id='breakdown'><h2>Outcomes and failure categories per step</h2>"
        "<p class='muted'>Categories "
        "come from the taxonomy table (palaestra/evals/taxonomy.py); click one to filter the rollouts.</p>"
        + _breakdown_html(view.step_counts())
        + "</section>",
        _browser_html(view, data),
    ]
    return (
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>palaestra report: {escape(view.title)}</title><style>{css}</style></head><body>\n"
        + "\n".join(s for s in sections if s)
        + f"\n<script type='application/json' id='report-data'>{payload}</script>\n"
        f"<script>{js}</script>\n</body></html>\n"
    )


def write_report(
    run_dir: PathLike,
    out: PathLike | None = None,
    *,
    max_rollouts: int = MAX_ROLLOUTS,
    max_chars: int = MAX_CHARS,
    page_size: int = PAGE_SIZE,
) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN/report.html``) atomically; return it."""
    if max_rollouts < 0 or page_size < 1:
        raise ValueError("max_rollouts must be >= 0 and page_size >= 1")
    view = load_run(run_dir)
    target = Path(out) if out is not None else view.root / "report.html"
    html = report_html(view, max_rollouts=max_rollouts, max_chars=max_chars, page_size=page_size)
    atomic_write_text(target, html)
    return target
