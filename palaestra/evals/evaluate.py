"""Loop A: score fixed completions (or fresh samples of a model) against a dataset; write the run folder.

Inputs are read by :mod:`palaestra.evals.inputs` (errors name ``file:line``); several completions per id
need a ``sample`` index and the same count for every id. The run folder holds ``results.jsonl`` (one row per
scored completion, dataset order then sample), ``summary.json``, ``manifest.json``
(:mod:`palaestra.evals.manifest`) and the ``README.md`` run note; a live run (:func:`evaluate_model`) also
the samples it scored (``samples.jsonl`` + ``samples.meta.json``, the format ``palaestra select`` reads).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.envs.verifier import Verifier
from palaestra.evals.inputs import Dataset, SampleRow, check_equal_counts, load_dataset, load_samples
from palaestra.evals.manifest import build_manifest, file_record, locked_room, sidecar_path
from palaestra.evals.passk import pass_at_k
from palaestra.evals.scorers import CrossCheck, cross_check_for, get_scorer, scorer_tag
from palaestra.evals.taxonomy import CATEGORIES, category_of, classify
from palaestra.trajectories.io import PathLike, canonical_json, sha256_file, sha256_text, write_jsonl
from palaestra.trajectories.runs import write_json, write_run_note

__all__ = [
    "PREVIEW_CHARS",
    "Dataset",
    "RunArtifacts",
    "SampleRow",
    "evaluate_completions",
    "evaluate_model",
    "load_dataset",
    "load_samples",
    "score_completion",
    "summarize",
]

#: Characters of each completion kept in ``results.jsonl`` (``completion_chars`` gives the full length).
PREVIEW_CHARS = 300


@dataclass(frozen=True)
class RunArtifacts:
    """What a harness command wrote: the run folder, its summary, manifest and result rows."""

    outdir: Path
    summary: dict[str, Any]
    manifest: dict[str, Any]
    results: list[dict[str, Any]]


def score_completion(
    scorer: Verifier, cross: CrossCheck | None, example: Mapping[str, Any], completion: str
) -> dict[str, Any]:
    """Score one completion: reward, outcome, categories, suspect flag, cross-check outcomes and details."""
    score = scorer.score(example, completion)
    suspect = False
    cross_out: dict[str, str] | None = None
    if cross is not None:
        strict = score if _same(cross.strict, scorer) else cross.strict.score(example, completion)
        lenient = score if _same(cross.lenient, scorer) else cross.lenient.score(example, completion)
        suspect = lenient.reward > 0.0 and not strict.reward > 0.0
        cross_out = {"strict": strict.outcome, "lenient": lenient.outcome}
    return {
        "reward": score.reward,
        "outcome": score.outcome,
        "category": classify(score.outcome, suspect=suspect),
        "table_category": category_of(score.outcome),
        "suspect": suspect,
        "cross_check": cross_out,
        "details": score.details,
    }


def _same(a: Verifier, b: Verifier) -> bool:
    return a is b or (a.name == b.name and a.version == b.version)


def preview_fields(completion: str) -> dict[str, Any]:
    """``completion_preview`` (first :data:`PREVIEW_CHARS` characters), its length and sha256."""
    return {
        "completion_preview": completion[:PREVIEW_CHARS],
        "completion_chars": len(completion),
        "completion_sha256": sha256_text(completion),
    }


def summarize(results: Sequence[Mapping[str, Any]], *, samples_per_id: int) -> dict[str, Any]:
    """``n``, ``n_ids``, ``pass_rate`` (reward > 0), ``mean_reward``, counts by outcome and by category."""
    n = len(results)
    rewards = [float(r["reward"]) for r in results]
    by_category = dict.fromkeys(CATEGORIES, 0)
    by_category.update(Counter(r["category"] for r in results))
    return {
        "n": n,
        "n_ids": len({r["id"] for r in results}),
        "samples_per_id": samples_per_id,
        "pass_rate": sum(x > 0.0 for x in rewards) / n if n else 0.0,
        "mean_reward": sum(rewards) / n if n else 0.0,
        "counts_by_outcome": dict(sorted(Counter(r["outcome"] for r in results).items())),
        "counts_by_category": by_category,
        "suspect": sum(bool(r.get("suspect")) for r in results),
    }


def score_samples(
    dataset: Dataset, samples: Mapping[str, list[SampleRow]], scorer: Verifier, cross: CrossCheck | None
) -> list[dict[str, Any]]:
    """Result rows for every sample, in dataset order then sample index."""
    by_id = dataset.by_id()
    results = []
    for ex_id, rows in samples.items():
        for s in rows:
            row: dict[str, Any] = {"id": ex_id, "sample": s.sample}
            row.update(score_completion(scorer, cross, by_id[ex_id], s.completion))
            row.update(preview_fields(s.completion))
            if s.sum_logprob is not None:
                row["sum_logprob"] = s.sum_logprob
            if s.extra:
                row["extra"] = s.extra
            results.append(row)
    return results


def pass_at_k_table(correct_counts: Sequence[int], n: int) -> dict[str, float]:
    """Mean unbiased pass@k over ids (``correct_counts[i]`` correct of ``n`` samples) for k = 1, 2, 4, ... < n
    and k = n, keyed by ``str(k)``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return {str(k): sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts) for k in ks}


