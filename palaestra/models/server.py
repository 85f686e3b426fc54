"""OpenAI-compatible HTTP API over served models: a plain ASGI app (no web framework) for ``palaestra serve``,
whose request handler the in-process ``openai`` client calls directly (:func:`in_process_client`).

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(raw text prompt, no chat template), ``GET /health``.

Chat completions accept ``messages, n (1..128), temperature (0..2), top_p (0, 1], max_tokens /
max_completion_tokens (>= 1; the latter wins; clamped to the context left after the prompt), stop (string or
list), seed, logprobs, top_logprobs (0..20), logit_bias, presence_penalty, frequency_penalty (-2..2), stream,
stream_options.include_usage, tools, tool_choice``. Fields that would change the contract of the reply and
that the server cannot keep are refused with a 400 rather than ignored: ``response_format`` other than
``{"type": "text"}`` (no constrained decoding), ``tool_choice="required"`` or a named function (the model
cannot be forced to call a tool), the legacy ``functions``/``function_call``, ``audio``, ``modalities`` other
than ``["text"]``, ``web_search_options``, ``echo``/``suffix``/``best_of`` on completions, and ``logit_bias`` or
penalties on a model whose sampler lacks them (see :data:`SAMPLING_FEATURES`). Other OpenAI fields (``user``,
``metadata``, ``parallel_tool_calls``, ...) are accepted and ignored.

* ``choices[i].logprobs.content`` lists every generated token with its logprob under the *raw* model
  distribution (before temperature, top_p, logit_bias and penalties), its bytes and ``top_logprobs``; when
  the model ended its turn the last entry is the ``<|end|>`` token (``finish_reason == "stop"``), which the
  message text omits. Token strings are exact vocabulary entries, so ``tokenizer.id_of(entry.token)``
  recovers the ids. With ``logprobs`` each choice also carries ``token_ids`` (the sampled ids) and
  ``prompt_token_ids`` (the rendered prompt), as vLLM's ``return_token_ids``: the trainer trains on them.
* ``usage``: prompt tokens (once, whatever ``n``), completion tokens summed over choices (``<|end|>``
  included).
* ``system_fingerprint``: ``"<model>@step<k>"``, the policy version that produced the reply.

Tools: ``tools`` go to the chat template; with ``tool_choice`` ``"auto"`` (or absent) each reply becomes
``tool_calls`` or content (``palaestra.models.toolcalls.reply_message``); with ``"none"`` the reply never
holds tool-call markup (generation stops before ``<call>``, which acts as a stop string).

Streaming (``stream=true``): server-sent events of ``chat.completion.chunk`` / ``text_completion`` objects
(role, one content delta per token with its logprobs, tool-call deltas, a last chunk per choice with its
``finish_reason``; with ``stream_options.include_usage`` a final chunk with ``usage`` and no choices), then
``data: [DONE]``. The tokens are those of the same request without streaming. The chunks of a reply are sent
together when its generation is done.

Limits (:class:`ServerLimits`, per app): body size (413), body upload time (408), rows (prompts x n) and
tokens (rows x (prompt + max completion)) per request (400). Large bodies are parsed and tokenised in a
worker thread, not on the event loop. A request whose client disconnects while it is queued is dropped (no
tokens are generated for it), one already generating leaves the batch at its next token (the engine batches
continuously: :mod:`palaestra.models.engine`); both are counted in ``/health``.

Errors never come back as a bare 500: a body that is not JSON or that fails validation (missing or
mistyped field, value out of range, unsupported setting) gets 400, a prompt longer than the context 400 with
OpenAI's code ``context_length_exceeded``, an unknown model or route 404, a wrong method 405, each with an
OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` body; only a genuine internal failure is a
500, with the same body shape.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from palaestra.models.engine import (
    EngineStats,
    RequestError,
    Sample,
    SamplingParams,
    choice_seeds,
    prepare_params,
)
from palaestra.models.toolcalls import CALL_CLOSE, CALL_OPEN, reply_message, tool_names

if TYPE_CHECKING:
    from openai import AsyncOpenAI

_LOGPROB_FLOOR = -9999.0
_TYPES = {404: "not_found_error", 500: "server_error"}  # OpenAI error types; others: invalid_request_error
SAMPLING_FEATURES = ("logit_bias", "penalties")
"""Optional sampler features a model declares in its ``sampling_features`` attribute (absent: none)."""


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the app (``palaestra serve`` flags set them).

    ``max_body_bytes``: larger bodies get 413 (checked on ``Content-Length`` before reading, and while
    reading). ``body_timeout_s``: a body not received within this time gets 408. ``max_rows``: prompts x
    ``n`` of one request. ``max_request_tokens``: sum over rows of prompt tokens + max completion tokens.
    ``inline_parse_bytes``: bodies above this size are parsed and tokenised in a worker thread.
    """

    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    max_rows: int = 256
    max_request_tokens: int = 65_536
    inline_parse_bytes: int = 32 << 10

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_rows", "max_request_tokens", "inline_parse_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"ServerLimits.body_timeout_s must be > 0, got {self.body_timeout_s}")


