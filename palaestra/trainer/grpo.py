"""GRPOTrainer: scored trajectory groups in, one policy update out (Loop C: sample, score, advantage, update).

::

    trainer = GRPOTrainer(model, TrainConfig())
    groups = await gather_trajectory_groups(...)        # scored by a verifier or a judge
    result = await trainer.step(groups)                 # advantages, update, model.step += 1
    trainer.save("ckpt.npz"); trainer.load("ckpt.npz")  # weights, optimiser, RNG, steps

``objective="grpo"``: group-relative advantages (:func:`~palaestra.trainer.advantages.batch_advantages`,
zero-std groups dropped when ``drop_zero_std``), then the clipped surrogate. ``objective="dpo"``: each kept
group's ranking becomes (chosen, rejected) pairs (:func:`~palaestra.trainer.advantages.ranking_to_pairs`) and
the backend minimises the DPO loss against the frozen reference. The learning rate of each update is
``config.lr_at(global_step)`` (cosine decay over ``decay_steps`` by default). The update itself is synchronous
numpy work and runs in a worker thread, so rollouts and servers on the event loop keep running meanwhile.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from palaestra.models.embedded import EmbeddedModel
from palaestra.trainer.advantages import batch_advantages, ranking_to_pairs, turn_advantages
from palaestra.trainer.backend import Backend, TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trajectories.io import atomic_write_bytes
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

__all__ = ["GRPOTrainer", "StepResult"]

_TRAINER_FORMAT = "palaestra.grpo_trainer/1"


@dataclass(frozen=True)
class StepResult:
    """Outcome of :meth:`GRPOTrainer.step`.

    ``step``: trainer steps taken so far (this one included); ``policy_step``: ``model.step`` after it;
    ``updated``: False when no group had a learning signal (nothing to train on; the weights are unchanged).
    ``metrics`` (floats): ``reward_mean``, ``reward_std`` (population std over every trajectory),
    ``groups``, ``groups_kept``, ``frac_zero_std``, ``trajectories``, ``exceptions``, ``adv_abs_mean``,
    ``seconds`` (wall time of the call) and, when updated, the backend's: ``loss``, ``pg_loss``,
    ``clip_frac``, ``clip_low_frac``, ``clip_high_frac``, ``ratio_mean/min/max``, ``kl`` (only when a
    reference policy is kept: ``kl_beta > 0`` or DPO), ``entropy``, ``tokens``, ``grad_norm``,
    ``optimizer_steps``, ``train_seconds``; DPO adds ``pairs``, ``reward_accuracy``, ``margin``.
    """

    step: int
    policy_step: int
    updated: bool
    metrics: dict[str, float] = field(default_factory=dict)


def _as_trajectories(group: TrajectoryGroup | Sequence[Trajectory], i: int) -> tuple[list[Trajectory], int]:
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
    """Policy-gradient trainer over trajectory groups (see the module docstring).

    ``backend`` defaults to :class:`~palaestra.trainer.embedded.EmbeddedBackend` for an
    :class:`~palaestra.models.embedded.EmbeddedModel`; any other model needs an explicit backend.
    """

    def __init__(self, model: Any, config: TrainConfig | None = None, backend: Backend | None = None) -> None:
        self.model = model
        self.config = config if config is not None else TrainConfig()
        if backend is None:
            if getattr(model, "backend_kind", None) == "hf":  # palaestra.models.hf.HFModel (torch: lazy)
                from palaestra.trainer.hf_backend import HFBackend

                backend = HFBackend(model, self.config)
            elif isinstance(model, EmbeddedModel):
                from palaestra.trainer.embedded import EmbeddedBackend

                backend = EmbeddedBackend(model, self.config)
            else:
                raise TypeError(
                    f"GRPOTrainer: no default backend for {type(model).__name__}; pass backend=<Backend>"
                )
        self.backend: Backend = backend
        self.global_step = 0

    # ------------------------------------------------------------------ batch building
    def build_batch(
        self, groups: Sequence[TrajectoryGroup | Sequence[Trajectory]]
    ) -> tuple[TrainBatch, dict[str, float]]:
        """Advantages (or DPO pairs) for ``groups`` and the :class:`TrainBatch` of the kept groups."""
        cfg = self.config
        trajs_of: list[list[Trajectory]] = []
        n_exc = 0
        for i, group in enumerate(groups):
            trajs, exc = _as_trajectories(group, i)
            trajs_of.append(trajs)
            n_exc += exc
        rewards = [[float(t.reward) for t in trajs] for trajs in trajs_of]
        adv = batch_advantages(
            rewards, mode=cfg.advantage_mode, eps=cfg.advantage_eps, drop_zero_std=cfg.drop_zero_std
        )
        flat = np.asarray([r for rs in rewards for r in rs], dtype=np.float64)
        metrics: dict[str, float] = {
            "reward_mean": float(flat.mean()) if flat.size else 0.0,
            "reward_std": float(flat.std()) if flat.size else 0.0,
            "trajectories": float(flat.size),
            "exceptions": float(n_exc),
            **adv.metrics,
        }
        kept = [g for g in adv.kept if trajs_of[g]]
        if cfg.objective == "dpo":
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
            batch = TrainBatch(
                batch_trajs, np.zeros(len(batch_trajs)), np.asarray(gidx, dtype=np.int64), pairs
            )
            return batch, metrics
        if cfg.turn_credit != "final":
            return self._build_turn_batch(trajs_of, rewards, metrics)
        advs = [adv.advantages[g] for g in kept]
        if cfg.negative_advantage_scale != 1.0:
            advs = [np.where(a < 0.0, a * cfg.negative_advantage_scale, a) for a in advs]
        for g, trajs in enumerate(trajs_of):  # recorded so `palaestra show` / reports can display them
            for t, a in zip(trajs, adv.advantages[g]):
                t.metrics["advantage"] = float(a)
        batch = TrainBatch.from_groups([trajs_of[g] for g in kept], advs)
        batch.group_index = np.asarray(kept, dtype=np.int64)[batch.group_index] if kept else batch.group_index
        return batch, metrics

    def _build_turn_batch(
        self, trajs_of: list[list[Trajectory]], rewards: list[list[float]], metrics: dict[str, float]
    ) -> tuple[TrainBatch, dict[str, float]]:
        """Per-turn credit (``config.turn_credit``): one advantage per Choice (advantages.turn_advantages)."""
        cfg = self.config
        turn_advs: list[list[np.ndarray]] = []
        for g, trajs in enumerate(trajs_of):
            try:
                turn_advs.append(
                    turn_advantages(
                        rewards[g],
                        [t.turn_rewards for t in trajs],
                        [len(t.choices()) for t in trajs],
                        credit=cfg.turn_credit,
                        mode=cfg.advantage_mode,
                        eps=cfg.advantage_eps,
                        discount=cfg.turn_discount,
                    )
                )
            except ValueError as exc:
                raise ValueError(f"groups[{g}]: {exc}") from None
        zero = [g for g, ta in enumerate(turn_advs) if len(ta) < 2 or all(not np.any(a) for a in ta)]
        kept = [g for g in range(len(trajs_of)) if trajs_of[g] and not (cfg.drop_zero_std and g in set(zero))]
        if cfg.negative_advantage_scale != 1.0:
            turn_advs = [
                [np.where(a < 0.0, a * cfg.negative_advantage_scale, a) for a in ta] for ta in turn_advs
            ]
        for g, trajs in enumerate(trajs_of):  # the first turn's advantage, for `palaestra show` / reports
            for t, a in zip(trajs, turn_advs[g]):
                t.metrics["advantage"] = float(a[0]) if a.size else 0.0
                t.metrics["advantage_last_turn"] = float(a[-1]) if a.size else 0.0
        firsts = [[float(a[0]) if a.size else 0.0 for a in turn_advs[g]] for g in kept]
        kept_flat = [abs(float(x)) for g in kept for a in turn_advs[g] for x in a]
        metrics.update(
            groups_kept=float(len(kept)),
            frac_zero_std=len(zero) / len(trajs_of) if trajs_of else 0.0,
            adv_abs_mean=float(np.mean(kept_flat)) if kept_flat else 0.0,
        )
        batch = TrainBatch.from_groups(
            [trajs_of[g] for g in kept], firsts, turn_advantages=[turn_advs[g] for g in kept]
        )
        batch.group_index = np.asarray(kept, dtype=np.int64)[batch.group_index] if kept else batch.group_index
        return batch, metrics

    # ------------------------------------------------------------------ update
    async def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update on a batch from :meth:`build_batch` at ``config.lr_at(global_step)`` (no update when it
        holds nothing to train on); the numpy work runs in a worker thread. Returns the backend's metrics."""
        metrics: dict[str, float] = {}
        if len(batch) > 0 and (self.config.objective != "dpo" or bool(batch.pairs)):
            cfg = self.config
            if cfg.lr_schedule != "constant" or cfg.warmup_steps:
                cfg = cfg.model_copy(update={"lr": cfg.lr_at(self.global_step)})
            metrics = await asyncio.to_thread(self.backend.train_step, batch, cfg)
        self.global_step += 1
        return metrics

    async def step(self, groups: Sequence[TrajectoryGroup | Sequence[Trajectory]]) -> StepResult:
        """One training step on scored groups: :meth:`build_batch` (advantages), then :meth:`update`."""
        t0 = time.perf_counter()
        batch, metrics = self.build_batch(groups)
        trained = await self.update(batch)
        metrics.update(trained)
        metrics["seconds"] = time.perf_counter() - t0
        return StepResult(
            step=self.global_step,
            policy_step=int(getattr(self.model, "step", 0)),
            updated=bool(trained),
            metrics=metrics,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, np.ndarray]:
        """Backend state (weights, optimiser, RNG, reference, policy step), trainer step and config."""
        state = {"backend/" + k: v for k, v in self.backend.state_dict().items()}
        state["trainer/format"] = np.array(_TRAINER_FORMAT)
        state["trainer/global_step"] = np.array(self.global_step, dtype=np.int64)
        state["trainer/config_json"] = np.array(self.config.model_dump_json())
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict`. The config is not restored (the trainer keeps its own); it is stored
        only so that a run can be inspected. ``weights_only=True`` restores the policy weights alone (e.g.
        the best validated ones at the end of a run) and keeps optimiser, RNG and step counters."""
        fmt = str(np.asarray(state.get("trainer/format", "")))
        if fmt != _TRAINER_FORMAT:
            raise ValueError(f"trainer state: format {fmt!r} is not {_TRAINER_FORMAT!r}")
        backend_state = {k[8:]: v for k, v in state.items() if k.startswith("backend/")}
        self.backend.load_state_dict(backend_state, weights_only=weights_only)
        if not weights_only:
            self.global_step = int(np.asarray(state["trainer/global_step"]))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` to an ``.npz`` file atomically (no pickle)."""
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=False, **self.state_dict())  # type: ignore[arg-type]
        atomic_write_bytes(path, buf.getvalue())

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a file written by :meth:`save` (errors name the file)."""
        try:
            with np.load(path, allow_pickle=False) as npz:
                state = {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable trainer checkpoint ({exc})") from exc
        try:
            self.load_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    @staticmethod
    def saved_config(path: str | os.PathLike[str]) -> TrainConfig:
        """The TrainConfig stored in a checkpoint written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as npz:
            return TrainConfig.model_validate(json.loads(str(npz["trainer/config_json"])))
