"""The embedded model's OpenAI-compatible app, through the real ``openai`` client bound in-process."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
from server_fixtures import holding_weights

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.engine import RequestError
from palaestra.models.server import create_app
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What is 12+7? Reply with one line: Final: <int>"}]


def tiny_gpt(seed: int = 1, end_bias: float = 0.0) -> TinyGPT:
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=48, d_model=32, n_layer=1, n_head=2, d_ff=64)
    gpt = TinyGPT(cfg, tokenizer=tok, seed=seed)
    gpt.params["head.b"][tok.end_id] += end_bias
    return gpt


@pytest.fixture()
def model() -> EmbeddedModel:
    return EmbeddedModel(tiny_gpt(), name="tiny")


async def chat(m: EmbeddedModel, **kw: object) -> openai.types.chat.ChatCompletion:
    args: dict[str, object] = {"model": m.name, "messages": USER, "max_tokens": 8}
    args.update(kw)
    return await m.openai_client().chat.completions.create(**args)  # type: ignore[call-overload,no-any-return]


async def test_chat_completion_logprobs_and_usage(model: EmbeddedModel) -> None:
    r = await chat(model, n=2, max_tokens=6, logprobs=True, top_logprobs=3, seed=5)
    assert isinstance(r, openai.types.chat.ChatCompletion)
    assert r.model == "tiny" and r.system_fingerprint == "tiny@step0"
    assert [c.index for c in r.choices] == [0, 1]
    tok = model.tokenizer
    prompt_len = len(tok.render(USER).ids)
    assert r.usage is not None and r.usage.prompt_tokens == prompt_len
    total = 0
    for c in r.choices:
        assert c.logprobs is not None and c.logprobs.content is not None
        entries = c.logprobs.content
        total += len(entries)
        ids = [tok.id_of(e.token) for e in entries]
        assert c.message.content == tok.decode(ids)
        for e in entries:
            assert e.logprob <= 0.0 and e.bytes == list(e.token.encode())
            assert len(e.top_logprobs) == 3
            tops = [t.logprob for t in e.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            assert e.logprob <= tops[0] + 1e-6
        # logprobs are the raw model distribution: rescoring the sequence gives the same numbers
        full = np.asarray([tok.render(USER).ids + ids])
        expected = model.gpt.logprobs_of(full)[0][prompt_len - 1 :]
        np.testing.assert_allclose([e.logprob for e in entries], expected, atol=2e-4)
    assert r.usage.completion_tokens == total
    assert r.usage.total_tokens == prompt_len + total


async def test_end_token_is_last_logprob_entry() -> None:
    m = EmbeddedModel(tiny_gpt(end_bias=8.0), name="ender")
    r = await chat(m, n=4, max_tokens=10, logprobs=True, temperature=0.0)
    for c in r.choices:
        assert c.finish_reason == "stop"
        assert c.logprobs is not None and c.logprobs.content
        assert c.logprobs.content[-1].token == "<|end|>"
        assert "<|end|>" not in (c.message.content or "")


async def test_n8_and_seed_determinism(model: EmbeddedModel) -> None:
    a = await chat(model, n=8, seed=123, logprobs=True, temperature=1.0)
    b = await chat(model, n=8, seed=123, logprobs=True, temperature=1.0)
    assert len(a.choices) == 8
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # the 8 choices are different samples
    c = await chat(model, n=8, seed=124, temperature=1.0)
    assert [x.message.content for x in c.choices] != texts


async def test_seed_result_independent_of_batching(model: EmbeddedModel) -> None:
    alone = await chat(model, n=3, seed=77, logprobs=True, max_tokens=12)
    others = [
        chat(model, n=2, seed=i, max_tokens=5 + i % 7, messages=[{"role": "user", "content": "x" * i}])
        for i in range(20)
    ]
    results = await asyncio.gather(
        *others[:10], chat(model, n=3, seed=77, logprobs=True, max_tokens=12), *others[10:]
    )
    crowded = results[10]
    assert [c.message.content for c in crowded.choices] == [c.message.content for c in alone.choices]
    for x, y in zip(alone.choices, crowded.choices):
        assert x.logprobs and y.logprobs and x.logprobs.content and y.logprobs.content
        np.testing.assert_allclose(
            [e.logprob for e in x.logprobs.content], [e.logprob for e in y.logprobs.content], atol=1e-4
        )
    assert max(model.stats.snapshot()["batch_requests"]) > 1


async def test_stop_strings_and_length(model: EmbeddedModel) -> None:
    full = await chat(model, seed=9, max_tokens=20)
    text = full.choices[0].message.content or ""
    if len(text) < 4:
        pytest.skip("random model ended its turn early")
    stop = text[3]
    cut = await chat(model, seed=9, max_tokens=20, stop=[stop, "never-there"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    short = await chat(model, seed=9, max_tokens=3, logprobs=True)
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 3
    # max_completion_tokens wins over max_tokens
    both = await chat(model, seed=9, max_tokens=10, max_completion_tokens=2)
    assert both.usage is not None and both.usage.completion_tokens == 2


async def test_batching_serves_concurrent_requests_together(model: EmbeddedModel) -> None:
    before = model.stats.snapshot()["generate_calls"]
    rs = await asyncio.gather(*[chat(model, seed=i, max_tokens=4) for i in range(32)])
    assert len(rs) == 32
    snap = model.stats.snapshot()
    calls = snap["generate_calls"] - before
    assert calls <= 4, snap  # 32 concurrent requests share at most 4 passes...
    assert sum(snap["batch_requests"][-calls:]) == 32, snap  # ...which served every one of them


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"model": "nope"}, openai.NotFoundError, "model"),
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens"),
        ({"temperature": 2.5}, openai.BadRequestError, "temperature"),
        ({"temperature": -0.1}, openai.BadRequestError, "temperature"),
        ({"top_p": 0.0}, openai.BadRequestError, "top_p"),
        ({"n": 0}, openai.BadRequestError, "n"),
        ({"n": 1000}, openai.BadRequestError, "n"),
        ({"top_logprobs": 21, "logprobs": True}, openai.BadRequestError, "top_logprobs"),
        ({"top_logprobs": 2}, openai.BadRequestError, "top_logprobs"),
        ({"messages": []}, openai.BadRequestError, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 100}]}, openai.BadRequestError, "messages"),
        ({"extra_body": {"n": "three"}}, openai.BadRequestError, "n"),
        ({"extra_body": {"stop": 5}}, openai.BadRequestError, "stop"),
        ({"response_format": {"type": "json_object"}}, openai.BadRequestError, "response_format"),
        ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice"),
        ({"logit_bias": {"99999": 5}}, openai.BadRequestError, "logit_bias"),
        ({"logit_bias": {"3": 500}}, openai.BadRequestError, "logit_bias"),
        ({"presence_penalty": 2.5}, openai.BadRequestError, "presence_penalty"),
        (
            {"extra_body": {"stream_options": {"include_usage": True}}},
            openai.BadRequestError,
            "stream_options",
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    model: EmbeddedModel, kwargs: dict[str, object], error: type[Exception], param: str
) -> None:
    with pytest.raises(error) as info:
        await chat(model, **kwargs)
    body = info.value.body  # type: ignore[attr-defined]
    assert isinstance(body, dict) and body["param"] == param and body["message"]
    assert body["type"] in ("invalid_request_error", "not_found_error")


async def test_raw_malformed_bodies_never_500(model: EmbeddedModel) -> None:
    transport = httpx.ASGITransport(app=create_app(model))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        cases = [
            ("POST", "/v1/chat/completions", b"{not json", 400),
            ("POST", "/v1/chat/completions", b"[1, 2]", 400),
            ("POST", "/v1/chat/completions", b"", 400),
            ("POST", "/v1/chat/completions", b'{"model": "tiny"}', 400),
            ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', 400),
            ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ""}', 400),
            ("POST", "/v1/nothing", b"{}", 404),
            ("GET", "/v1/chat/completions", b"", 405),
            ("GET", "/v1/models/other", b"", 404),
            ("POST", "/v1/models", b"{}", 405),
            ("DELETE", "/health", b"", 405),
        ]
        for method, path, body, status in cases:
            r = await http.request(method, path, content=body)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if status == 405:
                allow = "POST" if path.endswith("completions") else "GET"
                assert (
                    r.headers["allow"] == allow
                    and err["message"] == f"{method} {path} is not allowed: use {allow}"
                )
        streamed = {
            "model": "tiny",
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": "yes"},
        }
        r = await http.post("/v1/chat/completions", json=streamed)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
        assert r.json()["error"]["message"] == "stream_options.include_usage must be a boolean"
        ok = await http.get("/v1/models")
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"


async def test_text_completions_and_models_list(model: EmbeddedModel) -> None:
    client = model.openai_client()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = await client.completions.create(
        model="tiny", prompt=["What is ", "1+1"], n=2, max_tokens=5, logprobs=2, seed=3
    )
    assert len(r.choices) == 4
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.top_logprobs and len(lp.top_logprobs[0]) == 2


async def test_step_lock_and_fingerprint(model: EmbeddedModel) -> None:
    assert model.bump_step() == 1
    r = await chat(model)
    assert r.system_fingerprint == "tiny@step1"
    # a trainer holding the lock (in another thread) holds back generation until it lets go
    with holding_weights(model, then=model.bump_step) as release:
        task = asyncio.ensure_future(chat(model))
        await asyncio.sleep(0.2)
        assert not task.done()
        release.set()
        r2 = await task
    assert r2.system_fingerprint == "tiny@step2"


async def test_direct_generate(model: EmbeddedModel) -> None:
    one = await model.generate(USER, n=3, max_tokens=5, seed=4, top_logprobs=2)
    assert len(one) == 3 and all(len(s.token_ids) == len(s.logprobs) for s in one)  # type: ignore[union-attr]
    again = await model.generate(USER, n=3, max_tokens=5, seed=4)
    assert [s.text for s in one] == [s.text for s in again]  # type: ignore[union-attr]
    many = await model.generate([USER, [{"role": "user", "content": "hi"}]], n=2, max_tokens=4, seed=1)
    assert len(many) == 2 and all(len(x) == 2 for x in many)  # type: ignore[arg-type]
    via_http = await chat(model, n=3, max_tokens=5, seed=4)
    assert [c.message.content for c in via_http.choices] == [s.text for s in one]  # type: ignore[union-attr]
    with pytest.raises(RequestError, match="temperature"):
        await model.generate(USER, temperature=5.0)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"temperature": "hot"}, "temperature", "temperature must be a number, got 'hot'"),
        ({"top_p": True}, "top_p", "top_p must be a number, got True"),
        ({"n": "2"}, "n", "n must be an integer, got '2'"),
        ({"max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer, got 2.0"),
        ({"stop": 5}, "stop", "stop must be a string or a list of strings"),
        ({"stop": ["a", 1]}, "stop", "stop must be a string or a list of strings"),
        ({"stop": ["x"] * 17}, "stop", "stop may hold at most 16 strings, got 17"),
        ({"stop": ["a", ""]}, "stop", "stop strings must not be empty"),
    ],
)
async def test_direct_generate_checks_its_settings(
    model: EmbeddedModel, kwargs: dict[str, object], param: str, message: str
) -> None:
    with pytest.raises(RequestError) as info:
        await model.generate(USER, **kwargs)  # type: ignore[arg-type]
    assert info.value.param == param and str(info.value) == message


async def test_direct_generate_checks_its_messages(model: EmbeddedModel) -> None:
    for bad in ("What is 1+1?", b"hi", None):
        with pytest.raises(TypeError, match="messages must be a list of messages or a list of conversations"):
            await model.generate(bad)
    with pytest.raises(ValueError, match="messages must not be empty"):
        await model.generate([])


async def test_logit_bias_is_a_bounded_map(model: EmbeddedModel) -> None:
    from palaestra.models.engine import MAX_LOGIT_BIAS, prepare_params

    big = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}  # the size is refused before any key is looked at
    with pytest.raises(openai.BadRequestError) as info:
        await chat(model, logit_bias=big)
    assert info.value.param == "logit_bias"
    assert (
        f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {MAX_LOGIT_BIAS + 1}"
        in info.value.message
    )
    for bad in ([[3, 1.0]], "3:1"):
        with pytest.raises(RequestError, match="logit_bias must be an object mapping token ids to biases"):
            prepare_params(prompt_len=3, block_size=48, logit_bias=bad, vocab_size=model.tokenizer.vocab_size)


async def test_a_failing_pass_fails_its_requests_and_the_next_pass_serves(
    model: EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from palaestra.models import sampling

    real_step = sampling.DecodeBatch.step
    calls = 0

    def step(self: sampling.DecodeBatch) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom in the pass")
        return real_step(self)

    monkeypatch.setattr(sampling.DecodeBatch, "step", step)
    with pytest.raises(openai.InternalServerError) as info:
        await asyncio.wait_for(chat(model, n=2), 20)  # the error reaches the request: it never hangs
    assert info.value.status_code == 500
    assert info.value.body["message"] == "internal error while generating: RuntimeError: boom in the pass"  # type: ignore[index]
    ok = await chat(model, n=2, seed=3)
    assert len(ok.choices) == 2
    stats = model.stats.snapshot()
    assert (stats["requests"], stats["rows"], stats["generate_calls"]) == (2, 4, 2)  # the failed pass counted


def test_client_works_across_event_loops(model: EmbeddedModel) -> None:
    async def once() -> str:
        r = await chat(model, seed=1, max_tokens=4)
        return r.choices[0].message.content or ""

    assert asyncio.run(once()) == asyncio.run(once())


def test_save_and_load_round_trip(model: EmbeddedModel, tmp_path: object) -> None:
    from pathlib import Path

    model.card = {"note": "test"}
    model.bump_step()
    path = Path(str(tmp_path)) / "m.npz"
    model.save(path)
    back = EmbeddedModel.load(path)
    assert (back.name, back.step, back.card) == ("tiny", 1, {"note": "test"})
    for k, v in model.gpt.params.items():
        np.testing.assert_array_equal(back.gpt.params[k], v)
    assert EmbeddedModel.load(path, name="other").name == "other"


async def test_in_process_client_holds_the_body_limit(model: EmbeddedModel) -> None:
    from palaestra.models.server import ServerLimits, in_process_client

    app = create_app(model, limits=ServerLimits(max_body_bytes=2_000))
    client = in_process_client(app, "http://in-process/v1")
    big = [{"role": "user", "content": "1+1=" * 600}]
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model="tiny", messages=big)  # type: ignore[arg-type]
    assert info.value.status_code == 413 and info.value.code == "request_too_large"
    assert "this server accepts at most 2000" in info.value.message
    assert app.counters["body_too_large"] == 1 and model.stats.snapshot()["requests"] == 0
    ok = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)  # type: ignore[arg-type]
    assert ok.choices[0].message.content is not None


async def test_app_refuses_scopes_other_than_http(model: EmbeddedModel) -> None:
    async def receive() -> dict[str, object]:
        raise AssertionError("nothing is read from a websocket")

    async def send(message: object) -> None:
        raise AssertionError("nothing is sent on a websocket")

    with pytest.raises(RuntimeError, match="the palaestra server speaks HTTP, not websocket"):
        await create_app(model)({"type": "websocket", "path": "/v1/models"}, receive, send)


def test_create_app_checks_its_models(model: EmbeddedModel) -> None:
    with pytest.raises(TypeError, match="submit"):
        create_app(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        create_app({})
    app = create_app({"alias": model})
    assert app.models == {"alias": model}


async def test_context_overflow_is_context_length_exceeded(model: EmbeddedModel) -> None:
    """Client libraries recognise OpenAI's code: a 400 with error.code == "context_length_exceeded"."""
    client = model.openai_client()
    long_chat = [{"role": "user", "content": "1+1=" * 15}]
    huge_chat = [{"role": "user", "content": "x" * 200_000}]  # refused without tokenising it
    huge_parts = [{"role": "user", "content": [{"type": "text", "text": "x" * 100_000}] * 2}]  # the same
    for messages in (long_chat, huge_chat, huge_parts):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
        assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
        unread = messages is not long_chat  # "at least": counted from the characters, never tokenised
        assert ("the prompt is at least " in info.value.message) == unread, info.value.message
    for prompt in ("1+1=" * 20, ["ok", "y" * 100_000]):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny", prompt=prompt)
        assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    card = (await client.models.retrieve("tiny")).model_dump()
    assert card["context_length"] == model.block_size == 48


