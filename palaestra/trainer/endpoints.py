"""Models as picklable endpoints for rollouts in other processes (Ray workers), served over HTTP or by vLLM:
weights never leave the trainer process (docs/scaling.md, section 2)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from palaestra.models.remote import RemoteModel
from palaestra.trajectories.executors import Executor

__all__ = ["ModelEndpoint", "endpoint_of", "remote_rollout", "serve_model"]


@dataclass(frozen=True)
class ModelEndpoint:
    """A picklable description of an OpenAI-compatible policy endpoint (never an API key itself)."""

    name: str
    base_urls: tuple[str, ...]
    api_key_env: str | None = None


def endpoint_of(model: Any) -> tuple[ModelEndpoint, Callable[[], None]]:
    """The endpoint other processes should use for ``model`` (a RemoteModel's or vLLM's own, else ``app()``
    served on 127.0.0.1 by a new uvicorn thread), and a function that stops what was started for it."""
    remote = model if isinstance(model, RemoteModel) else None
    vllm = getattr(model, "vllm", None)
    if remote is None and vllm is not None:
        if not vllm.published:
            vllm.publish(model, model.step)
        remote = vllm.remote(model)
    if remote is not None:
        ep = ModelEndpoint(remote.name, tuple(remote.base_urls), api_key_env=remote.api_key_env)
        return ep, lambda: None
    if not hasattr(model, "app"):
        raise TypeError(f"{type(model).__name__} has no app() to serve and is not a RemoteModel")
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    app = model.app()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name="palaestra-endpoint", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30.0
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the policy endpoint server did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return ModelEndpoint(model.name, (f"http://127.0.0.1:{sock.getsockname()[1]}/v1",)), stop


@contextlib.contextmanager
def serve_model(model: Any) -> Iterator[ModelEndpoint]:
    """``with serve_model(model) as endpoint:`` the model reachable over HTTP for the block (:func:`endpoint_of`)."""
    endpoint, stop = endpoint_of(model)
    try:
        yield endpoint
    finally:
        stop()


_MODELS: dict[ModelEndpoint, Any] = {}  # connected models of this process (a Ray worker reuses them)
_MAX_MODELS = 8


async def _with_endpoint(fn: Callable[..., Any], endpoint: ModelEndpoint, args: Any, kwargs: Any) -> Any:
    """Worker side: the rollout with a RemoteModel for ``endpoint`` (connected once per process)."""
    model = _MODELS.get(endpoint)
    if model is None:
        while len(_MODELS) >= _MAX_MODELS:  # endpoints of past policy copies: close the oldest client
            old = _MODELS.pop(next(iter(_MODELS)))
            with contextlib.suppress(Exception):
                await old.openai_client().close()
        model = _MODELS[endpoint] = RemoteModel(
            endpoint.name, list(endpoint.base_urls), api_key_env=endpoint.api_key_env, max_retries=0
        )
    return await fn(model, *args, **kwargs)


def remote_rollout(
    fn: Callable[..., Any], executor: Executor, endpoint: ModelEndpoint | None = None
) -> Callable[..., Any]:
    """``fn`` run by ``executor`` with a :class:`ModelEndpoint` (``endpoint``, else the first argument) as the
    model; same signature, so ``inspect.signature`` still sees ``fn``'s keyword arguments."""

    @functools.wraps(fn)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        target = endpoint if endpoint is not None else model
        if not isinstance(target, ModelEndpoint):
            raise TypeError(f"remote rollouts take a ModelEndpoint, got {type(target).__name__}")
        return executor.submit(_with_endpoint, fn, target, args, kwargs)

    return call
