"""Loop B: best-of-N selection over fixed samples, with unbiased pass@k; the policy does not change. The
chosen sample of each id is the first under :data:`TIE_BREAK` (docs/harness.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from palaestra.evals.evaluate import RunArtifacts, pass_at_k_summary, preview_fields, summarize, write_run
from palaestra.evals.inputs import SampleRow, load_inputs
from palaestra.evals.manifest import build_manifest
from palaestra.evals.passk import pass_at_k
from palaestra.evals.scorers import get_scorer, scorer_tag
from palaestra.trajectories.io import DataError, PathLike

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
    """Run Loop B on the first ``n`` samples of each id and write ``results.jsonl`` (the chosen sample of
    each id, with the ranking), ``summary.json``, ``manifest.json`` and ``README.md``. ``selector`` names the
    verifier that ranks the samples (default: the scorer, i.e. oracle best-of-N)."""
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
