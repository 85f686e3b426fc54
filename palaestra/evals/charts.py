"""Curves of a run as plain data (series of points, stop markers), drawn by :mod:`palaestra.evals.report_svg`.

Train runs: train reward with validation accuracy (greedy and sampled), the KL to the reference, and the
fraction of groups with no reward spread (no learning signal), each with the stop step and reason and the
best validated step. Lab runs: every numeric column of each CSV artifact that has a ``step`` column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Chart", "Marker", "Series", "charts_for_history", "charts_for_lab"]

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


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def _series(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    pts = []
    for row in history:
        y = _finite(row.get(key))
        if y is not None and isinstance(row.get("step"), int):
            pts.append((float(row["step"]), y))
    return pts


def _markers(stop: Mapping[str, Any] | None) -> list[Marker]:
    out = []
    if stop and isinstance(stop.get("step"), int):
        out.append(Marker(float(stop["step"]), f"stop: {stop.get('reason')}", "stop"))
    if stop and isinstance(stop.get("best_step"), int):
        best = _finite(stop.get("best_value"))
        out.append(
            Marker(float(stop["best_step"]), "best" + (f" {best:.3g}" if best is not None else ""), "best")
        )
    return out


def charts_for_history(history: Sequence[Mapping[str, Any]], stop: Mapping[str, Any] | None) -> list[Chart]:
    """The train-run charts (only those with data)."""
    markers = _markers(stop)
    reward = [
        Series("train reward (mean)", _series(history, "train/reward_mean"), PALETTE[0]),
        Series("val accuracy (greedy)", _series(history, "val/greedy_accuracy"), PALETTE[1], dots=True),
        Series(
            "val pass@1 (T=1)", _series(history, "val/sampled_accuracy"), PALETTE[2], dots=True, dashed=True
        ),
    ]
    reward = [s for s in reward if s.points]
    ys = [y for s in reward for _, y in s.points]
    unit = bool(ys) and min(ys) >= 0.0 and max(ys) <= 1.0
    charts = []
    if reward:
        charts.append(
            Chart(
                "reward",
                "Train reward and validation accuracy",
                "reward / accuracy",
                reward,
                markers,
                (0.0, 1.0) if unit else None,
            )
        )
    kl = _series(history, "train/kl")
    if kl:
        charts.append(
            Chart("kl", "KL to the reference policy", "KL (k3)", [Series("KL", kl, PALETTE[3])], markers)
        )
    zero = _series(history, "train/frac_zero_std")
    if zero:
        charts.append(
            Chart(
                "signal",
                "Groups with no reward spread (no learning signal)",
                "fraction",
                [Series("groups with equal rewards", zero, PALETTE[5])],
                markers,
                (0.0, 1.0),
            )
        )
    return charts


def charts_for_lab(tables: Mapping[str, Sequence[Mapping[str, str]]], max_charts: int = 12) -> list[Chart]:
    """For each CSV with a ``step`` column, one chart per numeric column (split by any text column's values),
    at most ``max_charts`` in all."""
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
            if series and len(charts) < max_charts:
                charts.append(Chart(f"lab-{name}-{col}", f"{name}: {col}", col, series))
    return charts


def _to_float(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