def write_artifacts(
    outdir: Path,
    results: list[dict[str, Any]],
    summary: dict[str, Any],
    manifest: dict[str, Any],
    title: str,
    knob: str,
    numbers: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> RunArtifacts:
    """Write results, summary, manifest (with output hashes) and the run note into ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    write_jsonl(outdir / "results.jsonl", results)
    write_json(outdir / "summary.json", summary)
    for name in ("results.jsonl", "summary.json"):
        manifest["outputs"][name] = sha256_file(outdir / name)
    write_json(outdir / "manifest.json", manifest)
    # quoted in full (the note shortens long dicts): JSON text for objects and null
    room: dict[str, Any] = {
        k: canonical_json(v) if v is None or isinstance(v, (dict, list)) else v
        for k, v in locked_room(manifest).items()
    }
    room["scorer"] = f"{manifest['scorer']['name']}@{manifest['scorer']['version']}"
    room["code"] = manifest["code"]
    write_run_note(
        outdir, loop=manifest["loop"], title=title, knob=knob, locked_room=room, numbers=numbers, notes=notes
    )
    return RunArtifacts(outdir=outdir, summary=summary, manifest=manifest, results=results)


def run_numbers(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers quoted in an eval run note."""
    numbers: dict[str, Any] = {
        k: summary[k] for k in ("n", "n_ids", "samples_per_id", "pass_rate", "mean_reward")
    }
    numbers["suspect (lenient accepts, strict rejects)"] = summary["suspect"]
    for cat, c in summary["counts_by_category"].items():
        numbers[f"category {cat}"] = c
    return numbers


def evaluate_completions(
    dataset: PathLike,
    completions: PathLike,
    outdir: PathLike,
    *,
    scorer: str = "arith-strict",
    knob: str | None = None,
    live: bool = False,
) -> RunArtifacts:
    """Loop A on frozen completions; sampling settings, seed and policy come from the completions' sidecar
    (``<name>.meta.json``) when there is one, else they are null."""
    verifier = get_scorer(scorer)
    ds = load_dataset(dataset)
    comp_path = Path(completions)
    samples = load_samples(comp_path, ds, repeats=False)
    k = check_equal_counts(samples, comp_path)
    cross = cross_check_for(scorer)
    results = score_samples(ds, samples, verifier, cross)
    summary = summarize(results, samples_per_id=k)
    manifest = build_manifest(
        loop="A",
        command="eval",
        dataset=ds,
        samples=comp_path,
        samples_key="completions",
        samples_rows=len(results),
        scorer=verifier,
        cross_check=cross.describe() if cross else None,
        samples_per_id=k,
        selection_n=None,
    )
    summary["scorer"] = scorer_tag(verifier)
    if k > 1:  # several samples per id: also the unbiased pass@k over them
        wins = Counter(r["id"] for r in results if r["reward"] > 0.0)
        summary["pass_at_k"] = pass_at_k_table([wins[ex_id] for ex_id in samples], k)
        summary["pass@1"] = summary["pass_at_k"]["1"]
        summary[f"pass@{k}"] = summary["pass_at_k"][str(k)]
    policy = manifest["policy"]
    if live:
        knob_text = knob or f"policy: model {(policy or {}).get('model')!r} sampled live"
        side = sidecar_path(comp_path).name
        notes = [f"sampled live in this run; the samples are in {comp_path.name} (+ {side})"]
    else:
        digest = manifest["inputs"]["completions"]["sha256"][:12]
        knob_text = knob or f"policy outputs: completions file {comp_path.name} (sha256 {digest})"
        if isinstance(policy, dict) and not knob:
            knob_text += f", sampled from {policy.get('fingerprint') or policy.get('model')}"
        notes = ["frozen completions: nothing was sampled in this run"]
        if "completions_meta" not in manifest["inputs"]:
            notes.append("no sidecar .meta.json next to the completions: sampling settings unknown (null)")
    title = f"eval of {comp_path.name} on {ds.path.name}"
    return write_artifacts(
        Path(outdir), results, summary, manifest, title, knob_text, run_numbers(summary), notes
    )


async def evaluate_model(
    dataset: PathLike,
    model: Any,
    outdir: PathLike,
    *,
    samples: int = 1,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int = 0,
    scorer: str = "arith-strict",
    base_url: str | None = None,
    concurrency: int = 64,
    knob: str | None = None,
    progress: bool = False,
) -> RunArtifacts:
    """Loop A on fresh samples: sample ``samples`` completions per example from ``model`` (a ChatModel, or a
    name resolved by :func:`palaestra.evals.sampling.resolve_model`), write them to ``outdir/samples.jsonl``
    with a sidecar, then score them exactly as frozen completions."""
    from palaestra.evals import sampling as smp

    ds = load_dataset(dataset)
    get_scorer(scorer)  # fail on an unknown scorer before sampling
    chat = smp.resolve_model(model, base_url=base_url) if isinstance(model, str) else model
    rows = await smp.sample_completions(
        chat,
        ds.examples,
        samples=samples,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        concurrency=concurrency,
        progress=progress,
    )
    out = Path(outdir)
    samples_path = out / "samples.jsonl"
    smp.write_samples(
        samples_path,
        rows,
        sampling=smp.sampling_settings(
            temperature=temperature, max_tokens=max_tokens, samples_per_id=samples
        ),
        seed=seed,
        policy=smp.policy_record(chat, base_url=base_url),
        dataset=file_record(ds.path, len(ds.examples)),
    )
    return evaluate_completions(ds.path, samples_path, out, scorer=scorer, knob=knob, live=True)
