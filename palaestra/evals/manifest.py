"""Run manifests of the measurement harness, their Locked-Room facts and the promotion gate that compares
two runs by them (schema, definitions and rules: docs/harness.md). Unusable input raises
:class:`~palaestra.trajectories.io.DataError` (the CLI exits 2)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.evals.inputs import HarnessInputs
from palaestra.trajectories.io import DataError, PathLike, canonical_json, sha256_file, sha256_text
from palaestra.trajectories.runs import code_version, command_line, read_json, utc_now

MANIFEST_KIND = "palaestra-run-manifest"
FORMAT_VERSION = 1

#: The facts two runs must share to be compared (order = order of the gate's reasons).
LOCKED_ROOM_FIELDS: tuple[str, ...] = (
    "dataset_fingerprint",
    "n_examples",
    "scorer_name",
    "scorer_version",
    "prompt_template_hash",
    "sampling",
    "samples_per_id",
    "selection_n",
)


def dataset_fingerprint(examples: Iterable[Mapping[str, Any]]) -> str:
    """Content hash of a dataset: canonical JSON of each example, sorted by id (docs/harness.md)."""
    keyed = sorted((canonical_json(e.get("id")), canonical_json(dict(e))) for e in examples)
    return sha256_text("".join(line + "\n" for _, line in keyed))


def prompt_template_hash(examples: Iterable[Mapping[str, Any]]) -> str:
    """Hash of the sorted set of distinct prompts (non-string prompts are taken as their canonical JSON)."""
    prompts = {p if isinstance(p, str) else canonical_json(p) for p in (e.get("prompt") for e in examples)}
    return sha256_text(canonical_json(sorted(prompts)))


def file_record(path: PathLike, rows: int | None = None) -> dict[str, Any]:
    """``{"path", "sha256", "bytes", "rows"}`` of an input file."""
    p = Path(path)
    return {"path": str(p), "sha256": sha256_file(p), "bytes": p.stat().st_size, "rows": rows}


def sidecar_path(path: PathLike) -> Path:
    """``x.meta.json`` for ``x.jsonl`` (or ``x.ext.meta.json`` for another suffix)."""
    p = Path(path)
    return p.with_suffix(".meta.json") if p.suffix == ".jsonl" else p.with_name(p.name + ".meta.json")


def read_sidecar(path: PathLike) -> dict[str, Any] | None:
    """The sidecar of a completions/samples file, or None when there is none; must be a JSON object."""
    side = sidecar_path(path)
    if not side.exists():
        return None
    value = read_json(side)
    if not isinstance(value, dict):
        raise DataError("sidecar must be a JSON object", path=side)
    if not isinstance(value.get("sampling"), (dict, type(None))):
        raise DataError("field 'sampling' must be an object or null", path=side)
    return value


def build_manifest(
    inp: HarnessInputs,
    command: str,
    samples_per_id: int,
    *,
    samples_rows: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of an ``eval`` (Loop A) or ``select`` run (Loop B); sampling settings, seed and policy come
    from the samples file's sidecar (null without one); outputs are added once written."""
    samples_key = "completions" if command == "eval" else "samples"
    side = read_sidecar(inp.path)
    examples = inp.dataset.examples
    inputs = {
        "dataset": file_record(inp.dataset.path, len(examples)),
        samples_key: file_record(inp.path, samples_rows),
    }
    if side is not None:
        inputs[f"{samples_key}_meta"] = file_record(sidecar_path(inp.path))
    side = side or {}
    return {
        "kind": MANIFEST_KIND,
        "format_version": FORMAT_VERSION,
        "loop": "A" if command == "eval" else "B",
        "command": command,
        "created": utc_now(),
        "command_line": command_line(),
        "code": code_version(),
        "inputs": inputs,
        "outputs": {},
        "dataset_fingerprint": dataset_fingerprint(examples),
        "prompt_template_hash": prompt_template_hash(examples),
        "n_examples": len(examples),
        "scorer": {"name": inp.scorer.name, "version": inp.scorer.version},
        "cross_check": inp.cross.describe() if inp.cross is not None else None,
        "sampling": side.get("sampling"),
        "samples_per_id": samples_per_id,
        "selection_n": samples_per_id if command == "select" else None,
        "seed": side.get("seed"),
        "policy": side.get("policy"),
        **(extra or {}),
    }


def load_manifest(run_dir: PathLike) -> dict[str, Any]:
    """Read ``manifest.json`` of a run folder; :class:`DataError` when missing, malformed or not ours."""
    if not Path(run_dir).is_dir():
        raise DataError("run folder not found", path=run_dir)
    path = Path(run_dir) / "manifest.json"
    value = read_json(path)
    if not isinstance(value, dict) or value.get("kind") != MANIFEST_KIND:
        raise DataError(f"not a palaestra run manifest (kind must be {MANIFEST_KIND!r})", path=path)
    return value


def locked_room(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The Locked-Room facts of a manifest, keyed by :data:`LOCKED_ROOM_FIELDS` (missing -> None)."""
    scorer = manifest.get("scorer")
    scorer = scorer if isinstance(scorer, Mapping) else {}
    facts = {k: manifest.get(k) for k in LOCKED_ROOM_FIELDS}
    return {**facts, "scorer_name": scorer.get("name"), "scorer_version": scorer.get("version")}


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
    decision = PROMOTE if reached and not violations else REJECT
    return GateResult(decision, reasons, delta, metric, base_value, cand_value, violations)


def format_gate(result: GateResult, baseline: PathLike, candidate: PathLike) -> str:
    """The text ``palaestra gate`` prints: the decision line, then one line per reason."""
    return "\n".join(
        [f"{result.decision}  ({candidate} vs baseline {baseline})", *(f"  - {r}" for r in result.reasons)]
    )
