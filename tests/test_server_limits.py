"""Limits and fairness of the server: body size (413), slow bodies (408), rows and tokens per request (400),
big bodies parsed off the event loop, and no generation for clients that disconnected."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from server_fixtures import USER, holding_weights, serve_in_thread, tiny_model

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.engine import SamplingParams
from palaestra.models.server import ServerLimits, create_app


def error_of(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err  # type: ignore[no-any-return]


@pytest.fixture()
def model() -> EmbeddedModel:
    return tiny_model()


async def test_body_size_rows_and_tokens_limits(model: EmbeddedModel) -> None:
    limits = ServerLimits(max_body_bytes=32_768, max_rows=8, max_request_tokens=100)
    app = create_app(model, limits=limits)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40_000}]}
        r = await http.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

        async def chunks() -> Any:  # no Content-Length: the limit holds while reading
            for _ in range(10):
                yield b" " * 4000

        r = await http.post("/v1/completions", content=chunks())
        assert r.status_code == 413
        before = model.stats.snapshot()["requests"]
        many = {"model": "tiny", "prompt": ["1+1="] * 1000, "n": 128, "max_tokens": 4}
        r = await http.post("/v1/completions", json=many)
        # 1000 prompts x 128 (a 17 kB body) is refused before any prompt is tokenised or generated
        assert r.status_code == 400 and error_of(r)["code"] == "request_too_large"
        r = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "n": 9})
        assert r.status_code == 400 and error_of(r)["param"] == "n"
        # tokens: rows x (prompt + max_tokens); 8 rows x (a prompt + 16) exceed 100
        r = await http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": USER, "n": 8, "max_tokens": 16}
        )
        assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
        assert model.stats.snapshot()["requests"] == before  # nothing was generated for them
        ok = await http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 4}
        )
        assert ok.status_code == 200
        health = (await http.get("/health")).json()["server"]
        assert health["body_too_large"] == 2 and health["request_too_large"] == 3
    with pytest.raises(ValueError, match="max_rows"):
        ServerLimits(max_rows=0)


def test_big_body_does_not_block_a_tiny_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20 MB body is parsed and checked off the event loop: while its (here artificially slow) checks run,
    tiny requests are served, and the event loop's thread never plans a big body."""
    import palaestra.models.server as server

    threads: dict[str, set[str]] = {"big": set(), "tiny": set()}
    real = server.plan_chat

    def slow_plan(model: Any, table: Any, req: Any, limits: Any) -> Any:
        big = len(req.messages[0]["content"]) > 1_000_000
        threads["big" if big else "tiny"].add(threading.current_thread().name)
        if big:
            time.sleep(1.0)  # stands in for tokenising a huge prompt
        return real(model, table, req, limits)

    monkeypatch.setattr(server, "plan_chat", slow_plan)
    model = tiny_model()
    app = create_app(model, limits=ServerLimits(max_body_bytes=64 << 20))
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (20 << 20)}]}).encode()
    done: dict[str, float] = {}
    with serve_in_thread(app) as base:

        def send_big() -> None:
            r = httpx.post(base + "/v1/chat/completions", content=big, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            done["big"] = time.monotonic()

        t = threading.Thread(target=send_big)
        t.start()
        time.sleep(0.3)
        with httpx.Client(base_url=base, timeout=60) as http:
            for _ in range(3):
                r = http.post(
                    "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2}
                )
                assert r.status_code == 200
        done["tiny"] = time.monotonic()
        t.join(60)
    assert done["tiny"] < done["big"], done
    assert threads["big"] and not threads["big"] & threads["tiny"]  # small bodies inline, big ones not


def read_response(sock: socket.socket) -> str:
    """One HTTP/1.1 response with a Content-Length, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\r\n\r\n"
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_slow_body_times_out_without_holding_others() -> None:
    model = tiny_model()
    app = create_app(model, limits=ServerLimits(body_timeout_s=0.5))
    with serve_in_thread(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": '
            )
            # meanwhile, a good client is served
            r = httpx.post(
                base + "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2}
            )
            assert r.status_code == 200
            reply = read_response(sock)
        head, body = reply.split("\r\n\r\n", 1)
        assert head.startswith("HTTP/1.1 408"), reply
        assert json.loads(body)["error"]["code"] == "timeout"
        assert httpx.get(base + "/health").json()["server"]["body_timeout"] == 1


def test_disconnected_clients_get_no_generation() -> None:
    """Requests whose clients leave while queued (here: while the trainer holds the weights) are dropped
    before generation, and counted."""
    model = tiny_model()
    with serve_in_thread(create_app(model)) as base:
        body = {"model": "tiny", "messages": USER, "max_tokens": 8, "n": 4}

        def queued() -> list[Any]:  # the jobs waiting in the server's engine (one per request)
            return [job for engine in list(model._engines.values()) for job in list(engine._pending)]

        async def until(ready: Any, what: str) -> None:  # event-driven: no timing bound is under test
            deadline = time.monotonic() + 20
            while not await ready():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.01)

        async def ask() -> None:  # leaves when cancelled, closing its connection
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                await http.post("/v1/chat/completions", json=body)

        async def run() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:

                async def disconnected() -> int:
                    return int((await http.get("/health")).json()["server"]["disconnected"])

                with holding_weights(model):  # the first pass waits for the weights, the rest queue behind it
                    first = asyncio.ensure_future(ask())

                    async def n_queued(n: int) -> bool:
                        return len(queued()) == n

                    await until(lambda: n_queued(1), "the first request was not queued")
                    rest = [asyncio.ensure_future(ask()) for _ in range(6)]
                    await until(lambda: n_queued(7), "the seven requests were not queued")
                    for client in (first, *rest):  # the clients leave while their requests are queued
                        client.cancel()
                    await asyncio.gather(first, *rest, return_exceptions=True)

                    async def all_gone() -> bool:
                        return await disconnected() == 7 and all(job.gone for job in queued())

                    await until(all_gone, "the server did not see the seven clients leave")
                ok = await http.post("/v1/chat/completions", json=body)
                assert ok.status_code == 200
                health = (await http.get("/health")).json()
            stats = health["models"]["tiny"]["stats"]
            assert health["server"]["disconnected"] == 7
            # a pass takes its jobs once it holds the weights: none of the seven reached the model
            assert stats["cancelled"] == 7
            assert stats["requests"] == 1  # the good one
            assert stats["rows"] == 4
            assert stats["tokens"] == ok.json()["usage"]["completion_tokens"]

        asyncio.run(run())


async def test_small_requests_are_not_queued_behind_big_ones() -> None:
    """While big requests wait, a small one joins the next pass."""
    model = tiny_model(max_batch_rows=64)
    order: list[str] = []

    async def ask(tag: str, n: int) -> None:
        await model.generate(USER, n=n, max_tokens=2, seed=1)
        order.append(tag)

    with holding_weights(model) as release:
        first = asyncio.ensure_future(ask("first", 1))  # takes the pass that waits for the lock
        await asyncio.sleep(0.1)
        tasks = [asyncio.ensure_future(ask(f"big{i}", 64)) for i in range(3)]
        await asyncio.sleep(0.05)
        tasks.append(asyncio.ensure_future(ask("small", 2)))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(first, *tasks)
    assert order.index("small") == 1, order  # right after the pass that was running
    assert order[2:] == ["big0", "big1", "big2"]


async def test_big_replies_are_built_off_the_event_loop(
    model: EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import palaestra.models.server as server

    where: list[tuple[int, bool]] = []
    real = server.chat_body

    def spy(plan: Any) -> dict[str, Any]:
        where.append((len(plan.results[0]), threading.current_thread() is threading.main_thread()))
        return real(plan)

    monkeypatch.setattr(server, "chat_body", spy)
    client = model.openai_client()
    big = await client.chat.completions.create(
        model="tiny",
        messages=USER,
        n=64,
        max_tokens=20,
        logprobs=True,
        top_logprobs=20,
        seed=1,  # type: ignore[arg-type]
    )
    small = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)  # type: ignore[arg-type]
    assert len(big.choices) == 64 and len(small.choices) == 1
    assert where == [(64, False), (1, True)]


async def test_a_job_waiting_too_long_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import palaestra.models.engine as engine

    monkeypatch.setattr(engine, "STARVATION_S", 0.2)
    model = tiny_model(max_batch_rows=64)
    order: list[str] = []

    async def ask(tag: str, n: int) -> None:
        await model.generate(USER, n=n, max_tokens=2, seed=1)
        order.append(tag)

    with holding_weights(model) as release:
        first = asyncio.ensure_future(ask("first", 1))
        await asyncio.sleep(0.1)
        big = asyncio.ensure_future(ask("big", 64))
        await asyncio.sleep(0.4)  # the big job has now waited longer than STARVATION_S
        small = asyncio.ensure_future(ask("small", 16))  # smaller, but above the small-request headroom
        await asyncio.sleep(0.02)
        release.set()
        await asyncio.gather(first, big, small)
    assert order == ["first", "big", "small"]


async def test_a_caller_leaving_mid_generation_stops_its_rows_at_the_next_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Continuous batching: the rows of a request whose caller goes away leave the running batch at the next
    decoding step, while the other rows go on."""
    from palaestra.models import sampling

    model = tiny_model()
    loop = asyncio.get_running_loop()
    real_step = sampling.DecodeBatch.step
    steps = 0
    doomed: asyncio.Future[Any] | None = None

    def step(self: sampling.DecodeBatch) -> Any:
        nonlocal steps
        out = real_step(self)
        steps += 1
        if steps == 2 and doomed is not None:  # after two tokens, its caller goes away
            loop.call_soon_threadsafe(doomed.cancel)
            time.sleep(0.3)  # the loop cancels it before the next step
        return out

    monkeypatch.setattr(sampling.DecodeBatch, "step", step)
    ids = model.tokenizer.render(USER).ids
    no_end = SamplingParams(max_tokens=20, logit_bias=((model.tokenizer.end_id, -100.0),))  # never ends early
    before = model.stats.snapshot()
    doomed = asyncio.ensure_future(model.submit(ids, no_end, [1, 2, 3, 4]))
    other = asyncio.ensure_future(model.submit(ids, no_end, [5]))
    with pytest.raises(asyncio.CancelledError):
        await doomed
    kept = await other
    after = model.stats.snapshot()
    assert after["requests"] - before["requests"] == 2
    # the doomed rows generated two tokens each; the other one went on to its own end
    assert after["tokens"] - before["tokens"] == 4 * 2 + len(kept[0].token_ids)
    assert len(kept[0].token_ids) == min(20, model.block_size - len(ids)) > 2


async def test_a_waiting_trainer_gets_the_weights_while_requests_keep_coming() -> None:
    """A continuous pass stops admitting new jobs once another thread waits for the model's lock: the
    trainer gets the weights after the running rows end, though requests never stop arriving."""
    model = tiny_model()
    stop = asyncio.Event()
    served = 0

    async def client(seed: int) -> None:
        nonlocal served
        while not stop.is_set():
            await model.generate(USER, n=2, max_tokens=8, seed=seed)
            served += 1

    clients = [asyncio.ensure_future(client(i)) for i in range(8)]
    await asyncio.sleep(0.3)
    passes = model.stats.snapshot()["generate_calls"]
    got: list[float] = []

    def trainer() -> None:
        t0 = time.monotonic()
        with model.lock:
            got.append(time.monotonic() - t0)

    t = threading.Thread(target=trainer)
    t.start()
    deadline = time.monotonic() + 10.0
    while t.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    before = served
    await asyncio.sleep(0.2)  # requests go on after the update
    stop.set()
    await asyncio.gather(*clients)
    t.join()
    assert got[0] < 10.0
    assert served > before
    assert (
        model.stats.snapshot()["generate_calls"] > passes
    )  # the pass ended for the trainer, a new one began


def test_a_client_leaving_while_sending_its_body_is_counted_and_unanswered() -> None:
    model = tiny_model()
    with serve_in_thread(create_app(model)) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": '
            )
        # the client is gone with 990 bytes of its body unsent: the server stops reading and counts it
        deadline = time.monotonic() + 20
        while (health := httpx.get(base + "/health").json())["server"]["disconnected"] == 0:
            assert time.monotonic() < deadline, "the server did not see the client leave"
            time.sleep(0.01)
    assert health["server"] == {**dict.fromkeys(health["server"], 0), "disconnected": 1}  # not a timeout
    assert health["models"]["tiny"]["stats"]["requests"] == 0


