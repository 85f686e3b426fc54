"""Build an experiment's parts from its config: the model, the train reward, locked-room facts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from palaestra.envs.registry import EnvSpec
from palaestra.envs.verifier import VerifierReward, get_verifier
from palaestra.judges.base import quantize_score
from palaestra.judges.cache import JudgeCache
from palaestra.judges.prompt import DEFAULT_RUBRIC
from palaestra.judges.ruler import RulerJudge
from palaestra.judges.simulated import SimulatedJudge, contains_number, longer_than
from palaestra.models.registry import load as load_model
from palaestra.trainer.expconfig import ExperimentConfig
from palaestra.trajectories.io import DataError, sha256_text
from palaestra.trajectories.types import Trajectory, TrajectoryGroup


def build_model(cfg: ExperimentConfig) -> Any:
    """The trainable policy named by ``[model]``."""
    backend, name = resolve_backend(cfg.model.backend, cfg.model.name)  # the config allows no other backend
    if backend == "hf":
        from palaestra.models.hf import HFModel

        return HFModel.from_config_section(name, cfg.model.hf)
    return load_model(name)


def resolve_backend(backend: str, name: str) -> tuple[str, str]:
    """(backend, name): ``auto`` is ``hf`` for a tiny HF model or a name ``hf:<name or path>``, else ``embedded``."""
    from palaestra.models.hf import TINY_MODEL_NAMES  # light: no torch import

    if backend == "auto":
        backend = "hf" if name in TINY_MODEL_NAMES or name.startswith("hf:") else "embedded"
    return backend, name.removeprefix("hf:") if backend == "hf" else name


def build_reward(cfg: ExperimentConfig, run_dir: Path | None = None) -> Any:
    """The train reward named by ``[reward]`` (a ``score_group``), with ``reward.quantize`` applied."""
    return with_quantize(_base_reward(cfg, run_dir), cfg.reward.quantize)


def judge_cache_path(cfg: ExperimentConfig, run_dir: Path | None = None) -> Path | None:
    """Where ``reward.judge_cache`` lives (a relative path: in the run folder); ``None``: no cache."""
    raw = cfg.reward.judge_cache
    if raw is None or raw.strip().lower() in ("", "off", "none"):
        return None
    path = Path(raw).expanduser()
    return path if path.is_absolute() or run_dir is None else Path(run_dir) / path


class QuantizedReward:
    """Any reward function with its rewards rounded to ``levels`` grid values; everything else is the inner's."""

    def __init__(self, inner: Any, levels: int) -> None:
        self.inner = inner
        self.quantize = levels  # >= 2: checked by the config (reward.quantize)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def info(self) -> dict[str, Any]:
        base = self.inner.info() if hasattr(self.inner, "info") else {}
        return {**base, "quantize": self.quantize}

    async def score_group(self, group: TrajectoryGroup, example: Any = None) -> TrajectoryGroup | None:
        scored: TrajectoryGroup | None = await self.inner.score_group(group, example)
        if scored is not None:
            for traj in scored.trajectories:
                traj.reward = quantize_score(float(traj.reward), self.quantize)
        return scored


def with_quantize(reward: Any, levels: int | None) -> Any:
    """``reward`` with scores rounded to ``levels`` levels: a judge with a ``quantize`` attribute rounds its own
    (so they are recorded rounded); anything else is wrapped in :class:`QuantizedReward`."""
    if levels is None:
        return reward
    if hasattr(reward, "quantize") and not isinstance(reward, QuantizedReward):
        reward.quantize = levels
        return reward
    return QuantizedReward(reward, levels)


def _base_reward(cfg: ExperimentConfig, run_dir: Path | None) -> Any:
    r = cfg.reward
    if r.kind == "rollout":
        return RolloutReward()
    if r.kind == "verifier":
        return VerifierReward(get_verifier(r.verifier))
    if r.kind == "simulated_judge":
        s, verifier = r.simulated, get_verifier(r.simulated.gold)

        def gold(traj: Trajectory, example: Mapping[str, Any] | None) -> float:
            return float(verifier.score(example or {}, traj.last_assistant_text() or "").reward)

        gold.__qualname__ = f"verifier:{verifier.name}@{verifier.version}"
        feature = contains_number if s.format_min_chars is None else longer_than(s.format_min_chars)
        return SimulatedJudge(
            gold,
            **s.model_dump(exclude={"gold", "format_min_chars"}),
            format_feature=feature,
            seed=cfg.run.seed,
            on_failure=r.on_failure,
        )
    if r.kind == "judge" and not r.judge_model:
        raise DataError("field 'reward.judge_model': required when reward.kind = 'judge'")
    cache_path = judge_cache_path(cfg, run_dir)
    cache = JudgeCache(cache_path) if cache_path is not None else None
    if r.kind == "learned_judge":
        from palaestra.judges.learned import LearnedJudge
        from palaestra.models.reward_model import load_reward_model

        model = load_reward_model(r.learned.model)
        return LearnedJudge(
            model, min_span=r.learned.min_span, seed=cfg.run.seed, on_failure=r.on_failure, cache=cache
        )
    return RulerJudge(
        str(r.judge_model),
        base_url=r.judge_base_url,
        api_key_env=r.judge_api_key_env or "",
        on_failure=r.on_failure,
        max_retries=r.judge_max_retries,
        timeout=r.judge_timeout,
        max_group_seconds=r.judge_max_group_seconds,
        backoff=r.judge_backoff,
        seed=cfg.run.seed,
        cache=cache,
        rubric=r.rubric or DEFAULT_RUBRIC,
    )


def reward_info(cfg: ExperimentConfig, reward: Any = None) -> dict[str, Any]:
    """What the manifest records about the train reward (judge name/version/rubric hash; never a key)."""
    out: dict[str, Any] = {"kind": cfg.reward.kind}
    if reward is not None and hasattr(reward, "info"):
        out["judge"] = reward.info()
    if cfg.reward.kind == "verifier":
        v = get_verifier(cfg.reward.verifier)
        out.update(name=v.name, version=v.version)
    elif cfg.reward.kind == "judge":
        out.update(
            model=cfg.reward.judge_model,
            base_url=cfg.reward.judge_base_url,
            rubric_sha256=sha256_text(cfg.reward.rubric) if cfg.reward.rubric else "default",
            judge_cache=cfg.reward.judge_cache,
            max_judge_calls=cfg.reward.max_judge_calls,
        )
    elif cfg.reward.kind == "learned_judge":
        out.update(cfg.reward.learned.model_dump(), judge_cache=cfg.reward.judge_cache)
    elif cfg.reward.kind == "rollout":  # the environment scores its own episodes
        out.update(environment=cfg.env.name, rollout_options=dict(cfg.env.options))
    else:
        out.update(cfg.reward.simulated.model_dump())
    if cfg.reward.quantize is not None:
        out["quantize"] = cfg.reward.quantize
    return out


def locked_room(cfg: ExperimentConfig, env: EnvSpec, val_fingerprint: str | None) -> dict[str, Any]:
    """The facts two runs must share to be compared (validation side)."""
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
    """``reward.kind = "rollout"``: keep the reward each rollout set itself."""

    async def score_group(self, group: TrajectoryGroup, example: Any = None) -> TrajectoryGroup:
        return group