class ChatRequest(BaseModel):
    """Body of ``POST /v1/chat/completions`` (ranges are checked by ``prepare_params``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (legacy text completions)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    prompt: str | list[str]
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` as the OpenAI API writes it."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    if err["type"] in ("json_invalid", "json_type"):
        return APIError(400, f"the request body is not valid JSON ({err['msg']})", code="invalid_json")
    if err["type"] == "model_type" and not err["loc"]:
        return APIError(400, "the request body must be a JSON object")
    loc = err["loc"]
    param = ".".join(str(p) for p in loc) if loc else None
    top = str(loc[0]) if loc else None
    if err["type"] == "missing":
        return APIError(400, f"missing required field {param!r}", param=top)
    return APIError(400, f"invalid value for {param!r}: {err['msg']}", param=top)


class _TokenTable:
    """Per-tokenizer strings and UTF-8 bytes of every token id (built once)."""

    def __init__(self, model: Servable) -> None:
        from palaestra.models.tokenizer import Tokenizer

        tok = model.tokenizer
        vocab = tok.vocab
        self.strs = list(vocab)
        self.bytes = [list(s.encode("utf-8")) for s in vocab]
        # the embedded tokenizer's tokens are exact text pieces: a text of more than
        # block_size * max_chars characters cannot fit the context (checked before tokenising)
        self.exact = isinstance(tok, Tokenizer)
        self.special: frozenset[int] = frozenset(getattr(tok, "special_ids", ()))
        self.max_chars = max((len(s) for s in self.strs), default=1) if self.exact else None

    def entry(self, tid: int, lp: float) -> dict[str, Any]:
        return {"token": self.strs[tid], "logprob": max(lp, _LOGPROB_FLOOR), "bytes": self.bytes[tid]}

    def chat_entry(self, s: Sample, i: int) -> dict[str, Any]:
        tid = s.token_ids[i]
        top = s.top_logprobs[i] if s.top_logprobs else ()
        return {
            "token": self.strs[tid],
            "logprob": max(s.logprobs[i], _LOGPROB_FLOOR),
            "bytes": self.bytes[tid],
            "top_logprobs": [self.entry(int(t), float(v)) for t, v in top],
        }

    def text_ends(self, tokenizer: Any, s: Sample, text: str) -> list[int]:
        """For each generated token, how much of ``text`` (the reply) is written once it is out."""
        ends: list[int] = []
        pos, cap = 0, len(text)
        if self.exact:
            special, strs = self.special, self.strs
            for tid in s.token_ids:
                if tid not in special:
                    pos = min(cap, pos + len(strs[tid]))
                ends.append(pos)
        else:  # decoded prefixes (quadratic, but completions are short)
            for i in range(len(s.token_ids)):
                pos = max(pos, min(cap, len(tokenizer.decode(s.token_ids[: i + 1]))))
                ends.append(pos)
        if ends:
            ends[-1] = cap
        return ends


def _usage(prompt_tokens: int, samples: Sequence[Sample]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _fingerprint(name: str, model: Servable, samples: Sequence[Sample]) -> str:
    step = samples[0].step if samples else model.step
    return f"{name}@step{step}"


@dataclass
class Plan:
    """A checked request, ready to generate: one job (prompt, params, seeds) per prompt."""

    req: Any
    model: Servable
    table: _TokenTable
    jobs: list[tuple[list[int], SamplingParams, list[int]]]
    prompt_tokens: int
    names: list[str] | None = None  # offered tool names when replies are parsed for tool calls
    no_calls: bool = False  # tool_choice "none": replies are cut before any tool-call markup
    stream: bool = False
    include_usage: bool = False
    results: list[list[Sample]] = field(default_factory=list)


def _params(
    model: Servable,
    table: _TokenTable,
    req: Any,
    prompt_len: int,
    max_tokens: Any,
    logprobs: bool,
    top_logprobs: Any,
    prompt_param: str = "messages",
) -> SamplingParams:
    """The sampling settings of a chat or completions request (checked by ``prepare_params``)."""
    return prepare_params(
        prompt_len=prompt_len,
        block_size=model.block_size,
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=max_tokens,
        stop=req.stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=req.logit_bias,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        vocab_size=len(table.strs),
        prompt_param=prompt_param,
    )


def _check_sampling(model: Servable, req: Any) -> None:
    feats = frozenset(getattr(model, "sampling_features", ()))
    if req.logit_bias and "logit_bias" not in feats:
        raise APIError(400, "logit_bias is not supported by this model's sampler", param="logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) and "penalties" not in feats:
            raise APIError(400, f"{name} is not supported by this model's sampler", param=name)


def _stream_flags(req: Any) -> tuple[bool, bool]:
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    usage = (opts or {}).get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(400, "stream_options.include_usage must be a boolean", param="stream_options")
    return bool(req.stream), usage


def _text_len(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_long(model: Servable, table: _TokenTable, chars: int, param: str) -> None:
    """Refuse a text that cannot fit the context without tokenising it (exact tokenizers only)."""
    if table.max_chars is not None and chars > model.block_size * table.max_chars:
        raise APIError(
            400,
            f"the prompt is at least {chars // table.max_chars} tokens, but this model's context is "
            f"{model.block_size} tokens (prompt and completion together); shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )


def _check_tokens(limits: ServerLimits, jobs: Sequence[tuple[list[int], SamplingParams, list[int]]]) -> None:
    total = sum(len(seeds) * (len(ids) + p.max_tokens) for ids, p, seeds in jobs)
    if total > limits.max_request_tokens:
        raise APIError(
            400,
            f"this request asks for up to {total} tokens (rows x (prompt + max_tokens)); this server allows "
            f"{limits.max_request_tokens} per request: lower n, max_tokens or the number of prompts",
            param="max_tokens",
            code="request_too_large",
        )


def _check_rows(limits: ServerLimits, rows: int, param: str) -> None:
    if rows > limits.max_rows:
        raise APIError(
            400,
            f"this request asks for {rows} completions (prompts x n); this server allows "
            f"{limits.max_rows} per request",
            param=param,
            code="request_too_large",
        )


_UNSUPPORTED_CHAT = {
    "functions": "use tools (the legacy functions field is not read)",
    "function_call": "use tool_choice (the legacy function_call field is not read)",
    "audio": "text only",
    "modalities": 'text only (["text"] is accepted)',
    "web_search_options": "no web search",
}
"""Chat fields that would change the reply's contract and that the server cannot honour (refused, not ignored)."""