async def test_a_cancelled_request_task_cancels_its_generation() -> None:
    """An ASGI server that cancels a request's task (as some do when the client leaves, or at shutdown) cancels
    the generation the task was waiting for: a queued request never reaches the model."""
    model = tiny_model()
    app = create_app(model)
    body = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 4}).encode()
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", str(len(body)).encode())],
    }
    with holding_weights(model):  # the request waits in the queue for the weights
        task = asyncio.ensure_future(app(scope, receive, send))
        deadline = time.monotonic() + 20
        while not any(engine._pending for engine in list(model._engines.values())):
            assert time.monotonic() < deadline, "the request was not queued"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    ok = await model.generate(USER, max_tokens=2, seed=1)
    stats = model.stats.snapshot()
    assert sent == [] and stats["cancelled"] == 1 and stats["requests"] == 1  # only the later one
    assert len(ok) == 1


async def test_while_a_trainer_waits_only_jobs_that_end_in_time_join_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a trainer waits for the weights, the running pass still takes a job that ends within its running
    rows' steps (it does not hold the trainer back) and leaves a longer one for after the update."""
    from palaestra.models import sampling

    model = tiny_model()
    loop = asyncio.get_running_loop()
    ids = model.tokenizer.render(USER).ids
    end = model.tokenizer.end_id

    def no_end(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, logit_bias=((end, -100.0),))

    trainer = threading.Thread(target=model.bump_step)  # blocks on the lock the pass holds
    late: list[asyncio.Future[Any]] = []
    real_step = sampling.DecodeBatch.step
    steps = 0

    def step(self: sampling.DecodeBatch) -> Any:
        nonlocal steps
        steps += 1
        if steps == 2:  # on the pass thread, with the first row running: the trainer waits, two jobs arrive
            trainer.start()
            deadline = time.monotonic() + 10
            while not model.lock.waiting:
                assert time.monotonic() < deadline, "the trainer never waited"
                time.sleep(0.001)

            def arrive() -> None:
                late.append(asyncio.ensure_future(model.submit(ids, no_end(3), [2])))
                late.append(asyncio.ensure_future(model.submit(ids, no_end(30), [3])))

            loop.call_soon_threadsafe(arrive)
            while sum(len(e._pending) for e in list(model._engines.values())) < 2:
                assert time.monotonic() < deadline, "the two jobs were not queued"
                time.sleep(0.001)
        return real_step(self)

    monkeypatch.setattr(sampling.DecodeBatch, "step", step)
    first = await model.submit(ids, no_end(20), [1])
    short, long = [(await fut)[0] for fut in late]
    trainer.join(10)
    assert len(first[0].token_ids) == 20 and len(short.token_ids) == 3
    assert (first[0].step, short.step) == (0, 0)  # generated before the update
    assert long.step == 1 and model.step == 1  # after it
