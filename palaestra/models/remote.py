"""RemoteModel: any OpenAI-compatible endpoint (OpenAI, vLLM, Ollama, a LiteLLM proxy), optionally several,
requests routed round-robin with at most ``max_concurrency_per_endpoint`` in flight on each (per event loop).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from palaestra.trajectories.runs import register_secret, scrub_text, url_secrets

_ROUTER_BASE = "http://palaestra-router.invalid/"


def http_module() -> Any:
    """The HTTP library the installed ``openai`` client is built on: ``httpx2`` (openai>=3) or ``httpx``; our
    transports use it so the client takes its native, faster path rather than a compatibility one."""
    roots = {base.__module__.split(".")[0] for base in DefaultAsyncHttpxClient.__mro__}
    return importlib.import_module("httpx2" if "httpx2" in roots else "httpx")


def openai_over(
    transport: Any, base_url: str, *, api_key: str, timeout: float | None, max_retries: int
) -> AsyncOpenAI:
    """A plain ``openai.AsyncOpenAI`` whose requests go through ``transport`` (of :func:`http_module`)."""
    httpx = http_module()
    http = httpx.AsyncClient(transport=transport, base_url=base_url, timeout=httpx.Timeout(timeout))
    return AsyncOpenAI(
        api_key=api_key, base_url=base_url, http_client=http, timeout=timeout, max_retries=max_retries
    )


def _check_url(url: Any) -> str:
    if not isinstance(url, str):
        raise TypeError(f"base_url must be a string or a list of strings, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        msg = f"base_url {scrub_text(url)!r} must be an http(s) URL such as http://127.0.0.1:8000/v1"
        raise ValueError(msg)
    return url.rstrip("/")


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    peak_in_flight: int = 0
    requests: int = 0
    failures: int = 0


def _router_transport(endpoints: list[_Endpoint], limit: int) -> Any:
    httpx = http_module()

    class ReleasingStream(httpx.AsyncByteStream):  # type: ignore[misc,name-defined]
        """Response body wrapper that frees the endpoint slot when the body is closed."""

        def __init__(self, stream: Any, release: Any) -> None:
            self._stream = stream
            self._release = release

        def __aiter__(self) -> AsyncIterator[bytes]:
            return self._stream.__aiter__()  # type: ignore[no-any-return]

        async def aclose(self) -> None:
            try:
                await self._stream.aclose()
            finally:
                release, self._release = self._release, None
                if release is not None:  # once, however often the body is closed
                    await release()

    class RouterTransport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        """Round-robin over endpoints with a per-endpoint cap on requests in flight."""

        def __init__(self) -> None:
            self._rr = 0
            self._cond = asyncio.Condition()
            self._inner = httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=limit * len(endpoints))
            )

        def _pick(self) -> _Endpoint | None:
            n = len(endpoints)
            for k in range(n):
                ep = endpoints[(self._rr + k) % n]
                if ep.in_flight < limit:
                    self._rr = (self._rr + k + 1) % n
                    return ep
            return None

        async def handle_async_request(self, request: Any) -> Any:
            async with self._cond:
                while (ep := self._pick()) is None:
                    await self._cond.wait()
                ep.in_flight += 1
                ep.requests += 1
                ep.peak_in_flight = max(ep.peak_in_flight, ep.in_flight)

            async def release() -> None:
                async with self._cond:
                    ep.in_flight -= 1
                    self._cond.notify()

            try:
                url = httpx.URL(ep.url + "/" + request.url.raw_path.decode("ascii").lstrip("/"))
                headers = [
                    (b"Host", url.netloc),
                    *((k, v) for k, v in request.headers.raw if k.lower() != b"host"),
                ]
                routed = httpx.Request(
                    request.method, url, headers=headers, stream=request.stream, extensions=request.extensions
                )
                resp = await self._inner.handle_async_request(routed)
            except BaseException:
                ep.failures += 1
                await asyncio.shield(release())
                raise
            stream = ReleasingStream(resp.stream, release)
            return httpx.Response(
                resp.status_code, headers=resp.headers, stream=stream, extensions=resp.extensions
            )

        async def aclose(self) -> None:
            await self._inner.aclose()

    return RouterTransport()


class RemoteModel:
    """A model behind one or more OpenAI-compatible endpoints (not trainable: ``step`` is None)."""

    def __init__(
        self,
        model: str,
        base_url: str | Sequence[str],
        api_key: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        max_concurrency_per_endpoint: int = 32,
        timeout: float = 120.0,
        max_retries: int = 2,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url must name at least one endpoint")
        if max_concurrency_per_endpoint < 1:
            raise ValueError(f"max_concurrency_per_endpoint must be >= 1, got {max_concurrency_per_endpoint}")
        self.name = model
        self.step: int | None = None
        self.base_urls = [_check_url(u) for u in urls]
        self.max_concurrency_per_endpoint = int(max_concurrency_per_endpoint)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.api_key_env = api_key_env
        key = api_key if api_key else (os.environ.get(api_key_env) if api_key_env else None)
        self.__key = key or None
        for secret in [key, *(s for u in self.base_urls for s in url_secrets(u))]:
            register_secret(secret)  # scrubbed from records and from errors quoting it, however short
        self._clients = weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI]()
        self._endpoint_sets: list[list[_Endpoint]] = []
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        urls = [scrub_text(u) for u in self.base_urls]
        key = "set" if self.__key else "none"
        return (
            f"RemoteModel(model={self.name!r}, base_url={urls!r}, api_key=<{key}>, "
            f"max_concurrency_per_endpoint={self.max_concurrency_per_endpoint})"
        )

    def __reduce__(self) -> Any:
        raise TypeError("RemoteModel is not picklable (it holds an API key); rebuild it from its settings")

    @property
    def has_api_key(self) -> bool:
        return self.__key is not None

    def _new_client(self) -> AsyncOpenAI:
        endpoints = [_Endpoint(u) for u in self.base_urls]
        with self._lock:
            self._endpoint_sets.append(endpoints)
        transport = _router_transport(endpoints, self.max_concurrency_per_endpoint)
        key = self.__key or "no-key"  # local servers accept anything
        return openai_over(
            transport, _ROUTER_BASE, api_key=key, timeout=self.timeout, max_retries=self.max_retries
        )

    def openai_client(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` routed over the endpoints (one cached per running event loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._new_client()  # used from a loop started later; httpx binds lazily
        with self._lock:
            if loop not in self._clients:
                self._clients[loop] = self._new_client()
            return self._clients[loop]

    def endpoint_stats(self) -> list[dict[str, Any]]:
        """Per endpoint (redacted URL): requests sent, failures, requests in flight now, peak in flight."""
        with self._lock:
            sets = list(self._endpoint_sets)
        return [
            {
                "url": scrub_text(url),
                "requests": sum(s[i].requests for s in sets),
                "failures": sum(s[i].failures for s in sets),
                "in_flight": sum(s[i].in_flight for s in sets),
                "peak_in_flight": max((s[i].peak_in_flight for s in sets), default=0),
            }
            for i, url in enumerate(self.base_urls)
        ]


__all__ = ["RemoteModel", "http_module", "openai_over"]
