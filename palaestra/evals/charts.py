"""Curves of a run as plain data (series of points, stop/best markers) and their inline SVG for the report,
drawn by hand (no plotting library) so that the report stays one self-contained file."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

PALETTE = ("#d9730d", "#2f6fdd", "#2e9e5b", "#c23b3b", "#8a55c9", "#6b7280", "#b8860b", "#0f9bb5")


@dataclass
class Series:
    """One named line: points ``(x, y)``; ``dots`` draws a marker at each point; ``dashed`` a dashed line."""

    name: str
    points: list[tuple[float, float]]
    color: str
    dots: bool = False
    dashed: bool = False


@dataclass
class Marker:
    """A vertical line at step ``x`` with a label (``kind``: ``"stop"`` or ``"best"``)."""

    x: float
    label: str
    kind: str = "stop"


@dataclass
class Chart:
    """A chart: title, y label, series, markers; ``y_range`` fixes the y axis (else it fits the data)."""

    key: str
    title: str
    y_label: str
    series: list[Series]
    markers: list[Marker] = field(default_factory=list)
    y_range: tuple[float, float] | None = None


def num(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def _series(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    pts = [(row.get("step"), num(row.get(key))) for row in history]
    return [(float(x), y) for x, y in pts if isinstance(x, int) and y is not None]


def charts_for_history(history: Sequence[Mapping[str, Any]], stop: Mapping[str, Any] | None) -> list[Chart]:
    """The train-run charts (only those with data)."""
    reward = [
        Series("train reward (mean)", _series(history, "train/reward_mean"), PALETTE[0]),
        Series("val accuracy (greedy)", _series(history, "val/greedy_accuracy"), PALETTE[1], dots=True),
        Series(
            "val pass@1 (T=1)", _series(history, "val/sampled_accuracy"), PALETTE[2], dots=True, dashed=True
        ),
    ]
    reward = [s for s in reward if s.points]
    ys = [y for s in reward for _, y in s.points]
    fit = None if ys and (min(ys) < 0.0 or max(ys) > 1.0) else (0.0, 1.0)
    kl = Series("KL", _series(history, "train/kl"), PALETTE[3])
    zero = Series("groups with equal rewards", _series(history, "train/frac_zero_std"), PALETTE[5])
    marks = []
    if stop and isinstance(stop.get("step"), int):
        marks.append(Marker(float(stop["step"]), f"stop: {stop.get('reason')}", "stop"))
    if stop and isinstance(stop.get("best_step"), int):
        best = num(stop.get("best_value"))
        marks.append(Marker(float(stop["best_step"]), "best" if best is None else f"best {best:.3g}", "best"))
    no_spread = "Groups with no reward spread (no learning signal)"
    charts = [
        Chart("reward", "Train reward and validation accuracy", "reward / accuracy", reward, marks, fit),
        Chart("kl", "KL to the reference policy", "KL (k3)", [kl], marks),
        Chart("signal", no_spread, "fraction", [zero], marks, (0.0, 1.0)),
    ]
    return [c for c in charts if any(s.points for s in c.series)]


def charts_for_lab(tables: Mapping[str, Sequence[Mapping[str, str]]]) -> list[Chart]:
    """For each CSV with a ``step`` column, one chart per numeric column (split by any text column's values),
    at most 12 in all."""
    charts: list[Chart] = []
    for name, rows in tables.items():
        if not rows or "step" not in rows[0]:
            continue
        cols = [c for c in rows[0] if c != "step"]
        numeric = [
            c
            for c in cols
            if all(_to_float(r.get(c)) is not None or r.get(c) in ("", None) for r in rows)
            and any(_to_float(r.get(c)) is not None for r in rows)
        ]
        group_cols = [c for c in cols if c not in numeric]
        for col in numeric:
            by_group: dict[str, list[tuple[float, float]]] = {}
            for r in rows:
                x, y = _to_float(r.get("step")), _to_float(r.get(col))
                if x is not None and y is not None:
                    tag = ", ".join(f"{g}={r.get(g)}" for g in group_cols)
                    by_group.setdefault(tag, []).append((x, y))
            series = [
                Series(tag or col, pts, PALETTE[i % len(PALETTE)], dashed=i >= len(PALETTE))
                for i, (tag, pts) in enumerate(by_group.items())
            ]
            if series and len(charts) < 12:
                charts.append(Chart(f"lab-{name}-{col}", f"{name}: {col}", col, series))
    return charts


def _to_float(v: Any) -> float | None:
    try:
        return num(float(v))
    except (TypeError, ValueError):
        return None


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
        for cat in order:
            v = counts.get(cat, 0)
            if not v:
                continue
            h = v / total * ph
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
    out.append(f'<text x="{ML}" y="14" class="label">{escape(title)}</text>')
    out.append("</svg>")
    legend = "".join(
        f'<button type="button" class="chip legend-chip" data-filter-category="{escape(c)}">'
        f'<span class="swatch" style="background:{CATEGORY_COLORS.get(c, "#999")}"></span>'
        f"{escape(c)}</button>"
        for c in order
    )
    return "\n".join(out) + f'\n<div class="legend-row">{legend}</div>'
