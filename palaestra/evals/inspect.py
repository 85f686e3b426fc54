"""``palaestra inspect``: a run's results grouped by taxonomy category and by outcome, with examples; the
completions are made :func:`visible`, so that a zero-width space, a bidi mark or a fullwidth digit cannot hide."""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable

from palaestra.evals.runs import Rollout, RunView, load_run
from palaestra.evals.taxonomy import CATEGORIES, CATEGORY_MEANING, OK, UNMAPPED
from palaestra.trajectories.io import PathLike

_SIMPLE = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", '"': '\\"'}


def visible(text: str, limit: int | None = 160) -> str:
    """``text`` in double quotes, invisible or non-ASCII characters as ``\\u{XXXX NAME}``, cut after ``limit``."""
    out = []
    for ch in text if limit is None else text[:limit]:
        if ch in _SIMPLE:
            out.append(_SIMPLE[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            name = unicodedata.name(ch, "")
            out.append(f"\\u{{{ord(ch):04X}{' ' + name if name else ''}}}")
    more = "" if limit is None or len(text) <= limit else f"...(+{len(text) - limit} chars)"
    return '"' + "".join(out) + '"' + more


def visible_lines(role: str, text: str) -> list[str]:
    """Each line of a message made :func:`visible` (in full; quoted only for the assistant's text)."""
    quoted = [visible(ln, limit=None) for ln in text.split("\n")]
    return quoted if role == "assistant" else [q[1:-1] for q in quoted]


def _example_lines(r: Rollout) -> list[str]:
    tag = f"{r.example_id}" + (f" #{r.index}" if r.index is not None else "")
    cross = f"  [{r.extra['cross_check']}]" if r.extra.get("cross_check") else ""
    lines = [
        f"    {tag}  reward {r.reward:g}  outcome {r.outcome}{cross}",
        f"      completion: {visible(r.completion)}",
    ]
    return lines + ([f"      {r.note}"] if r.note else [])


def _header(view: RunView, n: int) -> list[str]:
    m, summary = view.manifest, view.summary
    head = f"run {view.root}  (loop {m.get('loop', '?')}, {m.get('command', '?')}"
    if m.get("scorer"):
        head += f", scorer {m['scorer'].get('name')}@{m['scorer'].get('version')}"
    numbers = [
        f"{k} {summary[k]:.4g}" for k in ("pass_rate", "mean_reward", "pass@1", "pass@N") if k in summary
    ]
    return [head + f", {n} results)"] + (["  " + ", ".join(numbers)] if numbers else [])


def group_by(rows: Iterable[Rollout], key: Callable[[Rollout], str]) -> dict[str, list[Rollout]]:
    """Rollouts grouped by ``key``, groups and rows in first-seen order."""
    out: dict[str, list[Rollout]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def inspect_run(run_dir: PathLike, *, only_fails: bool = False, top_k: int = 5, show: int = 2) -> str:
    """The text report of ``palaestra inspect``: counts per category and per outcome (the ``top_k`` most
    frequent), then ``show`` examples of each; ``only_fails`` leaves accepted results out."""
    if top_k < 1 or show < 0:
        raise ValueError("top_k must be >= 1 and show >= 0")
    view = load_run(run_dir)
    results = view.rollouts()
    rows = [r for r in results if not r.correct or r.category != OK] if only_fails else results
    lines = _header(view, len(results))
    n = len(results) or 1
    scope = "failures only" if only_fails else "all results"
    by_cat = group_by(rows, lambda r: r.category or "-")
    lines += ["", f"By category ({scope}; table in palaestra/evals/taxonomy.py):"]
    cats = [c for c in CATEGORIES if not (only_fails and c == OK)] + sorted(set(by_cat) - set(CATEGORIES))
    for cat in cats:
        count = len(by_cat.get(cat, []))
        lines.append(f"  {cat:<17} {count:>6}  {100 * count / n:5.1f}%  {CATEGORY_MEANING.get(cat, '')}")
    if UNMAPPED in by_cat:
        lines.append(
            f"  WARNING: {len(by_cat[UNMAPPED])} result(s) have outcome codes missing from the taxonomy table"
        )

    ranked = sorted(group_by(rows, lambda r: r.outcome or "-").items(), key=lambda kv: (-len(kv[1]), kv[0]))
    lines += ["", f"By outcome (top {min(top_k, len(ranked))} of {len(ranked)}; {scope}):"]
    for outcome, group in ranked[:top_k]:
        cats_here = Counter(r.category or "-" for r in group)
        cat_text = ", ".join(f"{c} {k}" for c, k in sorted(cats_here.items()))
        lines.append(f"  {outcome:<17} {len(group):>6}  {100 * len(group) / n:5.1f}%  [{cat_text}]")
    if len(ranked) > top_k:
        rest = sum(len(g) for _, g in ranked[top_k:])
        lines.append(
            f"  ({len(ranked) - top_k} more outcome(s), {rest} result(s); raise --top-k to see them)"
        )
    if show > 0:
        lines += ["", f"Examples per outcome (first {show} in file order):"]
        for outcome, group in ranked[:top_k]:
            lines.append(f"  == {outcome} ({len(group)}) ==")
            lines += [line for r in group[:show] for line in _example_lines(r)]
        lines += ["", f"Examples per category (first {show}):"]
        for cat in (c for c in cats if by_cat.get(c)):
            lines.append(f"  == {cat} ({len(by_cat[cat])}) ==")
            lines += [line for r in by_cat[cat][:show] for line in _example_lines(r)]
    return "\n".join(lines) + "\n"
