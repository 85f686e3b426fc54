"""Streaming (``stream=true``): the real ``openai`` client reads server-sent events, in-process and over HTTP,
and gets exactly the tokens of the same request without streaming."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import USER, serve_in_thread, tiny_model

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.engine import EngineStats, Sample, SamplingParams
from palaestra.models.remote import http_module
from palaestra.models.server import create_app
from palaestra.models.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


async def collect_chat(stream: Any) -> tuple[dict[int, dict[str, Any]], list[Any]]:
    """Accumulate chat chunks per choice: content, tool calls, logprob entries, finish reason."""
    out: dict[int, dict[str, Any]] = {}
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            acc = out.setdefault(c.index, {"content": "", "calls": {}, "entries": [], "finish": None})
            assert acc["finish"] is None, "no delta after a choice's finish_reason"
            if c.delta.content:
                acc["content"] += c.delta.content
            for tc in c.delta.tool_calls or []:
                call = acc["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            if c.logprobs is not None and c.logprobs.content:
                acc["entries"] += c.logprobs.content
            if c.finish_reason is not None:
                acc["finish"] = c.finish_reason
    return out, chunks


@pytest.fixture()
def model() -> EmbeddedModel:
    return tiny_model(end_bias=2.0)


async def test_chat_stream_matches_non_streamed(model: EmbeddedModel) -> None:
    client = model.openai_client()
    args: dict[str, Any] = {
        "model": "tiny",
        "messages": USER,
        "n": 3,
        "seed": 11,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["zz"],
    }
    plain = await client.chat.completions.create(**args)
    stream = await client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    got, chunks = await collect_chat(stream)
    assert sorted(got) == [0, 1, 2]
    for c in plain.choices:
        acc = got[c.index]
        assert acc["content"] == c.message.content
        assert acc["finish"] == c.finish_reason and not acc["calls"]
        assert c.logprobs is not None and c.logprobs.content is not None
        assert [e.token for e in acc["entries"]] == [e.token for e in c.logprobs.content]
        assert [e.logprob for e in acc["entries"]] == [e.logprob for e in c.logprobs.content]
        assert all(len(e.top_logprobs) == 2 for e in acc["entries"])
    # usage only on the last chunk, which has no choices; every other chunk has usage null
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(ch.usage is None for ch in chunks[:-1])
    assert {ch.id for ch in chunks} == {chunks[0].id}
    assert {ch.system_fingerprint for ch in chunks} == {"tiny@step0"}


async def test_stream_without_usage_and_raw_events(model: EmbeddedModel) -> None:
    transport = httpx.ASGITransport(app=create_app(model))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"model": "tiny", "messages": USER, "stream": True, "seed": 1, "max_tokens": 5}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        objs = [json.loads(e) for e in events[:-1]]
        assert all("usage" not in o for o in objs)  # not asked for
        assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
        assert objs[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        # stream_options without stream is a clean 400
        bad = await http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": USER, "stream_options": {"include_usage": True}},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"


async def test_completions_stream_matches_non_streamed(model: EmbeddedModel) -> None:
    client = model.openai_client()
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": ["What is ", "1+1="],
        "n": 2,
        "seed": 3,
        "max_tokens": 9,
        "logprobs": 2,
    }
    plain = await client.completions.create(**args)
    stream = await client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens or [])
                assert all(len(t) == 2 for t in c.logprobs.top_logprobs or [])
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert len(plain.choices) == 4
    for c in plain.choices:
        assert texts[c.index] == c.text and finish[c.index] == c.finish_reason
        assert c.logprobs is not None and tokens[c.index] == c.logprobs.tokens
    assert usage == plain.usage


class Scripted:
    """A Servable replying with given texts (drives the tool-call deltas exactly)."""

    def __init__(self, replies: Sequence[str]) -> None:
        self.name, self.step, self.stats, self.block_size = "scripted", 0, EngineStats(), 512
        self.tokenizer = Tokenizer.default()  # character tokens: the markup spans many tokens
        self.replies = list(replies)

    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Sample]:
        out = []
        for seed in seeds:
            text = self.replies.pop(0)
            ids = [*self.tokenizer.encode(text), self.tokenizer.end_id]
            lps = [-0.1 * (i + 1) for i in range(len(ids))]
            out.append(Sample(text, ids, lps, [], "stop", list(prompt_ids), seed, 0))
        return out


async def test_tool_call_deltas() -> None:
    reply = 'Let me see.<call>calc {"expression":"81*92"}</call><call>calc {"expression":"1+2"}</call>'
    policy = Scripted([reply, reply])
    httpx2 = http_module()
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(policy)), base_url="http://t/v1")
    client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", http_client=http, max_retries=0)
    args: dict[str, Any] = {
        "model": "scripted",
        "messages": USER,
        "tools": TOOLS,
        "seed": 5,
        "logprobs": True,
    }
    plain = await client.chat.completions.create(**args)
    got, _ = await collect_chat(await client.chat.completions.create(**args, stream=True))
    await client.close()
    msg, acc = plain.choices[0].message, got[0]
    assert plain.choices[0].finish_reason == acc["finish"] == "tool_calls"
    assert acc["content"] == msg.content == "Let me see."
    calls = [acc["calls"][k] for k in sorted(acc["calls"])]
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
        (t.id, t.function.name, t.function.arguments) for t in msg.tool_calls or []
    ]
    # every token's logprob arrives exactly once, in order
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert [e.logprob for e in acc["entries"]] == [e.logprob for e in plain.choices[0].logprobs.content]


def test_stream_over_http_on_localhost() -> None:
    import asyncio

    model = tiny_model(end_bias=2.0)
    with serve_in_thread(create_app(model)) as base:

        async def run() -> None:
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
                args: dict[str, Any] = {
                    "model": "tiny",
                    "messages": USER,
                    "n": 2,
                    "seed": 4,
                    "max_tokens": 10,
                    "logprobs": True,
                }
                plain = await client.chat.completions.create(**args)
                got, chunks = await collect_chat(
                    await client.chat.completions.create(
                        **args, stream=True, stream_options={"include_usage": True}
                    )
                )
                for c in plain.choices:
                    assert got[c.index]["content"] == c.message.content
                    assert got[c.index]["finish"] == c.finish_reason
                assert chunks[-1].usage == plain.usage

        asyncio.run(run())
    # the sync client too
    with serve_in_thread(create_app(model)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        chunks = client.chat.completions.create(model="tiny", messages=USER, seed=4, stream=True)  # type: ignore[arg-type]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)  # type: ignore[union-attr]
        again = client.chat.completions.create(model="tiny", messages=USER, seed=4)  # type: ignore[arg-type]
        assert text == again.choices[0].message.content
        client.close()