async def test_contract_breaking_settings_are_refused(model: EmbeddedModel) -> None:
    client = model.openai_client()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "calc"}}
    refused: list[tuple[dict[str, object], str, str, str | None]] = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
            "response_format 'json_schema' is not supported",
            "unsupported_value",
        ),
        ({"tool_choice": "required", "tools": tools}, "tool_choice", "cannot be forced", "unsupported_value"),
        ({"tool_choice": named, "tools": tools}, "tool_choice", "a named function", "unsupported_value"),
        (
            {"tool_choice": named},
            "tool_choice",
            "needs tools, and this request has none",
            "unsupported_value",
        ),
        ({"tool_choice": "foo"}, "tool_choice", "got 'foo'", None),
    ]
    for kwargs, param, message, code in refused:
        with pytest.raises(openai.BadRequestError) as info:
            await chat(model, **kwargs)
        assert info.value.param == param and message in info.value.message and info.value.code == code
    legacy = {"functions": [{"name": "calc", "parameters": {}}], "function_call": "auto"}
    for name, value in (*legacy.items(), ("modalities", ["text", "audio"]), ("web_search_options", {})):
        with pytest.raises(openai.BadRequestError) as info:
            await chat(model, extra_body={name: value})
        assert info.value.param == name and info.value.code == "unsupported_parameter"
    ok = await chat(model, response_format={"type": "text"}, modalities=["text"], seed=1)  # these are fine
    assert ok.choices[0].message.content is not None
    extras: list[dict[str, object]] = [{"echo": True}, {"suffix": "!"}, {"best_of": 3}]
    for extra in extras:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="1+1=", **extra)  # type: ignore[call-overload]


