"""Chat-completions throughput of the embedded policy's OpenAI-compatible server, 64 concurrent clients.

    python benchmarks/server_throughput.py [--quick] [--clients 64] [--n 8] [--max-tokens 16] [--seconds 6]
                                           [--client-procs 1] [--no-logprobs] [--no-http] [--json]

Each client loops: one ``chat.completions.create`` (an arithmetic prompt, ``n`` choices, temperature 1,
``logprobs=True`` unless --no-logprobs) through the real ``openai`` client, until the time is up. The paths:

* ``raw_generate``: the same load through ``EmbeddedModel.generate`` (the same batching engine, no API): raw
  batched generation, the reference of the ratios;
* ``in_process``: ``model.openai_client()`` (a transport that calls the app's handler, no socket); clients, server and generation
  share one process, so the openai client's own CPU per request counts against the server;
* ``http``: ``palaestra serve`` in a subprocess on 127.0.0.1, the clients in ``--client-procs`` other
  processes: the server process's CPU is the server's own work (parsing, tokenising, batching, generation,
  response building), and the clients' CPU is reported apart.
* ``http_rollouts``: the same server and openai clients, each request sent by the route of palaestra's shipped
  rollouts (``palaestra.envs.rollouts.request_choices``: the client's ``post``, the reply validated as the SDK's
  ``ChatCompletion``), which costs the client about half the CPU of ``create``;
* ``http_light``: the same server, the same requests, sent by a light load generator (the HTTP client the
  openai client is built on, used bare: it posts the JSON body and reads ``usage`` from the JSON reply, as serving benchmarks such as vLLM's do) instead of the
  openai client, whose response parsing costs the shared cores more than the server's own work: on a 2-core
  machine the openai clients leave the server part of a core, so this path shows what the server does when
  the load generator is not the bottleneck. Off with ``--no-light``.

Reported: generated tokens/s (``usage.completion_tokens``, ``<|end|>`` included), requests/s, choices/s,
rows per generation pass, CPU seconds per process, and each API path over ``raw_generate`` in tokens/s and
in tokens per CPU-second of its process (for ``http``: of the server process). Target (issue 19): server
tokens/s vs raw batched generation on the same machine >= 0.6. On a machine shared with other work (or with
the client processes on the same cores) the wall-clock figures drop; the per-CPU-second ratio is less
sensitive to that. The model is ``arith-base`` when shipped (replies are short: ``Final: <int>`` then
``<|end|>``), else a random model of the same shape (replies run to max_tokens). Absolute target: >= 20,000
generated tokens/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from palaestra.envs.arithmetic_data import make_problem  # noqa: E402
from palaestra.models import registry  # noqa: E402
from palaestra.models.embedded import EmbeddedModel  # noqa: E402
from palaestra.models.engine import Sample  # noqa: E402

TARGET = 20_000
TARGET_RATIO = 0.6  # server tokens/s over raw batched generation (EmbeddedModel.generate), same machine


@dataclass(frozen=True)
class Load:
    """What the clients send."""

    clients: int = 64
    n: int = 8
    max_tokens: int = 16
    logprobs: bool = True
    seconds: float = 6.0


def bench_model(spec: str | None = None) -> EmbeddedModel:
    """``spec``: a shipped name or .npz path, "random" (random weights, arith-base's shape), or None (the
    shipped arith-base if present, else random)."""
    if spec is None and "arith-base" in registry.available():
        spec = "arith-base"
    if spec not in (None, "random"):
        return registry.load(spec)
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, d_model=64, n_layer=2, n_head=4, d_ff=256)
    return EmbeddedModel(TinyGPT(cfg, tokenizer=tok, seed=0), name="random-d64")


@functools.cache
def prompts(k: int = 256) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": make_problem(i % 100, "+-"[i % 2], (7 * i) % 100)["prompt"]}]
        for i in range(k)
    ]


def request_body(name: str, load: Load, i: int) -> dict[str, Any]:
    """Client ``i``'s chat-completions request (the same for every client kind)."""
    msgs = prompts()
    return {
        "model": name,
        "messages": msgs[i % len(msgs)],
        "n": load.n,
        "max_tokens": load.max_tokens,
        "temperature": 1.0,
        "logprobs": load.logprobs,
    }


