"""Scripts for the :class:`~palaestra.trajectories.scripted_server.ScriptedServer` that answer judge requests
well or badly, on purpose: one *kind* per failure mode a group judge must survive (docs/judges.md)."""

from __future__ import annotations

import functools
import json
import math
import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from palaestra.judges.base import content_json
from palaestra.judges.prompt import parse_request
from palaestra.trajectories.io import sha256_text
from palaestra.trajectories.scripted_server import Reply, completion_body
from palaestra.trajectories.seeds import derive_seed

ScoreFn = Callable[[list[dict[str, Any]]], float]
Script = Callable[[dict[str, Any], int], Reply]

Entries = list[dict[str, Any]]


def _with_first(entries: Entries, **changes: Any) -> Entries:
    return [{**entries[0], **changes}, *entries[1:]]


def _scores(entries: Entries) -> str:
    return json.dumps({"scores": entries})  # NaN is written as the bare token NaN, as some endpoints do


DEEP = 100_000  # nesting depth of the deep_json / deep_body replies (past any JSON decoder's recursion limit)
_NUMBER_5000 = "3" * 5000  # more digits than Python's int() accepts from text
_PROSE = "Here is my assessment of the candidates.\n{}\nLet me know if you need more detail."

#: Replies a judge can use as they are (after tolerant extraction / matching by id): kind -> reply text.
_USABLE: dict[str, Callable[[Entries], str]] = {
    "good": _scores,
    "reordered": lambda e: _scores(e[::-1]),
    "code_fenced": lambda e: f"```json\n{_scores(e)}\n```",
    "prose_wrapped": lambda e: _PROSE.format(_scores(e)),
    "slow": _scores,  # sent after ``delay`` seconds
}
#: Replies whose content must be retried: kind -> (the fault a judge records, the reply text).
_INVALID: dict[str, tuple[str, Callable[[Entries], str]]] = {
    "missing_id": ("missing_ids", lambda e: _scores(e[:-1])),
    "duplicate_id": ("duplicate_ids", lambda e: _scores([*e, {**e[0], "score": 1.0 - e[0]["score"]}])),
    "unknown_id": ("unknown_ids", lambda e: _scores(_with_first(e, id="zz" + e[0]["id"]))),
    "out_of_range": ("out_of_range", lambda e: _scores(_with_first(e, score=7.5))),
    "negative": ("out_of_range", lambda e: _scores(_with_first(e, score=-0.25))),
    "nan": ("non_finite", lambda e: _scores(_with_first(e, score=float("nan")))),
    "non_json": ("not_json", lambda e: "Candidate one looks best to me, the others less so."),
    "empty": ("empty", lambda e: ""),
    "schema": ("schema", lambda e: json.dumps({"results": e})),
    "string_score": ("schema", lambda e: _scores(_with_first(e, score=str(e[0]["score"])))),
    "inf": ("non_finite", lambda e: _scores(_with_first(e, score=float("inf")))),
    "huge_score": ("out_of_range", lambda e: _scores(_with_first(e, score=10**400))),
    "long_number": (
        "not_json",
        lambda e: _scores(_with_first(e, score=0)).replace('"score": 0}', f'"score": {_NUMBER_5000}}}', 1),
    ),
    "deep_json": (
        "not_json",
        lambda e: '{"scores": [{"id": "x", "score": 0.5, "explanation": ' + "[" * DEEP + "]" * DEEP + "}]}",
    ),
}
#: Well-formed HTTP 200s whose envelope is broken (re-sent unchanged, no correction): kind -> (the fault, how the
#: good completion body is broken); ``deep_body`` is a body nested too deeply (no completion body at all).
_BAD_USAGE: dict[str, Any] = {"prompt_tokens": "many", "completion_tokens": [], "total_tokens": None}
_NAN_USAGE = {"prompt_tokens": math.nan, "completion_tokens": math.inf, "total_tokens": 1}
_ENVELOPE: dict[str, tuple[str, Callable[[dict[str, Any], str], object]]] = {
    "content_parts": (
        "bad_content",
        lambda b, text: b["choices"][0]["message"].update(content=[{"type": "text", "text": text}]),
    ),
    "bad_choices": ("bad_envelope", lambda b, _: b.update(choices="many")),
    "no_choices": ("bad_envelope", lambda b, _: b.pop("choices")),
    "missing_message": ("bad_envelope", lambda b, _: b["choices"][0].pop("message")),
    "bad_usage": ("bad_envelope", lambda b, _: b.update(usage=_BAD_USAGE)),
    "nan_usage": ("bad_envelope", lambda b, _: b.update(usage=_NAN_USAGE)),
    "deep_body": ("bad_response", lambda b, _: None),  # no completion body at all (see reply_for)
}
USABLE_KINDS = tuple(_USABLE)
INVALID_KINDS = tuple(_INVALID)
ENVELOPE_KINDS = tuple(_ENVELOPE)
HTTP_KINDS = ("rate_limit", "server_error")
FAULT_KINDS = USABLE_KINDS + INVALID_KINDS + ENVELOPE_KINDS + HTTP_KINDS
#: The fault a judge records for each invalid, envelope or HTTP kind (``judge_fault_<fault>``); "slow" records
#: "timeout" only when the delay exceeds the judge's timeout.
EXPECTED_FAULT = {
    **{kind: fault for kind, (fault, _) in (_INVALID | _ENVELOPE).items()},
    **{kind: kind for kind in HTTP_KINDS},
    "slow": "timeout",
}
_CHAOS_INVALID = ("missing_id", "duplicate_id", "unknown_id", "out_of_range", "nan", "non_json")
CHAOS_KINDS = ("reordered", "code_fenced", *_CHAOS_INVALID, *HTTP_KINDS)


