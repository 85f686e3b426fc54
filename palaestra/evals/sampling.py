"""Live sampling for the harness: K completions per example from any chat model, seeded, with sum_logprob;
the samples file and its ``.meta.json`` sidecar (docs/harness.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from palaestra.envs.rollouts import single_turn_rollout
from palaestra.evals.manifest import sidecar_path
from palaestra.trajectories.gather import gather_trajectory_groups
from palaestra.trajectories.io import PathLike, write_jsonl
from palaestra.trajectories.protocols import ChatModel
from palaestra.trajectories.runs import code_version, utc_now, write_json
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import TrajectoryGroup

ROLLOUT = "palaestra.envs.rollouts.single_turn_rollout"
#: ``sum_logprob`` is rounded to this many decimals: float32 batched generation gives the same text with sums
#: that differ by ~1e-5 depending on which requests shared a batch.
LOGPROB_DECIMALS = 4


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
    """What the manifest says about the sampled policy; ``base_url`` without user:password and query string
    (which may carry a key)."""
    record: dict[str, Any] = {"model": model.name, "backend": "remote" if base_url else "embedded"}
    if base_url:
        parts = urlsplit(base_url)
        host = (parts.hostname or "") + (f":{parts.port}" if parts.port is not None else "")
        record["base_url"] = urlunsplit((parts.scheme, host, parts.path, "", ""))
    for attr in ("step", "fingerprint"):
        value = getattr(model, attr, None)
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            record[attr] = value
    return record


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
    """``samples`` completions per example (example order, then sample index), sample ``j`` of ``id`` seeded
    ``derive_seed(seed, id, j)``; a failed request aborts it all (a half-sampled eval is not a result)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    seeds = [[derive_seed(seed, str(ex["id"]), j) for j in range(samples)] for ex in examples]
    rollout = partial(single_turn_rollout, model, temperature=temperature, max_tokens=max_tokens)
    groups = [
        TrajectoryGroup([rollout(ex, seed=s) for s in ex_seeds]) for ex, ex_seeds in zip(examples, seeds)
    ]
    done = await gather_trajectory_groups(
        groups, max_concurrency=concurrency, max_exceptions=0, progress=progress, desc="sample"
    )
    rows = []
    for ex, ex_seeds, group in zip(examples, seeds, done):
        for j, (s, traj) in enumerate(zip(ex_seeds, group.trajectories)):
            choices = traj.choices()
            choice = choices[-1] if choices else None
            lps = choice.logprobs.content if choice is not None and choice.logprobs is not None else None
            sum_lp = round(float(sum(t.logprob for t in lps)), LOGPROB_DECIMALS) if lps else None
            rows.append(
                {
                    "id": ex["id"],
                    "sample": j,
                    "completion": traj.last_assistant_text() or "",
                    "sum_logprob": sum_lp,
                    "finish_reason": getattr(choice, "finish_reason", None),
                    "seed": s,
                }
            )
    return rows


def write_samples(path: PathLike, rows: Sequence[Mapping[str, Any]], **meta: Any) -> Path:
    """Write a samples JSONL and its sidecar (:func:`sidecar_meta` of ``meta``); returns the sidecar path."""
    write_jsonl(path, rows)
    write_json(side := sidecar_path(path), sidecar_meta(**meta))
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
    return {
        "sampling": dict(sampling),
        "seed": seed,
        "policy": dict(policy),
        "dataset": dict(dataset) if dataset else None,
        "created": utc_now(),
        "code": code_version(),
        "seed_rule": seed_rule,
        **(extra or {}),
    }