def openai_asker(client: openai.AsyncOpenAI, name: str, load: Load) -> Any:
    """One request through the openai client: ``(choices, completion tokens)``."""

    async def ask(i: int) -> tuple[int, int]:
        r = await client.chat.completions.create(**request_body(name, load, i))
        return len(r.choices), r.usage.completion_tokens if r.usage else 0

    return ask


def rollouts_asker(client: openai.AsyncOpenAI, name: str, load: Load) -> Any:
    """One request through the openai client by the route of palaestra's shipped rollouts
    (:func:`palaestra.envs.rollouts.request_choices`: the client's ``post``, the reply validated as a
    ``ChatCompletion``)."""
    from types import SimpleNamespace

    from palaestra.envs.rollouts import request_choices

    policy: Any = SimpleNamespace(name=name, openai_client=lambda: client)

    async def ask(i: int) -> tuple[int, int]:
        body = request_body(name, load, i)
        choices, r = await request_choices(
            policy,
            body["messages"],
            load.n,
            temperature=1.0,
            max_tokens=load.max_tokens,
            logprobs=load.logprobs,
        )
        return len(choices), r.usage.completion_tokens if r.usage else 0

    return ask


def light_asker(http: Any, base: str, name: str, load: Load) -> Any:
    """One request as a load generator sends it: the JSON body by a bare HTTP client, the reply read with
    ``json``."""

    async def ask(i: int) -> tuple[int, int]:
        r = await http.post(base + "/v1/chat/completions", json=request_body(name, load, i))
        r.raise_for_status()
        reply = json.loads(r.content)
        return len(reply["choices"]), int(reply["usage"]["completion_tokens"])

    return ask


async def drive(ask_one: Any, load: Load, started: Any = None) -> dict[str, Any]:
    """Warm up (one request per client), call ``started()`` (where callers take their CPU and engine
    snapshots, so the warm-up is not counted), then run the clients for ``load.seconds``; ``ask_one(i)``
    sends client ``i``'s request and returns ``(choices, completion tokens)``."""
    counts = {"requests": 0, "tokens": 0, "choices": 0}

    async def ask(i: int) -> None:
        choices, tokens = await ask_one(i)
        counts["requests"] += 1
        counts["choices"] += choices
        counts["tokens"] += tokens

    await asyncio.gather(*[ask(i) for i in range(load.clients)])  # warm-up: connections, first batches
    counts.update(requests=0, tokens=0, choices=0)
    if started is not None:
        await started()
    deadline = time.perf_counter() + load.seconds

    async def worker(w: int) -> None:
        i = w
        while time.perf_counter() < deadline:
            await ask(i)
            i += load.clients

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(w) for w in range(load.clients)])
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 3),
        "requests": counts["requests"],
        "tokens": counts["tokens"],
        "choices": counts["choices"],
        "tokens_per_s": round(counts["tokens"] / wall, 1),
        "requests_per_s": round(counts["requests"] / wall, 1),
        "choices_per_s": round(counts["choices"] / wall, 1),
        "tokens_per_choice": round(counts["tokens"] / max(counts["choices"], 1), 2),
    }


