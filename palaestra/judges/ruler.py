"""RULER-style group judge over any OpenAI-compatible endpoint (the real ``openai`` client): one request per
group, scores matched by id and validated strictly, faults retried, a failing group left unscored (never 0)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from palaestra.judges.base import (
    Candidate,
    GroupJudge,
    GroupStats,
    JudgeConfigError,
    JudgeError,
    common_prefix,
    content_json,
    log,
)
from palaestra.judges.prompt import (
    CORRECTION_TEMPLATE,
    DEFAULT_RUBRIC,
    PROMPT_VERSION,
    ReplyError,
    Verdict,
    build_messages,
    parse_reply,
    response_format,
    rubric_hash,
)
from palaestra.trajectories.runs import register_secret, scrub_text, url_secrets
from palaestra.trajectories.types import TrajectoryGroup, field_of

if TYPE_CHECKING:
    import openai

FORMAT_MODES = ("json_schema", "json_object", "none")


class TransientError(Exception):
    """A failed call worth retrying (429, 5xx, timeout, connection)."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after


def _retry_after(exc: Any) -> float | None:
    headers: Any = getattr(getattr(exc, "response", None), "headers", None) or {}
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            value = float(headers.get(name)) * scale
        except (TypeError, ValueError):  # absent, or not a number of seconds
            continue
        if value >= 0:
            return value
    return None