def plan_chat(model: Servable, table: _TokenTable, req: ChatRequest, limits: ServerLimits) -> Plan:
    """Check a chat request and tokenise its prompt (pure CPU work: may run in a worker thread)."""
    stream, include_usage = _stream_flags(req)
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise APIError(
            400,
            f"response_format {fmt.get('type')!r} is not supported by this model (no constrained decoding); "
            "ask for JSON in the prompt and parse the reply, or omit response_format",
            param="response_format",
            code="unsupported_value",
        )
    extra = req.model_extra or {}
    for name, why in _UNSUPPORTED_CHAT.items():
        value = extra.get(name)
        if value is not None and not (name == "modalities" and value == ["text"]):
            raise APIError(
                400, f"{name} is not supported by this model: {why}", param=name, code="unsupported_parameter"
            )
    choice = req.tool_choice
    if choice not in (None, "auto", "none"):
        if choice == "required" or isinstance(choice, dict):
            what = "'required'" if choice == "required" else "a named function"
            if not req.tools:
                msg = f"tool_choice {what} needs tools, and this request has none"
            else:
                msg = f"tool_choice {what} is not supported: this model cannot be forced to call a tool"
            raise APIError(400, msg, param="tool_choice", code="unsupported_value")
        raise APIError(
            400,
            f"tool_choice must be 'auto', 'none', 'required' or an object, got {choice!r}",
            param="tool_choice",
        )
    _check_sampling(model, req)
    _check_rows(limits, req.n, "n")
    _too_long(model, table, sum(_text_len(m.get("content")) for m in req.messages), "messages")
    try:
        prompt = model.tokenizer.render(req.messages, add_generation_prompt=True, tools=req.tools).ids
    except (ValueError, TypeError, KeyError) as exc:
        raise APIError(400, str(exc), param="messages") from exc
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _params(model, table, req, len(prompt), max_tokens, bool(req.logprobs), req.top_logprobs)
    parses = bool(req.tools) and hasattr(model.tokenizer, "parse_tool_calls")
    if parses and choice == "none":  # no tool-call markup in the reply: stop before it
        params = replace(params, stop=(*params.stop, _call_open(model)))
    names = tool_names(req.tools) if parses and choice != "none" and req.tools else None
    jobs = [(prompt, params, choice_seeds(req.seed, req.n))]
    _check_tokens(limits, jobs)
    return Plan(
        req,
        model,
        table,
        jobs,
        len(prompt),
        names=names,
        no_calls=parses and choice == "none",
        stream=stream,
        include_usage=include_usage,
    )


