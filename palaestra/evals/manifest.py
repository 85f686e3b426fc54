"""Run manifests of the measurement harness and the Locked-Room facts that ``palaestra gate`` compares.

Every eval (Loop A) and select (Loop B) run folder holds ``manifest.json``::

    {
      "kind": "palaestra-run-manifest", "format_version": 1,
      "loop": "A" | "B", "command": "eval" | "select",
      "created": ISO time, "command_line": [...], "code": {"palaestra", "git", "python"},
      "inputs": {"dataset": {"path", "sha256", "bytes", "rows"}, "completions" | "samples": {...}, ...},
      "outputs": {"results.jsonl": sha256, ...},
      "dataset_fingerprint": sha256,  "prompt_template_hash": sha256,  "n_examples": int,
      "scorer": {"name", "version"},  "cross_check": {"strict": {...}, "lenient": {...}} | null,
      "sampling": {...} | null,  "samples_per_id": int,  "selection_n": int | null,
      "seed": int | null,  "policy": {...} | null
    }

Definitions (documented here because the gate depends on them):

* ``dataset_fingerprint``: sha256 of the dataset's *content*: each example as canonical JSON (sorted keys,
  compact), sorted by id, one per line. Reformatting or reordering the file keeps it; changing any field of
  any example changes it. The file's byte hash is recorded separately under ``inputs``.
* ``prompt_template_hash``: sha256 of the canonical JSON list of the sorted *distinct* prompts of the dataset
  (the rendered prompt set; a rollout's message template is part of ``sampling["rollout"]``).
* ``sampling``: null for frozen completions without a sidecar; otherwise the settings they were sampled with
  (temperature, top_p, max_tokens, samples_per_id, rollout), from the live run or from a sidecar file
  ``<name>.meta.json`` next to ``<name>.jsonl`` (its ``"sampling"`` key). The model is *not* part of it: the
  policy is the knob being compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from palaestra.evals.inputs import Dataset
from palaestra.trajectories.io import DataError, PathLike, canonical_json, sha256_file, sha256_text
from palaestra.trajectories.runs import code_version, command_line, read_json, utc_now

__all__ = [
    "FORMAT_VERSION",
    "LOCKED_ROOM_FIELDS",
    "MANIFEST_KIND",
    "build_manifest",
    "dataset_fingerprint",
    "file_record",
    "load_manifest",
    "locked_room",
    "prompt_template_hash",
    "read_sidecar",
    "sidecar_path",
]

MANIFEST_KIND = "palaestra-run-manifest"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

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
    """Content hash of a dataset (see the module docstring)."""
    keyed = sorted((canonical_json(e.get("id")), canonical_json(dict(e))) for e in examples)
    return sha256_text("".join(line + "\n" for _, line in keyed))


def prompt_template_hash(examples: Iterable[Mapping[str, Any]]) -> str:
    """Hash of the sorted set of distinct prompts (non-string prompts are taken as their canonical JSON)."""
    prompts = set()
    for e in examples:
        p = e.get("prompt")
        prompts.add(p if isinstance(p, str) else canonical_json(p))
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
    sampling = value.get("sampling")
    if sampling is not None and not isinstance(sampling, dict):
        raise DataError("field 'sampling' must be an object or null", path=side)
    return value


def build_manifest(
    *,
    loop: str,
    command: str,
    dataset: Dataset,
    samples: Path,
    samples_key: str,
    samples_rows: int | None,
    scorer: Any,
    cross_check: Mapping[str, Any] | None,
    samples_per_id: int,
    selection_n: int | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble a manifest: sampling settings, seed and policy come from the samples file's sidecar (null
    without one, and ``inputs`` then has no ``<samples_key>_meta``); outputs are added once written."""
    side = read_sidecar(samples)
    inputs = {
        "dataset": file_record(dataset.path, len(dataset.examples)),
        samples_key: file_record(samples, samples_rows),
    }
    if side is not None:
        inputs[f"{samples_key}_meta"] = file_record(sidecar_path(samples))
    side = side or {}
    examples = dataset.examples
    manifest: dict[str, Any] = {
        "kind": MANIFEST_KIND,
        "format_version": FORMAT_VERSION,
        "loop": loop,
        "command": command,
        "created": utc_now(),
        "command_line": command_line(),
        "code": code_version(),
        "inputs": inputs,
        "outputs": {},
        "dataset_fingerprint": dataset_fingerprint(examples),
        "prompt_template_hash": prompt_template_hash(examples),
        "n_examples": len(examples),
        "scorer": {"name": scorer.name, "version": scorer.version},
        "cross_check": dict(cross_check) if cross_check is not None else None,
        "sampling": side.get("sampling"),
        "samples_per_id": samples_per_id,
        "selection_n": selection_n,
        "seed": side.get("seed"),
        "policy": side.get("policy"),
        **(extra or {}),
    }
    return manifest


def load_manifest(run_dir: PathLike) -> dict[str, Any]:
    """Read ``manifest.json`` of a run folder; :class:`DataError` when missing, malformed or not ours."""
    path = Path(run_dir) / MANIFEST_NAME
    if not Path(run_dir).is_dir():
        raise DataError("run folder not found", path=run_dir)
    value = read_json(path)
    if not isinstance(value, dict) or value.get("kind") != MANIFEST_KIND:
        raise DataError(f"not a palaestra run manifest (kind must be {MANIFEST_KIND!r})", path=path)
    return value


def locked_room(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The Locked-Room facts of a manifest, keyed by :data:`LOCKED_ROOM_FIELDS` (missing -> None)."""
    scorer = manifest.get("scorer") or {}
    facts = {
        "dataset_fingerprint": manifest.get("dataset_fingerprint"),
        "n_examples": manifest.get("n_examples"),
        "scorer_name": scorer.get("name") if isinstance(scorer, Mapping) else None,
        "scorer_version": scorer.get("version") if isinstance(scorer, Mapping) else None,
        "prompt_template_hash": manifest.get("prompt_template_hash"),
        "sampling": manifest.get("sampling"),
        "samples_per_id": manifest.get("samples_per_id"),
        "selection_n": manifest.get("selection_n"),
    }
    return {k: facts[k] for k in LOCKED_ROOM_FIELDS}
