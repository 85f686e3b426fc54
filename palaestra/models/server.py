"""OpenAI-compatible HTTP API over served models: a plain ASGI app that ``palaestra serve`` runs under uvicorn
and the in-process ``openai`` client calls directly. Routes, refusals, limits and error bodies: docs/guide.md
("What the server supports"); only a genuine internal failure is a 500."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from palaestra.models.engine import (
    LOGPROB_FLOOR,
    EngineStats,
    RequestError,
    Sample,
    SamplingParams,
    choice_seeds,
    prepare_params,
)
from palaestra.models.remote import http_module, openai_over
from palaestra.models.tokenizer import Tokenizer
from palaestra.models.toolcalls import CALL_CLOSE, CALL_OPEN, reply_message, tool_names

if TYPE_CHECKING:
    from openai import AsyncOpenAI

COUNTED = ("disconnected", "body_too_large", "body_timeout", "request_too_large")
"""What the app refused or dropped, counted by reason under ``/health``."""


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the app (``palaestra serve`` flags set them); each must be > 0."""

    max_body_bytes: int = 1 << 20  # larger bodies get 413 (Content-Length checked first, then while reading)
    body_timeout_s: float = 30.0  # a body not received within this time gets 408
    max_rows: int = 256  # prompts x n of one request (400 above)
    max_request_tokens: int = 65_536  # sum over rows of prompt tokens + max completion tokens (400 above)
    inline_parse_bytes: int = 32 << 10  # larger bodies are parsed and tokenised in a worker thread

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"ServerLimits.{f.name} must be > 0, got {getattr(self, f.name)}")


Refusal = Callable[[str, Any, Any, frozenset[str]], "tuple[str, str | None] | None"]
"""``refusal(name, value, request, sampler features)``: ``(message, code)`` of the 400 for a setting the server
cannot keep (refused, not ignored; checked for every field present in the body, declared or not), or None."""


def _lacks(feature: str) -> Refusal:
    return lambda name, v, req, feats: (
        None if not v or feature in feats else (f"{name} is not supported by this model's sampler", None)
    )


def _unread(why: str, allowed: Any = None) -> Refusal:
    """Refuse a field this server does not read (except the value ``allowed``, when given)."""
    return lambda name, v, req, feats: (
        None
        if allowed is not None and v == allowed
        else (f"{name} is not supported by this model: {why}", "unsupported_parameter")
    )


def _unkept(message: str, refused: Callable[[Any, Any], Any] = lambda v, req: v) -> Refusal:
    return lambda name, v, req, feats: (message, None) if refused(v, req) else None


def _stream_options(name: str, value: Any, req: Any, feats: frozenset[str]) -> tuple[str, None] | None:
    if not req.stream:
        return "stream_options is only allowed with stream=true", None
    if not isinstance(value.get("include_usage", False), bool):
        return "stream_options.include_usage must be a boolean", None
    return None


def _response_format(name: str, value: Any, req: Any, feats: frozenset[str]) -> tuple[str, str] | None:
    if value.get("type", "text") == "text":
        return None
    return (
        f"response_format {value.get('type')!r} is not supported by this model (no constrained decoding); "
        "ask for JSON in the prompt and parse the reply, or omit response_format",
        "unsupported_value",
    )


def _tool_choice(name: str, value: Any, req: Any, feats: frozenset[str]) -> tuple[str, str | None] | None:
    if value in ("auto", "none"):
        return None
    if value != "required" and not isinstance(value, dict):
        return f"tool_choice must be 'auto', 'none', 'required' or an object, got {value!r}", None
    what = "'required'" if value == "required" else "a named function"
    why = "is not supported: this model cannot be forced to call a tool"
    if not req.tools:
        why = "needs tools, and this request has none"
    return f"tool_choice {what} {why}", "unsupported_value"


