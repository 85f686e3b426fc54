"""`palaestra serve` as a real subprocess on 127.0.0.1, driven by the real ``openai`` client over HTTP."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.remote import RemoteModel
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What is 3+4? Reply with one line: Final: <int>"}]
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=48, d_model=32, n_layer=1, n_head=2, d_ff=64)
    gpt = TinyGPT(cfg, tokenizer=tok, seed=3)
    gpt.params["head.b"][tok.end_id] += 3.0  # end some turns early so both finish reasons occur
    path = tmp_path_factory.mktemp("serve") / "tiny.npz"
    EmbeddedModel(gpt, name="tiny").save(path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "palaestra", "serve", "--model", str(path), "--port", str(port)),
            *("--max-body-bytes", "65536", "--max-rows-per-request", "64"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise RuntimeError(f"palaestra serve exited with {proc.returncode}:\n{out}")
            try:
                if httpx.get(base + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("palaestra serve did not become ready in 30 s")
            time.sleep(0.1)
        yield base + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def test_http_chat_with_logprobs(server: str) -> None:
    async with client(server) as c:
        models = await c.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        r = await c.chat.completions.create(
            model="tiny", messages=USER, n=8, max_tokens=10, logprobs=True, top_logprobs=2, seed=11
        )
        assert len(r.choices) == 8 and r.system_fingerprint == "tiny@step0"
        assert r.usage is not None
        assert r.usage.completion_tokens == sum(
            len(ch.logprobs.content or []) for ch in r.choices if ch.logprobs
        )
        for ch in r.choices:
            assert ch.logprobs is not None and ch.logprobs.content
            assert all(len(e.top_logprobs) == 2 for e in ch.logprobs.content)
            if ch.finish_reason == "stop":
                assert ch.logprobs.content[-1].token == "<|end|>"
            else:
                assert ch.finish_reason == "length" and len(ch.logprobs.content) == 10


async def test_http_seed_determinism_under_concurrency(server: str) -> None:
    async with client(server) as c:

        async def ask(seed: int, max_tokens: int = 12) -> list[str | None]:
            r = await c.chat.completions.create(
                model="tiny", messages=USER, n=2, seed=seed, max_tokens=max_tokens
            )
            return [ch.message.content for ch in r.choices]

        alone = await ask(42)
        crowd = await asyncio.gather(
            *[ask(i, 3 + i % 9) for i in range(15)], ask(42), *[ask(i) for i in range(15)]
        )
        assert crowd[15] == alone
        assert alone == await ask(42)


async def test_http_stop_and_length(server: str) -> None:
    async with client(server) as c:
        r = await c.chat.completions.create(
            model="tiny", messages=USER, max_tokens=2, seed=1, temperature=0.0
        )
        assert r.choices[0].finish_reason in ("length", "stop")
        for seed in range(20):
            full = await c.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=seed)
            text = full.choices[0].message.content or ""
            if full.choices[0].finish_reason == "length" and len(text) >= 4:
                break
        else:
            pytest.fail("no long completion in 20 seeds")
        assert full.usage is not None and full.usage.completion_tokens == 16
        cut = await c.chat.completions.create(
            model="tiny", messages=USER, max_tokens=16, seed=seed, stop=text[2]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[: text.index(text[2])]


async def test_http_errors(server: str) -> None:
    async with client(server) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nope", messages=USER)
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="tiny", messages=USER, max_tokens=-5)
        assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="tiny", messages=USER, temperature=9)
    async with httpx.AsyncClient(base_url=server) as http:
        for body in (
            b"{oops",
            b'{"model": "tiny", "messages": "hi"}',
            b'{"model": "tiny", "messages": [], "n": 1}',
        ):
            r = await http.post(
                "/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"


async def test_http_batching_and_remote_model_client(server: str) -> None:
    base = server.removesuffix("/v1")
    async with httpx.AsyncClient() as http:
        before = (await http.get(base + "/health")).json()["models"]["tiny"]["stats"]
    # RemoteModel pointed twice at the same server: the rollout code is the same as for an embedded model
    remote = RemoteModel(
        "tiny", [server, server + "/"], api_key="sk-test-not-a-real-key", max_concurrency_per_endpoint=16
    )
    c = remote.openai_client()
    rs = await asyncio.gather(
        *[c.chat.completions.create(model="tiny", messages=USER, max_tokens=6, seed=i) for i in range(32)]
    )
    assert all(len(r.choices) == 1 for r in rs)
    async with httpx.AsyncClient() as http:
        after = (await http.get(base + "/health")).json()["models"]["tiny"]["stats"]
    assert after["requests"] - before["requests"] == 32
    assert after["generate_calls"] - before["generate_calls"] <= 12, (before, after)
    stats = remote.endpoint_stats()
    assert [s["requests"] for s in stats] == [16, 16]
    assert all(s["peak_in_flight"] <= 16 for s in stats)


async def test_http_limits_from_serve_flags(server: str) -> None:
    """`palaestra serve --max-body-bytes/--max-rows-per-request` bound each request, with OpenAI errors."""
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]}
        r = await http.post("/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        many = {"model": "tiny", "prompt": ["1+1="] * 33, "n": 2, "max_tokens": 2}
        r = await http.post("/completions", json=many)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        long = {"model": "tiny", "messages": [{"role": "user", "content": "1+1=" * 30}]}
        r = await http.post("/chat/completions", json=long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        ok = await http.post("/completions", json={**many, "prompt": ["1+1="] * 32})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


def test_serve_refuses_bad_limits() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "palaestra", "serve", "--max-rows-per-request", "0", "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and "max_rows" in proc.stderr and "Traceback" not in proc.stderr
