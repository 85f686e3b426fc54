"""Per-token data of a rollout for ``palaestra show`` and ``report.html``: each sampled token with its
sampling-time logprob and entropy, and per-turn rewards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from openai.types.chat.chat_completion import Choice

from palaestra.trajectories.types import Trajectory, field_of


def entropy_from_top(top: Sequence[Any] | None) -> float | None:
    """Entropy estimate (nats) from one position's top logprobs: ``-sum p log p`` over the returned
    alternatives, the remaining probability mass counted as one more outcome (a lower bound of the true
    entropy, exact when the alternatives cover the distribution); None without any."""
    lps = [field_of(alt, "logprob") for alt in top or []]
    ps = [math.exp(min(float(lp), 0.0)) for lp in lps if isinstance(lp, (int, float)) and math.isfinite(lp)]
    if not ps:
        return None
    h = -sum(p * math.log(p) for p in ps if p > 0.0)
    rest = 1.0 - sum(ps)
    if rest > 1e-12:
        h -= rest * math.log(rest)
    return max(h, 0.0)


def logprob_class(lp: float | None) -> str:
    """A display bucket of a token's logprob: ``sure`` (p >= 0.6), ``mid`` (p >= 0.2), ``low`` (below)."""
    if lp is None or not math.isfinite(lp):
        return "unknown"
    return "sure" if lp >= math.log(0.6) else ("mid" if lp >= math.log(0.2) else "low")


def token_info(choice: Choice) -> list[dict[str, Any]]:
    """``[{"t": token text, "lp": logprob, "h": entropy or None}]`` for every sampled token of a Choice
    (``[]`` without logprobs); the entropy is the server's when it recorded one, else :func:`entropy_from_top`."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    out: list[dict[str, Any]] = []
    for entry in content or []:
        lp = float(entry.logprob) if isinstance(entry.logprob, (int, float)) else None
        h = (entry.model_extra or {}).get("entropy")
        if not isinstance(h, (int, float)) or isinstance(h, bool):
            h = entropy_from_top(entry.top_logprobs)
        out.append({"t": entry.token, "lp": lp, "h": None if h is None else float(h)})
    return out


def trajectory_token_info(traj: Trajectory) -> list[dict[str, Any]]:
    """One dict per item of ``traj.messages()``: for a Choice, ``tokens`` (:func:`token_info`), ``turn``
    (its index among the Choices) and ``turn_reward`` (from ``traj.turn_rewards``, when recorded); ``{}``
    for a plain message."""
    rewards = traj.turn_rewards or []
    out: list[dict[str, Any]] = []
    turn = 0
    for x in traj.messages_and_choices:
        info: dict[str, Any] = {}
        if isinstance(x, Choice):
            info = {"tokens": token_info(x), "turn": turn}
            if turn < len(rewards):
                info["turn_reward"] = float(rewards[turn])
            turn += 1
        out.append(info)
    return out
