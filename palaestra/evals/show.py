"""``palaestra show RUN`` (a run's rollouts, filtered, ranked or diffed between steps) and ``palaestra inspect``
(its results grouped by taxonomy category and outcome): every line is made :func:`visible` (docs/harness.md)."""

from __future__ import annotations

import json
import math
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from palaestra.evals.runs import Rollout, RunView, load_run
from palaestra.evals.taxonomy import CATEGORIES, CATEGORY_MEANING, KNOWN_CATEGORIES, OK, UNMAPPED
from palaestra.trajectories.io import DataError, PathLike
from palaestra.trajectories.runs import fmt

_SIMPLE = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", '"': '\\"'}


def logprob_class(lp: float | None) -> str:
    """A display bucket of a token's logprob: ``sure`` (p >= 0.6), ``mid`` (p >= 0.2), ``low`` (below)."""
    if lp is None or not math.isfinite(lp):
        return "unknown"
    return "sure" if lp >= math.log(0.6) else ("mid" if lp >= math.log(0.2) else "low")


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


def group_by(rows: Iterable[Rollout], key: Callable[[Rollout], str]) -> dict[str, list[Rollout]]:
    """Rollouts grouped by ``key``, groups and rows in first-seen order."""
    out: dict[str, list[Rollout]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def inspect_run(run_dir: PathLike, *, only_fails: bool = False, top_k: int = 5, show: int = 2) -> str:
    """The text of ``palaestra inspect``: counts per category and per outcome (the ``top_k`` most frequent), then
    ``show`` examples of each; ``only_fails`` leaves accepted results out."""
    if top_k < 1 or show < 0:
        raise ValueError("top_k must be >= 1 and show >= 0")
    view = load_run(run_dir)
    results = view.rollouts()
    rows = [r for r in results if not r.correct or r.category != OK] if only_fails else results
    m, summary = view.manifest, view.summary
    head = f"run {view.root}  (loop {m.get('loop', '?')}, {m.get('command', '?')}"
    if m.get("scorer"):
        head += f", scorer {m['scorer'].get('name')}@{m['scorer'].get('version')}"
    lines = [head + f", {len(results)} results)"]
    numbers = [
        f"{k} {summary[k]:.4g}" for k in ("pass_rate", "mean_reward", "pass@1", "pass@N") if k in summary
    ]
    lines += ["  " + ", ".join(numbers)] if numbers else []
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
        cat_text = ", ".join(f"{c} {k}" for c, k in sorted(Counter(r.category or "-" for r in group).items()))
        lines.append(f"  {outcome:<17} {len(group):>6}  {100 * len(group) / n:5.1f}%  [{cat_text}]")
    if len(ranked) > top_k:
        rest = sum(len(g) for _, g in ranked[top_k:])
        lines.append(
            f"  ({len(ranked) - top_k} more outcome(s), {rest} result(s); raise --top-k to see them)"
        )
    if show > 0:
        per_category = [(c, by_cat[c]) for c in cats if by_cat.get(c)]
        titles = (f"outcome (first {show} in file order)", f"category (first {show})")
        for title, groups in zip(titles, (ranked[:top_k], per_category)):
            lines += ["", f"Examples per {title}:"]
            for name, group in groups:
                lines.append(f"  == {name} ({len(group)}) ==")
                lines += [line for r in group[:show] for line in _example_lines(r)]
    return "\n".join(lines) + "\n"


Order = Literal["file", "top", "bottom"]
VERDICTS = ("improved", "regressed", "changed", "same")


def parse_steps(text: str, view: RunView) -> list[int]:
    """``"3"``, ``"3,5"``, ``"2-6"``, ``"first"``, ``"last"`` -> steps of the run that have rollouts."""
    if not (have := view.steps()):
        raise DataError(
            f"this {view.kind} run has no steps (no per-step rollouts); drop --step", path=view.root
        )
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        part = {"first": str(have[0]), "last": str(have[-1])}.get(part, part)
        try:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise DataError(f"--step: {part!r} is not a step, a range a-b, 'first' or 'last'") from None
        if not (found := [s for s in have if first <= s <= last]):
            raise DataError(
                f"--step: no rollouts saved at step {part} (steps with rollouts: {_ranges(have)})"
            )
        out += found
    return sorted(set(out))


def _ranges(steps: Sequence[int]) -> str:
    if len(steps) <= 12:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:6]))}, ..., {', '.join(map(str, steps[-3:]))} ({len(steps)} steps)"


