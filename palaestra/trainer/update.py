"""The update (GRPO-family and DPO), written once for every backend.

A backend renders its batch to token rows (:class:`~palaestra.trainer.tokenize.PackedBatch`), scores the
reference policy when the config needs one, and hands both to :func:`update`, which for each epoch and
minibatch:

1. computes the current per-token logprobs of the minibatch's rows (:meth:`TrainablePolicy.train_logprobs`);
2. applies the pure loss math of :mod:`palaestra.trainer.losses` (:func:`~palaestra.trainer.losses.policy_loss`,
   or :func:`~palaestra.trainer.losses.dpo_loss` on the batch's pairs), which returns ``dloss/dlogp``;
3. backpropagates ``dloss/dlogp`` through the network (:meth:`TrainablePolicy.train_backward`) and takes one
   optimiser step (:meth:`TrainablePolicy.optimizer_step`, which clips and returns the gradient norm).

After the last step the policy publishes its new version (:meth:`TrainablePolicy.publish`), also when a later
step raised, since the weights changed. The numpy model and the HF model implement :class:`TrainablePolicy`
as small adapters (:mod:`palaestra.trainer.embedded`, :mod:`palaestra.trainer.hf_backend`).
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.losses import dpo_loss, policy_loss
from palaestra.trainer.tokenize import PackedBatch

__all__ = ["TrainablePolicy", "check_batch", "dpo_grad", "first_trained_column", "minibatches", "update"]


class TrainablePolicy(Protocol):
    """What :func:`update` needs from the weights it trains."""

    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Per-token logprobs ``(B, T-1)`` (float64) and entropies of the rows ``ids`` ``(B, T)`` under the
        current policy, keeping what :meth:`train_backward` needs. No row trains on a column before ``start``:
        a backend may return 0 there and skip the output layer over those positions (the shared prompt)."""
        ...

    def train_backward(self, dlogp: np.ndarray) -> None:
        """Gradient of the loss from ``dloss/dlogp`` ``(B, T-1)`` of the last :meth:`train_logprobs` rows."""
        ...

    def optimizer_step(self, cfg: TrainConfig) -> float:
        """Clip (``cfg.clip_norm``) and apply the gradient; returns its norm (non-finite: no update)."""
        ...

    def publish(self) -> int:
        """The weights changed: count the update, bump and return the served policy version."""
        ...


def update(
    policy: TrainablePolicy,
    batch: TrainBatch,
    packed: PackedBatch,
    owner: np.ndarray,
    cfg: TrainConfig,
    rng: np.random.Generator,
    ref_logp: np.ndarray | None,
    policy_step: int,
    t0: float,
) -> dict[str, float]:
    """One update of ``policy`` on ``batch`` rendered as ``packed`` (row ``i`` from trajectory ``owner[i]``;
    ``ref_logp`` the reference logprobs of the rows when the config needs them); returns float metrics
    averaged over optimiser steps. ``policy_step`` is reported when no step was taken; ``t0`` is when the
    update began (``time.perf_counter``)."""
    turn = packed.turn if packed.turn is not None else np.full(packed.mask.shape, -1, dtype=np.int64)
    token_adv = batch.token_advantages(turn, owner)  # per-turn credit: each turn its own advantage
    sums: dict[str, float] = {}
    steps = 0
    ent_sum, ent_n = 0.0, 0
    try:
        for epoch in range(cfg.update_epochs):
            for trajs, pair_ids in minibatches(batch, cfg, rng):
                rows = np.flatnonzero(np.isin(owner, trajs))  # a trajectory may span several rows
                if rows.size == 0:
                    continue
                t = int(packed.lengths[rows].max())  # rows trimmed to their longest kept length
                mask = packed.mask[rows, : t - 1]
                ref = ref_logp[rows, : t - 1].astype(np.float64) if ref_logp is not None else None
                logp, ent = policy.train_logprobs(packed.ids[rows, :t], first_trained_column(mask))
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
                m = dict(m)
                m.update(loss=loss, grad_norm=gnorm, nonfinite_grad=float(not np.isfinite(gnorm)))
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                steps += 1
    finally:
        if steps:  # the weights changed: the served policy is a new version, even if a later step failed
            policy_step = policy.publish()
    out = {k: v / max(steps, 1) for k, v in sums.items()}
    out["nonfinite_grad"] = sums.get("nonfinite_grad", 0.0)
    out.update(
        {
            "tokens": float(packed.tokens),
            "entropy": ent_sum / max(ent_n, 1),
            "optimizer_steps": float(steps),
            "batch_rows": float(len(batch)),
            "seq_len": float(packed.ids.shape[1]),
            "lr": float(cfg.lr),
            "policy_step": float(policy_step),
            "train_seconds": time.perf_counter() - t0,
        }
    )
    return out


