"""The RL loop, top to bottom: sample -> score -> advantage -> loss -> step -> validate -> stop.

This file is the whole training loop of ``palaestra train``. :class:`~palaestra.trainer.experiment.Experiment`
builds its parts from a config (:class:`Loop`) and implements :class:`RunHooks`, the I/O around it: run folder,
history, samples, checkpoints, reports. Read :func:`train` first.

Hyper-parameters (fields of :class:`~palaestra.trainer.expconfig.ExperimentConfig`; defaults in expconfig.py
and config.py):

==========================  ========================================================================
``run.max_steps``           hard cap on training steps
``run.groups_per_step``     scenarios per step: ``G`` groups
``run.group_size``          rollouts per scenario: ``K``; advantages are relative within a group
``run.seed``                data order and every sampling seed derive from it (``derive_seed``)
``run.max_concurrency``,    the gather's limits: rollouts in flight, failed rollouts a step may absorb,
``run.max_exceptions``,     seconds one rollout may take
``run.rollout_timeout``
``run.max_staleness``       ``s``: step ``k`` samples from the policy after update ``k - 1 - s`` (pipeline.py)
``run.checkpoint_every``    a resume state every ``k`` steps and when the run stops (a kill replays < k)
``validation.every``,       validate every ``k`` steps (and at the last) on this metric; the stopper watches
``validation.metric``       it (``stopping.*``: patience, regression, reward-hacking alarm)
``train.*``                 the update (:class:`~palaestra.trainer.config.TrainConfig`): ``lr`` and its
                            schedule, ``advantage_mode``, ``drop_zero_std``, ``negative_advantage_scale``,
                            ``clip_low``/``clip_high``, ``kl_beta``, ``agg``, ``minibatch_size``, ``objective``
==========================  ========================================================================

The math of one step (``objective="grpo"``, ``advantage_mode="grpo"``, final reward credited to every token):

* advantage of rollout ``k`` of group ``g``: ``A_gk = (r_gk - mean_k r_g) / (std_k r_g + eps)``
  (:func:`~palaestra.trainer.advantages.batch_advantages`); a group whose rewards are all equal carries no
  signal and is dropped (``drop_zero_std``); ``A < 0`` is scaled by ``negative_advantage_scale``;
* per trainable token ``t``: ``rho_t = exp(logp_theta(t) - logp_sampled(t))`` and the clipped surrogate
  ``loss = -agg_t min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A)`` (+ ``kl_beta`` k3 KL to the
  initial policy) (:func:`~palaestra.trainer.losses.policy_loss`);
* backward from ``d loss / d logp``, then one Adam step with the gradient norm clipped at ``clip_norm`` and
  the learning rate ``lr_at(step)`` (:func:`~palaestra.trainer.update.update`).

``objective="dpo"`` turns each group's ranking into (chosen, rejected) pairs instead; ``turn_credit`` gives each
assistant turn its own advantage (advantages.py).
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from palaestra.trainer.grpo import GRPOTrainer
from palaestra.trainer.runfolder import accumulate_totals, judge_usage, prefixed
from palaestra.trainer.stopping import StopDecision, ValidationStopping
from palaestra.trajectories.gather import gather_trajectory_groups
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import TrajectoryGroup

if TYPE_CHECKING:
    from palaestra.trainer.expconfig import ExperimentConfig

__all__ = ["Loop", "RunHooks", "accepted_kwargs", "rollout_calls", "sample_and_score", "train"]

Call = tuple[
    tuple[Any, ...], dict[str, Any]
]  # one rollout call: (arguments after the model, keyword arguments)


class RunHooks(Protocol):
    """The I/O around the loop (:class:`~palaestra.trainer.experiment.Experiment` implements it)."""

    def examples_for_step(self, step: int) -> list[dict[str, Any]]:
        """The scenarios of step ``step`` (1-based), in a seeded order."""
        ...

    async def validation(self, step: int) -> dict[str, Any]:
        """Validation metrics of the current policy (its per-example rows kept in the run folder)."""
        ...

    def save_best(self, step: int) -> None:
        """The policy after ``step`` validated best so far: keep it."""
        ...

    def log_step(self, row: dict[str, Any], groups: Sequence[TrajectoryGroup]) -> None:
        """A finished step: its history row and sampled groups (step 0: the base validation alone)."""
        ...

    def checkpoint(self) -> None:
        """Write the resume state: after it, a kill loses no finished step."""
        ...


class Pipeline(Protocol):
    """Where rollouts run ahead of time (:class:`~palaestra.trainer.pipeline.RolloutPipeline`)."""

    def begin(self, step: int) -> None: ...

    def end(self, step: int) -> dict[str, Any]: ...


@dataclass
class Loop:
    """Everything :func:`train` works on; ``counters`` (with the trainer, stopper and pipeline state) is what a
    checkpoint holds, so a resumed loop goes on exactly where the checkpoint was written."""

    cfg: ExperimentConfig
    model: Any  # the policy: sampled through its OpenAI-compatible API, trained by ``trainer``
    rollout: Callable[..., Any]  # rollout(model, example, **kw) -> Trajectory; grouped: (model, example, K)
    grouped: bool  # one call samples the whole group
    reward: Any  # reward.score_group(group, example) -> the scored group, or None (dropped)
    trainer: GRPOTrainer
    stopper: ValidationStopping
    pipeline: Pipeline  # begin(step) / end(step): rollouts of later steps running ahead (max_staleness)
    counters: dict[str, Any]  # step, elapsed, base_val, best_val, totals (fresh: step 0, base_val None)

    def __post_init__(self) -> None:
        self._t0 = time.monotonic() - float(self.counters["elapsed"])

    def elapsed(self) -> float:
        """Wall seconds of the run so far, across resumes."""
        return time.monotonic() - self._t0


async def train(loop: Loop, hooks: RunHooks) -> StopDecision:
    """Run ``loop`` until the stopper or ``run.max_steps`` ends it; returns why it stopped."""
    cfg, run, counters = loop.cfg, loop.cfg.run, loop.counters
    trainer, stopper = loop.trainer, loop.stopper
    metric = cfg.validation.metric.removeprefix("val_")

    if counters["base_val"] is None:  # a fresh run: validate the base policy first (step 0)
        val = await hooks.validation(0)
        counters["base_val"] = counters["best_val"] = val | {"step": 0}
        stopper.update_val(0, val[metric])
        hooks.save_best(0)
        hooks.log_step({"step": 0, "time": loop.elapsed(), **prefixed("val", val)}, [])
        hooks.checkpoint()

    decision = stopper.decision
    while decision is None and counters["step"] < run.max_steps:
        step = counters["step"] + 1
        loop.pipeline.begin(step)  # max_staleness > 0: rollouts of steps step..step+s are already running

        # 1-2. sample K rollouts of each of the step's G scenarios; each group is scored when it finishes
        examples = hooks.examples_for_step(step)
        t0 = time.monotonic()
        groups, dropped, failures = await sample_and_score(loop, step, examples)
        t_rollout, t0 = time.monotonic() - t0, time.monotonic()

        # 3. advantages: rewards -> group-relative advantages, zero-signal groups dropped (advantages.py)
        batch, metrics = trainer.build_batch(groups)
        # 4-5. loss and step: per minibatch the clipped surrogate (losses.py), backward, Adam (update.py)
        metrics.update(await trainer.update(batch))
        metrics["seconds"] = time.monotonic() - t0

        # the stopper watches the train reward (a learned judge: its absolute score; no scored group: none)
        usage = judge_usage(groups)
        absolute = usage["absolute_sum"] / usage["absolute_n"] if usage.get("absolute_n") else None
        stopper.update_train(
            step, (absolute if absolute is not None else metrics["reward_mean"]) if groups else None
        )
        row = step_row(step, loop.model, groups, dropped, failures, len(examples), metrics, t_rollout)
        row.update(loop.pipeline.end(step))

        # 6. validate every validation.every steps and at the last one
        if stopper.should_validate(step) or step == run.max_steps:
            val = await hooks.validation(step)
            row.update(prefixed("val", val))
            decision = stopper.update_val(step, val[metric])
            if stopper.improved:
                counters["best_val"] = val | {"step": step}
                hooks.save_best(step)

        # 7. stop? (no improvement, a regression, the reward-hacking alarm, the judge down)
        decision = decision or stopper.decision
        counters["step"] = step
        row["time"] = loop.elapsed()
        hooks.log_step(row, groups)
        accumulate_totals(counters["totals"], row)
        if step % run.checkpoint_every == 0 or decision is not None or step == run.max_steps:
            hooks.checkpoint()

    if decision is None:
        decision = stopper.stop_max_steps(counters["step"])
    hooks.checkpoint()
    return decision


async def sample_and_score(
    loop: Loop, step: int, examples: Sequence[Mapping[str, Any]]
) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup], int]:
    """Every rollout of ``step``, run concurrently within the failure budget and timeouts, each group scored by
    the reward as soon as its rollouts finish. Returns the scored groups, the groups the reward dropped (not
    trained on; their judge calls still count) and the number of rollouts that raised."""
    run = loop.cfg.run
    dropped: list[TrajectoryGroup] = []
    failures = 0

    async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
        nonlocal failures
        failures += len(group.exceptions)  # counted before a judge adds its own record
        example = examples[int(group.metadata["group_index"] or 0)]
        scored: TrajectoryGroup | None = await loop.reward.score_group(group, example)
        if scored is None:
            dropped.append(group)
        return scored

    groups = [
        TrajectoryGroup(
            [loop.rollout(loop.model, *args, **kw) for args, kw in calls],
            metadata={
                "example_id": str(ex.get("id", g)),
                "group_index": g,
                "step": step,
                "judge_salt": f"{run.seed}:{step}:{g}",
            },
        )
        for g, (ex, calls) in enumerate(
            zip(examples, rollout_calls(loop.cfg, step, examples, loop.rollout, loop.grouped))
        )
    ]
    scored = await gather_trajectory_groups(
        groups,
        max_concurrency=run.max_concurrency,
        max_exceptions=run.max_exceptions,
        rollout_timeout=run.rollout_timeout,
        after_each=score,
        progress=False,
    )
    return scored, dropped, failures


def rollout_calls(
    cfg: ExperimentConfig,
    step: int,
    examples: Sequence[Mapping[str, Any]],
    fn: Callable[..., Any],
    grouped: bool,
) -> list[list[Call]]:
    """The rollout calls of ``step``, per group: ``K`` calls ``fn(model, example, seed=...)`` seeded from (run
    seed, step, group, rollout), or one call ``fn(model, example, K, seed=...)`` seeded from (run seed, step,
    group) when ``grouped``; with the sampling settings and ``env.options`` that ``fn`` accepts. The pipeline
    starts the same calls ahead of time."""
    run, env = cfg.run, cfg.env
    params = _accepted(fn)

    def kwargs(*where: int) -> dict[str, Any]:
        wanted = {
            "seed": derive_seed(run.seed, step, *where),
            "temperature": env.temperature,
            "max_tokens": env.max_tokens,
            **env.options,
        }
        return wanted if params is None else {k: v for k, v in wanted.items() if k in params}

    if grouped:
        return [[((ex, run.group_size), kwargs(g))] for g, ex in enumerate(examples)]
    return [[((ex,), kwargs(g, i)) for i in range(run.group_size)] for g, ex in enumerate(examples)]


def step_row(
    step: int,
    model: Any,
    groups: Sequence[TrajectoryGroup],
    dropped: Sequence[TrajectoryGroup],
    failures: int,
    n_groups: int,
    metrics: Mapping[str, float],
    t_rollout: float,
) -> dict[str, Any]:
    """The history row of a step: train/* (update metrics, outcome codes), judge/* usage, faults/*."""
    row: dict[str, Any] = {"step": step, "policy_version": getattr(model, "step", None)}
    row.update(prefixed("train", metrics))
    codes = Counter(
        str(t.metadata["outcome"]) for g in groups for t in g.trajectories if "outcome" in t.metadata
    )
    row.update({f"train/outcome/{k}": v for k, v in sorted(codes.items())})
    row["train/rollout_seconds"] = t_rollout
    row.update(prefixed("judge", judge_usage([*groups, *dropped])))
    row["faults/rollout_exceptions"] = failures
    row["faults/groups_dropped"] = len(dropped)
    row["faults/groups_total"] = n_groups
    return row


def _accepted(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword arguments ``fn`` takes (None: any, it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def accepted_kwargs(fn: Callable[..., Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The items of ``wanted`` that ``fn`` accepts as keyword arguments (all of them with ``**kwargs``)."""
    params = _accepted(fn)
    return dict(wanted) if params is None else {k: v for k, v in wanted.items() if k in params}