class _Request(BaseModel):
    """Fields both generation routes share (ranges are checked by ``prepare_params``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    REFUSED: ClassVar[dict[str, Refusal]] = {
        "stream_options": _stream_options,
        "logit_bias": _lacks("logit_bias"),
        "presence_penalty": _lacks("penalties"),
        "frequency_penalty": _lacks("penalties"),
    }

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ChatRequest(_Request):
    """Body of ``POST /v1/chat/completions``."""

    REFUSED: ClassVar[dict[str, Refusal]] = {
        **_Request.REFUSED,
        "response_format": _response_format,
        "functions": _unread("use tools (the legacy functions field is not read)"),
        "function_call": _unread("use tool_choice (the legacy function_call field is not read)"),
        "audio": _unread("text only"),
        "modalities": _unread('text only (["text"] is accepted)', allowed=["text"]),
        "web_search_options": _unread("no web search"),
        "tool_choice": _tool_choice,
    }

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Request):
    """Body of ``POST /v1/completions`` (legacy text completions)."""

    REFUSED: ClassVar[dict[str, Refusal]] = {
        **_Request.REFUSED,
        "echo": _unkept("echo=true is not supported by the embedded server"),
        "suffix": _unkept("suffix is not supported by the embedded server"),
        "best_of": _unkept(
            "best_of is not supported (it must equal n when given)", lambda v, req: v != req.n
        ),
    }

    prompt: str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class APIError(RequestError):
    """An error answered with an OpenAI-style body and HTTP ``status``."""

    def __init__(self, status: int, message: str, **fields: str | None) -> None:
        super().__init__(message, **fields)  # param, code
        self.status = status


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class _TokenTable:
    """Per-tokenizer strings and UTF-8 bytes of every token id (built once)."""

    def __init__(self, model: Servable) -> None:
        self.tokenizer = tok = model.tokenizer
        self.strs = list(tok.vocab)
        self.bytes = [list(s.encode("utf-8")) for s in self.strs]
        # exact text pieces: a text of more than block_size * max_chars characters cannot fit the context
        self.exact = isinstance(tok, Tokenizer)
        self.special: frozenset[int] = frozenset(getattr(tok, "special_ids", ()))
        self.max_chars = max((len(s) for s in self.strs), default=1) if self.exact else None

    def entry(self, tid: int, lp: float) -> dict[str, Any]:
        return {"token": self.strs[tid], "logprob": max(lp, LOGPROB_FLOOR), "bytes": self.bytes[tid]}

    def chat_entry(self, s: Sample, i: int) -> dict[str, Any]:
        top = s.top_logprobs[i] if s.top_logprobs else ()
        entry = self.entry(s.token_ids[i], s.logprobs[i])
        return {**entry, "top_logprobs": [self.entry(int(t), float(v)) for t, v in top]}

    def text_ends(self, s: Sample) -> list[int]:
        """For each generated token, how much of the reply ``s.text`` is written once it is out."""
        ends: list[int] = []
        pos, cap = 0, len(s.text)
        if self.exact:
            special, strs = self.special, self.strs
            for tid in s.token_ids:
                if tid not in special:
                    pos = min(cap, pos + len(strs[tid]))
                ends.append(pos)
        else:  # decoded prefixes (quadratic, but completions are short)
            for i in range(len(s.token_ids)):
                pos = max(pos, min(cap, len(self.tokenizer.decode(s.token_ids[: i + 1]))))
                ends.append(pos)
        if ends:
            ends[-1] = cap
        return ends


Job = tuple[list[int], SamplingParams, list[int]]  # one prompt: its ids, sampling settings, a seed per choice


@dataclass
class Plan:
    """A checked request, ready to generate: one job per prompt."""

    req: Any
    model: Servable
    table: _TokenTable
    jobs: list[Job]
    names: list[str] | None = None  # offered tool names when replies are parsed for tool calls
    cut: str | None = None  # tool_choice "none": replies are cut before this tool-call opening
    results: list[list[Sample]] = field(default_factory=list)

    def samples(self) -> list[Sample]:
        """Every generated choice, cut before ``cut`` when set (whatever the backend did with the stop)."""
        samples = [s for group in self.results for s in group]
        if self.cut is None:
            return samples
        return [
            s if (c := s.text.find(self.cut)) < 0 else replace(s, text=s.text[:c], finish_reason="stop")
            for s in samples
        ]


def _params(
    model: Servable, table: _TokenTable, req: Any, prompt_len: int, **settings: Any
) -> SamplingParams:
    for name in ("n", "temperature", "top_p", "stop", "logit_bias", "presence_penalty", "frequency_penalty"):
        settings[name] = getattr(req, name)
    return prepare_params(
        prompt_len=prompt_len, block_size=model.block_size, vocab_size=len(table.strs), **settings
    )


def _text_len(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_long(model: Servable, table: _TokenTable, chars: int, param: str) -> None:
    """Refuse a text that cannot fit the context without tokenising it (exact tokenizers only)."""
    if table.max_chars is not None and chars > model.block_size * table.max_chars:
        msg = (
            f"the prompt is at least {chars // table.max_chars} tokens, but this model's context is "
            f"{model.block_size} tokens (prompt and completion together); shorten the {param}"
        )
        raise APIError(400, msg, param=param, code="context_length_exceeded")


def _check_rows(limits: ServerLimits, rows: int, param: str) -> None:
    if rows > limits.max_rows:
        msg = f"this request asks for {rows} completions (prompts x n); this server allows {limits.max_rows}"
        raise APIError(400, msg, param=param, code="request_too_large")


def plan_chat(model: Servable, table: _TokenTable, req: ChatRequest, limits: ServerLimits) -> Plan:
    """Check a chat request and tokenise its prompt (pure CPU work: may run in a worker thread)."""
    _check_rows(limits, req.n, "n")
    _too_long(model, table, sum(_text_len(m.get("content")) for m in req.messages), "messages")
    try:
        prompt = model.tokenizer.render(req.messages, add_generation_prompt=True, tools=req.tools).ids
    except (ValueError, TypeError, KeyError) as exc:
        raise APIError(400, str(exc), param="messages") from exc
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    settings = {"max_tokens": max_tokens, "logprobs": bool(req.logprobs), "top_logprobs": req.top_logprobs}
    params = _params(model, table, req, len(prompt), **settings)
    parses = bool(req.tools) and hasattr(model.tokenizer, "parse_tool_calls")
    cut = None
    if parses and req.tool_choice == "none":  # no tool-call markup in the reply: stop before it
        cut = getattr(model.tokenizer, "call_open", None) or CALL_OPEN  # HF templates' own, else <call>
        params = replace(params, stop=(*params.stop, cut))
    names = tool_names(req.tools) if parses and cut is None and req.tools else None
    jobs = [(prompt, params, choice_seeds(req.seed, req.n))]
    return Plan(req, model, table, jobs, names=names, cut=cut)


def plan_completion(
    model: Servable, table: _TokenTable, req: CompletionRequest, limits: ServerLimits
) -> Plan:
    """Check a legacy completions request and tokenise its prompts (may run in a worker thread)."""
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not texts:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    _check_rows(limits, len(texts) * max(req.n, 1), "prompt" if len(texts) > 1 else "n")
    jobs: list[Job] = []
    k = req.logprobs
    settings = {"max_tokens": req.max_tokens, "logprobs": k is not None, "top_logprobs": k or 0}
    for c, text in enumerate(texts):
        _too_long(model, table, len(text), "prompt")
        ids = model.tokenizer.encode(text)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        params = _params(model, table, req, len(ids), prompt_param="prompt", **settings)
        jobs.append((ids, params, choice_seeds(req.seed, req.n, salt=c)))
    return Plan(req, model, table, jobs)


def _usage(plan: Plan, samples: Sequence[Sample]) -> dict[str, int]:
    prompt = sum(len(ids) for ids, _, _ in plan.jobs)
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _head(plan: Plan, obj: str, samples: Sequence[Sample]) -> dict[str, Any]:
    """The fields of a reply body, repeated by every chunk of a streamed reply."""
    step = samples[0].step if samples else plan.model.step
    return {
        "id": ("chatcmpl-" if obj.startswith("chat") else "cmpl-") + uuid.uuid4().hex,
        "object": obj,
        "created": int(time.time()),
        "model": plan.req.model,
        "system_fingerprint": f"{plan.req.model}@step{step}",
    }


def chat_body(plan: Plan) -> dict[str, Any]:
    """The ``chat.completion`` body of a generated plan."""
    samples = plan.samples()
    choices = []
    for i, s in enumerate(samples):
        message, finish = reply_message(plan.model.tokenizer, s, i, plan.names)
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        # with logprobs, also the exact tokens for the trainer: what was sampled, from which prompt (as vLLM's)
        if plan.req.logprobs:
            lp = {"content": [plan.table.chat_entry(s, t) for t in range(len(s.token_ids))], "refusal": None}
            choice.update(logprobs=lp, token_ids=s.token_ids, prompt_token_ids=plan.jobs[0][0])
        choices.append(choice)
    return {**_head(plan, "chat.completion", samples), "choices": choices, "usage": _usage(plan, samples)}


def _text_logprobs(
    table: _TokenTable, s: Sample, k: int, first: int = 0, last: int | None = None, offset: int = 0
) -> dict[str, Any]:
    toks = [table.strs[t] for t in s.token_ids[first:last]]
    tops = s.top_logprobs[first:last] if k else None
    return {
        "tokens": toks,
        "token_logprobs": [max(x, LOGPROB_FLOOR) for x in s.logprobs[first:last]],
        "top_logprobs": None
        if tops is None
        else [{table.strs[int(t)]: max(float(v), LOGPROB_FLOOR) for t, v in top} for top in tops],
        "text_offset": list(accumulate(map(len, toks), initial=offset))[:-1],
    }


def completion_body(plan: Plan) -> dict[str, Any]:
    """The ``text_completion`` body of a generated plan."""
    samples, k = plan.samples(), plan.req.logprobs
    choices = [
        {
            "index": i,
            "text": s.text,
            "finish_reason": s.finish_reason,
            "logprobs": None if k is None else _text_logprobs(plan.table, s, k),
        }
        for i, s in enumerate(samples)
    ]
    return {**_head(plan, "text_completion", samples), "choices": choices, "usage": _usage(plan, samples)}


def _chat_chunks(plan: Plan, i: int, s: Sample) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` choices of one reply: role, one content delta per token, a delta per tool
    call (with the logprobs of its tokens), the finish reason."""
    table, logprobs = plan.table, plan.req.logprobs

    def chunk(delta: dict[str, Any], tokens: Sequence[int]) -> dict[str, Any]:
        lp = {"content": [table.chat_entry(s, t) for t in tokens], "refusal": None} if logprobs else None
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}

    message, finish = reply_message(plan.model.tokenizer, s, i, plan.names)
    ends = table.text_ends(s)
    calls = message.get("tool_calls") or []
    content_len = len(message["content"] or "") if calls else len(s.text)
    yield chunk({"role": "assistant", "content": ""}, ())
    # tokens that write the content: one delta each; the rest belong to the tool calls
    prev, t, n_tok = 0, 0, len(s.token_ids)
    while t < n_tok and (prev < content_len or not calls):
        yield chunk({"content": s.text[prev : min(ends[t], content_len)]}, (t,))
        prev = ends[t]
        t += 1
    pos = content_len
    for k, c in enumerate(calls):
        fn = c["function"]
        pos += len(CALL_OPEN) + len(fn["name"]) + 1 + len(fn["arguments"]) + len(CALL_CLOSE)  # its text's end
        mine = []
        while t < n_tok and (k == len(calls) - 1 or (ends[t - 1] if t else 0) < pos):
            mine.append(t)
            t += 1
        yield chunk({"tool_calls": [{"index": k, **c}]}, mine)
    yield {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}


