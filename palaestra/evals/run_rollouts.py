"""Readers of rollout files into :class:`Rollout`, the one shape ``palaestra show`` and the report use.

* train samples (``samples/step_N.jsonl``, trajectory groups): :func:`train_rollouts`;
* greedy validation rows (``val/step_N.jsonl``: ``id``, ``greedy_completion``, ``greedy_outcome``,
  ``greedy_reward``; ``completion``/``outcome``/``reward`` are read too): :func:`val_rollouts`;
* eval/select ``results.jsonl`` rows: :func:`result_rollouts`;
* lab JSONL rows that carry a ``reward``: :func:`lab_rollouts`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from palaestra.evals.taxonomy import category_of
from palaestra.evals.tokens import trajectory_token_info
from palaestra.trajectories.io import DataError, iter_jsonl, read_groups

__all__ = ["Rollout", "lab_rollouts", "num", "result_rollouts", "train_rollouts", "val_rollouts"]

_SKIP_METRICS = ("outcome/",)


@dataclass
class Rollout:
    """One rollout in the uniform view (a sampled trajectory, a validation row or an eval result row).

    ``messages`` are plain dicts ``{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}`` with
    ``tool_calls`` as ``[{"name", "arguments"}]`` (a sampled turn also has ``tokens``, ``turn`` and maybe
    ``turn_reward``, a tool result ``tool_name``: :mod:`palaestra.evals.tokens`); ``key`` pairs the same
    prompt across steps (the example id, else the prompt text); ``note`` says what is missing (e.g. a
    truncated completion preview).
    """

    uid: str
    step: int | None
    source: str
    example_id: str | None
    reward: float
    outcome: str | None
    category: str | None
    advantage: float | None = None
    group: int | None = None
    index: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    logs: list[str] = field(default_factory=list)

    def _last(self, role: str) -> str:
        return next(
            (str(m.get("content") or "") for m in reversed(self.messages) if m.get("role") == role), ""
        )

    @property
    def completion(self) -> str:
        """Content of the last assistant message ("" when there is none)."""
        return self._last("assistant")

    @property
    def prompt(self) -> str:
        """Content of the last user message ("" when there is none)."""
        return self._last("user")

    @property
    def key(self) -> str:
        """What identifies the prompt across steps: ``id:<example id>`` or ``prompt:<text>``."""
        return f"id:{self.example_id}" if self.example_id is not None else f"prompt:{self.prompt}"

    @property
    def correct(self) -> bool:
        return self.reward > 0.0


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    out: dict[str, Any] = {
        "role": str(m.get("role", "?")),
        "content": "" if content is None else str(content),
    }
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function", tc) if isinstance(tc, Mapping) else {}
        calls.append({"name": str(fn.get("name", "?")), "arguments": str(fn.get("arguments", ""))})
    if calls:
        out["tool_calls"] = calls
    for k in ("tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = str(m[k])
    return out


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def train_rollouts(path: Path, step: int | None) -> list[Rollout]:
    out = []
    for g_i, group in enumerate(read_groups(path)):
        gmeta = group.metadata
        g_idx = gmeta.get("group_index")
        g_num = g_idx if isinstance(g_idx, int) and not isinstance(g_idx, bool) else g_i
        for t_i, t in enumerate(group.trajectories):
            meta = dict(t.metadata)
            outcome = meta.pop("outcome", None)
            ex_id = meta.pop("example_id", None) or gmeta.get("example_id") or gmeta.get("id")
            choices = t.choices()
            extra: dict[str, Any] = {}
            if choices and choices[-1].finish_reason:
                extra["finish_reason"] = choices[-1].finish_reason
            if t.policy_version is not None:
                extra["policy_version"] = t.policy_version
            extra.update(
                {k: v for k, v in t.metrics.items() if k != "advantage" and not k.startswith(_SKIP_METRICS)}
            )
            extra.update({k: v for k, v in meta.items() if k != "score_details"})
            out.append(
                Rollout(
                    uid=f"s{step}/g{g_num}/{t_i}",
                    step=step,
                    source="train",
                    example_id=None if ex_id is None else str(ex_id),
                    reward=float(t.reward),
                    outcome=None if outcome is None else str(outcome),
                    category=None if outcome is None else category_of(str(outcome)),
                    advantage=num(t.metrics.get("advantage")),
                    messages=[{**_message(m), **x} for m, x in zip(t.messages(), trajectory_token_info(t))],
                    group=g_num,
                    index=t_i,
                    extra=extra,
                    logs=list(t.logs),
                    note=_details_note(meta.get("score_details")),
                )
            )
    return out


def _details_note(details: Any) -> str | None:
    """``why: <reason> (expected .., parsed ..)`` from the verifier details JSON kept in metadata."""
    if not details:
        return None
    try:
        d = json.loads(str(details))
    except ValueError:
        return f"verifier details: {details}"
    if not isinstance(d, dict):
        return f"verifier details: {details}"
    rest = ", ".join(f"{k} {json.dumps(v)}" for k, v in d.items() if k != "reason")
    return (f"why: {d['reason']}" if d.get("reason") else "verifier details") + (f" ({rest})" if rest else "")


def _first(row: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if n in row:
            return row[n]
    return None


def _exchange(prompts: Mapping[str, str], ex_id: str | None, completion: str) -> list[dict[str, Any]]:
    """The user prompt (when known by id) and the assistant's completion as messages."""
    msgs = [{"role": "user", "content": prompts[ex_id]}] if ex_id is not None and ex_id in prompts else []
    return [*msgs, {"role": "assistant", "content": completion}]