async def test_tool_choice_none_never_returns_markup() -> None:
    """Whatever the model wants to write, tool_choice="none" cuts the reply before any <call> markup."""
    from palaestra.models.tokenizer import default_vocab

    tok = Tokenizer([*default_vocab(), "<call>"])
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=48, d_model=32, n_layer=1, n_head=2, d_ff=64)
    m = EmbeddedModel(TinyGPT(cfg, tokenizer=tok, seed=2), name="tiny")
    tools = [{"type": "function", "function": {"name": "calc"}}]
    bias = {str(tok.id_of("<call>")): 100.0}  # the model writes markup and nothing else
    auto = await chat(m, tools=tools, logit_bias=bias, seed=3, max_tokens=12)
    assert "<call>" in (auto.choices[0].message.content or "")
    kwargs: dict[str, object] = {"tools": tools, "tool_choice": "none", "logit_bias": bias, "seed": 3}
    r = await chat(m, **kwargs, max_tokens=12, n=3)
    for c in r.choices:
        assert "<call>" not in (c.message.content or "") and not c.message.tool_calls
        assert c.finish_reason == "stop"
    text = ""
    async for ch in await chat(m, **kwargs, max_tokens=12, stream=True):  # type: ignore[attr-defined]
        text += "".join(c.delta.content or "" for c in ch.choices)
    assert "<call>" not in text


