"""Scripts for the :class:`~palaestra.trajectories.scripted_server.ScriptedServer` that answer judge requests
well or badly, on purpose.

Every failure mode a group judge must survive has a *kind* (:data:`FAULT_KINDS`); :func:`reply_for` builds
that reply for a given request, :func:`fault_script` plays a fixed sequence of kinds and then good replies,
and :func:`chaos_script` mixes faults into good replies at a seeded rate (for chaos runs). Good scores come
from ``score_fn(messages)`` (default :func:`content_score`, a deterministic pseudo-score of the candidate's
content), so a test can tell which trajectory received which score whatever ids and order the judge used.
"""

from __future__ import annotations

import json
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

#: Replies a judge can use as they are (after tolerant extraction / matching by id).
USABLE_KINDS = ("good", "reordered", "code_fenced", "prose_wrapped", "slow")
#: Replies that must be retried (invalid content or a failed HTTP call).
INVALID_KINDS = (
    "missing_id",
    "duplicate_id",
    "unknown_id",
    "out_of_range",
    "negative",
    "nan",
    "non_json",
    "empty",
    "schema",
    "string_score",
    "inf",
    "huge_score",
    "long_number",
    "deep_json",
)
#: Well-formed HTTP 200s whose envelope is broken (re-sent unchanged, no correction): content as a list of
#: parts, ``choices``/``usage``/``message`` of the wrong type or missing, a body nested too deeply to decode.
ENVELOPE_KINDS = (
    "content_parts",
    "bad_choices",
    "no_choices",
    "missing_message",
    "bad_usage",
    "nan_usage",
    "deep_body",
)
HTTP_KINDS = ("rate_limit", "server_error")
FAULT_KINDS = USABLE_KINDS + INVALID_KINDS + ENVELOPE_KINDS + HTTP_KINDS
DEEP = 100_000  # nesting depth of the deep_json / deep_body replies (past any JSON decoder's recursion limit)
#: The fault a judge records for each invalid or HTTP kind (``judge_fault_<fault>``); "slow" records
#: "timeout" only when the delay exceeds the judge's timeout.
EXPECTED_FAULT = {
    "missing_id": "missing_ids",
    "duplicate_id": "duplicate_ids",
    "unknown_id": "unknown_ids",
    "out_of_range": "out_of_range",
    "negative": "out_of_range",
    "nan": "non_finite",
    "non_json": "not_json",
    "empty": "empty",
    "schema": "schema",
    "string_score": "schema",
    "inf": "non_finite",
    "huge_score": "out_of_range",
    "long_number": "not_json",
    "deep_json": "not_json",
    "content_parts": "bad_content",
    "bad_choices": "bad_envelope",
    "no_choices": "bad_envelope",
    "missing_message": "bad_envelope",
    "bad_usage": "bad_envelope",
    "nan_usage": "bad_envelope",
    "deep_body": "bad_response",
    "rate_limit": "rate_limit",
    "server_error": "server_error",
    "slow": "timeout",
}
CHAOS_KINDS = (
    "reordered",
    "code_fenced",
    "missing_id",
    "duplicate_id",
    "unknown_id",
    "out_of_range",
    "nan",
    "non_json",
    "rate_limit",
    "server_error",
)


_BAD_FIRST_SCORE: dict[str, Any] = {
    "out_of_range": 7.5,
    "negative": -0.25,
    "nan": float("nan"),
    "inf": float("inf"),
    "huge_score": 10**400,
}


def content_score(messages: list[dict[str, Any]]) -> float:
    """A deterministic score in [0.05, 0.95] from a candidate's content (its messages as canonical JSON)."""
    return 0.05 + 0.9 * (int(sha256_text(content_json(messages))[:8], 16) / 0xFFFFFFFF)