def _call_open(model: Servable) -> str:
    """The text that opens a tool call in this model's replies (the tokenizer's ``call_open``, else
    ``<call>``, the embedded template's)."""
    return getattr(model.tokenizer, "call_open", None) or CALL_OPEN


def _chat_samples(plan: Plan) -> list[Sample]:
    """The plan's samples; with tool_choice "none", each text cut before tool-call markup (whatever the
    backend did with the stop string)."""
    samples = plan.results[0]
    if not plan.no_calls:
        return samples
    out = []
    call_open = _call_open(plan.model)
    for s in samples:
        cut = s.text.find(call_open)
        out.append(s if cut < 0 else replace(s, text=s.text[:cut], finish_reason="stop"))
    return out


def plan_completion(
    model: Servable, table: _TokenTable, req: CompletionRequest, limits: ServerLimits
) -> Plan:
    """Check a legacy completions request and tokenise its prompts (may run in a worker thread)."""
    stream, include_usage = _stream_flags(req)
    if req.echo:
        raise APIError(400, "echo=true is not supported by the embedded server", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported by the embedded server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", param="best_of")
    _check_sampling(model, req)
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not texts:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    n = req.n if isinstance(req.n, int) else 1
    _check_rows(limits, len(texts) * max(n, 1), "prompt" if len(texts) > 1 else "n")
    k = req.logprobs or 0
    jobs: list[tuple[list[int], SamplingParams, list[int]]] = []
    for c, text in enumerate(texts):
        _too_long(model, table, len(text), "prompt")
        ids = model.tokenizer.encode(text)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        params = _params(model, table, req, len(ids), req.max_tokens, req.logprobs is not None, k, "prompt")
        jobs.append((ids, params, choice_seeds(req.seed, req.n, salt=c)))
    _check_tokens(limits, jobs)
    return Plan(
        req,
        model,
        table,
        jobs,
        sum(len(ids) for ids, _, _ in jobs),
        stream=stream,
        include_usage=include_usage,
    )


# ---------------------------------------------------------------------------------------------- replies
def _chat_logprobs(table: _TokenTable, s: Sample) -> dict[str, Any]:
    return {"content": [table.chat_entry(s, i) for i in range(len(s.token_ids))], "refusal": None}


def chat_body(plan: Plan) -> dict[str, Any]:
    """The ``chat.completion`` body of a generated plan."""
    req, table, model = plan.req, plan.table, plan.model
    samples = _chat_samples(plan)
    choices = []
    prompt_ids = plan.jobs[0][0]
    for i, s in enumerate(samples):
        message, finish = reply_message(model.tokenizer, s, i, plan.names)
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "finish_reason": finish,
            "logprobs": _chat_logprobs(table, s) if req.logprobs else None,
        }
        if req.logprobs:  # exact tokens for the trainer: what was sampled, from which prompt (as vLLM's)
            choice["token_ids"] = s.token_ids
            choice["prompt_token_ids"] = prompt_ids
        choices.append(choice)
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": _fingerprint(req.model, model, samples),
        "choices": choices,
        "usage": _usage(plan.prompt_tokens, samples),
    }


