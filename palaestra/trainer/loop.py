"""The RL loop, top to bottom: sample -> score -> advantage -> loss -> step -> validate -> stop.

:func:`train` is the whole loop of ``palaestra train``; :class:`~palaestra.trainer.experiment.Experiment` builds
its parts (:class:`Loop`) and is its :class:`RunHooks` (the I/O). :class:`GRPOTrainer` is the update of one step.

Hyper-parameters (:class:`~palaestra.trainer.expconfig.ExperimentConfig`): ``run.max_steps``; ``G =
run.groups_per_step`` scenarios of ``K = run.group_size`` rollouts; ``run.seed``; the gather's
``run.max_concurrency``, ``max_exceptions`` and ``rollout_timeout``; ``run.max_staleness``;
``run.checkpoint_every``; ``validation.every`` and ``metric`` (watched by ``stopping.*``); the update's ``train.*``.

The math of one step (``objective="grpo"``, ``advantage_mode="grpo"``, final reward credited to every token):
``A_gk = (r_gk - mean_k r_g) / (std_k r_g + eps)``, groups of equal rewards dropped, ``A < 0`` scaled by
``negative_advantage_scale`` (advantages.py); per token ``rho_t = exp(logp_theta(t) - logp_sampled(t))`` and
``loss = -agg_t min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A)`` (+ ``kl_beta`` k3 KL) (losses.py);
one Adam step at ``lr_at(step)`` with the gradient norm clipped at ``clip_norm`` (update.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from palaestra.models.embedded import EmbeddedModel
from palaestra.trainer.advantages import batch_advantages, ranking_to_pairs, turn_advantages
from palaestra.trainer.backend import Backend, TrainBatch
from palaestra.trainer.checkpoints import load_checkpoint, save_checkpoint
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.embedded import EmbeddedBackend
from palaestra.trainer.expconfig import ExperimentConfig, accepted_kwargs
from palaestra.trainer.runfolder import accumulate_totals, judge_usage, prefixed
from palaestra.trainer.stopping import StopDecision, ValidationStopping
from palaestra.trajectories.executors import frozen_heap
from palaestra.trajectories.gather import gather_trajectory_groups
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from palaestra.trainer.pipeline import RolloutPipeline


# one rollout call: (arguments after the model, keyword arguments)
Call = tuple[tuple[Any, ...], dict[str, Any]]


class RunHooks(Protocol):
    """The I/O around the loop (:class:`~palaestra.trainer.experiment.Experiment` implements it)."""

    def examples_for_step(self, step: int) -> list[dict[str, Any]]: ...

    async def validation(self, step: int) -> dict[str, Any]: ...

    def save_best(self, step: int) -> None: ...

    def log_step(self, row: dict[str, Any], groups: Sequence[TrajectoryGroup]) -> None: ...

    def checkpoint(self) -> None: ...


@dataclass
class Loop:
    """Everything :func:`train` works on; ``counters`` and the parts' states are what a checkpoint holds."""

    cfg: ExperimentConfig
    model: Any  # the policy: sampled through its OpenAI-compatible API, trained by ``trainer``
    rollout: Callable[..., Any]  # rollout(model, example, **kw) -> Trajectory; grouped: (model, example, K)
    grouped: bool  # one call samples the whole group
    reward: Any  # reward.score_group(group, example) -> the scored group, or None (dropped)
    trainer: GRPOTrainer
    stopper: ValidationStopping
    pipeline: RolloutPipeline  # runs the rollouts: now, or ahead of time from begin(step) (max_staleness)
    counters: dict[str, Any]  # step, elapsed, base_val, best_val, totals: new_counters() or a checkpoint's

    def __post_init__(self) -> None:
        self._t0 = time.monotonic() - float(self.counters["elapsed"])

    def elapsed(self) -> float:
        """Wall seconds of the run so far, across resumes."""
        return time.monotonic() - self._t0


def new_counters() -> dict[str, Any]:
    """The counters of a fresh run (no base validation yet)."""
    return {"step": 0, "elapsed": 0.0, "base_val": None, "best_val": None, "totals": {}}


