"""``palaestra inspect``: read a run's results grouped by taxonomy category and by outcome, with examples.

Works on any run folder with a ``results.jsonl`` whose rows carry ``id``, ``reward``, ``outcome`` and
(optionally) ``category``, ``completion_preview``, ``details`` (eval and select runs). Completions are shown
with invisible characters made visible: :func:`visible` escapes newlines, tabs and every non-ASCII or
non-printable character as ``\\u{XXXX NAME}`` (so a zero-width space, a bidi mark or a fullwidth digit
cannot hide).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from palaestra.evals.taxonomy import CATEGORIES, CATEGORY_MEANING, OK, UNMAPPED, category_of
from palaestra.trajectories.io import DataError, PathLike, read_jsonl
from palaestra.trajectories.runs import read_json

__all__ = ["inspect_run", "visible", "visible_lines"]

_SIMPLE = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", '"': '\\"'}


def visible(text: str, limit: int | None = 160) -> str:
    """``text`` in double quotes with invisible or non-ASCII characters escaped, cut after ``limit`` chars."""
    out = []
    shown = text if limit is None else text[:limit]
    for ch in shown:
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
    return [
        visible(ln, limit=None) if role == "assistant" else visible(ln, limit=None)[1:-1]
        for ln in text.split("\n")
    ]


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    if not run_dir.is_dir():
        raise DataError("run folder not found", path=run_dir)
    results = read_jsonl(run_dir / "results.jsonl")
    for i, row in enumerate(results, start=1):
        for key in ("id", "reward", "outcome"):
            if key not in row:
                raise DataError(f"result row lacks field {key!r}", path=run_dir / "results.jsonl", line=i)
    summary = read_json(run_dir / "summary.json") if (run_dir / "summary.json").exists() else {}
    manifest = read_json(run_dir / "manifest.json") if (run_dir / "manifest.json").exists() else {}
    return results, summary, manifest


def _category(row: Mapping[str, Any]) -> str:
    cat = row.get("category")
    return cat if isinstance(cat, str) else category_of(str(row["outcome"]))


def _is_fail(row: Mapping[str, Any]) -> bool:
    return not float(row["reward"]) > 0.0 or _category(row) != OK


def _example_line(row: Mapping[str, Any], width: int) -> list[str]:
    sample = row.get("chosen_sample", row.get("sample"))
    tag = f"{row['id']}" + (f" #{sample}" if sample is not None else "")
    completion = row.get("completion_preview", row.get("completion", ""))
    text = visible(str(completion), limit=width)
    full = row.get("completion_chars")
    if isinstance(full, int) and isinstance(completion, str) and full > len(completion):
        text += f" (preview of {full} chars)"
    details = row.get("details")
    reason = details.get("reason", "") if isinstance(details, Mapping) else ""
    extra = ""
    if row.get("cross_check"):
        cc = row["cross_check"]
        extra = f"  [strict {cc.get('strict')}, lenient {cc.get('lenient')}]"
    lines = [
        f"    {tag}  reward {float(row['reward']):g}  outcome {row['outcome']}{extra}",
        f"      completion: {text}",
    ]
    if reason:
        lines.append(f"      why: {reason}")
    return lines


def _header(run_dir: Path, summary: Mapping[str, Any], manifest: Mapping[str, Any], n: int) -> list[str]:
    scorer = manifest.get("scorer") or {}
    loop = manifest.get("loop", "?")
    cmd = manifest.get("command", "?")
    head = f"run {run_dir}  (loop {loop}, {cmd}"
    if scorer:
        head += f", scorer {scorer.get('name')}@{scorer.get('version')}"
    head += f", {n} results)"
    lines = [head]
    numbers = [
        f"{k} {summary[k]:.4g}" for k in ("pass_rate", "mean_reward", "pass@1", "pass@N") if k in summary
    ]
    if numbers:
        lines.append("  " + ", ".join(numbers))
    return lines


def _groups(rows: Sequence[Mapping[str, Any]], key: Any) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def inspect_run(
    run_dir: PathLike, *, only_fails: bool = False, top_k: int = 5, show: int = 2, width: int = 160
) -> str:
    """The text report of ``palaestra inspect`` (see the module docstring)."""
    if top_k < 1 or show < 0:
        raise ValueError("top_k must be >= 1 and show >= 0")
    run = Path(run_dir)
    results, summary, manifest = _load(run)
    rows = [r for r in results if _is_fail(r)] if only_fails else results
    lines = _header(run, summary, manifest, len(results))
    n = len(results) or 1
    scope = "failures only" if only_fails else "all results"
    by_cat = _groups(rows, _category)
    lines += ["", f"By category ({scope}; table in palaestra/evals/taxonomy.py):"]
    cats = [c for c in CATEGORIES if not (only_fails and c == OK)] + sorted(set(by_cat) - set(CATEGORIES))
    for cat in cats:
        count = len(by_cat.get(cat, []))
        lines.append(f"  {cat:<17} {count:>6}  {100 * count / n:5.1f}%  {CATEGORY_MEANING.get(cat, '')}")
    if UNMAPPED in by_cat:
        lines.append(
            f"  WARNING: {len(by_cat[UNMAPPED])} result(s) have outcome codes missing from the taxonomy table"
        )

    by_outcome = _groups(rows, lambda r: str(r["outcome"]))
    ranked = sorted(by_outcome.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    lines += ["", f"By outcome (top {min(top_k, len(ranked))} of {len(ranked)}; {scope}):"]
    for outcome, group in ranked[:top_k]:
        cats_here = Counter(_category(r) for r in group)
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
            for r in group[:show]:
                lines += _example_line(r, width)
        lines += ["", f"Examples per category (first {show}):"]
        for cat in cats:
            group = by_cat.get(cat, [])
            if not group:
                continue
            lines.append(f"  == {cat} ({len(group)}) ==")
            for r in group[:show]:
                lines += _example_line(r, width)
    return "\n".join(lines) + "\n"
