"""Build an experiment's parts from its config: the model, the train reward, seeds, locked-room facts."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from palaestra.envs.registry import EnvSpec
from palaestra.trainer.expconfig import ExperimentConfig
from palaestra.trajectories.io import DataError, sha256_text
from palaestra.trajectories.types import Trajectory, TrajectoryGroup


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any sequence of values (run seed, step, group, rollout index, ...), stable across
    processes and platforms (sha256 of their text), so resumed runs draw the same numbers."""
    text = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def build_model(cfg: ExperimentConfig) -> Any:
    """The trainable policy named by ``[model]``."""
    backend, name = resolve_backend(cfg.model.backend, cfg.model.name)
    if backend == "embedded":
        from palaestra.models.registry import load

        return load(name)
    if backend == "hf":
        from palaestra.models.hf import HFModel

        return HFModel.from_config_section(name, cfg.model.hf)
    raise DataError(f"field 'model.backend': unknown backend {cfg.model.backend!r}")


def resolve_backend(backend: str, name: str) -> tuple[str, str]:
    """``backend="auto"``: ``hf`` for a built-in tiny HF model or a name written ``hf:<name or path>``, else
    ``embedded``; returns (backend, name without the ``hf:`` prefix)."""
    from palaestra.models.hf import TINY_MODEL_NAMES  # light: no torch import

    if backend == "auto":
        backend = "hf" if name in TINY_MODEL_NAMES or name.startswith("hf:") else "embedded"
    return backend, name.removeprefix("hf:") if backend == "hf" else name


def verifier_gold(name: str) -> Any:
    """A judge gold function (trajectory, example) -> reward from a shipped verifier."""
    from palaestra.envs.verifier import get_verifier

    verifier = get_verifier(name)

    def gold(traj: Trajectory, example: Mapping[str, Any] | None) -> float:
        return float(verifier.score(example or {}, traj.last_assistant_text() or "").reward)

    gold.__qualname__ = f"verifier:{verifier.name}@{verifier.version}"
    return gold


def build_reward(cfg: ExperimentConfig, run_dir: Path | None = None) -> Any:
    """The train reward function named by ``[reward]`` (all implement ``score_group``)."""
    r = cfg.reward
    if r.kind == "verifier":
        from palaestra.envs.verifier import VerifierReward, get_verifier

        return VerifierReward(get_verifier(r.verifier))
    if r.kind == "simulated_judge":
        from palaestra.judges.simulated import SimulatedJudge, contains_number, longer_than

        s = r.simulated
        feature = contains_number if s.format_min_chars is None else longer_than(s.format_min_chars)
        return SimulatedJudge(
            verifier_gold(s.gold),
            noise=s.noise,
            position_bias=s.position_bias,
            length_bias=s.length_bias,
            format_bias=s.format_bias,
            format_feature=feature,
            quantize=s.quantize,
            seed=cfg.run.seed,
            on_failure=r.on_failure,
        )
    from palaestra.judges.cache import JudgeCache
    from palaestra.judges.ruler import RulerJudge

    if not r.judge_model:
        raise DataError("field 'reward.judge_model': required when reward.kind = 'judge'")
    kwargs: dict[str, Any] = {}
    if r.rubric:
        kwargs["rubric"] = r.rubric
    return RulerJudge(
        r.judge_model,
        base_url=r.judge_base_url,
        api_key_env=r.judge_api_key_env or "",
        on_failure=r.on_failure,
        max_retries=r.judge_max_retries,
        timeout=r.judge_timeout,
        backoff=r.judge_backoff,
        seed=cfg.run.seed,
        cache=JudgeCache(r.judge_cache) if r.judge_cache else None,
        **kwargs,
    )


def reward_info(cfg: ExperimentConfig, reward: Any = None) -> dict[str, Any]:
    """What the manifest records about the train reward (judge name/version/rubric hash; never a key)."""
    out: dict[str, Any] = {"kind": cfg.reward.kind}
    if reward is not None and hasattr(reward, "info"):
        out["judge"] = reward.info()
    if cfg.reward.kind == "verifier":
        from palaestra.envs.verifier import get_verifier

        v = get_verifier(cfg.reward.verifier)
        out.update(name=v.name, version=v.version)
    elif cfg.reward.kind == "judge":
        out.update(
            model=cfg.reward.judge_model,
            base_url=cfg.reward.judge_base_url,
            rubric_sha256=sha256_text(cfg.reward.rubric) if cfg.reward.rubric else "default",
        )
    else:
        out.update(cfg.reward.simulated.model_dump())
    return out


def locked_room(cfg: ExperimentConfig, env: EnvSpec, val_fingerprint: str | None) -> dict[str, Any]:
    """The facts two runs must share to be compared (validation side)."""
    from palaestra.envs.verifier import get_verifier

    v = get_verifier(cfg.validation.verifier)
    return {
        "environment": env.name,
        "val_split": cfg.env.val_split,
        "val_dataset_sha256": val_fingerprint,
        "val_examples": cfg.validation.max_examples,
        "prompt_template_sha256": env.prompt_hash,
        "validation_scorer": f"{v.name}@{v.version}",
        "val_sampling": {
            "greedy": cfg.validation.greedy,
            "sampled_temperature": 1.0 if cfg.validation.sampled else None,
            "max_tokens": cfg.env.max_tokens,
        },
        "seed": cfg.run.seed,
    }


class RolloutReward:
    """``reward.kind = "rollout"``: keep the reward each rollout set itself (environments that score their
    own episodes, e.g. the calculator's tool costs or 2048)."""

    async def score_group(self, group: TrajectoryGroup, example: Any = None) -> TrajectoryGroup:
        return group