def _completion_chunks(plan: Plan, i: int, s: Sample) -> Iterator[dict[str, Any]]:
    """The ``text_completion`` chunk choices of one reply: one per token, then the finish reason."""
    k, prev = plan.req.logprobs, 0
    for t, end in enumerate(plan.table.text_ends(s)):
        lp = None if k is None else _text_logprobs(plan.table, s, k, t, t + 1, prev)
        yield {"index": i, "text": s.text[prev:end], "logprobs": lp, "finish_reason": None}
        prev = end
    yield {"index": i, "text": "", "logprobs": None, "finish_reason": s.finish_reason}


def _render(plan: Plan, chat: bool) -> bytes:
    """The reply body of a generated plan: JSON, or server-sent events when it streams (the chunks of every
    choice, the usage chunk when asked, [DONE])."""
    if not plan.req.stream:
        return _dumps(chat_body(plan) if chat else completion_body(plan))
    samples = plan.samples()
    head = _head(plan, "chat.completion.chunk" if chat else "text_completion", samples)
    usage = bool((plan.req.stream_options or {}).get("include_usage"))
    if usage:
        head["usage"] = None  # until the last chunk
    chunks = _chat_chunks if chat else _completion_chunks
    events = [{**head, "choices": [c]} for i, s in enumerate(samples) for c in chunks(plan, i, s)]
    if usage:
        events.append({**head, "choices": [], "usage": _usage(plan, samples)})
    return b"".join(b"data: " + _dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class Servable(Protocol):
    """What the app needs from a model; an optional ``sampling_features`` (of ``"logit_bias"`` and
    ``"penalties"``) names what its sampler honours (requests using any other get a 400)."""

    name: str
    step: int
    stats: EngineStats

    @property
    def block_size(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Sample]: ...


Reply = tuple[int, bytes, dict[str, str]]  # status, body, headers
_JSON = {"content-type": "application/json"}
_SSE = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
_SERVABLE = ("name", "step", "stats", "block_size", "tokenizer", "submit")  # what App checks a model has
_POST_ROUTES = ("/v1/chat/completions", "/v1/completions")


def _error_reply(exc: RequestError, **headers: str) -> Reply:
    """``{"error": {...}}`` as the OpenAI API writes it."""
    status = getattr(exc, "status", 400)
    kind = {404: "not_found_error", 500: "server_error"}.get(status, "invalid_request_error")
    body = {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}
    return status, _dumps(body), {**_JSON, **headers}


def _not_allowed(method: str, path: str, allow: str) -> Reply:
    return _error_reply(APIError(405, f"{method} {path} is not allowed: use {allow}"), allow=allow)


class _Gone(Exception):
    """The HTTP client disconnected before its request was answered."""


class App:
    """The OpenAI-compatible ASGI app serving a :class:`Servable` model or a dict of them (keys: served names);
    the in-process client calls :meth:`handle` directly. ``counters``: the :data:`COUNTED` events (``/health``)."""

    def __init__(
        self, models: Servable | Mapping[str, Servable], *, limits: ServerLimits | None = None
    ) -> None:
        if not isinstance(models, Mapping):
            models = {getattr(models, "name", "model"): models}
        self.models = {str(k): m for k, m in models.items()}
        if not self.models:
            raise ValueError("create_app needs at least one model")
        for key, m in self.models.items():
            missing = [a for a in _SERVABLE if not hasattr(m, a)]
            if missing:
                msg = f"create_app: model {key!r} ({type(m).__name__}) cannot be served: it lacks {missing}"
                raise TypeError(msg)
        self.limits = limits or ServerLimits()
        self.counters = dict.fromkeys(COUNTED, 0)
        self._count_lock = threading.Lock()  # requests are planned on worker threads too
        self._tables = {name: _TokenTable(m) for name, m in self.models.items()}

    def _count(self, event: str) -> None:
        with self._count_lock:
            self.counters[event] += 1

    async def handle(self, method: str, path: str, body: bytes = b"", until_gone: Any = None) -> Reply | None:
        """Answer one request. ``until_gone``: a coroutine function that returns when the client goes away
        (None: it never does); the answer is None when it went away first."""
        try:
            if len(path) > 1:
                path = path.rstrip("/")
            if path in _POST_ROUTES:
                if method != "POST":
                    return _not_allowed(method, path, "POST")
                if len(body) > self.limits.max_body_bytes:
                    raise self._too_big(len(body))
                return await self._generate(body, path == _POST_ROUTES[0], until_gone)
            if path in ("/v1/models", "/health") or path.startswith("/v1/models/"):
                if method not in ("GET", "HEAD"):
                    return _not_allowed(method, path, "GET")
                return 200, _dumps(self._get(path)), _JSON
            raise APIError(404, f"no route {method} {path} (try /v1/chat/completions or /v1/models)")
        except RequestError as exc:
            return _error_reply(exc)
        except _Gone:
            self._count("disconnected")
            return None
        except Exception as exc:  # reported to the client as an OpenAI-style 500
            msg = f"internal error while generating: {type(exc).__name__}: {exc}"
            return _error_reply(APIError(500, msg))

    def _too_big(self, size: int) -> APIError:
        self._count("body_too_large")
        msg = f"the request body is at least {size} bytes; this server accepts at most {self.limits.max_body_bytes}"
        return APIError(413, msg, code="request_too_large")

    def _lookup(self, name: str) -> tuple[Servable, _TokenTable]:
        if name not in self.models:
            msg = f"the model {name!r} does not exist; this server serves {sorted(self.models)}"
            raise APIError(404, msg, param="model", code="model_not_found")
        return self.models[name], self._tables[name]

    def _plan(self, body: bytes, chat: bool) -> Plan:
        try:
            req: Any = (ChatRequest if chat else CompletionRequest).model_validate_json(body)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc, param = err["loc"], ".".join(str(p) for p in err["loc"])
            if err["type"] in ("json_invalid", "json_type"):
                msg = f"the request body is not valid JSON ({err['msg']})"
                raise APIError(400, msg, code="invalid_json") from None
            if not loc:
                raise APIError(400, "the request body must be a JSON object") from None
            if err["type"] == "missing":
                raise APIError(400, f"missing required field {param!r}", param=str(loc[0])) from None
            raise APIError(400, f"invalid value for {param!r}: {err['msg']}", param=str(loc[0])) from None
        model, table = self._lookup(req.model)
        feats = frozenset(getattr(model, "sampling_features", ()))
        fields, extra = req.__dict__, req.model_extra or {}  # dict lookups: a missing extra is no exception
        for name, refusal in req.REFUSED.items():  # 400 for a setting the server cannot keep
            value = fields[name] if name in fields else extra.get(name)
            refused = refusal(name, value, req, feats) if value is not None else None
            if refused is not None:
                raise APIError(400, refused[0], param=name, code=refused[1])
        limit = self.limits.max_request_tokens
        try:
            plan: Plan = (plan_chat if chat else plan_completion)(model, table, req, self.limits)
            total = sum(len(seeds) * (len(ids) + p.max_tokens) for ids, p, seeds in plan.jobs)
            if total > limit:
                msg = (
                    f"this request asks for up to {total} tokens (rows x (prompt + max_tokens)); this server "
                    f"allows {limit} per request: lower n, max_tokens or the number of prompts"
                )
                raise APIError(400, msg, param="max_tokens", code="request_too_large")
            return plan
        except APIError as exc:
            if exc.code == "request_too_large":
                self._count("request_too_large")
            raise

    async def _generate(self, body: bytes, chat: bool, until_gone: Any) -> Reply:
        big = len(body) > self.limits.inline_parse_bytes  # big bodies: parse and tokenise off the event loop
        plan = await asyncio.to_thread(self._plan, body, chat) if big else self._plan(body, chat)
        rows = sum(len(seeds) for _, _, seeds in plan.jobs)
        plan.jobs = [(ids, replace(p, request_rows=rows), seeds) for ids, p, seeds in plan.jobs]
        many = getattr(plan.model, "submit_many", None)  # one call, one future per prompt
        work = many(plan.jobs) if many else asyncio.gather(*[plan.model.submit(*job) for job in plan.jobs])
        plan.results = list(await _until(work, until_gone))
        render = partial(_render, plan, chat)
        # a big reply (many rows x tokens x top_logprobs) is serialised off the event loop
        tokens = sum(len(s.token_ids) for samples in plan.results for s in samples)
        entries = tokens * (1 + max(p.top_logprobs for _, p, _ in plan.jobs))
        payload = await asyncio.to_thread(render) if entries > 4096 else render()
        return 200, payload, _SSE if plan.req.stream else _JSON

    def _get(self, path: str) -> dict[str, Any]:
        if path == "/health":
            models = {
                k: {"fingerprint": f"{k}@step{m.step}", "stats": m.stats.snapshot(batches=False)}
                for k, m in self.models.items()
            }
            with self._count_lock:
                counters = dict(self.counters)
            return {"status": "ok", "models": models, "server": counters}
        if path == "/v1/models":
            return {"object": "list", "data": [self._card(k, m) for k, m in self.models.items()]}
        name = path[len("/v1/models/") :]
        return self._card(name, self._lookup(name)[0])

    @staticmethod
    def _card(name: str, m: Servable) -> dict[str, Any]:
        return dict(
            id=name, object="model", created=0, owned_by="palaestra", step=m.step, context_length=m.block_size
        )

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """The ASGI entry point (HTTP and lifespan)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]  # startup or shutdown
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            raise RuntimeError(f"the palaestra server speaks HTTP, not {scope['type']}")
        method, path = scope["method"], scope["path"]
        body = b""
        try:
            if method == "POST" and path.rstrip("/") in _POST_ROUTES:
                body = await self._read_body(scope, receive)
        except APIError as exc:
            reply: Reply | None = _error_reply(exc)
        except _Gone:
            self._count("disconnected")
            return
        else:
            reply = await self.handle(method, path, body, partial(_until_disconnect, receive))
        # 499: nobody is listening; the status is for the logs
        status, payload, headers = reply or (499, b"", {})
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        raw.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else payload})

    async def _read_body(self, scope: MutableMapping[str, Any], receive: Any) -> bytes:
        lim = self.limits
        size = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if size.isdigit() and int(size) > lim.max_body_bytes:
            raise self._too_big(int(size))

        async def read() -> bytes:
            parts, got = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Gone
                chunk = message.get("body", b"")
                got += len(chunk)
                if got > lim.max_body_bytes:
                    raise self._too_big(got)
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)

        try:
            return await asyncio.wait_for(read(), lim.body_timeout_s)
        except asyncio.TimeoutError:
            self._count("body_timeout")
            msg = f"the request body was not received within {lim.body_timeout_s:g} s"
            raise APIError(408, msg, code="timeout") from None


async def _until(work: Any, until_gone: Any) -> Any:
    """Await ``work``; raise :class:`_Gone` (cancelling it: nothing is generated for a queued request, a
    running one leaves the batch at its next token) if ``until_gone()`` returns first."""
    if until_gone is None:
        return await work
    gen = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_gone())
    try:
        await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        gen.cancel()
        raise
    finally:
        watch.cancel()
    if not gen.done():
        gen.cancel()
        raise _Gone
    return gen.result()


async def _until_disconnect(receive: Any) -> None:
    """Return when the ASGI client disconnects (its body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


create_app = App  # the name the docs use


def in_process_client(app: App, base_url: str) -> AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` whose requests go straight to ``app.handle`` (no sockets, no ASGI); usable
    from any event loop. ``base_url`` is only a name (never resolved), e.g. ``ServedModel.base_url``."""
    httpx = http_module()

    class Transport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        async def handle_async_request(self, request: Any) -> Any:
            reply = await app.handle(request.method, request.url.path, await request.aread())
            status, payload, headers = reply or (499, b"", {})
            return httpx.Response(status, headers=headers, content=payload, request=request)

    return openai_over(Transport(), base_url, api_key="embedded", timeout=None, max_retries=0)


__all__ = [
    "App",
    "ChatRequest",
    "CompletionRequest",
    "Servable",
    "ServerLimits",
    "create_app",
    "in_process_client",
]
