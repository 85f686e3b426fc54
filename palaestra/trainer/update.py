"""The update (GRPO-family and DPO), written once for every backend (docs/architecture.md): per epoch and
minibatch, logprobs, the loss of :mod:`palaestra.trainer.losses`, backward and one clipped optimiser step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.losses import dpo_loss, policy_loss
from palaestra.trainer.tokenize import PackedBatch, tokenize_batch

__all__ = ["PolicyBackend", "TrainablePolicy", "dpo_grad", "first_trained_column", "minibatches", "update"]


class TrainablePolicy(Protocol):
    """What :func:`update` needs from the weights it trains."""

    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Per-token logprobs ``(B, T-1)`` and entropies of the rows ``ids`` ``(B, T)``, keeping what
        :meth:`train_backward` needs; a backend may return 0 before column ``start`` (no row trains there)."""

    def train_backward(self, dlogp: np.ndarray) -> None:
        """Gradient of the loss from ``dloss/dlogp`` ``(B, T-1)`` of the last :meth:`train_logprobs` rows."""

    def optimizer_step(self, cfg: TrainConfig) -> float:
        """Clip (``cfg.clip_norm``) and apply the gradient; returns its norm (non-finite: no update)."""

    def publish(self) -> int:
        """The weights changed: count the update, bump and return the served policy version."""


class CountedUpdates:
    """:meth:`TrainablePolicy.publish` of a bare model (it serves nothing): the updates are only counted."""

    updates: int = 0

    def publish(self) -> int:
        """Count the update; returns the count."""
        self.updates += 1
        return self.updates