def proc_cpu_s(*pids: int) -> float:
    """User + system CPU seconds of processes ``pids`` so far (Linux /proc, 10 ms ticks; 0.0 elsewhere). The one
    reader of /proc CPU times for the benchmarks (pipeline, time_to_accuracy and trl_compare import it)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _engine_figures(out: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> None:
    calls = after["generate_calls"] - before["generate_calls"]
    out["generate_calls"] = calls
    out["mean_rows_per_pass"] = round((after["rows"] - before["rows"]) / max(calls, 1), 1)
    out["engine_busy_s"] = round(after["busy_s"] - before["busy_s"], 3)


def raw_generate(model: EmbeddedModel, load: Load) -> dict[str, Any]:
    """The same load without the API: each client awaits ``EmbeddedModel.generate`` (batched by the same
    engine), so the difference to the other paths is the OpenAI layer (client, transport, server)."""

    async def run() -> dict[str, Any]:
        msgs = prompts()
        counts = {"requests": 0, "tokens": 0, "choices": 0}

        async def ask(i: int) -> None:
            out = await model.generate(
                msgs[i % len(msgs)], n=load.n, max_tokens=load.max_tokens, temperature=1.0, logprobs=True
            )
            counts["requests"] += 1
            counts["choices"] += len(out)
            counts["tokens"] += sum(len(s.token_ids) for s in out if isinstance(s, Sample))

        await asyncio.gather(*[ask(i) for i in range(load.clients)])
        counts.update(requests=0, tokens=0, choices=0)
        before = model.stats.snapshot(batches=False)
        deadline = time.perf_counter() + load.seconds
        cpu0 = time.process_time()

        async def worker(w: int) -> None:
            i = w
            while time.perf_counter() < deadline:
                await ask(i)
                i += load.clients

        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w) for w in range(load.clients)])
        wall = time.perf_counter() - t0
        res = {
            "wall_s": round(wall, 3),
            "requests": counts["requests"],
            "tokens": counts["tokens"],
            "tokens_per_s": round(counts["tokens"] / wall, 1),
            "requests_per_s": round(counts["requests"] / wall, 1),
            "choices_per_s": round(counts["choices"] / wall, 1),
            "tokens_per_choice": round(counts["tokens"] / max(counts["choices"], 1), 2),
            "cpu_s": round(time.process_time() - cpu0, 3),
        }
        res["tokens_per_cpu_s"] = round(res["tokens"] / max(res["cpu_s"], 1e-9), 1)
        _engine_figures(res, before, model.stats.snapshot(batches=False))
        return res

    return asyncio.run(run())


async def client_cpu_ms(
    client: openai.AsyncOpenAI, kw: dict[str, Any], clients: int, requests: int, route: str = "create"
) -> float:
    """CPU ms per request of the ``openai`` client alone: ``kw``'s request, answered once by ``client`` and then
    ``requests`` times (``clients`` at once) with that canned response by a mock transport (no server, no
    generation). What no server can remove. ``route``: ``create`` (``chat.completions.create``, as a user's own
    code calls it) or ``request_choices`` (the route of palaestra's shipped rollouts: the client's ``post`` and a
    pydantic-validated ``ChatCompletion``)."""
    from types import SimpleNamespace

    from palaestra.envs.rollouts import request_choices
    from palaestra.models.remote import http_module

    canned = (await client.chat.completions.with_raw_response.create(**kw)).http_response.content
    hx = http_module()

    def answer(request: Any) -> Any:
        return hx.Response(200, content=canned, headers={"content-type": "application/json"})

    http = hx.AsyncClient(transport=hx.MockTransport(answer), base_url="http://mock/v1")
    mock = openai.AsyncOpenAI(api_key="x", base_url="http://mock/v1", http_client=http, max_retries=0)
    policy = SimpleNamespace(name=kw["model"], openai_client=lambda: mock)
    extra = {k: v for k, v in kw.items() if k not in ("model", "messages", "n", "logprobs")}

    def call() -> Any:
        if route == "create":
            return mock.chat.completions.create(**kw)
        return request_choices(policy, kw["messages"], kw.get("n"), **extra)  # type: ignore[arg-type]

    await call()
    cpu0 = time.process_time()
    for _ in range(0, requests, clients):
        await asyncio.gather(*[call() for _c in range(clients)])
    cpu = time.process_time() - cpu0
    await mock.close()
    return cpu / max(requests, 1) * 1000


def client_floor(model: EmbeddedModel, load: Load, requests: int = 512) -> dict[str, Any]:
    """:func:`client_cpu_ms` for this benchmark's requests."""
    kw: dict[str, Any] = {
        "model": model.name,
        "messages": prompts(1)[0],
        "n": load.n,
        "max_tokens": load.max_tokens,
        "temperature": 1.0,
        "logprobs": load.logprobs,
    }
    ms = asyncio.run(client_cpu_ms(model.openai_client(), kw, load.clients, requests))
    return {"requests": requests, "cpu_ms_per_request": round(ms, 3)}


def in_process(model: EmbeddedModel, load: Load) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        client = model.openai_client()
        await client.models.list()
        snap: dict[str, Any] = {}

        async def started() -> None:
            snap.update(before=model.stats.snapshot(batches=False), cpu0=time.process_time())

        res = await drive(openai_asker(client, model.name, load), load, started)
        before = snap["before"]
        res["cpu_s"] = round(time.process_time() - snap["cpu0"], 3)
        res["tokens_per_cpu_s"] = round(res["tokens"] / max(res["cpu_s"], 1e-9), 1)
        _engine_figures(res, before, model.stats.snapshot(batches=False))
        return res

    return asyncio.run(run())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_parser() -> str:
    """The HTTP parser uvicorn uses in ``palaestra serve``: httptools (the ``serve`` extra) if installed."""
    import importlib.util

    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11 (pure Python)"


