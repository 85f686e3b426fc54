"""Live sampling for the harness: K completions per example from any chat model, seeded, with sum_logprob.

Each sample is one :func:`palaestra.envs.rollouts.single_turn_rollout` (user message = the example's prompt).
With a run seed ``S``, sample ``j`` of example ``id`` is requested with seed ``derive_seed(S, id, j)``
(:mod:`palaestra.trajectories.seeds`), so a sample does not depend on which other examples or how many
samples are drawn. ``sum_logprob`` is the sum of the returned token logprobs, rounded to
:data:`LOGPROB_DECIMALS` decimals (None when the endpoint returns none).

The samples file is JSONL ``{"id", "sample", "completion", "sum_logprob", "finish_reason", "seed"}``; its
sidecar ``<name>.meta.json`` holds ``{"sampling", "seed", "policy", "dataset", "created", "code"}`` (read by
``palaestra eval`` and ``palaestra select`` into their manifests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from palaestra.envs.rollouts import single_turn_rollout
from palaestra.trajectories.io import PathLike, write_jsonl
from palaestra.trajectories.protocols import ChatModel
from palaestra.trajectories.runs import code_version, utc_now, write_json
from palaestra.trajectories.seeds import derive_seed

__all__ = [
    "ROLLOUT",
    "policy_record",
    "resolve_model",
    "sample_completions",
    "sample_seed",
    "sampling_settings",
    "sidecar_meta",
    "write_samples",
]

ROLLOUT = "palaestra.envs.rollouts.single_turn_rollout"
#: ``sum_logprob`` is rounded to this many decimals: float32 batched generation gives the same text with sums
#: that differ by ~1e-5 depending on which requests shared a batch.
LOGPROB_DECIMALS = 4


def sample_seed(seed: int, example_id: str, sample: int) -> int:
    """The per-request seed of sample ``sample`` of ``example_id`` under run seed ``seed``."""
    return derive_seed(seed, example_id, sample)


def sampling_settings(*, temperature: float, max_tokens: int, samples_per_id: int) -> dict[str, Any]:
    """The sampling facts of the Locked Room (the model is not one of them: it is the knob)."""
    return {
        "rollout": ROLLOUT,
        "temperature": float(temperature),
        "top_p": 1.0,
        "max_tokens": int(max_tokens),
        "samples_per_id": int(samples_per_id),
        "system_prompt": None,
    }


def resolve_model(name: str, *, base_url: str | None = None) -> ChatModel:
    """An embedded model by name or checkpoint path, or a remote OpenAI-compatible model at ``base_url``."""
    if base_url:
        from palaestra.models.remote import RemoteModel

        return RemoteModel(model=name, base_url=base_url)  # type: ignore[no-any-return]
    from palaestra.models.registry import load

    return load(name)


def policy_record(model: ChatModel, *, base_url: str | None = None) -> dict[str, Any]:
    """What the manifest says about the sampled policy (never an API key)."""
    record: dict[str, Any] = {"model": model.name, "backend": "remote" if base_url else "embedded"}
    if base_url:
        record["base_url"] = _public_url(base_url)
    for attr in ("step", "fingerprint"):
        value = getattr(model, attr, None)
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            record[attr] = value
    return record


def _public_url(url: str) -> str:
    """``url`` without user:password and without a query string (which may carry a key)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _sum_logprob(choice: Any) -> float | None:
    lp = getattr(choice, "logprobs", None)
    content = getattr(lp, "content", None) if lp is not None else None
    if not content:
        return None
    return round(float(sum(t.logprob for t in content)), LOGPROB_DECIMALS)


async def sample_completions(
    model: ChatModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    samples: int,
    temperature: float,
    max_tokens: int,
    seed: int,
    concurrency: int = 64,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """``samples`` completions for each example (rows in example order then sample index).

    A failed request aborts the whole sampling with the gather's error (a half-sampled eval is not a result).
    """
    from palaestra.trajectories.gather import gather_trajectory_groups
    from palaestra.trajectories.types import TrajectoryGroup

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    groups = [
        TrajectoryGroup(
            [
                single_turn_rollout(
                    model,
                    ex,
                    temperature=temperature,
                    max_tokens=max_tokens,
                    seed=sample_seed(seed, str(ex["id"]), j),
                )
                for j in range(samples)
            ]
        )
        for ex in examples
    ]
    done = await gather_trajectory_groups(
        groups, max_concurrency=concurrency, max_exceptions=0, progress=progress, desc="sample"
    )
    rows = []
    for ex, group in zip(examples, done):
        for j, traj in enumerate(group.trajectories):
            choices = traj.choices()
            choice = choices[-1] if choices else None
            rows.append(
                {
                    "id": ex["id"],
                    "sample": j,
                    "completion": traj.last_assistant_text() or "",
                    "sum_logprob": _sum_logprob(choice),
                    "finish_reason": getattr(choice, "finish_reason", None),
                    "seed": sample_seed(seed, str(ex["id"]), j),
                }
            )
    return rows


def write_samples(
    path: PathLike,
    rows: Sequence[Mapping[str, Any]],
    *,
    sampling: Mapping[str, Any],
    seed: int,
    policy: Mapping[str, Any],
    dataset: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a samples JSONL and its ``.meta.json`` sidecar; returns the sidecar path."""
    from palaestra.evals.manifest import sidecar_path

    write_jsonl(path, rows)
    side = sidecar_path(path)
    write_json(side, sidecar_meta(sampling=sampling, seed=seed, policy=policy, dataset=dataset, extra=extra))
    return side


def sidecar_meta(
    *,
    sampling: Mapping[str, Any],
    seed: int,
    policy: Mapping[str, Any],
    dataset: Mapping[str, Any] | None = None,
    seed_rule: str = "palaestra.trajectories.seeds.derive_seed(seed, id, sample)",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``.meta.json`` sidecar of a samples file: how, with which seed rule, from which policy and data."""
    meta: dict[str, Any] = {
        "sampling": dict(sampling),
        "seed": seed,
        "policy": dict(policy),
        "dataset": dict(dataset) if dataset else None,
        "created": utc_now(),
        "code": code_version(),
        "seed_rule": seed_rule,
    }
    return {**meta, **(extra or {})}
