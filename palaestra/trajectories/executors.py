"""Where rollouts run: in this process or in Ray worker processes (``palaestra[ray]``, docs/scaling.md)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects that exist on entry out of the cyclic GC while the block runs (``gc.freeze``; why:
    docs/scaling.md); a heap already frozen on entry is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class WorkerDiedError(RuntimeError):
    """The worker process running a rollout died before returning (counted as one failed rollout)."""


class Executor(Protocol):
    """Runs ``fn(*args, **kwargs)`` somewhere and returns an awaitable of its result."""

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """Calls ``fn`` in this process when the submitted call is awaited (awaiting its result if async)."""

    async def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        return await result if isinstance(result, Awaitable) else result

    def close(self) -> None:
        pass


def _import_ray(local: bool = False) -> Any:
    """Import ray; for a ``local`` cluster first make Ray bind every service to 127.0.0.1 (on Linux its "cluster"
    mode, read from the environment at import, would replace a loopback node address by the outward one)."""
    if local:
        os.environ.setdefault(_RAY_CLUSTER_ENV, "0")
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the Ray executor needs ray: pip install 'palaestra[ray]' (or set [run] executor = \"local\")"
        ) from exc
    return ray


_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_WORKER_LOOP: list[asyncio.AbstractEventLoop] = []  # one event loop per worker process, kept between tasks


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The body of every Ray task: run ``fn``; a coroutine runs on the worker's event loop, which stays open
    between tasks so that HTTP clients and connections bound to it are reused."""
    result = fn(*args, **kwargs)
    if asyncio.iscoroutine(result):
        if not _WORKER_LOOP or _WORKER_LOOP[0].is_closed():
            _WORKER_LOOP[:] = [asyncio.new_event_loop()]
        return _WORKER_LOOP[0].run_until_complete(result)
    return result


class RayExecutor:
    """Runs calls as Ray tasks; ``num_workers``: CPUs of the local cluster started when no ``address`` is given;
    ``resources``: Ray resources of one call (default ``{"num_cpus": 1}``). :meth:`close` stops what it started."""

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        resources: Mapping[str, float] | None = None,
        address: str | None = None,
    ) -> None:
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 or None, got {num_workers}")
        self.num_workers = num_workers
        self.resources = _task_options(resources)
        self.address = address
        self._started = False
        self._remote: Any = None
        self._lock = threading.Lock()

    def _ensure(self) -> Any:
        ray = _import_ray(local=self.address is None)
        with self._lock:
            if not ray.is_initialized():
                kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
                if self.address is not None:
                    kwargs["address"] = self.address
                else:
                    if os.environ.get(_RAY_CLUSTER_ENV) == "0":  # a local cluster on loopback only
                        kwargs["_node_ip_address"] = "127.0.0.1"
                    if self.num_workers is not None:
                        kwargs["num_cpus"] = self.num_workers
                ray.init(**kwargs)
                self._started = True
            if self._remote is None:
                self._remote = ray.remote(max_retries=0)(_call)
        return ray

    async def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        ray = self._ensure()
        ref = self._remote.options(**self.resources).remote(fn, args, kwargs)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref, force=True)
            raise
        except ray.exceptions.RayTaskError as exc:
            # the rollout's own exception: an instance of its class too (``RayTaskError(ValueError)``), whose
            # message carries the worker's traceback
            raise exc.as_instanceof_cause() from None
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.ActorDiedError) as exc:
            name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or fn
            raise WorkerDiedError(f"the Ray worker running {name} died: {exc}") from None

    def close(self) -> None:
        if self._started:
            _import_ray().shutdown()
            self._started = False
            self._remote = None


def _task_options(resources: Mapping[str, float] | None) -> dict[str, Any]:
    """Ray ``.options()`` for one call: ``num_cpus``/``num_gpus``/``memory`` as such, the rest as custom."""
    res = dict(resources) if resources else {"num_cpus": 1}
    for key, value in res.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"rollout resource {key!r} must be a number >= 0, got {value!r}")
    out: dict[str, Any] = {k: v for k, v in res.items() if k in ("num_cpus", "num_gpus", "memory")}
    custom = {k: float(v) for k, v in res.items() if k not in out}
    return {**out, "resources": custom} if custom else out
