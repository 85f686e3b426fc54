"""Experiment configuration: one TOML file (or dict) describing a whole Loop C run (a full example:
docs/guide.md, "A hybrid experiment, offline"). Unknown keys and bad values are reported with their dotted field
path before any work starts."""

from __future__ import annotations

import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from palaestra.models.engine import MAX_N
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.stopping import StoppingRule
from palaestra.trajectories.io import DataError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# Bounds checked when a config is validated, before any file is written (one place for each):
MAX_GROUP_SIZE = MAX_N  # a group is sampled as one request with n = group_size; the embedded server's n limit
MAX_GROUPS_PER_STEP = 10_000  # scenarios per step: far above any useful batch, far below a typo like 1e11
_RESERVED_OPTIONS = ("seed", "temperature", "max_tokens")  # every rollout gets these from the experiment


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RunSection(_Section):
    """What a step is made of and how long the run may go."""

    name: str = Field("experiment", description="Run name (in the run folder name and the run note).")
    seed: int = Field(0, description="Run seed: data order, rollout and judge sampling seeds derive from it.")
    output_dir: str | None = Field(None, description="Run folder (default: runs/<name>).")
    groups_per_step: int = Field(32, ge=1, le=MAX_GROUPS_PER_STEP, description="Scenarios per training step.")
    group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="Rollouts per scenario (one group).")
    max_steps: int = Field(200, ge=1, description="Hard cap on training steps (stop reason max_steps).")
    max_concurrency: int | None = Field(256, ge=1, description="Rollouts running at once across the step.")
    max_exceptions: int | float = Field(0.1, ge=0, description="Failed rollouts per step: count or fraction.")
    rollout_timeout: float | None = Field(60.0, gt=0, description="Seconds one rollout may take.")
    samples_per_step: int = Field(16, ge=0, description="Trajectories saved per step to samples/ (capped).")
    checkpoint_every: int = Field(10, ge=1, description="Checkpoint every k steps and at the end.")
    progress: bool = Field(True, description="Print a progress line per step.")
    executor: Literal["local", "ray"] = Field("local", description="Rollouts in this process or Ray workers.")
    workers: int | None = Field(None, ge=1, description="CPUs of the local Ray cluster the run starts.")
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources of a rollout, e.g. {num_cpus = 0.5} (default 1 CPU)."
    )
    ray_address: str | None = Field(None, description="Join this Ray cluster ('auto', 'ray://host:10001').")
    max_staleness: int = Field(0, ge=0, description="Policy lag in steps (later steps' rollouts run ahead).")
    rollout_processes: int | None = Field(
        None, ge=0, le=64, description="Rollout worker processes (0: none; default 2 if max_staleness > 0)."
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_pipeline_keys(cls, data: Any) -> Any:
        """Configs written before rollout_processes: pipeline_worker and pipeline_processes (docs/scaling.md)."""
        if not isinstance(data, dict) or not {"pipeline_worker", "pipeline_processes"} & data.keys():
            return data
        data = dict(data)
        worker, n = data.pop("pipeline_worker", "process"), data.pop("pipeline_processes", None)
        if worker not in ("process", "thread"):
            raise ValueError(f"pipeline_worker must be 'process' or 'thread', not {worker!r}")
        if "rollout_processes" not in data and int(data.get("max_staleness") or 0) > 0:
            data["rollout_processes"] = 0 if worker == "thread" else n
        return data

    @property
    def processes(self) -> int:
        """The rollout worker processes asked for (``rollout_processes`` with its default resolved)."""
        if self.rollout_processes is None:
            return 2 if self.max_staleness > 0 else 0
        return self.rollout_processes

    @field_validator("max_exceptions")
    @classmethod
    def _budget(cls, value: int | float) -> int | float:
        if isinstance(value, float) and not 0.0 < value < 1.0:
            if value.is_integer():
                return int(value)  # 3.0 means a count of 3
            raise ValueError("a fraction must lie in (0, 1); a count must be a whole number")
        return value


class ModelSection(_Section):
    """The policy being trained."""

    backend: Literal["auto", "embedded", "hf"] = Field(
        "auto", description="auto: hf for the tiny HF models and names written hf:<name>, else embedded."
    )
    name: str = Field("arith-base", description="Embedded registry name or .npz path; HF model name or path.")
    hf: dict[str, Any] = Field(default_factory=dict, description="Options for the HF backend (see docs).")


class EnvSection(_Section):
    """Scenarios and the rollout function."""

    name: str = Field("arithmetic", description="Registered environment (palaestra.envs.registry).")
    rollout: str | None = Field(None, description="Custom rollout 'module:function'; default: the env's own.")
    group_rollout: bool = Field(True, description="Sample a group in one request (env's group rollout).")
    train_split: str = Field("train", description="Split the training scenarios come from.")
    val_split: str = Field("val", description="Split used for validation.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature of training rollouts.")
    max_tokens: int = Field(16, ge=1, description="Max new tokens per model call.")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for rollouts.")


class SimulatedJudgeSection(_Section):
    """A lab instrument: a judge built on a hidden gold verifier, with configurable biases."""

    gold: str = Field("arith-strict", description="Verifier whose reward is the hidden gold score.")
    noise: float = Field(0.05, ge=0.0, description="Std of Gaussian noise added to each score.")
    position_bias: float = Field(0.0, description="Bonus for the first presented slot.")
    length_bias: float = Field(0.0, description="Bonus per character of completion length (Goodhart lab).")
    format_bias: float = Field(0.0, description="Bonus for the surface feature (Goodhart lab).")
    format_min_chars: int | None = Field(None, ge=0, description="Feature: longer than this (None: a digit).")
    quantize: int | None = Field(None, ge=2, description="Quantise scores to this many levels.")


class LearnedJudgeSection(_Section):
    """A learned judge: a reward model (shipped name or .npz path) scoring groups relatively."""

    model: str = Field("arith-rm", description="Reward model: a shipped name (arith-rm) or an .npz path.")
    min_span: float = Field(1.0, ge=0.0, description="Raw-score spread needed to stretch scores to [0, 1].")


class RewardSection(_Section):
    """Where training rewards come from: a verifier, a RULER judge, a learned or a simulated judge."""

    kind: Literal["verifier", "judge", "learned_judge", "simulated_judge", "rollout"] = Field(
        "verifier", description="Reward source ('rollout': keep the reward the environment's rollout set)."
    )
    verifier: str = Field("arith-strict", description="Verifier name when kind = 'verifier'.")
    judge_model: str | None = Field(None, description="Judge model name when kind = 'judge'.")
    judge_base_url: str | None = Field(None, description="OpenAI-compatible base URL of the judge.")
    judge_api_key_env: str | None = Field("OPENAI_API_KEY", description="Env var holding the judge key.")
    rubric: str | None = Field(None, description="Rubric text (default: palaestra's own rubric).")
    judge_cache: str | None = Field(
        "judge_cache.sqlite", description="sqlite judge cache (relative: in the run dir); '' or 'off': none."
    )
    quantize: int | None = Field(None, ge=2, description="Round train rewards to this many levels in [0, 1].")
    max_judge_calls: int | None = Field(2000, ge=0, description="Judge calls a run may plan without --yes.")
    on_failure: Literal["drop", "raise"] = Field("drop", description="Group the judge failed: drop or raise.")
    judge_max_retries: int = Field(3, ge=0, description="Judge retries per group.")
    judge_timeout: float = Field(60.0, gt=0, description="Deadline of one judge request (whole reply), s.")
    judge_max_group_seconds: float | None = Field(
        None, gt=0, description="Seconds to judge one group, retries included (then dropped); None: no bound."
    )
    judge_backoff: float = Field(0.5, ge=0, description="First retry wait, s (doubles; Retry-After wins).")
    simulated: SimulatedJudgeSection = Field(default_factory=lambda: SimulatedJudgeSection())
    learned: LearnedJudgeSection = Field(default_factory=lambda: LearnedJudgeSection())


class ValidationSection(_Section):
    """Verifier accuracy on the validation split, the metric stopping watches."""

    every: int = Field(10, ge=1, description="Validate every k steps (and at step 0).")
    verifier: str = Field("arith-strict", description="Verifier scoring validation outputs.")
    max_examples: int | None = Field(None, ge=1, description="Use the first N validation examples.")
    greedy: bool = Field(True, description="Measure greedy accuracy (temperature 0).")
    sampled: bool = Field(True, description="Measure pass@1 at temperature 1 (seeded).")
    metric: Literal["val_greedy_accuracy", "val_sampled_accuracy"] = Field(
        "val_greedy_accuracy", description="Which accuracy stopping watches."
    )


class StoppingSection(StoppingRule):
    """ValidationStopping settings (palaestra.trainer.stopping.StoppingRule), plus what happens at the end."""

    restore_best: bool = Field(True, description="Leave the best validated weights in checkpoints/best.npz.")


class ExperimentConfig(_Section):
    """A whole experiment. Load one with :func:`load_config` (TOML) or build it in Python."""

    run: RunSection = Field(default_factory=lambda: RunSection())
    model: ModelSection = Field(default_factory=lambda: ModelSection())
    env: EnvSection = Field(default_factory=lambda: EnvSection())
    reward: RewardSection = Field(default_factory=lambda: RewardSection())
    validation: ValidationSection = Field(default_factory=lambda: ValidationSection())
    train: TrainConfig = Field(default_factory=TrainConfig)
    stopping: StoppingSection = Field(default_factory=lambda: StoppingSection())

    @model_validator(mode="after")
    def _finite(self) -> ExperimentConfig:
        bad = _non_finite(self.model_dump(), ())
        if bad:
            raise ValueError(f"field '{bad}': must be a finite number (not inf or nan)")
        return self

    def output_path(self) -> Path:
        """The run folder."""
        return Path(self.run.output_dir or Path("runs") / self.run.name)


def _non_finite(value: Any, path: tuple[str, ...]) -> str | None:
    """The dotted path of the first non-finite float anywhere in ``value`` (free-form dicts included)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".".join(path)
    if isinstance(value, (list, tuple)):
        value = dict(enumerate(value))
    if isinstance(value, dict):
        for k, v in value.items():
            if found := _non_finite(v, (*path, str(k))):
                return found
    return None


def keyword_names(fn: Callable[..., Any]) -> set[str] | None:
    """The names ``fn`` takes as keyword arguments; ``None``: any (``**kwargs``, or no signature to read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def accepted_kwargs(fn: Callable[..., Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The items of ``wanted`` that ``fn`` accepts as keyword arguments (all of them with ``**kwargs``)."""
    names = keyword_names(fn)
    return dict(wanted) if names is None else {k: v for k, v in wanted.items() if k in names}


def check_env_options(cfg: ExperimentConfig, takers: Sequence[Callable[..., Any]]) -> None:
    """Refuse ``env.options`` keys no taker (rollouts, env validation) accepts, or that the experiment sets."""
    accepted: set[str] = set()
    for fn in takers:
        taken = keyword_names(fn)
        if taken is None:
            return
        accepted |= taken
    for key in cfg.env.options:
        if key in _RESERVED_OPTIONS:
            raise DataError(f"field 'env.options.{key}': set by the experiment (use env.{key} or run.seed)")
        if key not in accepted:
            names = sorted(accepted - {"model", "example", "n", "examples", *_RESERVED_OPTIONS})
            raise DataError(
                f"field 'env.options.{key}': unknown option for environment {cfg.env.name!r} "
                f"(its rollout takes: {', '.join(names) or 'no options'})"
            )


def config_from_dict(data: dict[str, Any], *, source: str = "<config>") -> ExperimentConfig:
    """Validate a dict; errors name the source and the dotted field path of every problem."""
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(x) for x in err["loc"]) or "<root>"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            whole = field == "<root>" and str(msg).startswith("Value error, field '")  # a whole-config check
            problems.append(str(msg).removeprefix("Value error, ") if whole else f"field '{field}': {msg}")
        raise DataError("; ".join(problems), path=source) from None


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate an experiment TOML file; a syntax error names its line."""
    p = Path(path)
    if not p.exists():
        raise DataError("config file not found", path=p)
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError("not valid UTF-8", path=p, line=raw[: exc.start].count(b"\n") + 1) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = getattr(exc, "lineno", None) or (int(found.group(1)) if found else None)
        if line is None and "end of document" in str(exc):
            line = len(text.splitlines()) or 1
        raise DataError(f"TOML syntax error: {exc}", path=p, line=line) from None
    return config_from_dict(data, source=str(p))
