"""Verifier accuracy of a policy on a split (greedy and sampled pass@1), and a one-request group sampler, by
``method="generate"`` (an embedded model, no HTTP) or ``"openai"`` (any chat model); every draw is seeded.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.rollouts import (
    request_choices,
    single_turn_group_rollout,
    single_turn_start,
    trajectories_from_choices,
)
from palaestra.envs.verifier import Verifier, get_verifier
from palaestra.models.embedded import EmbeddedModel
from palaestra.models.engine import LOGPROB_FLOOR
from palaestra.trajectories.types import TrajectoryGroup

Method = Literal["auto", "generate", "openai"]


@dataclass(frozen=True)
class AccuracyResult:
    """Accuracy of a policy on ``n`` examples: ``greedy`` and ``sampled`` are shares with reward > 0 (None if
    not measured); ``rows`` one dict per example (``id``, ``greedy_completion``, ``greedy_outcome``,
    ``greedy_reward``, ``sampled_correct``: how many draws were correct)."""

    n: int
    greedy: float | None
    sampled: float | None
    samples: int
    greedy_outcomes: dict[str, int] = field(default_factory=dict)
    method: str = "generate"
    seconds: float = 0.0
    policy_step: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)


def _method(model: Any, method: Method) -> str:
    """The text path: ``auto`` is ``generate`` for an embedded model, else ``openai``."""
    if method == "auto":
        method = "generate" if isinstance(model, EmbeddedModel) else "openai"
    if method == "generate" and not isinstance(model, EmbeddedModel):
        raise TypeError(f"method='generate' needs an EmbeddedModel, got {type(model).__name__}")
    if method not in ("generate", "openai"):
        raise ValueError(f"method must be 'auto', 'generate' or 'openai', got {method!r}")
    return method


async def evaluate_accuracy(
    model: Any,
    examples: Sequence[Mapping[str, Any]],
    verifier: Verifier | None = None,
    *,
    greedy: bool = True,
    samples: int = 0,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int = 0,
    method: Method = "auto",
    max_concurrency: int = 32,
) -> AccuracyResult:
    """Greedy and/or sampled (pass@1 over ``samples`` draws) verifier accuracy of ``model`` on ``examples``:
    dicts with ``prompt`` and what the verifier (default: the strict arithmetic one) needs."""
    t0 = time.perf_counter()
    verifier = verifier or StrictFinalVerifier()
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    path = _method(model, method)
    convs = []
    for i, ex in enumerate(examples):
        prompt = ex.get("prompt") if isinstance(ex, Mapping) else None
        if not isinstance(prompt, str):
            raise ValueError(f"examples[{i}]: field 'prompt' must be a string, got {type(prompt).__name__}")
        convs.append([{"role": "user", "content": prompt}])
    n_ex = len(convs)

    async def texts(n: int, temp: float, sd: int) -> list[list[str]]:
        """``n`` completions of each conversation ``c``: seeded from ``(sd, c, i)`` (generate) or ``sd + c``."""
        if not convs:
            return []
        if path == "generate":
            out = await model.generate(
                convs, n=n, temperature=temp, max_tokens=max_tokens, seed=sd, logprobs=False
            )
            return [[s.text for s in choices] for choices in out]
        sem = asyncio.Semaphore(max_concurrency)

        async def one(c: int, conv: list[dict[str, Any]]) -> list[str]:
            async with sem:
                choices, _ = await request_choices(
                    model, conv, n, temperature=temp, max_tokens=max_tokens, seed=sd + c, logprobs=False
                )
            return [ch.message.content or "" for ch in choices]

        return list(await asyncio.gather(*(one(c, conv) for c, conv in enumerate(convs))))

    rows: list[dict[str, Any]] = [{"id": ex.get("id", i)} for i, ex in enumerate(examples)]
    greedy_acc: float | None = None
    outcomes: Counter[str] = Counter()
    if greedy:
        for row, ex, (text,) in zip(rows, examples, await texts(1, 0.0, seed)):
            score = verifier.score(ex, text)
            outcomes[score.outcome] += 1
            row.update(greedy_completion=text, greedy_outcome=score.outcome, greedy_reward=score.reward)
        greedy_acc = sum(row["greedy_reward"] > 0.0 for row in rows) / n_ex if n_ex else 0.0
    sampled_acc: float | None = None
    if samples:
        for row, ex, draws in zip(rows, examples, await texts(samples, temperature, seed + 1)):
            row["sampled_correct"] = sum(verifier.score(ex, text).reward > 0.0 for text in draws)
        sampled_acc = sum(row["sampled_correct"] for row in rows) / (n_ex * samples) if n_ex else 0.0
    step = getattr(model, "step", None)
    return AccuracyResult(
        n=n_ex,
        greedy=greedy_acc,
        sampled=sampled_acc,
        samples=samples,
        greedy_outcomes=dict(sorted(outcomes.items())),
        method=path,
        seconds=time.perf_counter() - t0,
        policy_step=step if isinstance(step, int) else None,
        rows=rows,
    )


async def validate(
    model: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    seed: int,
    greedy: bool = True,
    sampled: bool = True,
    max_tokens: int = 16,
    verifier: str = "arith-strict",
) -> dict[str, Any]:
    """An experiment's validation: :func:`evaluate_accuracy` with the named verifier and one temperature-1 draw
    per example when ``sampled``, as a flat dict (``greedy_accuracy``, ``outcome/<code>`` counts, ``rows``...)."""
    v = get_verifier(verifier)
    res = await evaluate_accuracy(
        model, examples, v, greedy=greedy, samples=int(sampled), max_tokens=max_tokens, seed=seed
    )
    vals = {"greedy_accuracy": res.greedy, "sampled_accuracy": res.sampled, "policy_step": res.policy_step}
    return {
        "n": res.n,
        "method": res.method,
        **{k: v for k, v in vals.items() if v is not None},
        **{f"outcome/{k}": c for k, c in res.greedy_outcomes.items()},
        "rows": res.rows,
    }


def _choice_of_sample(sample: Any, index: int, vocab: Sequence[str]) -> Choice:
    """The ``Choice`` the embedded server returns for a sample (same fields, built without HTTP/JSON;
    validating a plain dict is several times faster than the openai models' ``construct``)."""
    entries = [
        {
            "token": vocab[tid],
            "logprob": max(lp, LOGPROB_FLOOR),
            "bytes": list(vocab[tid].encode()),
            "top_logprobs": [],
        }
        for tid, lp in zip(sample.token_ids, sample.logprobs)
    ]
    return Choice.model_validate(
        {
            "index": index,
            "finish_reason": sample.finish_reason,
            "message": {"role": "assistant", "content": sample.text, "refusal": None},
            "logprobs": {"content": entries, "refusal": None},
            "token_ids": [int(t) for t in sample.token_ids],  # as the server records them (exact tokens)
            "prompt_token_ids": [int(t) for t in sample.prompt_ids],
        }
    )


async def sample_group(
    model: Any,
    example: Mapping[str, Any],
    n: int,
    *,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int | None = None,
    method: Method = "openai",
) -> TrajectoryGroup:
    """``n`` single-turn trajectories for one example from ONE request with ``n`` choices (``"generate"``: the
    Choices the server would return, without HTTP); the group's metadata holds the example's scalar fields."""
    if _method(model, method) == "generate":
        conv, traj_meta = single_turn_start(model, example, temperature, max_tokens, seed, None)
        samples = await model.generate(conv, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
        choices = [_choice_of_sample(s, i, model.tokenizer.vocab) for i, s in enumerate(samples)]
        policy = f"{model.name}@step{samples[0].step}" if samples else model.fingerprint  # type: ignore[union-attr]
        trajs = trajectories_from_choices(conv, {**traj_meta, "policy": policy}, choices)
    else:
        trajs = await single_turn_group_rollout(
            model, example, n, temperature=temperature, max_tokens=max_tokens, seed=seed
        )
    meta = {k: v for k, v in example.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return TrajectoryGroup(trajs, metadata=meta)
