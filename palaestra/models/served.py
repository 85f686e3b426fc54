"""What every served policy shares: name and version, the batching engine, ``generate()``, the in-process app;
a subclass calls :meth:`ServedModel._serve` and provides ``tokenizer``, ``block_size`` and ``row_cache()``."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palaestra.models.engine import (
    BatchEngine,
    EngineStats,
    Sample,
    SamplingParams,
    WatchedLock,
    choice_seeds,
    prepare_params,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from palaestra.models.sampling import RowCache
    from palaestra.models.server import App

__all__ = ["ServedModel"]


class ServedModel:
    """Base of the served policies. ``max_batch_rows`` caps the rows generating at once; before a pass the
    engine yields ``gather_yields`` times, then while requests arrive, for at most ``batch_wait_s`` seconds."""

    base_url = "http://embedded.palaestra.invalid/v1"  # the in-process client's (never resolved) address
    sampling_features = frozenset({"logit_bias", "penalties"})  # honoured by the one sampler (server checks)

    def _serve(
        self,
        name: str,
        step: int,
        card: Mapping[str, Any] | None,
        max_batch_rows: int,
        gather_yields: int,
        batch_wait_s: float,
    ) -> None:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"model name must be a non-empty string without spaces, got {name!r}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.name = name
        self.step = int(step)
        self.card: dict[str, Any] = dict(card or {})
        self.lock = WatchedLock()  # generation passes and optimiser steps hold it (a pass yields to a waiter)
        self.max_batch_rows = int(max_batch_rows)
        self.gather_yields = int(gather_yields)
        self.batch_wait_s = float(batch_wait_s)
        self.stats = EngineStats()
        # one engine per running event loop (engines hold loop-bound futures and tasks)
        self._engines = weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BatchEngine]()
        self._app: App | None = None
        self._client: AsyncOpenAI | None = None
        self._init_lock = threading.Lock()

    def row_cache(self) -> RowCache:
        """A fresh cache of this model's rows for one generation pass."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """``"<name>@step<step>"``: the ``system_fingerprint`` of completions produced now."""
        return f"{self.name}@step{self.step}"

    def bump_step(self) -> int:
        """Advance the policy version by one (after a weight update) and return it."""
        with self.lock:
            self.step += 1
            return self.step

    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Sample]:
        """Low level: queue one prompt (one choice per seed) on this event loop's batching engine."""
        return (await self.submit_many([(prompt_ids, params, seeds)]))[0]

    async def submit_many(
        self, items: Sequence[tuple[Sequence[int], SamplingParams, Sequence[int]]]
    ) -> list[list[Sample]]:
        """Low level: queue several prompts (``(prompt_ids, params, seeds)`` each) in one call."""
        loop = asyncio.get_running_loop()
        with self._init_lock:
            if loop not in self._engines:
                self._engines[loop] = BatchEngine(self, loop)
            engine = self._engines[loop]
        return await engine.submit_many(items)

    def render(self, messages: Sequence[Any], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids of a conversation under the chat template, ending with the generation prompt."""
        return self.tokenizer.render(messages, add_generation_prompt=True, tools=tools).ids  # type: ignore[attr-defined,no-any-return]

    async def generate(
        self,
        messages: Any,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | None = 16,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        logprobs: bool = True,
        top_logprobs: int = 0,
    ) -> list[Sample] | list[list[Sample]]:
        """Sample ``n`` completions without HTTP: ``n`` samples of one conversation, or a list of them per
        conversation of a list; conversation ``c``, choice ``i`` is seeded from ``(seed, c, i)``."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of messages or a list of conversations")
        if not messages:
            raise ValueError("messages must not be empty")
        single = isinstance(messages[0], Mapping) or hasattr(messages[0], "role")
        size = self.block_size  # type: ignore[attr-defined]
        settings: dict[str, Any] = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        settings.update(stop=stop, logprobs=True, top_logprobs=top_logprobs, block_size=size)
        prompts = [self.render(conv) for conv in ([messages] if single else messages)]
        items = [
            (p, prepare_params(prompt_len=len(p), **settings), choice_seeds(seed, n, salt=c))
            for c, p in enumerate(prompts)
        ]
        results: list[list[Sample]] = await self.submit_many(items)
        if not logprobs:
            for samples in results:
                for s in samples:
                    s.logprobs, s.top_logprobs = [], []
        return results[0] if single else results

    def app(self) -> App:
        """The OpenAI-compatible app serving this model alone (cached; an ASGI app for uvicorn)."""
        with self._init_lock:
            if self._app is None:
                from palaestra.models.server import create_app

                self._app = create_app(self)  # type: ignore[arg-type]
            return self._app

    def openai_client(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` bound in-process to :meth:`app` (cached; usable from any event loop)."""
        app = self.app()
        with self._init_lock:
            if self._client is None:
                from palaestra.models.server import in_process_client

                self._client = in_process_client(app, self.base_url)
            return self._client