async def train(loop: Loop, hooks: RunHooks) -> StopDecision:
    """Run ``loop`` until the stopper or ``run.max_steps`` ends it; returns why it stopped."""
    cfg, run, counters = loop.cfg, loop.cfg.run, loop.counters
    trainer, stopper = loop.trainer, loop.stopper
    metric = cfg.validation.metric.removeprefix("val_")

    async def validate(step: int) -> dict[str, Any]:  # val/* after step, told to the stopper; the best kept
        val = await hooks.validation(step)
        stopper.update_val(step, val[metric])
        if stopper.improved:
            counters["best_val"] = val | {"step": step}
            hooks.save_best(step)
        return prefixed("val", val)

    if counters["base_val"] is None:  # a fresh run: validate the base policy first (step 0)
        val = await validate(0)
        counters["base_val"] = counters["best_val"]
        hooks.log_step({"step": 0, "time": loop.elapsed(), **val}, [])
        hooks.checkpoint()

    with frozen_heap():  # no full garbage collection walks the model and data mid-run (executors.py)
        while stopper.decision is None and counters["step"] < run.max_steps:
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

            # the stopper watches the train reward (a learned judge's is relative: its absolute score instead)
            usage = judge_usage(groups)
            n_abs = usage.get("absolute_n")
            reward = usage["absolute_sum"] / n_abs if n_abs else metrics.get("reward_mean", 0.0)
            stopper.update_train(step, reward if groups else None)  # no group scored (judge down): no reward
            # the history row: train/* (update, outcome codes), judge/* (calls, faults), faults/*, staleness
            outcomes = Counter(
                str(t.metadata["outcome"]) for g in groups for t in g if "outcome" in t.metadata
            )
            row = {
                "step": step,
                "policy_version": getattr(loop.model, "step", None),
                **prefixed("train", metrics),
                **{f"train/outcome/{k}": v for k, v in sorted(outcomes.items())},
                **prefixed("judge", judge_usage([*groups, *dropped])),
                **loop.pipeline.end(step),
                "train/rollout_seconds": t_rollout,
                "faults/rollout_exceptions": failures,
                "faults/groups_dropped": len(dropped),
                "faults/groups_total": len(examples),
            }

            # 6. validate every validation.every steps and at the last one
            if stopper.should_validate(step) or step == run.max_steps:
                row.update(await validate(step))

            # 7. stop? (no improvement, a regression, the reward-hacking alarm, the judge down)
            stop = stopper.decision is not None
            if not stop and step < run.max_steps:  # the next rollouts start during this bookkeeping
                loop.pipeline.begin(step + 1)
            counters["step"] = step
            row["time"] = loop.elapsed()
            hooks.log_step(row, groups)
            accumulate_totals(counters["totals"], row)
            if step % run.checkpoint_every == 0 or stop or step == run.max_steps:
                hooks.checkpoint()

        decision = stopper.stop_max_steps(counters["step"])  # or the decision it stopped on
        hooks.checkpoint()
        return decision


