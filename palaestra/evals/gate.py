"""The promotion gate: compare a candidate run with a baseline inside the Locked Room (rules:
docs/harness.md). Unusable input raises :class:`~palaestra.trajectories.io.DataError` (the CLI exits 2)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.evals.manifest import LOCKED_ROOM_FIELDS, load_manifest, locked_room
from palaestra.trajectories.io import DataError, PathLike
from palaestra.trajectories.runs import read_json

PROMOTE = "PROMOTE"
REJECT = "REJECT"


@dataclass(frozen=True)
class GateResult:
    """``decision`` (PROMOTE/REJECT), every ``reasons`` line, and the metric values and their delta."""

    decision: str
    reasons: list[str]
    delta: float | None
    metric: str = "pass_rate"
    baseline_value: float | None = None
    candidate_value: float | None = None
    violations: list[str] = field(default_factory=list)

    @property
    def promoted(self) -> bool:
        return self.decision == PROMOTE

    @property
    def exit_code(self) -> int:
        return 0 if self.promoted else 1


def _show(value: Any) -> str:
    return (
        json.dumps(value, sort_keys=True) if value is None or isinstance(value, (dict, list)) else str(value)
    )


def _read_run(role: str, run_dir: Path, metric: str) -> tuple[dict[str, Any], float]:
    """The Locked-Room facts and the metric of an eval or select run folder."""
    path = run_dir / "manifest.json"
    if path.is_file() and isinstance(m := read_json(path), dict) and m.get("kind") == "train":
        raise DataError(
            f"the {role} is a training run; the gate compares eval (or select) runs. Evaluate its policy first: "
            f"palaestra eval --dataset DATA --model {run_dir / 'model.npz'} --outdir runs/eval-...",
            path=run_dir,
        )
    room = locked_room(load_manifest(run_dir))
    summary = read_json(path := run_dir / "summary.json")
    if not isinstance(summary, dict):
        raise DataError("summary must be a JSON object", path=path)
    if metric not in summary:
        numeric = ", ".join(
            sorted(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        )
        raise DataError(f"metric {metric!r} not in the summary; numeric metrics: {numeric}", path=path)
    value = summary[metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"metric {metric!r} is not a finite number: {value!r}", path=path)
    return room, float(value)


def gate(
    baseline_dir: PathLike, candidate_dir: PathLike, min_delta: float, metric: str = "pass_rate"
) -> GateResult:
    """Decide PROMOTE or REJECT for ``candidate_dir`` against ``baseline_dir`` (rules: docs/harness.md)."""
    if not math.isfinite(min_delta):
        raise ValueError(f"min_delta must be finite, got {min_delta!r}")
    base_room, base_value = _read_run("baseline", Path(baseline_dir), metric)
    cand_room, cand_value = _read_run("candidate", Path(candidate_dir), metric)
    violations = [key for key in LOCKED_ROOM_FIELDS if base_room[key] != cand_room[key]]
    reasons = [
        f"locked room broken: {key} differs: baseline {_show(base_room[key])} vs candidate {_show(cand_room[key])}"
        for key in violations
    ] or ["locked room intact: " + ", ".join(LOCKED_ROOM_FIELDS) + " all match"]
    delta = cand_value - base_value
    # a small tolerance so that 0.45 - 0.40 counts as reaching a min-delta of 0.05 despite float rounding
    reached = delta >= min_delta - 1e-12
    reasons.append(
        f"{metric}: baseline {base_value:.6g} -> candidate {cand_value:.6g}, "
        f"delta {delta:+.6g} {'>=' if reached else '<'} min-delta {min_delta:+.6g}"
        + ("" if reached else " (improvement too small)")
    )
    return GateResult(
        decision=PROMOTE if reached and not violations else REJECT,
        reasons=reasons,
        delta=delta,
        metric=metric,
        baseline_value=base_value,
        candidate_value=cand_value,
        violations=violations,
    )


def format_gate(result: GateResult, baseline: PathLike, candidate: PathLike) -> str:
    """The text ``palaestra gate`` prints: the decision line, then one line per reason."""
    return "\n".join(
        [f"{result.decision}  ({candidate} vs baseline {baseline})", *(f"  - {r}" for r in result.reasons)]
    )
