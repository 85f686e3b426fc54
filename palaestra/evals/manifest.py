"""Run manifests of the measurement harness and the Locked-Room facts that ``palaestra gate`` compares
(schema and definitions: docs/harness.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    """Assemble the manifest of an ``eval`` (Loop A, of ``completions``) or ``select`` run (Loop B, of
    ``samples``, with ``selection_n`` = ``samples_per_id``): sampling settings, seed and policy come from the
    samples file's sidecar (null without one, and ``inputs`` then has no ``<completions|samples>_meta``);
    outputs are added once written."""
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
