"""Models as endpoints for rollouts that run in other processes (Ray workers), and the rollout wrapper.

A rollout function ``async def rollout(model, scenario, **kw)`` only uses ``model.name`` and
``model.openai_client()``. In a Ray worker the model is a :class:`~palaestra.models.remote.RemoteModel` built
from a picklable :class:`ModelEndpoint`: the embedded (or HF) policy served over HTTP on 127.0.0.1 by an
in-process uvicorn server (:func:`serve_model`), or the vLLM fleet the policy already publishes to. Weights
never leave the trainer process.

From Python::

    from palaestra.trajectories import RayExecutor, gather_trajectory_groups, TrajectoryGroup
    from palaestra.trainer.endpoints import serve_model, remote_rollout

    executor = RayExecutor(num_workers=4)
    with serve_model(model) as endpoint:
        run = remote_rollout(my_rollout, executor)       # same signature as my_rollout
        groups = await gather_trajectory_groups(
            [TrajectoryGroup(run(endpoint, s, seed=i) for i in range(8)) for s in scenarios],
            max_exceptions=2,                               # a dead worker is one failed rollout
        )
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from palaestra.trajectories.executors import Executor, InProcessExecutor, RayExecutor

__all__ = ["ModelEndpoint", "RolloutExecution", "endpoint_of", "remote_rollout", "serve_model"]


@dataclass(frozen=True)
class ModelEndpoint:
    """A picklable description of an OpenAI-compatible policy endpoint (never an API key itself)."""

    name: str
    base_urls: tuple[str, ...]
    api_key_env: str | None = None
    max_concurrency_per_endpoint: int = 32
    timeout: float = 120.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def connect(self) -> Any:
        """A :class:`~palaestra.models.remote.RemoteModel` for this endpoint (built in the worker)."""
        from palaestra.models.remote import RemoteModel

        return RemoteModel(
            self.name,
            list(self.base_urls),
            api_key_env=self.api_key_env,
            max_concurrency_per_endpoint=self.max_concurrency_per_endpoint,
            timeout=self.timeout,
            max_retries=0,
        )


class _Server:
    """uvicorn serving one app on 127.0.0.1 from a daemon thread (its own event loop)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
            name="palaestra-endpoint",
            daemon=True,
        )

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the policy endpoint server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def endpoint_of(model: Any) -> tuple[ModelEndpoint, Callable[[], None]]:
    """The endpoint rollouts in other processes should use for ``model``, and a function that stops what was
    started for it: a RemoteModel (or an HF model publishing to vLLM) is used as it is; a model with an
    ``app()`` (embedded, HF) is served over HTTP on 127.0.0.1 by a new uvicorn thread."""
    from palaestra.models.remote import RemoteModel

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
    server = _Server(model.app())
    server.start()
    return ModelEndpoint(model.name, (f"http://127.0.0.1:{server.port}/v1",), api_key_env=None), server.stop


@contextlib.contextmanager
def serve_model(model: Any) -> Iterator[ModelEndpoint]:
    """``with serve_model(model) as endpoint:`` the model reachable over HTTP for the block (see
    :func:`endpoint_of`)."""
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
        model = _MODELS[endpoint] = endpoint.connect()
    return await fn(model, *args, **kwargs)


def remote_rollout(
    fn: Callable[..., Any], executor: Executor, endpoint: ModelEndpoint | None = None
) -> Callable[..., Any]:
    """``fn`` run by ``executor`` with a :class:`ModelEndpoint` in place of the model; same signature, so
    ``inspect.signature`` still sees ``fn``'s keyword arguments. With ``endpoint`` given, the first argument
    (the caller's model object) is ignored and ``endpoint`` is sent instead."""

    @functools.wraps(fn)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        target = endpoint if endpoint is not None else model
        if not isinstance(target, ModelEndpoint):
            raise TypeError(f"remote rollouts take a ModelEndpoint, got {type(target).__name__}")
        return executor.submit(_with_endpoint, fn, target, args, kwargs)

    return call


class RolloutExecution:
    """What an experiment's ``[run] executor`` builds: the executor, the endpoint and their clean-up.

    ``wrap(rollout, model)`` returns the rollout to call instead: unchanged for the local executor; for Ray,
    a wrapper submitting to workers with the model's endpoint.
    """

    def __init__(
        self,
        kind: str = "local",
        *,
        workers: int | None = None,
        resources: dict[str, float] | None = None,
        address: str | None = None,
    ) -> None:
        self.kind = kind
        self.executor: Executor = (
            RayExecutor(workers, resources=resources, address=address)
            if kind == "ray"
            else InProcessExecutor()
        )
        self._stop: Callable[[], None] | None = None

    def wrap(self, rollout: Callable[..., Any], model: Any) -> Callable[..., Any]:
        """The rollout to call with the live model: unchanged for the local executor; for Ray, ``model``
        served and a wrapper that sends its endpoint to the workers instead."""
        if self.kind == "local":
            return rollout
        endpoint, self._stop = endpoint_of(model)
        return remote_rollout(rollout, self.executor, endpoint)

    def close(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
        self.executor.close()