def good_scores(request: dict[str, Any], score_fn: ScoreFn | None = None) -> list[dict[str, Any]]:
    """Correct score entries for every candidate of ``request``, in presentation order."""
    fn = score_fn or content_score
    parsed = parse_request(request)
    return [
        {"id": cid, "explanation": f"scripted score for {cid}", "score": round(fn(rest), 6)}
        for cid, rest, _ in parsed.candidates
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
    entries = good_scores(request, score_fn)
    if kind in ENVELOPE_KINDS:
        return _envelope_reply(kind, request, json.dumps({"scores": entries}))
    body: Any = {"scores": entries}
    if kind in ("good", "slow"):
        pass
    elif kind == "reordered":
        body = {"scores": entries[::-1]}
    elif kind == "missing_id":
        body = {"scores": entries[:-1]}
    elif kind == "duplicate_id":
        body = {"scores": [*entries, {**entries[0], "score": 1.0 - entries[0]["score"]}]}
    elif kind == "unknown_id":
        body = {"scores": [{**entries[0], "id": "zz" + entries[0]["id"]}, *entries[1:]]}
    elif kind in _BAD_FIRST_SCORE:  # the first candidate's score replaced by an unusable number
        body = {"scores": [{**entries[0], "score": _BAD_FIRST_SCORE[kind]}, *entries[1:]]}
    elif kind == "long_number":  # more digits than Python's int() accepts from text
        text = json.dumps({"scores": [{**entries[0], "score": 0}, *entries[1:]]})
        return Reply(text.replace('"score": 0}', '"score": ' + "3" * 5000 + "}", 1))
    elif kind == "deep_json":
        return Reply(
            '{"scores": [{"id": "x", "score": 0.5, "explanation": ' + "[" * DEEP + "]" * DEEP + "}]}"
        )
    elif kind == "schema":
        body = {"results": entries}
    elif kind == "string_score":
        body = {"scores": [{**entries[0], "score": str(entries[0]["score"])}, *entries[1:]]}
    elif kind == "non_json":
        return Reply("Candidate one looks best to me, the others less so.")
    elif kind == "empty":
        return Reply("")
    elif kind not in ("code_fenced", "prose_wrapped"):
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    text = json.dumps(body)  # NaN is written as the bare token NaN, as some endpoints do
    if kind == "code_fenced":
        text = f"```json\n{text}\n```"
    elif kind == "prose_wrapped":
        text = f"Here is my assessment of the candidates.\n{text}\nLet me know if you need more detail."
    return Reply(text, delay=delay if kind == "slow" else 0.0)


def _envelope_reply(kind: str, request: dict[str, Any], good_text: str) -> Reply:
    """A 200 whose JSON body breaks the chat-completion envelope in the way ``kind`` names."""
    if kind == "deep_body":
        return Reply(raw_body='{"id": "x", "choices": ' + "[" * DEEP + "]" * DEEP + "}")
    body = completion_body(request, Reply(good_text))
    if kind == "content_parts":
        body["choices"][0]["message"]["content"] = [{"type": "text", "text": good_text}]
    elif kind == "bad_choices":
        body["choices"] = "many"
    elif kind == "no_choices":
        del body["choices"]
    elif kind == "missing_message":
        del body["choices"][0]["message"]
    elif kind == "bad_usage":
        body["usage"] = {"prompt_tokens": "many", "completion_tokens": [], "total_tokens": None}
    elif kind == "nan_usage":
        body["usage"] = {"prompt_tokens": float("nan"), "completion_tokens": float("inf"), "total_tokens": 1}
    return Reply(raw_body=json.dumps(body))


def fault_script(
    *kinds: str,
    then: str = "good",
    score_fn: ScoreFn | None = None,
    retry_after: float = 0.01,
    delay: float = 1.0,
) -> Script:
    """Request ``n`` gets ``kinds[n]``; every later request gets ``then``."""
    for k in (*kinds, then):
        if k not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {k!r}; known: {', '.join(FAULT_KINDS)}")

    def script(request: dict[str, Any], n: int) -> Reply:
        kind = kinds[n] if n < len(kinds) else then
        return reply_for(kind, request, score_fn=score_fn, retry_after=retry_after, delay=delay)

    return script


def reject_response_format(script: Script, types: Sequence[str] = ("json_schema",)) -> Script:
    """Wrap ``script``: a request asking for a ``response_format`` of one of ``types`` gets HTTP 400."""

    def wrapped(request: dict[str, Any], n: int) -> Reply:
        fmt = request.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in types:
            return Reply(
                f"response_format type {fmt.get('type')!r} is not supported by this model", status=400
            )
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
    """Good replies, except that each request is a fault with probability ``fault_rate``.

    The draw depends on the seed, the request body and how many times that exact body was seen before, so a
    run is reproducible even when requests arrive in a different order, and a retried request draws afresh.
    ``script.counts`` (a Counter) records the kinds served.
    """
    if not 0.0 <= fault_rate <= 1.0:
        raise ValueError("fault_rate must be in [0, 1]")
    for k in kinds:
        if k not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {k!r}; known: {', '.join(FAULT_KINDS)}")
    seen: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def script(request: dict[str, Any], n: int) -> Reply:
        body_key = sha256_text(content_json(request.get("messages", [])))
        with lock:
            seen[body_key] += 1
            occurrence = seen[body_key]
        rng = random.Random(derive_seed(seed, body_key, occurrence))
        kind = rng.choice(list(kinds)) if rng.random() < fault_rate else "good"
        with lock:
            counts[kind] += 1
        return reply_for(kind, request, score_fn=score_fn, retry_after=retry_after, delay=delay)

    script.counts = counts  # type: ignore[attr-defined]
    return script