def select(
    rollouts: Sequence[Rollout],
    *,
    outcomes: Iterable[str] | None = None,
    categories: Iterable[str] | None = None,
    example_id: str | None = None,
    order: Order = "file",
    k: int | None = None,
) -> list[Rollout]:
    """Filter, then order (``file``; ``top`` = highest reward first; ``bottom`` = lowest first; ties keep
    file order) and keep the first ``k`` (all when None)."""
    if order not in get_args(Order):
        raise ValueError(f"order must be one of {get_args(Order)}, got {order!r}")
    outs = None if outcomes is None else set(outcomes)
    cats = None if categories is None else set(categories)
    for c in (cats or set()) - set(KNOWN_CATEGORIES):
        raise DataError(f"--category: unknown category {c!r} (one of {', '.join(KNOWN_CATEGORIES)})")
    rows = [
        r
        for r in rollouts
        if (outs is None or (r.outcome or "-") in outs)
        and (cats is None or (r.category or "-") in cats)
        and (example_id is None or r.example_id == example_id)
    ]
    if order != "file":
        rows.sort(key=lambda r: -r.reward if order == "top" else r.reward)
    return rows if k is None else rows[:k]


_ANSI = {"sure": "\033[32m", "mid": "\033[33m", "low": "\033[31m", "unknown": ""}
MAX_TOKENS_SHOWN = 160


def token_line(tokens: Sequence[dict[str, Any]], *, color: bool = False) -> str:
    """Sampled tokens as ``'tok' -0.12/H0.85`` (entropy when known), ANSI-coloured by probability when ``color``."""
    parts = []
    for tok in tokens[:MAX_TOKENS_SHOWN]:
        lp, h = tok.get("lp"), tok.get("h")
        lp = lp if isinstance(lp, (int, float)) else None
        item = visible(str(tok.get("t", "")), 40) + (f"{lp:+.2f}" if lp is not None else "?")
        if isinstance(h, (int, float)):
            item += f"/H{h:.2f}"
        parts.append(f"{_ANSI[logprob_class(lp)]}{item}\033[0m" if color else item)
    if len(tokens) > MAX_TOKENS_SHOWN:
        parts.append(f"...(+{len(tokens) - MAX_TOKENS_SHOWN} tokens)")
    return " ".join(parts)


def tool_call_lines(msg: Mapping[str, Any]) -> list[str]:
    """``-> tool call name(arguments)`` for each call of a message."""
    return [
        f"-> tool call {c.get('name')}({visible(str(c.get('arguments', '')), 400)})"
        for c in msg.get("tool_calls") or []
    ]


def _message_lines(msg: dict[str, Any], max_chars: int, color: bool = False) -> list[str]:
    role, text = str(msg.get("role", "?")), str(msg.get("content") or "")
    cut = ""
    if max_chars and len(text) > max_chars:
        text, cut = text[:max_chars], f"  ...(+{len(text) - max_chars} chars; --max-chars 0 shows all)"
    shown = visible_lines(role, text)
    label = role + (f" ({msg['name']})" if msg.get("name") else "")
    label += f" [{msg['tool_call_id']}]" if msg.get("tool_call_id") else ""
    label += f" <- {msg['tool_name']}" if msg.get("tool_name") else ""
    pad = f"  {'':<10}"
    out = [f"  {label:<10} | {shown[0]}"] + [f"{pad} | {s}" for s in shown[1:]]
    out[-1] += cut
    out += [f"{pad} {line}" for line in tool_call_lines(msg)]
    reward = msg.get("turn_reward")
    reward_text = f"turn reward {reward:+.4g}" if isinstance(reward, (int, float)) else ""
    if msg.get("tokens"):
        known = [t["lp"] for t in msg["tokens"] if isinstance(t.get("lp"), (int, float))]
        head = f"turn {msg.get('turn', '?')}: {len(msg['tokens'])} tokens"
        head += f", logprob sum {sum(known):+.3f}" if known else ""
        head += f", {reward_text}" if reward_text else ""
        out += [f"{pad} ~ {head}", f"{pad} ~ tokens {token_line(msg['tokens'], color=color)}"]
    elif reward_text:
        out.append(f"{pad} ~ {reward_text}")
    return out


