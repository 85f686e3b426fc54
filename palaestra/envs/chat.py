"""The one chat-completions request of the shipped rollouts: sampled choices with their token logprobs."""

from __future__ import annotations

from typing import Any

from palaestra.trajectories.protocols import ChatModel


async def request_choices(
    model: ChatModel,
    messages: list[dict[str, Any]],
    n: int | None = None,
    *,
    temperature: float,
    max_tokens: int,
    seed: int | None = None,
    **extra: Any,
) -> tuple[list[Any], Any]:
    """``(choices sorted by index, response)`` of one request through ``model.openai_client()`` with
    ``logprobs=True``; ``n``, ``seed`` and ``extra`` fields (``tools``, ``top_logprobs``) are sent unless None.
    RuntimeError when the endpoint returns no choice, or not ``n`` of them."""
    body: dict[str, Any] = {"model": model.name, "messages": messages, "n": n, "temperature": temperature}
    body.update(max_tokens=max_tokens, logprobs=True, seed=seed, **extra)
    response = await model.openai_client().chat.completions.create(
        **{k: v for k, v in body.items() if v is not None}
    )
    choices = sorted(response.choices, key=lambda c: c.index)
    if not choices or (n is not None and len(choices) != n):
        raise RuntimeError(f"model {model.name!r} returned {len(choices)} choices, asked for {n or 1}")
    return choices, response
