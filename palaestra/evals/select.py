"""Loop B: best-of-N selection over fixed samples, with unbiased pass@k. The policy does not change.

Samples JSONL rows: ``{"id", "completion", "sum_logprob"?, "sample"?}`` (any other keys are ignored here).
For each dataset id the *first N* samples are used: by ``sample`` index when rows carry it, else in file
order.
An id with fewer than N samples, an unknown id or a dataset id without samples is an error naming file:line.

Every one of the N samples is scored by the scorer (which gives ``c``, the number correct, for pass@k). The
chosen sample is the first under this total order (deterministic: same inputs -> identical bytes):

1. selector reward, higher first (the selector is the scorer unless ``selector`` names another verifier;
   selecting with the scorer itself is *oracle* best-of-N, so the chosen pass rate equals pass@N);
2. ``sum_logprob``, higher first (a sample without one comes after every sample with one);
3. shorter completion (characters);
4. completion text, lexicographic (Python string order);
5. lower sample index.

``pass@k`` is the unbiased estimator of :func:`palaestra.evals.passk.pass_at_k` over the N samples per id,
averaged over ids.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from palaestra.envs.verifier import Verifier
from palaestra.evals.evaluate import (
    Dataset,
    RunArtifacts,
    SampleRow,
    load_dataset,
    load_samples,
    pass_at_k_table,
    preview_fields,
    score_completion,
    summarize,
    write_artifacts,
)
from palaestra.evals.manifest import build_manifest
from palaestra.evals.passk import pass_at_k
from palaestra.evals.scorers import cross_check_for, get_scorer, scorer_tag
from palaestra.trajectories.io import DataError, PathLike

__all__ = ["TIE_BREAK", "rank_key", "ranked", "select_best"]

TIE_BREAK = (
    "selector reward desc, sum_logprob desc (missing last), shorter, lexicographic, lower sample index"
)


def rank_key(selector_reward: float, row: SampleRow) -> tuple[Any, ...]:
    """Sort key of a sample: smaller sorts first (see the module docstring for the order)."""
    lp = row.sum_logprob
    return (-selector_reward, lp is None, -(lp or 0.0), len(row.completion), row.completion, row.sample)


def ranked(rows: Sequence[SampleRow], selector_rewards: Sequence[float]) -> list[int]:
    """Indices of ``rows`` from best to worst."""
    return sorted(range(len(rows)), key=lambda i: rank_key(selector_rewards[i], rows[i]))


def _first_n(samples: dict[str, list[SampleRow]], n: int, path: Path) -> dict[str, list[SampleRow]]:
    out = {}
    for ex_id, rows in samples.items():
        if len(rows) < n:
            raise DataError(
                f"id {ex_id!r} has {len(rows)} samples, fewer than N={n}", path=path, line=rows[0].line
            )
        out[ex_id] = rows[:n]
    return out


def _select_rows(
    ds: Dataset,
    samples: dict[str, list[SampleRow]],
    scorer: Verifier,
    selector: Verifier | None,
    n: int,
    cross: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    by_id = ds.by_id()
    results, every = [], []
    for ex_id, rows in samples.items():
        example = by_id[ex_id]
        scored = [score_completion(scorer, cross, example, r.completion) for r in rows]
        every += [{"id": ex_id, **s} for s in scored]
        if selector is None:
            sel = [s["reward"] for s in scored]
        else:
            sel = [selector.score(example, r.completion).reward for r in rows]
        order = ranked(rows, sel)
        best = order[0]
        c = sum(s["reward"] > 0.0 for s in scored)
        row: dict[str, Any] = {"id": ex_id, "chosen_sample": rows[best].sample}
        row.update(scored[best])
        row.update(preview_fields(rows[best].completion))
        row.update(
            {
                "sum_logprob": rows[best].sum_logprob,
                "selector_reward": sel[best],
                "n_samples": n,
                "n_correct": c,
                "pass_at_1": pass_at_k(n, c, 1),
                "pass_at_n": pass_at_k(n, c, n),
                "ranking": [
                    {
                        "sample": rows[i].sample,
                        "selector_reward": sel[i],
                        "reward": scored[i]["reward"],
                        "outcome": scored[i]["outcome"],
                        "sum_logprob": rows[i].sum_logprob,
                        "chars": len(rows[i].completion),
                    }
                    for i in order
                ],
            }
        )
        results.append(row)
    return results, every


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
    """Run Loop B and write ``results.jsonl``, ``summary.json``, ``manifest.json`` and ``README.md``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    verifier = get_scorer(scorer)
    sel_verifier = None if selector is None or selector == scorer else get_scorer(selector)
    ds = load_dataset(dataset)
    s_path = Path(samples)
    pool = _first_n(load_samples(s_path, ds, repeats=True, what="sample"), n, s_path)
    cross = cross_check_for(scorer)
    results, every = _select_rows(ds, pool, verifier, sel_verifier, n, cross)

    summary = summarize(results, samples_per_id=n)
    counts = [r["n_correct"] for r in results]
    pass_k = pass_at_k_table(counts, n)
    every_summary = summarize(every, samples_per_id=n)
    summary.update(
        {
            "N": n,
            "pass@1": pass_k["1"],
            "pass@N": pass_k[str(n)],
            f"pass@{n}": pass_k[str(n)],
            "pass_at_k": pass_k,
            "all_samples": {
                k: every_summary[k]
                for k in ("n", "pass_rate", "mean_reward", "counts_by_outcome", "counts_by_category")
            },
            "scorer": scorer_tag(verifier),
            "selector": scorer_tag(sel_verifier or verifier),
        }
    )
    chosen = sel_verifier or verifier
    manifest = build_manifest(
        loop="B",
        command="select",
        dataset=ds,
        samples=s_path,
        samples_key="samples",
        samples_rows=None,
        scorer=verifier,
        cross_check=cross.describe() if cross else None,
        samples_per_id=n,
        selection_n=n,
        extra={"selector": {"name": chosen.name, "version": chosen.version}, "tie_break": TIE_BREAK},
    )
    numbers = {
        "ids": summary["n_ids"],
        "N": n,
        "pass@1 (unbiased, over N samples)": summary["pass@1"],
        f"pass@{n} (unbiased)": summary["pass@N"],
        "best-of-N pass_rate (chosen sample)": summary["pass_rate"],
        "best-of-N mean_reward": summary["mean_reward"],
        "all samples pass_rate": every_summary["pass_rate"],
    }
    for cat, c in sorted(Counter(r["category"] for r in results).items()):
        numbers[f"chosen category {cat}"] = c
    notes = [f"tie-break: {TIE_BREAK}"]
    if sel_verifier is None:
        notes.append("selector = scorer: oracle best-of-N, so the chosen pass rate equals pass@N")
    if "samples_meta" not in manifest["inputs"]:
        notes.append("no sidecar .meta.json next to the samples: sampling settings unknown (null)")
    title = f"best-of-{n} selection over {s_path.name}"
    knob = knob or f"selection: best-of-N with N={n}, selector {scorer_tag(chosen)}"
    return write_artifacts(Path(outdir), results, summary, manifest, title, knob, numbers, notes)