def _text_logprobs(
    table: _TokenTable, s: Sample, k: int, first: int = 0, last: int | None = None, offset: int = 0
) -> dict[str, Any]:
    ids = s.token_ids[first:last]
    toks = [table.strs[t] for t in ids]
    offsets, pos = [], offset
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": toks,
        "token_logprobs": [max(x, _LOGPROB_FLOOR) for x in s.logprobs[first:last]],
        "top_logprobs": [
            {table.strs[int(t)]: max(float(v), _LOGPROB_FLOOR) for t, v in top}
            for top in s.top_logprobs[first:last]
        ]
        if k
        else None,
        "text_offset": offsets,
    }


def completion_body(plan: Plan) -> dict[str, Any]:
    """The ``text_completion`` body of a generated plan."""
    req, table = plan.req, plan.table
    k = req.logprobs or 0
    choices: list[dict[str, Any]] = []
    all_samples: list[Sample] = []
    for samples in plan.results:
        for s in samples:
            lp = _text_logprobs(table, s, k) if req.logprobs is not None else None
            choices.append(
                {"index": len(choices), "text": s.text, "finish_reason": s.finish_reason, "logprobs": lp}
            )
            all_samples.append(s)
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": _fingerprint(req.model, plan.model, all_samples),
        "choices": choices,
        "usage": _usage(plan.prompt_tokens, all_samples),
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _stream_head(plan: Plan, id_prefix: str, obj: str, samples: list[Any]) -> dict[str, Any]:
    """The fields every chunk of one streamed reply repeats (``usage`` stays None until the last chunk when the
    client asked for it)."""
    head: dict[str, Any] = {
        "id": id_prefix + uuid.uuid4().hex,
        "object": obj,
        "created": int(time.time()),
        "model": plan.req.model,
        "system_fingerprint": _fingerprint(plan.req.model, plan.model, samples),
    }
    if plan.include_usage:
        head["usage"] = None
    return head


