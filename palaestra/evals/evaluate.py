"""Loop A: score fixed completions (or fresh samples of a model) against a dataset; Loop B: best-of-N
selection over fixed samples, with unbiased pass@k. Both write a run folder (docs/harness.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.evals import sampling as smp
from palaestra.evals.inputs import SampleRow, get_scorer, load_dataset, load_inputs, scorer_tag
from palaestra.evals.manifest import build_manifest, file_record, locked_room, sidecar_path
from palaestra.evals.passk import pass_at_k
from palaestra.evals.taxonomy import CATEGORIES
from palaestra.trajectories.io import (
    DataError,
    PathLike,
    canonical_json,
    sha256_file,
    sha256_text,
    write_jsonl,
)
from palaestra.trajectories.runs import write_json, write_run_note

#: Characters of each completion kept in ``results.jsonl`` (``completion_chars`` gives the full length).
PREVIEW_CHARS = 300


@dataclass(frozen=True)
class RunArtifacts:
    """What a harness command wrote: the run folder, its summary, manifest and result rows."""

    outdir: Path
    summary: dict[str, Any]
    manifest: dict[str, Any]
    results: list[dict[str, Any]]


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
    by_category = dict.fromkeys(CATEGORIES, 0) | Counter(r["category"] for r in results)
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


def pass_at_k_summary(correct_counts: Sequence[int], n: int) -> dict[str, Any]:
    """``pass_at_k``: the mean unbiased pass@k over ids (``correct_counts[i]`` correct of ``n`` samples) for
    k = 1, 2, 4, ... < n and k = n, keyed by ``str(k)``; and ``pass@1``, ``pass@<n>`` from it."""
    ks = [2**i for i in range(n.bit_length()) if 2**i < n] + [n]
    table = {str(k): sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts) for k in ks}
    return {"pass_at_k": table, "pass@1": table["1"], f"pass@{n}": table[str(n)]}


def write_run(
    outdir: PathLike,
    results: list[dict[str, Any]],
    summary: dict[str, Any],
    manifest: dict[str, Any],
    *,
    title: str,
    knob: str,
    numbers: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> RunArtifacts:
    """Write results, summary, manifest (with output hashes) and the run note into ``outdir``."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "results.jsonl", results)
    write_json(out / "summary.json", summary)
    manifest["outputs"].update({name: sha256_file(out / name) for name in ("results.jsonl", "summary.json")})
    write_json(out / "manifest.json", manifest)
    key = "completions" if manifest["command"] == "eval" else "samples"
    if f"{key}_meta" not in manifest["inputs"]:
        notes = [*notes, f"no sidecar .meta.json next to the {key}: sampling settings unknown (null)"]
    # quoted in full (the note shortens long dicts): JSON text for objects and null
    room: dict[str, Any] = {
        k: canonical_json(v) if v is None or isinstance(v, (dict, list)) else v
        for k, v in locked_room(manifest).items()
    }
    room["scorer"] = f"{manifest['scorer']['name']}@{manifest['scorer']['version']}"
    room["code"] = manifest["code"]
    write_run_note(
        out, loop=manifest["loop"], title=title, knob=knob, locked_room=room, numbers=numbers, notes=notes
    )
    return RunArtifacts(outdir=out, summary=summary, manifest=manifest, results=results)


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
    inp = load_inputs(dataset, completions, scorer)
    first, k = next((ex_id, len(rows)) for ex_id, rows in inp.samples.items())
    by_id = inp.dataset.by_id()
    results = []
    for ex_id, rows in inp.samples.items():
        if len(rows) != k:
            raise DataError(
                f"id {ex_id!r} has {len(rows)} completions but {first!r} has {k}; every id needs the same number",
                path=inp.path,
                line=rows[0].line,
            )
        for s in rows:
            row = {"id": ex_id, "sample": s.sample, **inp.score(by_id[ex_id], s.completion)}
            row.update(preview_fields(s.completion))
            if s.sum_logprob is not None:
                row["sum_logprob"] = s.sum_logprob
            if s.extra:
                row["extra"] = s.extra
            results.append(row)
    summary = summarize(results, samples_per_id=k)
    summary["scorer"] = scorer_tag(inp.scorer)
    if k > 1:  # several samples per id: also the unbiased pass@k over them
        wins = Counter(r["id"] for r in results if r["reward"] > 0.0)
        summary.update(pass_at_k_summary([wins[ex_id] for ex_id in inp.samples], k))
    manifest = build_manifest(inp, "eval", k, samples_rows=len(results))
    policy, name = manifest["policy"], inp.path.name
    if live:
        knob_text = knob or f"policy: model {(policy or {}).get('model')!r} sampled live"
        notes = [f"sampled live in this run; the samples are in {name} (+ {sidecar_path(inp.path).name})"]
    else:
        digest = manifest["inputs"]["completions"]["sha256"][:12]
        knob_text = knob or f"policy outputs: completions file {name} (sha256 {digest})"
        if isinstance(policy, dict) and not knob:
            knob_text += f", sampled from {policy.get('fingerprint') or policy.get('model')}"
        notes = ["frozen completions: nothing was sampled in this run"]
    numbers = {k: summary[k] for k in ("n", "n_ids", "samples_per_id", "pass_rate", "mean_reward")}
    numbers["suspect (lenient accepts, strict rejects)"] = summary["suspect"]
    numbers.update({f"category {cat}": c for cat, c in summary["counts_by_category"].items()})
    title = f"eval of {name} on {inp.dataset.path.name}"
    return write_run(
        outdir, results, summary, manifest, title=title, knob=knob_text, numbers=numbers, notes=notes
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
    """Loop A on fresh samples of ``model`` (a ChatModel or a name for :func:`~palaestra.evals.sampling.resolve_model`),
    written to ``outdir/samples.jsonl`` with a sidecar, then scored exactly as frozen completions."""
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
    samples_path = Path(outdir) / "samples.jsonl"
    sampling = smp.sampling_settings(temperature=temperature, max_tokens=max_tokens, samples_per_id=samples)
    policy = smp.policy_record(chat, base_url=base_url)
    data = file_record(ds.path, len(ds.examples))
    smp.write_samples(samples_path, rows, sampling=sampling, seed=seed, policy=policy, dataset=data)
    return evaluate_completions(ds.path, samples_path, outdir, scorer=scorer, knob=knob, live=True)


#: The order of an id's samples in Loop B: the chosen sample is the first.
TIE_BREAK = (
    "selector reward desc, sum_logprob desc (missing last), shorter, lexicographic, lower sample index"
)


def ranked(rows: Sequence[SampleRow], selector_rewards: Sequence[float]) -> list[int]:
    """Indices of ``rows`` from best to worst (the order of :data:`TIE_BREAK`)."""

    def key(i: int) -> tuple[Any, ...]:
        lp, text = rows[i].sum_logprob, rows[i].completion
        return (-selector_rewards[i], lp is None, -(lp or 0.0), len(text), text, rows[i].sample)

    return sorted(range(len(rows)), key=key)


def select_best(
    dataset: PathLike,
    samples: PathLike,
    outdir: PathLike,
    *,
    n: int,
    scorer: str = "arith-strict",
    selector: str | None = None,
    knob: str | None = None,
) -> RunArtifacts:
    """Loop B on the first ``n`` samples of each id: the chosen sample of each id, with the ranking, in a run
    folder; ``selector`` ranks the samples (default: the scorer, i.e. oracle best-of-N)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    sel_verifier = None if selector is None or selector == scorer else get_scorer(selector)
    inp = load_inputs(dataset, samples, scorer, repeats=True)
    by_id = inp.dataset.by_id()
    results, every = [], []
    for ex_id, all_rows in inp.samples.items():
        if len(all_rows) < n:
            raise DataError(
                f"id {ex_id!r} has {len(all_rows)} samples, fewer than N={n}",
                path=inp.path,
                line=all_rows[0].line,
            )
        rows, example = all_rows[:n], by_id[ex_id]
        scored = [inp.score(example, r.completion) for r in rows]
        every += [{"id": ex_id, **s} for s in scored]
        if sel_verifier is None:
            sel = [s["reward"] for s in scored]
        else:
            sel = [sel_verifier.score(example, r.completion).reward for r in rows]
        order = ranked(rows, sel)
        best = order[0]
        c = sum(s["reward"] > 0.0 for s in scored)
        ranking = [
            {
                "sample": rows[i].sample,
                "selector_reward": sel[i],
                "reward": scored[i]["reward"],
                "outcome": scored[i]["outcome"],
                "sum_logprob": rows[i].sum_logprob,
                "chars": len(rows[i].completion),
            }
            for i in order
        ]
        results.append(
            {
                "id": ex_id,
                "chosen_sample": rows[best].sample,
                **scored[best],
                **preview_fields(rows[best].completion),
                "sum_logprob": rows[best].sum_logprob,
                "selector_reward": sel[best],
                "n_samples": n,
                "n_correct": c,
                "pass_at_1": pass_at_k(n, c, 1),
                "pass_at_n": pass_at_k(n, c, n),
                "ranking": ranking,
            }
        )

    chosen = sel_verifier or inp.scorer
    summary = summarize(results, samples_per_id=n)
    every_summary = summarize(every, samples_per_id=n)
    summary.update(pass_at_k_summary([r["n_correct"] for r in results], n))
    shared = ("n", "pass_rate", "mean_reward", "counts_by_outcome", "counts_by_category")
    summary.update(
        {
            "N": n,
            "pass@N": summary[f"pass@{n}"],
            "all_samples": {k: every_summary[k] for k in shared},
            "scorer": scorer_tag(inp.scorer),
            "selector": scorer_tag(chosen),
        }
    )
    extra = {"selector": {"name": chosen.name, "version": chosen.version}, "tie_break": TIE_BREAK}
    manifest = build_manifest(inp, "select", n, extra=extra)
    numbers = {
        "ids": summary["n_ids"],
        "N": n,
        "pass@1 (unbiased, over N samples)": summary["pass@1"],
        f"pass@{n} (unbiased)": summary["pass@N"],
        "best-of-N pass_rate (chosen sample)": summary["pass_rate"],
        "best-of-N mean_reward": summary["mean_reward"],
        "all samples pass_rate": every_summary["pass_rate"],
    }
    for cat, count in sorted(Counter(r["category"] for r in results).items()):
        numbers[f"chosen category {cat}"] = count
    notes = [f"tie-break: {TIE_BREAK}"]
    if sel_verifier is None:
        notes.append("selector = scorer: oracle best-of-N, so the chosen pass rate equals pass@N")
    title = f"best-of-{n} selection over {inp.path.name}"
    knob = knob or f"selection: best-of-N with N={n}, selector {scorer_tag(chosen)}"
    return write_run(outdir, results, summary, manifest, title=title, knob=knob, numbers=numbers, notes=notes)