_VAL_FIELDS = (
    "id",
    "reward",
    "greedy_reward",
    "outcome",
    "greedy_outcome",
    "completion",
    "greedy_completion",
)


def val_rollouts(
    path: Path, step: int | None, prompts: Mapping[str, str], limit: int | None = None
) -> list[Rollout]:
    out: list[Rollout] = []
    for line, row in islice(iter_jsonl(path), limit):
        reward = num(_first(row, "reward", "greedy_reward"))
        if not isinstance(row, dict) or reward is None:
            raise DataError(
                "validation row lacks a numeric 'reward' (or 'greedy_reward')", path=path, line=line
            )
        ex_id = None if row.get("id") is None else str(row["id"])
        outcome = _first(row, "outcome", "greedy_outcome")
        completion = _first(row, "completion", "greedy_completion")
        msgs = _exchange(prompts, ex_id, "" if completion is None else str(completion))
        extra = {k: v for k, v in row.items() if k not in _VAL_FIELDS}
        out.append(
            Rollout(
                uid=f"v{step}/{line}",
                step=step,
                source="val",
                example_id=ex_id,
                reward=reward,
                outcome=None if outcome is None else str(outcome),
                category=None if outcome is None else category_of(str(outcome)),
                messages=msgs,
                extra=extra,
                note=None if len(msgs) == 2 else "prompt not found (not stored in val rows)",
            )
        )
    return out


def result_rollouts(
    path: Path, source: str, prompts: Mapping[str, str], limit: int | None = None
) -> list[Rollout]:
    out: list[Rollout] = []
    for line, row in islice(iter_jsonl(path), limit):
        if not isinstance(row, dict):
            raise DataError("expected a JSON object", path=path, line=line)
        for key in ("id", "reward", "outcome"):
            if key not in row:
                raise DataError(f"result row lacks field {key!r}", path=path, line=line)
        ex_id, outcome = str(row["id"]), str(row["outcome"])
        text = str(_first(row, "completion", "completion_preview") or "")
        msgs = _exchange(prompts, ex_id, text)
        notes = []
        full = row.get("completion_chars")
        if isinstance(full, int) and full > len(text):
            notes.append(f"completion preview: first {len(text)} of {full} characters")
        details = row.get("details")
        if isinstance(details, Mapping) and details.get("reason"):
            notes.append(f"why: {details['reason']}")
        extra: dict[str, Any] = {}
        for k in ("suspect", "table_category", "selector_reward", "n_correct", "n_samples", "sum_logprob"):
            if row.get(k) is not None:
                extra[k] = row[k]
        cc = row.get("cross_check")
        if isinstance(cc, Mapping):
            extra["cross_check"] = f"strict {cc.get('strict')}, lenient {cc.get('lenient')}"
        sample = _first(row, "chosen_sample", "sample")
        category = row.get("category")
        out.append(
            Rollout(
                uid=f"r{line}",
                step=None,
                source=source,
                example_id=ex_id,
                reward=float(row["reward"]),
                outcome=outcome,
                category=category if isinstance(category, str) else category_of(outcome),
                messages=msgs,
                index=sample if isinstance(sample, int) else None,
                extra=extra,
                note="; ".join(notes) or None,
            )
        )
    return out


def lab_rollouts(path: Path) -> list[Rollout]:
    out = []
    for line, row in iter_jsonl(path):
        if not isinstance(row, dict) or num(row.get("reward")) is None:
            continue
        step = row.get("step")
        extra = {k: v for k, v in row.items() if k not in ("step", "reward", "advantage", "outcome")}
        outcome = row.get("outcome")
        out.append(
            Rollout(
                uid=f"l{path.stem}/{line}",
                step=step if isinstance(step, int) else None,
                source="lab",
                example_id=None,
                reward=float(row["reward"]),
                outcome=None if outcome is None else str(outcome),
                category=None if outcome is None else category_of(str(outcome)),
                advantage=num(row.get("advantage")),
                extra=extra,
            )
        )
    return out