CLIENTS = {
    "openai": "openai (chat.completions.create)",
    "rollouts": "openai (request_choices, the shipped rollouts' route)",
    "light": "bare HTTP client + json (load generator)",
}


def _client_process(base: str, name: str, load: Load, q: Any, go: Any, kind: str) -> None:
    """A process of HTTP clients of ``kind`` (a key of :data:`CLIENTS`: the openai client as users call it,
    the openai client by the shipped rollouts' route, or the load generator of :func:`light_asker`): warm up,
    report ready, wait for ``go``, run ``load``, send the counts and this process's CPU seconds."""
    light = kind == "light"

    async def run() -> dict[str, Any]:
        if light:  # the HTTP library the openai client is built on (httpx2 under openai 3), used bare
            from palaestra.models.remote import http_module

            client: Any = http_module().AsyncClient(timeout=120)
            ask = light_asker(client, base, name, load)
        else:
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
            ask = (openai_asker if kind == "openai" else rollouts_asker)(client, name, load)
        cpu: dict[str, float] = {}

        async def started() -> None:
            q.put("ready")
            await asyncio.to_thread(go.wait)
            cpu["cpu0"] = time.process_time()

        res = await drive(ask, load, started)
        res["cpu_s"] = time.process_time() - cpu["cpu0"]
        await (client.aclose() if light else client.close())
        return res

    q.put(asyncio.run(run()))


