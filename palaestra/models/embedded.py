"""EmbeddedModel: a trainable TinyGPT policy served in-process through an OpenAI-compatible API.

Rollout code talks to it exactly as to vLLM or OpenAI::

    model = palaestra.models.load("arith-base")
    client = model.openai_client()            # openai.AsyncOpenAI, no port, no network
    out = await client.chat.completions.create(model=model.name, messages=[...], logprobs=True)

The client's transport calls the app of :func:`palaestra.models.server.create_app` directly (no ASGI, no
sockets: :func:`palaestra.models.server.in_process_client`). Requests from
concurrent rollouts (and :meth:`EmbeddedModel.generate` calls) are decoded together, joining and leaving
the running batch between decoding steps (see :mod:`palaestra.models.engine`). The trainer updates
``model.gpt.params`` in place while holding ``model.lock`` (generation passes hold it too, in the engine's
thread) and then calls :meth:`EmbeddedModel.bump_step`; every completion names the policy version that produced it in
``system_fingerprint`` (``"arith-base@step3"``). Do not hold ``model.lock`` while awaiting a generation:
the pass waits for the lock and the await waits for the pass.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.models.engine import (
    EngineSet,
    EngineStats,
    Sample,
    SamplingParams,
    WatchedLock,
    choice_seeds,
    prepare_params,
)
from palaestra.models.tinygpt import TinyGPT
from palaestra.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from palaestra.models.server import App

_BASE_URL = "http://embedded.palaestra.invalid/v1"
Messages = Sequence[Mapping[str, Any]]


class EmbeddedModel:
    """A TinyGPT policy with a name, a policy version (``step``) and an in-process OpenAI-compatible server.

    ``max_batch_rows`` caps the rows (choices) generating at once. Before starting a pass the engine
    yields to the event loop ``gather_yields`` times, then keeps yielding while new requests arrive, for at
    most ``batch_wait_s`` seconds, so that requests already on their way join the batch.
    """

    sampling_features = frozenset({"logit_bias", "penalties"})  # honoured by the sampler (server checks)

    def __init__(
        self,
        gpt: TinyGPT,
        *,
        name: str = "embedded",
        step: int = 0,
        card: Mapping[str, Any] | None = None,
        max_batch_rows: int = 1024,
        gather_yields: int = 2,
        batch_wait_s: float = 0.005,
    ) -> None:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"model name must be a non-empty string without spaces, got {name!r}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.name = name
        self.gpt = gpt
        self.step = int(step)
        self.card: dict[str, Any] = dict(card or {})
        self.lock = WatchedLock()  # an RLock that counts waiters (the engine yields it to the trainer)
        self.max_batch_rows = int(max_batch_rows)
        self.gather_yields = int(gather_yields)
        self.batch_wait_s = float(batch_wait_s)
        self.stats = EngineStats()
        self._engines = EngineSet(self)
        self._app: App | None = None
        self._client: AsyncOpenAI | None = None
        self._init_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmbeddedModel(name={self.name!r}, step={self.step}, params={self.gpt.n_params})"

    @property
    def tokenizer(self) -> Tokenizer:
        return self.gpt.tokenizer

    @property
    def block_size(self) -> int:
        """Context length (prompt + completion tokens)."""
        return self.gpt.config.block_size

    @property
    def fingerprint(self) -> str:
        """``"<name>@step<step>"``: the ``system_fingerprint`` of completions produced now."""
        return f"{self.name}@step{self.step}"

    def bump_step(self) -> int:
        """Advance the policy version by one (after a weight update) and return it."""
        with self.lock:
            self.step += 1
            return self.step

    # ------------------------------------------------------------------ serving
    def app(self) -> App:
        """The OpenAI-compatible app serving this model alone (cached; an ASGI app for uvicorn)."""
        with self._init_lock:
            if self._app is None:
                from palaestra.models.server import create_app

                self._app = create_app(self)
            return self._app

    def openai_client(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` bound in-process to :meth:`app` (cached; usable from any event loop)."""
        app = self.app()
        with self._init_lock:
            if self._client is None:
                from palaestra.models.server import in_process_client

                self._client = in_process_client(app, _BASE_URL)
            return self._client

    # ------------------------------------------------------------------ direct generation
    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Sample]:
        """Low level: queue one prompt (one choice per seed) on this event loop's batching engine."""
        return await self._engines.get().submit(prompt_ids, params, seeds)

    async def submit_many(
        self, items: Sequence[tuple[Sequence[int], SamplingParams, Sequence[int]]]
    ) -> list[list[Sample]]:
        """Low level: queue several prompts (``(prompt_ids, params, seeds)`` each) in one call."""
        return await self._engines.get().submit_many(items)

    def render(self, messages: Messages, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids of a conversation under the chat template, ending with the assistant role token."""
        return self.tokenizer.render(messages, add_generation_prompt=True, tools=tools).ids

    async def generate(
        self,
        messages: Messages | Sequence[Messages],
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
        """Sample ``n`` completions without HTTP (batched with concurrent requests).

        ``messages`` is one conversation (returns ``n`` samples) or a list of conversations (returns one list
        of ``n`` samples per conversation). With a ``seed`` the result is reproducible: conversation ``c``,
        choice ``i`` uses a seed derived from ``(seed, c, i)``. ``logprobs=False`` leaves ``Sample.logprobs``
        empty. Invalid settings raise :class:`palaestra.models.engine.RequestError` (a ``ValueError``).
        """
        single = _is_conversation(messages)
        convs: list[Messages] = [messages] if single else list(messages)  # type: ignore[list-item,arg-type]
        queued: list[tuple[list[int], SamplingParams]] = []
        for conv in convs:  # check everything before queueing anything
            prompt = self.render(conv)
            params = prepare_params(
                prompt_len=len(prompt),
                block_size=self.block_size,
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop=stop,
                logprobs=True,
                top_logprobs=top_logprobs,
            )
            queued.append((prompt, params))
        results = await self.submit_many(
            [(p, sp, choice_seeds(seed, n, salt=c)) for c, (p, sp) in enumerate(queued)]
        )
        if not logprobs:
            for samples in results:
                for s in samples:
                    s.logprobs, s.top_logprobs = [], []
        return results[0] if single else results

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike[str], *, optimizer: Any = None) -> None:
        """Write an ``.npz`` checkpoint (weights, config, vocab; name, step and card in its metadata)."""
        with self.lock:
            meta = dict(self.gpt.meta)
            meta["palaestra"] = {"name": self.name, "step": self.step, "card": self.card}
            self.gpt.save(path, optimizer=optimizer, meta=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, name: str | None = None, **kwargs: Any) -> EmbeddedModel:
        """Load a checkpoint; the card is ``<path>.json`` beside it if present, else the one saved inside."""
        path = Path(path)
        gpt = TinyGPT.load(path)
        raw = gpt.meta.get("palaestra")
        info: dict[str, Any] = raw if isinstance(raw, dict) else {}
        card = read_card(path.with_suffix(".json"))
        if card is None:
            saved = info.get("card")
            card = saved if isinstance(saved, dict) else {}
        step = info.get("step", 0)
        return cls(
            gpt,
            name=name or info.get("name") or path.stem,
            step=step if isinstance(step, int) else 0,
            card=card,
            **kwargs,
        )


def read_card(path: Path) -> dict[str, Any] | None:
    """The JSON model card at ``path`` (None if absent); a malformed card raises naming the file."""
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable model card ({exc})") from exc
    if not isinstance(card, dict):
        raise ValueError(f"{path}: a model card must be a JSON object, got {type(card).__name__}")
    return card


def _is_conversation(messages: Any) -> bool:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of messages or a list of conversations")
    if not messages:
        raise ValueError("messages must not be empty")
    first = messages[0]
    return isinstance(first, Mapping) or hasattr(first, "role")


__all__ = ["EmbeddedModel", "Sample", "SamplingParams", "read_card"]