def extra_text(r: Rollout, limit: int) -> list[str]:
    """``key value`` of the rollout's scalar extras (at most ``limit``)."""
    return [f"{k} {fmt(v)}" for k, v in r.extra.items() if not isinstance(v, (dict, list))][:limit]


def format_rollout(r: Rollout, *, max_chars: int = 2000, color: bool = False) -> str:
    """A rollout as readable text (header, reward line, messages with their tokens, notes and logs)."""
    where = [
        f"step {r.step}" if r.step is not None else None,
        r.source,
        f"id {r.example_id}" if r.example_id is not None else None,
        f"group {r.group} #{r.index}"
        if r.group is not None
        else (f"sample {r.index}" if r.index is not None else None),
    ]
    line = f"reward {fmt(r.reward)}"
    if r.outcome is not None:
        line += f"  outcome {r.outcome} ({r.category})"
    if r.advantage is not None:
        line += f"  advantage {r.advantage:+.4g}"
    if extra := extra_text(r, 10):
        line += "  [" + ", ".join(extra) + "]"
    out = ["== " + " | ".join(w for w in where if w) + " ==", line]
    out += [line for m in r.messages for line in _message_lines(m, max_chars, color)]
    if r.note:
        out.append(f"  note: {r.note}")
    out += [f"  log: {visible(entry, 300)[1:-1]}" for entry in r.logs[:20]]
    return "\n".join(out)


def json_lines(rows: Sequence[Rollout]) -> str:
    """Rollouts as JSON lines (``--json``), their fields in order with the example id as ``id``."""
    fields = ({("id" if k == "example_id" else k): v for k, v in vars(r).items()} for r in rows)
    return "".join(json.dumps(f, ensure_ascii=False, default=str) + "\n" for f in fields)


def _mean(rows: Sequence[Rollout]) -> float:
    return sum(r.reward for r in rows) / len(rows)


@dataclass
class DiffPair:
    """The rollouts of one prompt at steps A and B; verdict: mean reward up, down, equal (other text), same."""

    example_id: str | None
    prompt: str
    a: list[Rollout]
    b: list[Rollout]

    @property
    def verdict(self) -> str:
        if (b := _mean(self.b)) != (a := _mean(self.a)):
            return "improved" if b > a else "regressed"
        same = sorted(r.completion for r in self.a) == sorted(r.completion for r in self.b)
        return "same" if same else "changed"


def diff_steps(
    view: RunView, step_a: int, step_b: int, *, source: str | None = None
) -> tuple[str, list[DiffPair], int, int]:
    """Pairs of the same prompts at two steps: ``(source, pairs, only_in_a, only_in_b)``; pairs ordered by
    verdict (improved, regressed, changed, same) then step-B file order."""
    for s in (step_a, step_b):
        if s not in view.steps():
            raise DataError(
                f"--diff: no rollouts saved at step {s} (steps with rollouts: {_ranges(view.steps())})"
            )
    if source is None:
        both = (src for src in ("val", "train") if {(step_a, src), (step_b, src)} <= view.files.keys())
        if (source := next(both, None)) is None:
            raise DataError(
                f"--diff: steps {step_a} and {step_b} share no rollout source (train samples or val rows)"
            )
    by_a, by_b = (
        group_by(view.rollouts(steps=[s], sources=[source]), lambda r: r.key) for s in (step_a, step_b)
    )
    pairs = [DiffPair(rs[0].example_id, rs[0].prompt, by_a[k], rs) for k, rs in by_b.items() if k in by_a]
    pairs.sort(key=lambda p: VERDICTS.index(p.verdict))
    return source, pairs, len(set(by_a) - set(by_b)), len(set(by_b) - set(by_a))