def over_http(
    model: EmbeddedModel, load: Load, client_procs: int = 1, kind: str = "openai"
) -> dict[str, Any]:
    """``palaestra serve`` in a subprocess, the clients (``kind``: a key of :data:`CLIENTS`) in
    ``client_procs`` other processes: the server process's CPU is its own work only (the clients' CPU is
    reported apart)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{model.name}.npz"
        model.save(path)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "palaestra", "serve", "--model", str(path), "--port", str(port)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(f"palaestra serve exited: {err}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("server not ready after 60 s")
                time.sleep(0.1)

            def stats() -> dict[str, Any]:
                return dict(httpx.get(base + "/health", timeout=60).json()["models"][model.name]["stats"])

            procs = max(1, client_procs)
            ctx = mp.get_context("spawn")
            q, go = ctx.Queue(), ctx.Event()
            shares = [load.clients // procs + (i < load.clients % procs) for i in range(procs)]
            workers = [
                ctx.Process(
                    target=_client_process,
                    args=(base, model.name, Load(**{**asdict(load), "clients": k}), q, go, kind),
                    daemon=True,
                )
                for k in shares
                if k
            ]
            for w in workers:
                w.start()
            for _ in workers:  # every client process has warmed up
                q.get(timeout=120)
            before, srv0 = stats(), proc_cpu_s(proc.pid)
            go.set()
            parts = [q.get(timeout=load.seconds + 120) for _ in workers]
            srv_cpu = proc_cpu_s(proc.pid) - srv0
            after = stats()
            for w in workers:
                w.join(30)
            wall = max(r["wall_s"] for r in parts)
            res: dict[str, Any] = {
                "wall_s": wall,
                "client_processes": len(workers),
                "clients": CLIENTS[kind],
                "http_parser": http_parser(),
            }
            for key in ("requests", "tokens", "choices"):
                res[key] = sum(r[key] for r in parts)
            res["tokens_per_s"] = round(res["tokens"] / wall, 1)
            res["requests_per_s"] = round(res["requests"] / wall, 1)
            res["choices_per_s"] = round(res["choices"] / wall, 1)
            res["tokens_per_choice"] = round(res["tokens"] / max(res["choices"], 1), 2)
            res["client_cpu_s"] = round(sum(r["cpu_s"] for r in parts), 3)
            res["server_cpu_s"] = round(srv_cpu, 3)
            res["tokens_per_server_cpu_s"] = round(res["tokens"] / max(srv_cpu, 1e-9), 1)
            _engine_figures(res, before, after)
            return res
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def server_throughput(
    quick: bool = False,
    *,
    load: Load | None = None,
    http: bool = True,
    model: str | None = None,
    client_procs: int = 1,
    light: bool = True,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (``quick``: half a second per path)."""
    load = load or Load()
    if quick:
        load = Load(**{**asdict(load), "seconds": 0.5})
    policy = bench_model(model)
    out: dict[str, Any] = {
        "benchmark": "server_throughput",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "model": policy.name,
        "params": policy.gpt.n_params,
        "load": asdict(load),
        "target_tokens_per_s": TARGET,
        "raw_generate": raw_generate(policy, load),
        "in_process": in_process(policy, load),
        "client_floor": client_floor(policy, load, 128 if quick else 1024),
    }
    if http:
        out["http"] = over_http(policy, load, client_procs)
        out["http_rollouts"] = over_http(policy, load, client_procs, kind="rollouts")
        if light:
            out["http_light"] = over_http(policy, load, client_procs, kind="light")
    raw = out["raw_generate"]
    out["ratio_vs_raw"] = {
        path: {
            "tokens_per_s": round(out[path]["tokens_per_s"] / max(raw["tokens_per_s"], 1e-9), 3),
            "tokens_per_cpu_s": round(
                out[path].get("tokens_per_cpu_s", out[path].get("tokens_per_server_cpu_s", 0.0))
                / max(raw["tokens_per_cpu_s"], 1e-9),
                3,
            ),
        }
        for path in ("in_process", "http", "http_rollouts", "http_light")
        if path in out
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="half a second per path (smoke run)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--no-logprobs", action="store_true")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--client-procs", type=int, default=1, help="processes the HTTP clients run in")
    ap.add_argument(
        "--no-light", action="store_true", help="skip the http path with the light load generator"
    )
    ap.add_argument("--model", default=None, help='shipped name, .npz path or "random" (default: arith-base)')
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load = Load(args.clients, args.n, args.max_tokens, not args.no_logprobs, args.seconds)
    res = server_throughput(
        args.quick,
        load=load,
        http=not args.no_http,
        model=args.model,
        client_procs=args.client_procs,
        light=not args.no_light,
    )
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    ld = res["load"]
    print(f"{res['benchmark']}  {res['date']}  {res['machine']}  load avg {res['load_average_1m']}")
    print(
        f"model {res['model']} ({res['params']} params); {ld['clients']} clients, n={ld['n']}, "
        f"max_tokens={ld['max_tokens']}, logprobs={ld['logprobs']}, {ld['seconds']} s per path"
    )
    for path in ("raw_generate", "in_process", "http", "http_rollouts", "http_light"):
        if path in res:
            r = res[path]
            if "cpu_s" in r:
                cpu = f"cpu {r['cpu_s']:.2f} s ({r['tokens_per_cpu_s']:,.0f} tok per cpu-s)"
            else:
                cpu = (
                    f"cpu server {r['server_cpu_s']:.2f} s ({r['tokens_per_server_cpu_s']:,.0f} tok per "
                    f"server cpu-s, {r['http_parser']}) + clients {r['client_cpu_s']:.2f} s in "
                    f"{r['client_processes']} process(es), clients: {r['clients']}"
                )
            print(
                f"  {path:<13}  {r['tokens_per_s']:>9,.0f} tok/s  {r['requests_per_s']:>7,.1f} req/s  "
                f"{r['choices_per_s']:>8,.0f} choices/s  {r['tokens_per_choice']:.1f} tok/choice  "
                f"{r['mean_rows_per_pass']:.0f} rows/pass  {cpu} in {r['wall_s']:.1f} s"
            )
    ms = {p: res[p]["cpu_s"] * 1000 / max(res[p]["requests"], 1) for p in ("raw_generate", "in_process")}
    floor = res["client_floor"]["cpu_ms_per_request"]
    print(
        f"  cpu per request: in_process {ms['in_process']:.2f} ms = the openai client alone {floor:.2f} ms "
        f"(mock transport) + server, transport and generation {ms['in_process'] - floor:.2f} ms "
        f"(raw_generate: {ms['raw_generate']:.2f} ms)"
    )
    what = {
        "in_process": "in_process (clients, server and generation in one process)",
        "http": "http (server process alone; openai clients in other processes)",
        "http_rollouts": "http_rollouts (server process alone; openai clients by request_choices in other processes)",
        "http_light": "http_light (server process alone; load-generator clients in other processes)",
    }
    for path, r in res["ratio_vs_raw"].items():
        print(
            f"  server tokens/s vs raw batched generation, {what[path]}: {r['tokens_per_s']:.2f} in "
            f"tokens/s, {r['tokens_per_cpu_s']:.2f} in tokens per cpu-s of its process; target >= {TARGET_RATIO}"
        )
    print(f"  target {TARGET:,} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
