"""RemoteModel: round-robin over real OpenAI-compatible HTTP endpoints with per-endpoint concurrency caps."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import openai
import pytest

from palaestra.models.remote import RemoteModel
from palaestra.testing import Reply, ScriptedServer

SECRET = "sk-palaestra-test-SECRET-1234567890"
USER = [{"role": "user", "content": "hi"}]


class Gauge:
    """Counts requests a scripted server is handling at once (the script itself sleeps)."""

    def __init__(self, label: str, delay: float = 0.05) -> None:
        self.label, self.delay = label, delay
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, request: dict[str, Any], n: int) -> str:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.delay)
        with self.lock:
            self.now -= 1
        return f"from {self.label}"


async def test_round_robin_and_per_endpoint_cap() -> None:
    ga, gb = Gauge("a"), Gauge("b")
    with ScriptedServer(ga) as a, ScriptedServer(gb) as b:
        model = RemoteModel(
            "scripted", [a.base_url, b.base_url], api_key=SECRET, max_concurrency_per_endpoint=3
        )
        client = model.openai_client()
        assert model.openai_client() is client  # cached per event loop
        t0 = time.perf_counter()
        rs = await asyncio.gather(
            *[client.chat.completions.create(model="scripted", messages=USER) for _ in range(24)]
        )
        elapsed = time.perf_counter() - t0
    texts = [r.choices[0].message.content for r in rs]
    assert texts.count("from a") == 12 and texts.count("from b") == 12
    assert a.calls == 12 and b.calls == 12
    assert ga.peak <= 3 and gb.peak <= 3
    assert ga.peak >= 2 and gb.peak >= 2  # requests did overlap
    assert elapsed >= 24 / 6 * 0.05 * 0.9  # 6 slots at a time
    stats = model.endpoint_stats()
    assert [s["requests"] for s in stats] == [12, 12]
    assert all(s["peak_in_flight"] <= 3 and s["in_flight"] == 0 for s in stats)


async def test_full_endpoint_is_skipped_for_a_free_one() -> None:
    slow, fast = Gauge("slow", delay=0.3), Gauge("fast", delay=0.0)
    with ScriptedServer(slow) as a, ScriptedServer(fast) as b:
        model = RemoteModel("m", [a.base_url, b.base_url], api_key=SECRET, max_concurrency_per_endpoint=1)
        client = model.openai_client()
        first = asyncio.ensure_future(client.chat.completions.create(model="m", messages=USER))
        await asyncio.sleep(0.05)  # the slow endpoint is now busy
        others = [await client.chat.completions.create(model="m", messages=USER) for _ in range(3)]
        assert [r.choices[0].message.content for r in others] == ["from fast"] * 3
        assert (await first).choices[0].message.content == "from slow"


async def test_paths_and_bodies_are_forwarded() -> None:
    with ScriptedServer("ok", model="remote-x") as a:
        model = RemoteModel("remote-x", a.base_url + "/", api_key=SECRET)
        client = model.openai_client()
        r = await client.chat.completions.create(model="remote-x", messages=USER, temperature=0.3, n=2)
        assert [c.message.content for c in r.choices] == ["ok", "ok"]
        assert a.requests[0]["temperature"] == 0.3 and a.requests[0]["messages"] == USER
        listed = await client.models.list()
        assert [m.id for m in listed.data] == ["remote-x"]


async def test_key_never_in_repr_or_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALAESTRA_TEST_KEY", SECRET)
    model = RemoteModel("m", "http://user:pw@127.0.0.1:9/v1", api_key_env="PALAESTRA_TEST_KEY")
    assert model.has_api_key
    for text in (repr(model), str(model), str(model.endpoint_stats())):
        assert SECRET not in text and "pw" not in text
    with pytest.raises(TypeError):
        __import__("pickle").dumps(model)

    def deny(request: dict[str, Any], n: int) -> Reply:
        return Reply("invalid api key", status=401)

    with ScriptedServer(deny) as a:
        model = RemoteModel("m", a.base_url, api_key=SECRET, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            await model.openai_client().chat.completions.create(model="m", messages=USER)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    model = RemoteModel("m", dead, api_key=SECRET, max_retries=0, timeout=5)
    with pytest.raises(openai.APIConnectionError) as conn:
        await model.openai_client().chat.completions.create(model="m", messages=USER)
    assert SECRET not in str(conn.value) and SECRET not in repr(conn.value)
    assert model.endpoint_stats()[0]["failures"] == 1 and model.endpoint_stats()[0]["in_flight"] == 0


def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="http"):
        RemoteModel("m", "ftp://x")
    with pytest.raises(ValueError, match="at least one"):
        RemoteModel("m", [])
    with pytest.raises(ValueError, match="max_concurrency"):
        RemoteModel("m", "http://x/v1", max_concurrency_per_endpoint=0)
    for model in ("", None, 3):
        with pytest.raises(ValueError, match=rf"model must be a non-empty string, got {model!r}"):
            RemoteModel(model, "http://x/v1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="base_url must be a string or a list of strings, got int"):
        RemoteModel("m", ["http://x/v1", 8000])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="base_url must be a string or a list of strings, got bytes"):
        RemoteModel("m", [b"http://x/v1"])  # type: ignore[list-item]
    m = RemoteModel("m", "http://x/v1")
    assert not m.has_api_key and m.step is None and m.name == "m"


def test_client_made_outside_a_loop_works_inside_one() -> None:
    with ScriptedServer("hello") as a:
        client = RemoteModel("m", a.base_url, api_key=SECRET).openai_client()

        async def go() -> str | None:
            r = await client.chat.completions.create(model="m", messages=USER)
            return r.choices[0].message.content

        assert asyncio.run(go()) == "hello"