def format_diff(
    view: RunView,
    step_a: int,
    step_b: int,
    *,
    source: str | None = None,
    outcomes: Iterable[str] | None = None,
    categories: Iterable[str] | None = None,
    limit: int = 20,
) -> str:
    """The text of ``palaestra show RUN --diff A B``."""
    src, pairs, only_a, only_b = diff_steps(view, step_a, step_b, source=source)
    counts = Counter(p.verdict for p in pairs)
    lines = [
        f"diff step {step_a} -> step {step_b} on {src} rollouts: {len(pairs)} prompt(s) in both "
        f"({only_a} only at step {step_a}, {only_b} only at step {step_b})",
        "  " + ", ".join(f"{v} {counts.get(v, 0)}" for v in VERDICTS),
    ]
    if outcomes is not None or categories is not None:
        every = [r for p in pairs for r in p.a + p.b]
        keep = {r.uid for r in select(every, outcomes=outcomes, categories=categories)}
        pairs = [p for p in pairs if any(r.uid in keep for r in p.a + p.b)]
        lines.append(f"  {len(pairs)} pair(s) with a rollout matching the filter on either side")
    shown = pairs if limit <= 0 else pairs[:limit]
    for p in shown:
        who = f"id {p.example_id}" if p.example_id is not None else "prompt"
        lines.append(f"== {who} | {p.verdict} | reward {fmt(_mean(p.a))} -> {fmt(_mean(p.b))} ==")
        if p.prompt:
            lines.append(f"  prompt   : {visible(p.prompt, 200)[1:-1]}")
        for label, rows in ((f"step {step_a}", p.a), (f"step {step_b}", p.b)):
            for i, r in enumerate(rows):
                adv = f" adv {r.advantage:+.3g}" if r.advantage is not None else ""
                lines.append(
                    f"  {label if i == 0 else '':<9}: {visible(r.completion, 200)}   "
                    f"reward {fmt(r.reward)} {r.outcome} ({r.category}){adv}"
                )
    if len(shown) < len(pairs):
        lines.append(f"({len(pairs) - len(shown)} more pair(s); --limit 0 shows all)")
    return "\n".join(lines) + "\n"


def show_text(
    view: RunView,
    *,
    steps: Sequence[int] | None = None,
    sources: Sequence[str] | None = None,
    outcomes: Sequence[str] | None = None,
    categories: Sequence[str] | None = None,
    example_id: str | None = None,
    order: Order = "file",
    k: int | None = None,
    limit: int = 20,
    max_chars: int = 2000,
    color: bool = False,
) -> str:
    """The text of ``palaestra show RUN`` (see the module docstring; ``color``: ANSI token colours)."""
    pool = view.rollouts(steps=steps, sources=sources)
    rows = select(pool, outcomes=outcomes, categories=categories, example_id=example_id, order=order, k=k)
    what = ["step " + _ranges(list(steps))] if steps is not None else []
    what += [
        f"{name} {'/'.join(vals)}"
        for name, vals in (("source", sources), ("outcome", outcomes), ("category", categories))
        if vals
    ]
    what += [f"id {example_id}"] if example_id is not None else []
    what += [f"{order} {k if k is not None else 'all'} by reward"] if order != "file" else []
    head = f"run {view.root} ({view.kind}"
    if view.kind == "train":
        stop = view.stop
        head += f", {view.history[-1]['step'] if view.history else 0} step(s)"
        head += (
            f"; stop: {stop.get('reason')} at step {stop.get('step')}" if stop else "; no summary.json yet"
        )
    elif "pass_rate" in view.summary:
        head += f", pass_rate {view.summary['pass_rate']:.4g}"
    by_src = Counter(r.source for r in pool)
    lines = [
        head + ")",
        f"selection: {'; '.join(what) or 'everything'} -> {len(rows)} of {len(pool)} rollout(s) "
        f"({', '.join(f'{s} {n}' for s, n in by_src.items()) or 'none saved'})",
    ]
    if not rows and pool:
        present = Counter(r.outcome or "-" for r in pool).most_common(8)
        lines.append("  outcomes present: " + ", ".join(f"{o} {n}" for o, n in present))
    shown = rows if limit <= 0 else rows[:limit]
    for r in shown:
        lines += ["", format_rollout(r, max_chars=max_chars, color=color)]
    if len(shown) < len(rows):
        lines += ["", f"({len(rows) - len(shown)} more; --limit 0 shows all)"]
    return "\n".join(lines) + "\n"