class RulerJudge(GroupJudge):
    """Scores a group relatively with one LLM call (docs/judges.md). The key falls back to ``$api_key_env`` (a
    loopback ``base_url`` needs none; a missing one raises :class:`JudgeConfigError` now); ``timeout`` bounds a
    whole call; ``client``: an ``openai.AsyncOpenAI`` whose own retries are turned off (ours apply)."""

    kind = "ruler"

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        rubric: str = DEFAULT_RUBRIC,
        *,
        temperature: float = 0.0,
        max_retries: int = 3,
        timeout: float = 60.0,
        client: openai.AsyncOpenAI | None = None,
        backoff: float = 0.5,
        max_backoff: float = 20.0,
        max_retry_after: float = 60.0,
        **options: Any,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if not rubric.strip():
            raise ValueError("rubric must not be empty")
        self.base_url, self.rubric, self.temperature = base_url, rubric, temperature
        self._api_key, self._api_key_env, self._user_client = api_key, api_key_env, client
        for secret in url_secrets(base_url):
            register_secret(secret)  # a key inside the URL is never recorded either
        super().__init__(
            model=model, rubric_hash=rubric_hash(rubric), prompt_version=PROMPT_VERSION, **options
        )
        try:
            if client is None:
                self._resolve_key()  # fail fast on a missing key
        except JudgeConfigError:
            if self._owns_cache:
                self.cache.close()  # opened from a path just now: not left open
            raise
        self.max_retries, self.timeout = max_retries, timeout
        self.backoff, self.max_backoff, self.max_retry_after = backoff, max_backoff, max_retry_after
        self.format_mode = "json_schema"
        self._client: openai.AsyncOpenAI | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def info(self) -> dict[str, Any]:
        return dict(
            super().info(),
            temperature=self.temperature,
            base_url=self.base_url and scrub_text(self.base_url),  # no key in the URL
            max_retries=self.max_retries,
            timeout=self.timeout,
            max_group_seconds=self.max_group_seconds,
            response_format=self.format_mode,
            api_key_env=self._api_key_env,
        )

    async def aclose(self) -> None:
        """Close the HTTP client this judge opened (not one passed in) and a cache it opened from a path."""
        client, self._client, self._client_loop = self._client, None, None
        try:
            if client is not None and self._user_client is None:
                await client.close()
        finally:
            await super().aclose()

    def _get_client(self) -> openai.AsyncOpenAI:
        """The client: the one passed in (our retries apply), else one of ours bound to the running loop."""
        if self._user_client is not None:
            if self._client is None:
                self._client = self._user_client.with_options(max_retries=0, timeout=self.timeout)
        elif self._client is None or self._client_loop is not asyncio.get_running_loop():
            import openai

            key = self._resolve_key()
            self._client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=key, max_retries=0, timeout=self.timeout
            )
            self._client_loop = asyncio.get_running_loop()
        return self._client

    def _resolve_key(self) -> str:
        if key := self._api_key or os.environ.get(self._api_key_env):
            register_secret(key)  # never recorded in a manifest, report or command line
            return key
        if urlparse(self.base_url or "").hostname in ("127.0.0.1", "localhost", "::1"):  # a local server
            return "local"
        raise JudgeConfigError(
            f"no API key for judge {self.model!r}: pass api_key= or set ${self._api_key_env}"
        )

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if (retry_after := getattr(exc, "retry_after", None)) is not None:
            return float(min(retry_after, self.max_retry_after))
        return float(min(self.backoff * 2 ** (state.attempt_number - 1), self.max_backoff))

    async def _call(self, conversation: list[dict[str, Any]], stats: GroupStats) -> str | None:
        """One request (plus re-sends while falling back from an unsupported response_format); every way it can
        fail raises a counted :class:`TransientError` (retried) or :class:`JudgeConfigError`."""
        client = self._get_client()
        while True:
            kwargs: dict[str, Any] = {"model": self.model, "messages": conversation}
            if (fmt := response_format(self.format_mode)) is not None:
                kwargs["response_format"] = fmt
            chars, tokens = len(content_json(conversation)), (0, 0)
            start = time.perf_counter()
            try:
                create = client.chat.completions.create(temperature=self.temperature, **kwargs)
                resp = await asyncio.wait_for(create, self.timeout)
                text = _content(resp)
                tokens = _usage(getattr(resp, "usage", None))
                return text
            except Exception as exc:  # a cancellation (a deadline, the caller) propagates as it is
                if (error := self._failure(exc, stats)) is not None:
                    raise error from None  # else: the next response_format
            finally:
                stats.record_call(latency=time.perf_counter() - start, tokens=tokens, prompt_chars=chars)

    def _failure(self, exc: Exception, stats: GroupStats) -> Exception | None:
        """What a failed call raises: a counted :class:`TransientError` (retried) or a
        :class:`JudgeConfigError`; None after switching to the next ``response_format`` the endpoint refused."""
        import openai

        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        if isinstance(exc, TransientError):  # a 200 whose envelope cannot be used (_content, _usage)
            kind = exc.kind
        elif isinstance(exc, (openai.APITimeoutError, asyncio.TimeoutError)):
            kind = "timeout"
        elif isinstance(exc, openai.APIConnectionError):
            kind = "connection"
        elif status is None:  # a 200 whose body is not JSON, nested too deeply...
            kind = "bad_response"
        elif status == 429 or status >= 500 or status in (408, 409):
            kind = "rate_limit" if status == 429 else "server_error"
        else:
            message = self._scrub(str(exc))  # an endpoint may quote the key it was sent
            refused = any(word in message.lower() for word in ("response_format", "json_schema"))
            if status in (400, 422) and refused and self.format_mode != "none":
                stats.faults["format_rejected"] += 1
                old = self.format_mode
                self.format_mode = new = FORMAT_MODES[FORMAT_MODES.index(old) + 1]
                log.info("judge %s: endpoint rejected response_format=%s; using %s", self.name, old, new)
                return None
            return JudgeConfigError(f"judge endpoint refused the request (HTTP {status}): {message}")
        stats.faults[kind] += 1
        return TransientError(kind, self._scrub(f"{kind}: {type(exc).__name__}: {exc}"), _retry_after(exc))

    def _scrub(self, text: str) -> str:
        """``text`` with the API key in use (whatever its length) and keys in URLs replaced by ``<redacted>``."""
        key = self._api_key or os.environ.get(self._api_key_env) or ""
        return scrub_text(text, [key, *url_secrets(self.base_url)], short_known=True)  # any length

    def build_request(self, cands: list[Candidate]) -> list[dict[str, Any]]:
        """The messages sent for ``cands`` (presentation order, ids assigned)."""
        prefix = common_prefix([c.messages for c in cands]) if len(cands) > 1 else 0
        tool_sets = {content_json(c.tools) for c in cands}
        shared = cands[0].tools if len(tool_sets) == 1 else None
        items = [(c.cid, c.messages[prefix:], None if len(tool_sets) == 1 else c.tools) for c in cands]
        return build_messages(self.rubric, cands[0].messages[:prefix], shared, items)

    async def _judge(
        self, candidates: list[Candidate], example: Mapping[str, Any] | None, seed: int, stats: GroupStats
    ) -> dict[str, Verdict]:
        conversation = base = self.build_request(candidates)
        ids = [c.cid for c in candidates]
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception_type((ReplyError, TransientError)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                stats.attempts += 1
                text = await self._call(conversation, stats)
                try:
                    verdicts = parse_reply(text, ids)
                except ReplyError as exc:
                    stats.faults[exc.kind] += 1
                    log.debug("judge %s: unusable reply (%s): %s", self.name, exc.kind, exc)
                    bad = {"role": "assistant", "content": (text or "")[:4000]}
                    fix = CORRECTION_TEMPLATE.format(problem=exc, ids=", ".join(ids))
                    conversation = [*base, bad, {"role": "user", "content": fix}]
                    raise
                # the judge's words are saved with the trajectories: no key may ride along in them
                return {cid: Verdict(v.score, self._scrub(v.explanation)) for cid, v in verdicts.items()}
        raise JudgeError("retry loop ended without a result")  # pragma: no cover


def _usage(usage: Any) -> tuple[int, int]:
    """Prompt and completion token counts (None: 0); anything but a whole count is a ``bad_envelope`` fault."""
    if usage is None:
        return 0, 0
    if isinstance(usage, (str, bytes, int, float, list, tuple)):
        raise TransientError("bad_envelope", f"usage is {type(usage).__name__}, not an object")
    counts = []
    for name in ("prompt_tokens", "completion_tokens"):
        value = field_of(usage, name)
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # no inf or nan
        if value is not None and not (whole and not isinstance(value, bool) and value >= 0):
            raise TransientError("bad_envelope", f"usage.{name} is {str(value)[:40]!r}, not a count")
        counts.append(int(value or 0))
    return counts[0], counts[1]


def _content(resp: Any) -> str | None:
    """The first choice's message content; a :class:`TransientError` names what is wrong with the envelope."""
    choices = field_of(resp, "choices")
    if not isinstance(choices, list) or not choices:
        shown = "missing" if choices is None else f"{type(choices).__name__} {str(choices)[:40]!r}"
        raise TransientError("bad_envelope", f"the reply has no usable choices ({shown})")
    message = field_of(choices[0], "message")
    if message is None or isinstance(message, (str, bytes, int, float, list)):
        raise TransientError("bad_envelope", "the reply's first choice has no message object")
    content = field_of(message, "content")
    if content is not None and not isinstance(content, str):
        raise TransientError("bad_content", f"the message content is a {type(content).__name__}, not text")
    return content


async def ruler_score_group(
    group: TrajectoryGroup,
    judge: str | GroupJudge,
    example: Mapping[str, Any] | None = None,
    *,
    swallow_exceptions: bool = False,
    **judge_kwargs: Any,
) -> TrajectoryGroup | None:
    """ART-style entry point: score ``group`` with a judge object, or with a :class:`RulerJudge` built from a
    model name and ``judge_kwargs`` for this call and closed after it (to score many groups, build one and pass
    it). ``swallow_exceptions=True`` turns a :class:`JudgeError` into None (group dropped, never scored 0)."""
    owned: RulerJudge | None = None
    if isinstance(judge, str):
        judge_kwargs.setdefault("on_failure", "raise")
        judge = owned = RulerJudge(judge, **judge_kwargs)
    elif judge_kwargs:
        raise TypeError("judge_kwargs are only used when judge is a model name")
    try:
        return await judge.score_group(group, example)
    except JudgeError:
        if swallow_exceptions:
            return None
        raise
    finally:
        if owned is not None:
            await owned.aclose()
