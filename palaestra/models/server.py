"""OpenAI-compatible HTTP API over embedded models (FastAPI; imported only when a server or client is made).

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(raw text prompt, no chat template), ``GET /health``. Not supported: streaming (``stream=true`` -> 400).

Tools: ``tools`` go to the chat template; unless ``tool_choice`` is ``"none"`` (other values act as
``"auto"``) each reply becomes ``tool_calls`` or content (``palaestra.models.toolcalls.reply_message``).

Chat completions accept ``messages, n (1..128), temperature (0..2), top_p (0, 1], max_tokens /
max_completion_tokens (>= 1; the latter wins; clamped to the context left after the prompt), stop (string or
list), seed, logprobs, top_logprobs (0..20)``; other OpenAI fields are accepted and ignored. Replies are the
OpenAI shapes that the ``openai`` client parses into ``ChatCompletion``:

* ``choices[i].logprobs.content`` lists every generated token with its logprob under the *raw* model
  distribution (before temperature and top_p), its bytes and ``top_logprobs``; when the model ended its turn
  the last entry is the ``<|end|>`` token (``finish_reason == "stop"``), which the message text omits. Token
  strings are exact vocabulary entries, so ``tokenizer.id_of(entry.token)`` recovers the ids.
* ``usage``: prompt tokens (once, whatever ``n``), completion tokens summed over choices (``<|end|>``
  included).
* ``system_fingerprint``: ``"<model>@step<k>"``, the policy version that produced the reply.

Errors never come back as a bare 500: a body that is not JSON or that fails validation (missing or
mistyped field, value out of range, prompt longer than the context, ``stream=true``) gets 400, an unknown
model or route 404, a wrong method 405, each with an OpenAI-style ``{"error": {"message", "type", "param",
"code"}}`` body; only a genuine internal failure is a 500, with the same body shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
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
from palaestra.models.toolcalls import reply_message, tool_names

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.responses import Response

_LOGPROB_FLOOR = -9999.0
_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "server_error",
}


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


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


def _json_response(status: int, body: Any) -> Response:
    from starlette.responses import Response

    return Response(
        json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json"
    )


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
        vocab = model.tokenizer.vocab
        self.strs = list(vocab)
        self.bytes = [list(s.encode("utf-8")) for s in vocab]

    def entry(self, tid: int, lp: float) -> dict[str, Any]:
        return {"token": self.strs[tid], "logprob": max(lp, _LOGPROB_FLOOR), "bytes": self.bytes[tid]}


def _chat_logprobs(table: _TokenTable, s: Sample) -> dict[str, Any]:
    content = []
    strs, tbytes = table.strs, table.bytes
    for i, (tid, lp) in enumerate(zip(s.token_ids, s.logprobs)):
        top = s.top_logprobs[i] if s.top_logprobs else ()
        content.append(
            {
                "token": strs[tid],
                "logprob": max(lp, _LOGPROB_FLOOR),
                "bytes": tbytes[tid],
                "top_logprobs": [table.entry(int(t), float(v)) for t, v in top],
            }
        )
    return {"content": content, "refusal": None}


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


async def chat_completion(model: Servable, table: _TokenTable, req: ChatRequest) -> dict[str, Any]:
    """Serve one validated chat-completions request; returns the response body."""
    if req.stream:
        raise APIError(
            400, "streaming is not supported by the embedded server; set stream=false", param="stream"
        )
    try:
        prompt = model.tokenizer.render(req.messages, add_generation_prompt=True, tools=req.tools).ids
    except (ValueError, TypeError, KeyError) as exc:
        raise APIError(400, str(exc), param="messages") from exc
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = prepare_params(
        prompt_len=len(prompt),
        block_size=model.block_size,
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=max_tokens,
        stop=req.stop,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs,
    )
    samples = await model.submit(prompt, params, choice_seeds(req.seed, req.n))
    parse = req.tools and req.tool_choice != "none" and hasattr(model.tokenizer, "parse_tool_calls")
    names = tool_names(req.tools) if parse and req.tools else None  # valid: the template rendered them
    choices = []
    for i, s in enumerate(samples):
        message, finish = reply_message(model.tokenizer, s, i, names)
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": _chat_logprobs(table, s) if req.logprobs else None,
            }
        )
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": _fingerprint(req.model, model, samples),
        "choices": choices,
        "usage": _usage(len(prompt), samples),
    }


async def text_completion(model: Servable, table: _TokenTable, req: CompletionRequest) -> dict[str, Any]:
    """Serve one validated legacy completions request (each prompt string gets ``n`` choices)."""
    import asyncio

    if req.stream:
        raise APIError(
            400, "streaming is not supported by the embedded server; set stream=false", param="stream"
        )
    if req.echo:
        raise APIError(400, "echo=true is not supported by the embedded server", param="echo")
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not texts:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    k = req.logprobs or 0
    queued: list[tuple[list[int], SamplingParams]] = []
    for text in texts:
        ids = model.tokenizer.encode(text)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        params = prepare_params(
            prompt_len=len(ids),
            block_size=model.block_size,
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_tokens,
            stop=req.stop,
            logprobs=req.logprobs is not None,
            top_logprobs=k,
        )
        queued.append((ids, params))
    prompts = [ids for ids, _ in queued]
    results = await asyncio.gather(
        *[model.submit(ids, p, choice_seeds(req.seed, req.n, salt=c)) for c, (ids, p) in enumerate(queued)]
    )
    choices: list[dict[str, Any]] = []
    all_samples: list[Sample] = []
    for samples in results:
        for s in samples:
            lp = None
            if req.logprobs is not None:
                toks = [table.strs[t] for t in s.token_ids]
                offsets, pos = [], 0
                for t in toks:
                    offsets.append(pos)
                    pos += len(t)
                lp = {
                    "tokens": toks,
                    "token_logprobs": [max(x, _LOGPROB_FLOOR) for x in s.logprobs],
                    "top_logprobs": [
                        {table.strs[int(t)]: max(float(v), _LOGPROB_FLOOR) for t, v in top}
                        for top in s.top_logprobs
                    ]
                    if k
                    else None,
                    "text_offset": offsets,
                }
            choices.append(
                {"index": len(choices), "text": s.text, "finish_reason": s.finish_reason, "logprobs": lp}
            )
            all_samples.append(s)
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": _fingerprint(req.model, model, all_samples),
        "choices": choices,
        "usage": _usage(sum(len(p) for p in prompts), all_samples),
    }


SERVABLE_ATTRS = ("name", "step", "stats", "block_size", "tokenizer", "submit")


class Servable(Protocol):
    """What the app needs from a model (``EmbeddedModel`` has it; other backends may too)."""

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


def _check_servable(where: str, m: Any) -> Servable:
    missing = [a for a in SERVABLE_ATTRS if not hasattr(m, a)]
    if missing:
        raise TypeError(f"create_app: {where} ({type(m).__name__}) cannot be served: it lacks {missing}")
    return m  # type: ignore[no-any-return]


def _model_table(models: Servable | Mapping[str, Servable]) -> dict[str, Servable]:
    if isinstance(models, Mapping):
        table = dict(models)
        if not table:
            raise ValueError("create_app needs at least one model")
        return {str(k): _check_servable(f"models[{k!r}]", m) for k, m in table.items()}
    m = _check_servable("the model", models)
    return {m.name: m}


def create_app(models: Servable | Mapping[str, Servable]) -> FastAPI:
    """The OpenAI-compatible FastAPI app serving ``models``: an :class:`EmbeddedModel` (or any object with
    the :class:`Servable` attributes) or a dict of them (keys are the served model names)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    table = _model_table(models)
    tokens = {name: _TokenTable(m) for name, m in table.items()}
    app = FastAPI(title="palaestra embedded models", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.models = table

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 400)
        detail = getattr(exc, "detail", None)
        msg = detail if isinstance(detail, str) else f"{request.method} {request.url.path}: HTTP {status}"
        if status == 404:
            msg = f"no route {request.method} {request.url.path} (try /v1/chat/completions or /v1/models)"
        return _json_response(status, error_body(status, msg))

    async def validation_error(request: Request, exc: Exception) -> Response:
        errors: list[Any] = list(getattr(exc, "errors", list)())
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = f"invalid value for {'.'.join(loc)!r}: {first.get('msg', 'invalid request')}"
        return _json_response(400, error_body(400, msg, param=loc[0] if loc else None))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)

    def lookup(name: str) -> tuple[Servable, _TokenTable]:
        model = table.get(name)
        if model is None:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {sorted(table)}",
                param="model",
                code="model_not_found",
            )
        return model, tokens[name]

    async def serve(request: Request, schema: type[BaseModel], handler: Any) -> Response:
        try:
            try:
                req = schema.model_validate_json(await request.body())
            except ValidationError as exc:
                raise _validation_error(exc) from None
            model, tok = lookup(req.model)  # type: ignore[attr-defined]
            body = await handler(model, tok, req)
            return _json_response(200, body)
        except APIError as exc:
            return _json_response(exc.status, error_body(exc.status, exc.message, exc.param, exc.code))
        except RequestError as exc:
            return _json_response(400, error_body(400, exc.message, exc.param, exc.code))
        except Exception as exc:  # reported to the client as an OpenAI-style 500
            msg = f"internal error while generating: {type(exc).__name__}: {exc}"
            return _json_response(500, error_body(500, msg))

    # plain Starlette routes: the handlers read the raw request themselves (no FastAPI parameter parsing)
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatRequest, chat_completion)

    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, text_completion)

    def card(name: str, m: Servable) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "palaestra",
            "step": m.step,
            "context_length": m.block_size,
        }

    async def list_models(request: Request) -> Response:
        return _json_response(200, {"object": "list", "data": [card(k, m) for k, m in table.items()]})

    async def get_model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        try:
            model, _ = lookup(model_id)
        except APIError as exc:
            return _json_response(exc.status, error_body(exc.status, exc.message, exc.param, exc.code))
        return _json_response(200, card(model_id, model))

    async def health(request: Request) -> Response:
        body = {
            "status": "ok",
            "models": {
                k: {"fingerprint": f"{k}@step{m.step}", "stats": m.stats.snapshot(batches=False)}
                for k, m in table.items()
            },
        }
        return _json_response(200, body)

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/models", list_models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    return app


__all__ = ["ChatRequest", "CompletionRequest", "Servable", "create_app", "error_body"]