def _reference_greedy(
    gpt: TinyGPT, prompt: list[int], steps: int, bias: dict[int, float], presence: float, frequency: float
) -> list[int]:
    """Greedy decoding with OpenAI's logit_bias and penalties, written plainly over full forward passes."""
    ids, out = list(prompt), []
    counts = np.zeros(gpt.config.vocab_size)
    for _ in range(steps):
        logits = gpt.forward_logits(np.asarray([ids]))[0, -1].astype(np.float64)
        for t, b in bias.items():
            logits[t] += b
        logits -= counts * frequency + (counts > 0) * presence
        nxt = int(np.argmax(logits))
        out.append(nxt)
        ids.append(nxt)
        counts[nxt] += 1
        if nxt == gpt.tokenizer.end_id:
            break
    return out


@pytest.mark.parametrize(
    ("bias", "presence", "frequency"),
    [({}, 0.0, 0.0), ({5: 4.0, 9: -100.0}, 0.0, 0.0), ({}, 1.5, 0.0), ({}, 0.0, 2.0), ({7: 3.0}, -1.0, 1.0)],
)
async def test_logit_bias_and_penalties_are_honoured(
    model: EmbeddedModel, bias: dict[int, float], presence: float, frequency: float
) -> None:
    r = await chat(
        model,
        temperature=0.0,
        max_tokens=14,
        logprobs=True,
        logit_bias={str(k): v for k, v in bias.items()},
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    tok = model.tokenizer
    c = r.choices[0]
    assert c.logprobs is not None and c.logprobs.content is not None
    got = [tok.id_of(e.token) for e in c.logprobs.content]
    prompt = tok.render(USER).ids
    assert got == _reference_greedy(model.gpt, prompt, 14, bias, presence, frequency)
    # reported logprobs stay those of the raw model distribution (what the trainer recomputes)
    expected = model.gpt.logprobs_of(np.asarray([prompt + got]))[0][len(prompt) - 1 :]
    np.testing.assert_allclose([e.logprob for e in c.logprobs.content], expected, atol=2e-4)


async def test_sampled_logit_bias_and_backends_without_it() -> None:
    m = EmbeddedModel(tiny_gpt(), name="tiny")
    only = m.tokenizer.id_of("7")
    r = await chat(m, n=4, seed=2, max_tokens=6, logit_bias={str(only): 100.0})
    assert all(set(c.message.content or "") == {"7"} for c in r.choices)

    class NoExtras:  # a backend whose sampler has neither logit_bias nor penalties
        name, step, stats, block_size, tokenizer = "plain", 0, m.stats, m.block_size, m.tokenizer

        async def submit(self, *a: object) -> list[object]:
            raise AssertionError("must be refused before generation")

    transport = httpx.ASGITransport(app=create_app(NoExtras()))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for extra in ({"logit_bias": {"3": 1}}, {"presence_penalty": 0.5}, {"frequency_penalty": -1}):
            body = {"model": "plain", "messages": USER, **extra}
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == next(iter(extra))


async def test_in_process_request_cancelled_while_queued_is_never_generated(model: EmbeddedModel) -> None:
    """The in-process client's transport awaits the app in the caller's task: cancelling the call (a rollout
    deadline) cancels the queued job, which the engine drops without generating it."""
    with holding_weights(model), pytest.raises(asyncio.TimeoutError):  # the request waits in the queue
        await asyncio.wait_for(chat(model, n=3), 0.2)
    ok = await chat(model, n=2)
    stats = model.stats.snapshot(batches=False)
    assert len(ok.choices) == 2
    assert stats["cancelled"] == 1 and stats["requests"] == 1 and stats["rows"] == 2