class PolicyBackend(CountedUpdates):
    """The :class:`~palaestra.trainer.backend.Backend` part both backends share, over a served ``model``; a
    subclass is also a :class:`TrainablePolicy`, sets ``STATE_FORMAT`` and provides :meth:`reference_logprobs`."""

    STATE_FORMAT = ""

    def __init__(self, model: Any, config: TrainConfig | None, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        self.config = config if config is not None else TrainConfig()
        self.rng = np.random.default_rng(self.config.seed)

    def reference_logprobs(self, packed: PackedBatch) -> np.ndarray:
        """Logprobs of the packed rows under the frozen reference policy."""
        raise NotImplementedError

    def tokenize(self, batch: TrainBatch, config: TrainConfig | None = None) -> PackedBatch:
        """The batch rendered and packed for this model (raises on missing logprobs or too-long rows)."""
        cfg = config if config is not None else self.config
        return tokenize_batch(
            batch.trajectories,
            self.model.tokenizer,
            allow_missing_logprobs=cfg.allow_missing_logprobs,
            max_len=self.max_len,
            on_drift=cfg.on_token_drift,
        )

    def train_step(self, batch: TrainBatch, config: TrainConfig | None = None) -> dict[str, float]:
        """One update on ``batch`` (module docstring); returns float metrics averaged over optimiser steps."""
        t0 = time.perf_counter()
        cfg = config if config is not None else self.config
        if len(batch) == 0:
            raise ValueError("train_step: the batch has no trajectories")
        if cfg.objective == "dpo" and not batch.pairs:
            raise ValueError("train_step: objective='dpo' needs preference pairs, the batch has none")
        packed = self.tokenize(batch, cfg)
        ref_logp = self.reference_logprobs(packed) if cfg.needs_reference else None
        return update(self, batch, packed, cfg, self.rng, ref_logp, self.model.step, t0)  # type: ignore[arg-type]

    def publish(self) -> int:
        """Count the update and bump ``model.step``."""
        super().publish()
        return int(self.model.bump_step())

    def _state(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` with the format, the update RNG's state and the update counter."""
        return {
            "format": np.array(self.STATE_FORMAT),
            **arrays,
            "rng": np.array(json.dumps(self.rng.bit_generator.state)),
            "updates": np.array(self.updates, dtype=np.int64),
        }

    def _check_format(self, state: Mapping[str, Any]) -> None:
        fmt = str(np.asarray(state.get("format", "")))
        if fmt != self.STATE_FORMAT:
            raise ValueError(f"backend state: format {fmt!r} is not {self.STATE_FORMAT!r}")

    def _load_counters(self, state: Mapping[str, Any]) -> None:
        """Restore the update RNG and counter of :meth:`_state`."""
        self.rng.bit_generator.state = json.loads(str(np.asarray(state["rng"])))
        self.updates = int(np.asarray(state["updates"]))


def update(
    policy: TrainablePolicy,
    batch: TrainBatch,
    packed: PackedBatch,
    cfg: TrainConfig,
    rng: np.random.Generator,
    ref_logp: np.ndarray | None,
    policy_step: int,
    t0: float,
) -> dict[str, float]:
    """One update of ``policy`` on ``batch`` rendered as ``packed``; returns float metrics averaged over
    optimiser steps (``policy_step`` is reported when no step was taken; ``t0``: when the update began)."""
    owner = packed.owner  # row i came from trajectory owner[i]; a trajectory may span several rows
    token_adv = batch.token_advantages(packed.turn, owner)  # per-turn credit: each turn its own advantage
    sums: dict[str, float] = {}
    steps = 0
    ent_sum, ent_n = 0.0, 0
    try:
        for epoch in range(cfg.update_epochs):
            for trajs, pair_ids in minibatches(batch, cfg, rng):
                rows = np.flatnonzero(np.isin(owner, trajs))
                if rows.size == 0:
                    continue
                t = int(packed.lengths[rows].max())  # rows trimmed to their longest kept length
                mask = packed.mask[rows, : t - 1]
                ref = ref_logp[rows, : t - 1].astype(np.float64) if ref_logp is not None else None
                logp, ent = policy.train_logprobs(packed.ids[rows, :t], first_trained_column(mask))
                logp = np.asarray(logp, dtype=np.float64)
                if epoch == 0:
                    ent_sum += float(ent[mask].sum())
                    ent_n += int(mask.sum())
                if cfg.objective == "dpo":
                    pairs = [batch.pairs[int(k)] for k in pair_ids]
                    loss, dlogp, m = dpo_grad(logp, ref, mask, owner[rows], pairs, cfg)
                else:
                    res = policy_loss(
                        logp,
                        packed.old_logp[rows, : t - 1],
                        ref,
                        token_adv[rows, : t - 1],
                        mask,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        kl_beta=cfg.kl_beta,
                        agg=cfg.agg,
                        max_tokens_constant=cfg.max_tokens_constant,
                        nonfinite_old="ratio_one" if cfg.allow_missing_logprobs else "raise",
                    )
                    loss, dlogp, m = res.loss, res.dlogp, res.metrics
                policy.train_backward(dlogp)
                gnorm = policy.optimizer_step(cfg)
                m = {**m, "loss": loss, "grad_norm": gnorm, "nonfinite_grad": float(not np.isfinite(gnorm))}
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                steps += 1
    finally:
        if steps:  # the weights changed: the served policy is a new version, even if a later step failed
            policy_step = policy.publish()
    seconds = time.perf_counter() - t0
    return {
        **{k: v / max(steps, 1) for k, v in sums.items()},
        "nonfinite_grad": sums.get("nonfinite_grad", 0.0),
        "tokens": float(packed.tokens),
        "entropy": ent_sum / max(ent_n, 1),
        "optimizer_steps": float(steps),
        "batch_rows": float(len(batch)),
        "packed_rows": float(packed.ids.shape[0]),
        "seq_len": float(packed.ids.shape[1]),
        "lr": float(cfg.lr),
        "policy_step": float(policy_step),
        "train_seconds": seconds,
        "train_tokens_per_s": float(packed.ids.size * cfg.update_epochs) / max(seconds, 1e-9),
    }


def first_trained_column(mask: np.ndarray) -> int:
    """The first logprob column that some row of ``mask`` (B, T-1) trains on (0 when none does)."""
    cols = np.flatnonzero(mask.any(axis=0))
    return int(cols[0]) if cols.size else 0


def minibatches(
    batch: TrainBatch, cfg: TrainConfig, rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(trajectory indices, pair indices)`` per optimiser step: trajectories (or DPO pairs, with the
    trajectories they touch) shuffled into chunks of ``minibatch_size``; in order when they fit one chunk."""
    dpo = cfg.objective == "dpo"
    n = len(batch.pairs) if dpo else len(batch)
    size = cfg.minibatch_size or n
    order = np.arange(n) if size >= n else rng.permutation(n)
    chunks = [order[i : i + size] for i in range(0, n, size)]
    if not dpo:
        return [(c, np.zeros(0, dtype=np.int64)) for c in chunks]
    pair_arr = np.asarray(batch.pairs, dtype=np.int64)
    return [(np.unique(pair_arr[c].reshape(-1)), c) for c in chunks]


def dpo_grad(
    logp: np.ndarray,
    ref: np.ndarray | None,
    mask: np.ndarray,
    row_owner: np.ndarray,
    pairs: list[tuple[int, int]],
    cfg: TrainConfig,
) -> tuple[float, np.ndarray, dict[str, float]]:
    """DPO over ``pairs`` (trajectory indices) for rows of trajectories ``row_owner`` (a trajectory's sequence
    logprob sums its rows' trainable tokens); returns the loss, ``dloss/dlogp`` and metrics."""
    if ref is None:
        raise ValueError("DPO needs the reference policy's logprobs")
    trajs, where = np.unique(np.asarray(row_owner, dtype=np.int64), return_inverse=True)
    pos = {int(t): i for i, t in enumerate(trajs)}
    for c, r in pairs:
        if c not in pos or r not in pos:
            raise ValueError(f"DPO pair {(c, r)}: a trajectory of the pair has no trainable token")
    seq = np.bincount(where, np.where(mask, logp, 0.0).sum(axis=1), len(trajs))  # summed over each one's rows
    seq_ref = np.bincount(where, np.where(mask, ref, 0.0).sum(axis=1), len(trajs))
    ci = np.asarray([pos[c] for c, _ in pairs], dtype=np.int64)
    ri = np.asarray([pos[r] for _, r in pairs], dtype=np.int64)
    res = dpo_loss(seq[ci], seq[ri], seq_ref[ci], seq_ref[ri], beta=cfg.dpo_beta)
    dseq = np.zeros(len(trajs))
    np.add.at(dseq, ci, res.dchosen)
    np.add.at(dseq, ri, res.drejected)
    dlogp = np.where(mask, dseq[where][:, None], 0.0)
    return res.loss, dlogp, {**res.metrics, "tokens": float(mask.sum()), "seqs": float(len(trajs))}