def _check_kinds(kinds: Sequence[str]) -> None:
    for k in kinds:
        if k not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {k!r}; known: {', '.join(FAULT_KINDS)}")


def content_score(messages: list[dict[str, Any]]) -> float:
    """A deterministic score in [0.05, 0.95] from a candidate's content (its messages as canonical JSON)."""
    return 0.05 + 0.9 * (int(sha256_text(content_json(messages))[:8], 16) / 0xFFFFFFFF)


def good_scores(request: dict[str, Any], score_fn: ScoreFn | None = None) -> list[dict[str, Any]]:
    """Correct score entries for every candidate of ``request``, in presentation order."""
    fn = score_fn or content_score
    return [
        {"id": cid, "explanation": f"scripted score for {cid}", "score": round(fn(rest), 6)}
        for cid, rest, _ in parse_request(request).candidates
    ]


def reply_for(
    kind: str,
    request: dict[str, Any],
    *,
    score_fn: ScoreFn | None = None,
    retry_after: float = 0.01,
    delay: float = 1.0,
) -> Reply:
    """The reply of ``kind`` (one of :data:`FAULT_KINDS`) to ``request``."""
    if kind == "rate_limit":
        return Reply("rate limited (scripted)", status=429, headers={"Retry-After": str(retry_after)})
    if kind == "server_error":
        return Reply("internal error (scripted)", status=500)
    if kind == "deep_body":
        return Reply(raw_body='{"id": "x", "choices": ' + "[" * DEEP + "]" * DEEP + "}")
    entries = good_scores(request, score_fn)
    if kind in _USABLE:
        return Reply(_USABLE[kind](entries), delay=delay if kind == "slow" else 0.0)
    if kind in _INVALID:
        return Reply(_INVALID[kind][1](entries))
    _check_kinds([kind])
    body = completion_body(request, Reply(_scores(entries)))
    _ENVELOPE[kind][1](body, _scores(entries))
    return Reply(raw_body=json.dumps(body))


def fault_script(
    *kinds: str,
    then: str = "good",
    score_fn: ScoreFn | None = None,
    retry_after: float = 0.01,
    delay: float = 1.0,
) -> Script:
    """Request ``n`` gets ``kinds[n]``; every later request gets ``then`` (the options: :func:`reply_for`'s)."""
    _check_kinds((*kinds, then))
    reply = functools.partial(reply_for, score_fn=score_fn, retry_after=retry_after, delay=delay)
    return lambda request, n: reply(kinds[n] if n < len(kinds) else then, request)


def reject_response_format(script: Script, types: Sequence[str] = ("json_schema",)) -> Script:
    """Wrap ``script``: a request asking for a ``response_format`` of one of ``types`` gets HTTP 400."""

    def wrapped(request: dict[str, Any], n: int) -> Reply:
        fmt = request.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in types:
            message = f"response_format type {fmt.get('type')!r} is not supported by this model"
            return Reply(message, status=400)
        return script(request, n)

    return wrapped


def chaos_script(
    fault_rate: float,
    *,
    seed: int = 0,
    kinds: Sequence[str] = CHAOS_KINDS,
    score_fn: ScoreFn | None = None,
    retry_after: float = 0.01,
    delay: float = 1.0,
) -> Script:
    """Good replies, except that each request is a fault with probability ``fault_rate``, drawn from the seed, the
    request body and how often that body was seen (docs/judges.md); ``script.counts`` counts the kinds served."""
    if not 0.0 <= fault_rate <= 1.0:
        raise ValueError("fault_rate must be in [0, 1]")
    _check_kinds(kinds)
    reply = functools.partial(reply_for, score_fn=score_fn, retry_after=retry_after, delay=delay)
    seen: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def script(request: dict[str, Any], n: int) -> Reply:
        body_key = sha256_text(content_json(request.get("messages", [])))
        with lock:
            seen[body_key] += 1
            rng = random.Random(derive_seed(seed, body_key, seen[body_key]))
            kind = rng.choice(list(kinds)) if rng.random() < fault_rate else "good"
            counts[kind] += 1
        return reply(kind, request)

    script.counts = counts  # type: ignore[attr-defined]
    return script