async def sample_and_score(
    loop: Loop, step: int, examples: Sequence[Mapping[str, Any]]
) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup], int]:
    """Run every rollout of ``step``, each group scored as soon as it finishes. Returns the scored groups, the
    groups the reward dropped (their judge calls still count) and the number of rollouts that raised."""
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

    calls = rollout_calls(loop.cfg, step, examples, loop.rollout, loop.grouped)
    groups = [
        TrajectoryGroup(
            rollouts,  # running ahead on a frozen policy (max_staleness > 0), else called now
            metadata={
                "example_id": str(ex.get("id", g)),
                "group_index": g,
                "step": step,
                "judge_salt": f"{run.seed}:{step}:{g}",
            },
        )
        for g, (ex, rollouts) in enumerate(zip(examples, loop.pipeline.rollouts(step, calls)))
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
    """The rollout calls of ``step``, per group: ``K`` calls ``fn(model, example, seed=...)``, or one call
    ``fn(model, example, K, seed=...)`` when ``grouped``, with the settings and ``env.options`` ``fn`` accepts."""
    run, env = cfg.run, cfg.env
    fixed = {"temperature": env.temperature, "max_tokens": env.max_tokens, **env.options}
    taken = accepted_kwargs(fn, {"seed": None, **fixed})  # signature read once per step

    def kwargs(*where: int) -> dict[str, Any]:
        return {**taken, "seed": derive_seed(run.seed, step, *where)} if "seed" in taken else taken.copy()

    if grouped:
        return [[((ex, run.group_size), kwargs(g))] for g, ex in enumerate(examples)]
    return [[((ex,), kwargs(g, i)) for i in range(run.group_size)] for g, ex in enumerate(examples)]


_TRAINER_FORMAT = "palaestra.grpo_trainer/1"


@dataclass(frozen=True)
class StepResult:
    """Outcome of :meth:`GRPOTrainer.step`: trainer steps so far, ``model.step``, whether the weights changed."""

    step: int
    policy_step: int
    updated: bool
    metrics: dict[str, float] = field(default_factory=dict)


def _as_trajectories(group: TrajectoryGroup | Sequence[Trajectory], i: int) -> tuple[list[Trajectory], int]:
    """A group's trajectories and its number of failed rollouts (a plain list of trajectories has none)."""
    if isinstance(group, TrajectoryGroup):
        if group.num_pending:
            raise ValueError(f"groups[{i}] still has {group.num_pending} pending rollouts; await it first")
        return list(group.trajectories), len(group.exceptions)
    trajs = list(group)
    for k, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise TypeError(f"groups[{i}][{k}] is {type(t).__name__}, not a Trajectory")
    return trajs, 0


class GRPOTrainer:
    """Scored trajectory groups in, one policy update out (:meth:`build_batch`, then :meth:`update`); the default
    backend serves the embedded and HF models, any other model needs an explicit ``backend``."""

    def __init__(self, model: Any, config: TrainConfig | None = None, backend: Backend | None = None) -> None:
        self.model = model
        self.config = config if config is not None else TrainConfig()
        if backend is None:
            if getattr(model, "backend_kind", None) == "hf":  # palaestra.models.hf.HFModel (torch: lazy)
                from palaestra.trainer.hf_backend import HFBackend

                backend = HFBackend(model, self.config)
            elif isinstance(model, EmbeddedModel):
                backend = EmbeddedBackend(model, self.config)
            else:
                raise TypeError(
                    f"GRPOTrainer: no default backend for {type(model).__name__}; pass backend=<Backend>"
                )
        self.backend: Backend = backend
        self.global_step = 0

    def build_batch(
        self, groups: Sequence[TrajectoryGroup | Sequence[Trajectory]]
    ) -> tuple[TrainBatch, dict[str, float]]:
        """Advantages (or DPO pairs) for ``groups`` and the :class:`TrainBatch` of the kept groups."""
        cfg = self.config
        parts = [_as_trajectories(group, i) for i, group in enumerate(groups)]  # (trajectories, failures)
        trajs_of = [trajs for trajs, _ in parts]
        rewards = [[float(t.reward) for t in trajs] for trajs in trajs_of]
        adv = batch_advantages(
            rewards, mode=cfg.advantage_mode, eps=cfg.advantage_eps, drop_zero_std=cfg.drop_zero_std
        )
        flat = np.asarray([r for rs in rewards for r in rs], dtype=np.float64)
        metrics: dict[str, float] = {
            **({"reward_mean": float(flat.mean()), "reward_std": float(flat.std())} if flat.size else {}),
            "trajectories": float(flat.size),  # 0 (no group scored): no reward to report, not a reward of 0
            "exceptions": float(sum(n for _, n in parts)),
            **adv.metrics,
        }
        kept = [g for g in adv.kept if trajs_of[g]]
        if cfg.objective == "dpo":  # each kept group's ranking -> (chosen, rejected) pairs
            batch_trajs: list[Trajectory] = []
            gidx: list[int] = []
            pairs: list[tuple[int, int]] = []
            for g in kept:
                gp = ranking_to_pairs(
                    rewards[g],
                    min_margin=cfg.dpo_min_margin,
                    max_pairs=cfg.dpo_max_pairs,
                    strategy=cfg.dpo_pairs,
                )
                used = sorted({k for p in gp for k in p})
                pos = {k: len(batch_trajs) + j for j, k in enumerate(used)}
                batch_trajs.extend(trajs_of[g][k] for k in used)
                gidx.extend([g] * len(used))
                pairs.extend((pos[c], pos[r]) for c, r in gp)
            metrics["pairs"] = float(len(pairs))
            return TrainBatch(
                batch_trajs, np.zeros(len(batch_trajs)), np.asarray(gidx, dtype=np.int64), pairs
            ), metrics
        if cfg.turn_credit == "final":  # the trajectory's advantage on all its tokens
            for g, trajs in enumerate(trajs_of):  # recorded so `palaestra show` / reports can display them
                for t, a in zip(trajs, adv.advantages[g]):
                    t.metrics["advantage"] = float(a)
            batch = TrainBatch.from_groups(
                [trajs_of[g] for g in kept], [self._scaled(adv.advantages[g]) for g in kept]
            )
        else:
            batch, kept = self._turn_batch(trajs_of, rewards, metrics)
        batch.group_index = np.asarray(kept, dtype=np.int64)[batch.group_index] if kept else batch.group_index
        return batch, metrics

    def _scaled(self, adv: np.ndarray) -> np.ndarray:
        """Negative advantages times ``negative_advantage_scale`` (< 1: failures pushed down less)."""
        scale = self.config.negative_advantage_scale
        return adv if scale == 1.0 else np.where(adv < 0.0, adv * scale, adv)

    def _turn_batch(
        self, trajs_of: list[list[Trajectory]], rewards: list[list[float]], metrics: dict[str, float]
    ) -> tuple[TrainBatch, list[int]]:
        """Per-turn credit (``config.turn_credit``): one advantage per Choice (advantages.turn_advantages)."""
        cfg, turns = self.config, []
        for g, trajs in enumerate(trajs_of):
            try:
                ta = turn_advantages(
                    rewards[g],
                    [t.turn_rewards for t in trajs],
                    [len(t.choices()) for t in trajs],
                    credit=cfg.turn_credit,
                    mode=cfg.advantage_mode,
                    eps=cfg.advantage_eps,
                    discount=cfg.turn_discount,
                )
            except ValueError as exc:
                raise ValueError(f"groups[{g}]: {exc}") from None
            turns.append([self._scaled(a) for a in ta])
            for t, a in zip(trajs, turns[-1]):  # the first and last turns' advantages, for `palaestra show`
                t.metrics["advantage"] = float(a[0]) if a.size else 0.0
                t.metrics["advantage_last_turn"] = float(a[-1]) if a.size else 0.0
        zero = {g for g, ta in enumerate(turns) if len(ta) < 2 or all(not np.any(a) for a in ta)}
        kept = [g for g, trajs in enumerate(trajs_of) if trajs and not (cfg.drop_zero_std and g in zero)]
        kept_flat = [abs(float(x)) for g in kept for a in turns[g] for x in a]
        metrics.update(
            groups_kept=float(len(kept)),
            frac_zero_std=len(zero) / len(trajs_of) if trajs_of else 0.0,
            adv_abs_mean=float(np.mean(kept_flat)) if kept_flat else 0.0,
        )
        firsts = [[float(a[0]) if a.size else 0.0 for a in turns[g]] for g in kept]
        return TrainBatch.from_groups([trajs_of[g] for g in kept], firsts, [turns[g] for g in kept]), kept

    async def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update at ``config.lr_at(global_step)`` in a worker thread (none on an empty batch); its metrics."""
        metrics: dict[str, float] = {}
        if len(batch) > 0 and (self.config.objective != "dpo" or bool(batch.pairs)):
            cfg = self.config.model_copy(update={"lr": self.config.lr_at(self.global_step)})
            metrics = await asyncio.to_thread(self.backend.train_step, batch, cfg)
        self.global_step += 1
        return metrics

    async def step(self, groups: Sequence[TrajectoryGroup | Sequence[Trajectory]]) -> StepResult:
        """One training step on scored groups: :meth:`build_batch` (advantages), then :meth:`update`."""
        t0 = time.perf_counter()
        batch, metrics = self.build_batch(groups)
        trained = await self.update(batch)
        metrics.update(trained, seconds=time.perf_counter() - t0)
        return StepResult(
            step=self.global_step,
            policy_step=int(getattr(self.model, "step", 0)),
            updated=bool(trained),
            metrics=metrics,
        )

    def state_dict(self) -> dict[str, np.ndarray]:
        """Backend state (weights, optimiser, RNG, reference, policy step), trainer step and config."""
        state = {"backend/" + k: v for k, v in self.backend.state_dict().items()}
        state["trainer/format"] = np.array(_TRAINER_FORMAT)
        state["trainer/global_step"] = np.array(self.global_step, dtype=np.int64)
        state["trainer/config_json"] = np.array(self.config.model_dump_json())
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict` but not its config; ``weights_only=True``: the policy weights alone."""
        fmt = str(np.asarray(state.get("trainer/format", "")))
        if fmt != _TRAINER_FORMAT:
            raise ValueError(f"trainer state: format {fmt!r} is not {_TRAINER_FORMAT!r}")
        backend_state = {k[8:]: v for k, v in state.items() if k.startswith("backend/")}
        self.backend.load_state_dict(backend_state, weights_only=weights_only)
        if not weights_only:
            self.global_step = int(np.asarray(state["trainer/global_step"]))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` to an ``.npz`` checkpoint."""
        save_checkpoint(path, {"trainer": self.state_dict()})

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a file written by :meth:`save`."""
        try:
            self.load_state_dict(load_checkpoint(path)["trainer"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a trainer checkpoint ({exc})") from None