def chat_stream(plan: Plan) -> bytes:
    """The server-sent events of a generated chat plan (``chat.completion.chunk`` objects, then [DONE])."""
    req, table, model = plan.req, plan.table, plan.model
    tok = model.tokenizer
    samples = _chat_samples(plan)
    head = _stream_head(plan, "chatcmpl-", "chat.completion.chunk", samples)
    out: list[bytes] = []

    def chunk(
        i: int, delta: dict[str, Any], entries: list[dict[str, Any]] | None, finish: str | None
    ) -> None:
        lp = {"content": entries, "refusal": None} if entries is not None else None
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        out.append(_sse({**head, "choices": [choice]}))

    for i, s in enumerate(samples):
        message, finish = reply_message(tok, s, i, plan.names)
        text = s.text
        ends = table.text_ends(tok, s, text)
        calls = message.get("tool_calls") or []
        content_len = len(message["content"] or "") if calls else len(text)
        chunk(i, {"role": "assistant", "content": ""}, [] if req.logprobs else None, None)
        # tokens that write the content: one delta each; the rest belong to the tool calls
        prev, t = 0, 0
        n_tok = len(s.token_ids)
        while t < n_tok and (prev < content_len or not calls):
            end = min(ends[t], content_len)
            chunk(i, {"content": text[prev:end]}, [table.chat_entry(s, t)] if req.logprobs else None, None)
            prev = ends[t]
            t += 1
        if calls:
            spans, pos = [], content_len
            for c in calls:
                fn = c["function"]
                pos += len(CALL_OPEN) + len(fn["name"]) + 1 + len(fn["arguments"]) + len(CALL_CLOSE)
                spans.append(pos)
            for k, c in enumerate(calls):
                mine = []
                while t < n_tok and (k == len(calls) - 1 or (ends[t - 1] if t else 0) < spans[k]):
                    mine.append(t)
                    t += 1
                delta = {"tool_calls": [{"index": k, **c}]}
                chunk(i, delta, [table.chat_entry(s, j) for j in mine] if req.logprobs else None, None)
        chunk(i, {}, None, finish)
    if plan.include_usage:
        out.append(_sse({**head, "choices": [], "usage": _usage(plan.prompt_tokens, samples)}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def completion_stream(plan: Plan) -> bytes:
    """The server-sent events of a generated completions plan (``text_completion`` chunks, then [DONE])."""
    req, table, model = plan.req, plan.table, plan.model
    k = req.logprobs or 0
    all_samples = [s for samples in plan.results for s in samples]
    head = _stream_head(plan, "cmpl-", "text_completion", all_samples)
    out: list[bytes] = []
    for i, s in enumerate(all_samples):
        ends = table.text_ends(model.tokenizer, s, s.text)
        prev = 0
        for t, end in enumerate(ends):
            lp = _text_logprobs(table, s, k, t, t + 1, prev) if req.logprobs is not None else None
            choice = {"index": i, "text": s.text[prev:end], "logprobs": lp, "finish_reason": None}
            out.append(_sse({**head, "choices": [choice]}))
            prev = end
        last = {"index": i, "text": "", "logprobs": None, "finish_reason": s.finish_reason}
        out.append(_sse({**head, "choices": [last]}))
    if plan.include_usage:
        out.append(_sse({**head, "choices": [], "usage": _usage(plan.prompt_tokens, all_samples)}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


class Servable(Protocol):
    """What the app needs from a model (``EmbeddedModel`` has it; other backends may too).

    A model may also declare ``sampling_features`` (a subset of :data:`SAMPLING_FEATURES`) that its sampler
    honours; requests using any other are refused with a 400.
    """

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


def _model_table(models: Servable | Mapping[str, Servable]) -> dict[str, Servable]:
    table = (
        {str(k): m for k, m in models.items()}
        if isinstance(models, Mapping)
        else {getattr(models, "name", "model"): models}
    )
    if not table:
        raise ValueError("create_app needs at least one model")
    for key, m in table.items():
        missing = [
            a for a in ("name", "step", "stats", "block_size", "tokenizer", "submit") if not hasattr(m, a)
        ]
        if missing:
            raise TypeError(
                f"create_app: model {key!r} ({type(m).__name__}) cannot be served: it lacks {missing}"
            )
    return table


class ServerCounters:
    """What the app refused or dropped, by reason (thread safe; shown under ``/health``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("disconnected", "body_too_large", "body_timeout", "request_too_large"), 0
        )

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


Reply = tuple[int, bytes, dict[str, str]]
"""A response: status, body, headers."""
_JSON = {"content-type": "application/json"}
_SSE = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
_POST_ROUTES = ("/v1/chat/completions", "/v1/completions")
_GET_ROUTES = ("/v1/models", "/health")


def _json_reply(status: int, body: Any) -> Reply:
    return status, _dumps(body), _JSON


def _error_reply(exc: APIError | RequestError, status: int = 400) -> Reply:
    status = getattr(exc, "status", status)
    return _json_reply(status, error_body(status, exc.message, exc.param, exc.code))


class _Gone(Exception):
    """The HTTP client disconnected before its request was answered."""


class App:
    """The OpenAI-compatible app: an ASGI application (``palaestra serve`` runs it under uvicorn) whose
    :meth:`handle` the in-process client calls directly (:func:`in_process_client`: no ASGI, no sockets).

    ``models`` are the served models by name, ``limits`` the :class:`ServerLimits`, ``counters`` the
    :class:`ServerCounters` shown under ``/health``.
    """

    def __init__(self, models: Servable | Mapping[str, Servable], limits: ServerLimits | None = None) -> None:
        self.models = _model_table(models)
        self.limits = limits or ServerLimits()
        self.counters = ServerCounters()
        self._tables = {name: _TokenTable(m) for name, m in self.models.items()}

    # ------------------------------------------------------------------ requests
    async def handle(self, method: str, path: str, body: bytes = b"", until_gone: Any = None) -> Reply | None:
        """Answer one request. ``until_gone``: a coroutine function that returns when the client goes away
        (None: it never does); the answer is None when it went away first."""
        try:
            if len(path) > 1:
                path = path.rstrip("/")
            if path in _POST_ROUTES:
                if method != "POST":
                    return self._not_allowed(method, path, "POST")
                if len(body) > self.limits.max_body_bytes:
                    self.counters.add("body_too_large")
                    raise self._too_big(len(body))
                chat = path == _POST_ROUTES[0]
                return await self._generate(body, chat, until_gone)
            if path in _GET_ROUTES or path.startswith("/v1/models/"):
                if method not in ("GET", "HEAD"):
                    return self._not_allowed(method, path, "GET")
                return self._get(path)
            return _json_reply(
                404,
                error_body(404, f"no route {method} {path} (try /v1/chat/completions or /v1/models)"),
            )
        except (APIError, RequestError) as exc:
            return _error_reply(exc)
        except _Gone:
            self.counters.add("disconnected")
            return None
        except Exception as exc:  # reported to the client as an OpenAI-style 500
            msg = f"internal error while generating: {type(exc).__name__}: {exc}"
            return _json_reply(500, error_body(500, msg))

    def _not_allowed(self, method: str, path: str, allow: str) -> Reply:
        status, body, _ = _json_reply(405, error_body(405, f"{method} {path} is not allowed: use {allow}"))
        return status, body, {**_JSON, "allow": allow}

    def _too_big(self, size: int) -> APIError:
        return APIError(
            413,
            f"the request body is {size} bytes; this server accepts at most {self.limits.max_body_bytes}",
            code="request_too_large",
        )

    def _lookup(self, name: str) -> tuple[Servable, _TokenTable]:
        model = self.models.get(name)
        if model is None:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {sorted(self.models)}",
                param="model",
                code="model_not_found",
            )
        return model, self._tables[name]

    def _plan(self, body: bytes, chat: bool) -> Plan:
        schema: type[BaseModel] = ChatRequest if chat else CompletionRequest
        try:
            req: Any = schema.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        model, table = self._lookup(req.model)
        try:
            if chat:
                return plan_chat(model, table, req, self.limits)
            return plan_completion(model, table, req, self.limits)
        except APIError as exc:
            if exc.code == "request_too_large":
                self.counters.add("request_too_large")
            raise

    async def _generate(self, body: bytes, chat: bool, until_gone: Any) -> Reply:
        if len(body) > self.limits.inline_parse_bytes:  # big bodies: parse and tokenise off the event loop
            plan = await asyncio.to_thread(self._plan, body, chat)
        else:
            plan = self._plan(body, chat)
        rows = sum(len(seeds) for _, _, seeds in plan.jobs)
        plan.jobs = [(ids, replace(p, request_rows=rows), seeds) for ids, p, seeds in plan.jobs]
        plan.results = await _until(_run_jobs(plan), until_gone)
        if plan.stream:
            render = partial(chat_stream if chat else completion_stream, plan)
        else:
            render = partial(_render_json, chat_body if chat else completion_body, plan)
        # a big reply (many rows x tokens x top_logprobs) is serialised off the event loop
        payload = await asyncio.to_thread(render) if _reply_entries(plan) > 4096 else render()
        return 200, payload, _SSE if plan.stream else _JSON

    def _get(self, path: str) -> Reply:
        if path == "/health":
            models = {
                k: {"fingerprint": f"{k}@step{m.step}", "stats": m.stats.snapshot(batches=False)}
                for k, m in self.models.items()
            }
            return _json_reply(200, {"status": "ok", "models": models, "server": self.counters.snapshot()})
        if path == "/v1/models":
            cards = [self._card(k, m) for k, m in self.models.items()]
            return _json_reply(200, {"object": "list", "data": cards})
        name = path[len("/v1/models/") :]
        return _json_reply(200, self._card(name, self._lookup(name)[0]))

    @staticmethod
    def _card(name: str, m: Servable) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "palaestra",
            "step": m.step,
            "context_length": m.block_size,
        }

    # ------------------------------------------------------------------ ASGI
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
            self.counters.add("disconnected")
            return
        else:
            reply = await self.handle(method, path, body, partial(_until_disconnect, receive))
        if reply is None:
            reply = 499, b"", {}  # nobody is listening; the status is for the logs
        status, payload, headers = reply
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        raw.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else payload})

    async def _read_body(self, scope: MutableMapping[str, Any], receive: Any) -> bytes:
        lim = self.limits
        size = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if size.isdigit() and int(size) > lim.max_body_bytes:
            self.counters.add("body_too_large")
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
                    self.counters.add("body_too_large")
                    raise APIError(
                        413,
                        f"the request body exceeds {lim.max_body_bytes} bytes, the most this server accepts",
                        code="request_too_large",
                    )
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)

        try:
            return await asyncio.wait_for(read(), lim.body_timeout_s)
        except asyncio.TimeoutError:
            self.counters.add("body_timeout")
            raise APIError(
                408, f"the request body was not received within {lim.body_timeout_s:g} s", code="timeout"
            ) from None


def _render_json(build: Any, plan: Plan) -> bytes:
    return _dumps(build(plan))


async def _run_jobs(plan: Plan) -> list[list[Sample]]:
    model = plan.model
    many = getattr(model, "submit_many", None)
    if many is not None:  # one call, one future per prompt
        return list(await many(plan.jobs))
    return list(await asyncio.gather(*[model.submit(ids, p, seeds) for ids, p, seeds in plan.jobs]))


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


def _reply_entries(plan: Plan) -> int:
    """Rough size of a reply: generated tokens, times (1 + top logprobs) when logprobs are returned."""
    tokens = sum(len(s.token_ids) for samples in plan.results for s in samples)
    return tokens * (1 + max((p.top_logprobs for _, p, _ in plan.jobs), default=0))


def create_app(models: Servable | Mapping[str, Servable], *, limits: ServerLimits | None = None) -> App:
    """The OpenAI-compatible app serving ``models``: an :class:`EmbeddedModel` (or any object with the
    :class:`Servable` attributes) or a dict of them (keys are the served model names). ``limits``:
    per-request limits (default :class:`ServerLimits`)."""
    return App(models, limits)


def in_process_client(app: App, base_url: str) -> AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` whose requests go straight to ``app.handle`` (no sockets, no ASGI); usable
    from any event loop. ``base_url`` is only a name (never resolved), e.g. ``ServedModel.base_url``."""
    import openai

    from palaestra.models.remote import http_module

    httpx = http_module()

    class Transport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        async def handle_async_request(self, request: Any) -> Any:
            reply = await app.handle(request.method, request.url.path, await request.aread())
            status, payload, headers = reply or (499, b"", {})
            return httpx.Response(status, headers=headers, content=payload, request=request)

    http = httpx.AsyncClient(transport=Transport(), base_url=base_url, timeout=httpx.Timeout(None))
    return openai.AsyncOpenAI(
        api_key="embedded",
        base_url=base_url,
        http_client=http,  # the library openai is built on
        max_retries=0,
        timeout=None,
    )


__all__ = [
    "SAMPLING_FEATURES",
    "App",
    "ChatRequest",
    "CompletionRequest",
    "Servable",
    "ServerLimits",
    "create_app",
    "error_body",
    "in_process_client",
]