def first_trained_column(mask: np.ndarray) -> int:
    """The first logprob column that some row of ``mask`` (B, T-1) trains on (0 when none does)."""
    cols = np.flatnonzero(mask.any(axis=0))
    return int(cols[0]) if cols.size else 0


def check_batch(batch: TrainBatch, cfg: TrainConfig) -> None:
    """Raise ``ValueError`` on a batch no update can use (no trajectories; DPO without pairs)."""
    if len(batch) == 0:
        raise ValueError("train_step: the batch has no trajectories")
    if cfg.objective == "dpo" and not batch.pairs:
        raise ValueError("train_step: objective='dpo' needs preference pairs, the batch has none")


def minibatches(
    batch: TrainBatch, cfg: TrainConfig, rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(trajectory indices, pair indices)`` per optimiser step: trajectories shuffled with ``rng`` into
    chunks of ``minibatch_size`` (GRPO), or pairs shuffled into chunks of ``minibatch_size`` pairs with the
    trajectories they touch (DPO); the whole batch in order when it fits one chunk."""
    if cfg.objective == "dpo":
        k = len(batch.pairs)
        size = cfg.minibatch_size or k
        order = np.arange(k) if size >= k else rng.permutation(k)
        pair_arr = np.asarray(batch.pairs, dtype=np.int64)
        chunks = [order[i : i + size] for i in range(0, k, size)]
        return [(np.unique(pair_arr[c].reshape(-1)), c) for c in chunks]
    n = len(batch)
    size = cfg.minibatch_size or n
    order = np.arange(n) if size >= n else rng.permutation(n)
    none = np.zeros(0, dtype=np.int64)
    return [(order[i : i + size], none) for i in range(0, n, size)]


def dpo_grad(
    logp: np.ndarray,
    ref: np.ndarray | None,
    mask: np.ndarray,
    row_owner: np.ndarray,
    pairs: list[tuple[int, int]],
    cfg: TrainConfig,
) -> tuple[float, np.ndarray, dict[str, float]]:
    """DPO over ``pairs`` (trajectory indices) for rows of trajectories ``row_owner``; a trajectory's
    sequence logprob sums its rows' trainable tokens, so every such token receives its trajectory's
    gradient. Returns the loss, ``dloss/dlogp`` and metrics."""
    if ref is None:
        raise ValueError("DPO needs the reference policy's logprobs")
    trajs, where = np.unique(np.asarray(row_owner, dtype=np.int64), return_inverse=True)
    pos = {int(t): i for i, t in enumerate(trajs)}
    for c, r in pairs:
        if c not in pos or r not in pos:
            raise ValueError(f"DPO pair {(c, r)}: a trajectory of the pair has no trainable token")
    seq = np.zeros(len(trajs))
    seq_ref = np.zeros(len(trajs))
    np.add.at(seq, where, np.where(mask, logp, 0.0).sum(axis=1))
    np.add.at(seq_ref, where, np.where(mask, ref, 0.0).sum(axis=1))
    ci = np.asarray([pos[c] for c, _ in pairs], dtype=np.int64)
    ri = np.asarray([pos[r] for _, r in pairs], dtype=np.int64)
    res = dpo_loss(seq[ci], seq[ri], seq_ref[ci], seq_ref[ri], beta=cfg.dpo_beta)
    dseq = np.zeros(len(trajs))
    np.add.at(dseq, ci, res.dchosen)
    np.add.at(dseq, ri, res.drejected)
    dlogp = np.where(mask, dseq[where][:, None], 0.0)
    metrics = dict(res.metrics)
    metrics["tokens"] = float(mask.sum())
    metrics["seqs"] = float(len(trajs))
    return res.loss, dlogp, metrics
