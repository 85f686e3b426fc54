"""EmbeddedBackend: trains an :class:`~palaestra.models.embedded.EmbeddedModel` (numpy TinyGPT) in place.

One :meth:`EmbeddedBackend.train_step`:

1. renders the batch's trajectories with the model's chat template (:mod:`palaestra.trainer.tokenize`): the
   sampled tokens of every ``Choice`` (exactly as recorded) are trainable and keep their sampling-time
   logprobs as ``old_logp``; each turn's prompt is the one the server saw, and a trajectory whose template is
   not append-only spans several rows (``config.on_token_drift``). Each token's advantage is its trajectory's,
   or its turn's with per-turn credit (``batch.turn_advantages``);
2. if the config needs a reference policy (``kl_beta > 0`` or ``objective="dpo"``), scores the batch with the
   frozen copy of the weights taken when the reference was first needed (normally at construction);
3. for each of ``update_epochs`` passes and each minibatch (whole batch by default; rows shuffled with the
   backend's seeded RNG otherwise): recomputes current logprobs with ``forward_logprobs``, applies
   :func:`~palaestra.trainer.losses.policy_loss` (or :func:`~palaestra.trainer.losses.dpo_loss` on the
   batch's pairs), backpropagates ``dloss/dlogp`` with ``backward_logprobs`` and takes one Adam step while
   holding ``model.lock`` (generation batches hold it too, so a rollout never sees half-updated weights);
4. bumps ``model.step`` once, so the next completions carry the new policy version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.optim import Adam
from palaestra.models.tinygpt import TinyGPT
from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.losses import dpo_loss, policy_loss
from palaestra.trainer.tokenize import PackedBatch, tokenize_batch

__all__ = ["EmbeddedBackend"]

_STATE_FORMAT = "palaestra.embedded_backend/1"


class EmbeddedBackend:
    """:class:`~palaestra.trainer.backend.Backend` for an in-process numpy policy (see module docstring).

    ``config`` sets the optimiser (Adam over ``model.gpt.params``) and the RNG seed; a later ``train_step``
    may pass a config with another ``lr``/``betas``/``weight_decay``/``clip_norm``, which then applies.
    """

    def __init__(self, model: EmbeddedModel, config: TrainConfig | None = None) -> None:
        self.model = model
        self.config = config if config is not None else TrainConfig()
        cfg = self.config
        self.optimizer = Adam(
            model.gpt.params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            clip_norm=cfg.clip_norm,
        )
        self.rng = np.random.default_rng(cfg.seed)
        self.updates = 0
        self.reference: TinyGPT | None = self._snapshot() if cfg.needs_reference else None

    # ------------------------------------------------------------------ helpers
    @property
    def gpt(self) -> TinyGPT:
        return self.model.gpt

    def _snapshot(self) -> TinyGPT:
        with self.model.lock:
            params = {k: v.copy() for k, v in self.gpt.params.items()}
        return TinyGPT(self.gpt.config, params=params, tokenizer=self.gpt.tokenizer)

    def _apply_optimizer_config(self, cfg: TrainConfig) -> None:
        opt = self.optimizer
        opt.lr = float(cfg.lr)
        opt.betas = (float(cfg.betas[0]), float(cfg.betas[1]))
        opt.eps = float(cfg.adam_eps)
        opt.weight_decay = float(cfg.weight_decay)
        opt.clip_norm = float(cfg.clip_norm) if cfg.clip_norm else None

    def tokenize(self, batch: TrainBatch, config: TrainConfig | None = None) -> PackedBatch:
        """The batch rendered and packed for this model (raises on missing logprobs or too-long rows)."""
        cfg = config if config is not None else self.config
        return tokenize_batch(
            batch.trajectories,
            self.gpt.tokenizer,
            allow_missing_logprobs=cfg.allow_missing_logprobs,
            max_len=self.gpt.config.block_size + 1,
            on_drift=cfg.on_token_drift,
        )

    # ------------------------------------------------------------------ update
    def train_step(self, batch: TrainBatch, config: TrainConfig | None = None) -> dict[str, float]:
        """One update on ``batch`` (module docstring); returns float metrics averaged over optimiser steps."""
        t0 = time.perf_counter()
        cfg = config if config is not None else self.config
        if len(batch) == 0:
            raise ValueError("train_step: the batch has no trajectories")
        if cfg.objective == "dpo" and not batch.pairs:
            raise ValueError("train_step: objective='dpo' needs preference pairs, the batch has none")
        self._apply_optimizer_config(cfg)
        if cfg.needs_reference and self.reference is None:
            self.reference = self._snapshot()
        packed = self.tokenize(batch, cfg)
        owner = packed.owner if packed.owner is not None else np.arange(len(batch), dtype=np.int64)
        turn = packed.turn if packed.turn is not None else np.full(packed.mask.shape, -1, dtype=np.int64)
        token_adv = batch.token_advantages(turn, owner)
        ref_logp = self.reference.logprobs_of(packed.ids) if cfg.needs_reference and self.reference else None
        sums: dict[str, float] = {}
        steps = 0
        ent_sum, ent_n = 0.0, 0
        policy_step = self.model.step
        try:
            for epoch in range(cfg.update_epochs):
                for trajs, pair_ids in self._minibatches(batch, cfg):
                    rows = np.flatnonzero(np.isin(owner, trajs))  # a trajectory may span several rows
                    if rows.size == 0:
                        continue
                    ids, mask, old, ref = _select(packed, ref_logp, rows)
                    res = self.gpt.forward_logprobs(ids, need_cache=True)
                    logp = res.logp.astype(np.float64)
                    if epoch == 0:
                        ent_sum += float(res.entropy[mask].sum())
                        ent_n += int(mask.sum())
                    if cfg.objective == "dpo":
                        pairs = [batch.pairs[int(k)] for k in pair_ids]
                        loss, dlogp, m = _dpo_grad(logp, ref, mask, pairs, owner[rows], cfg)
                    else:
                        lr_ = policy_loss(
                            logp,
                            old,
                            ref,
                            token_adv[rows, : mask.shape[1]],
                            mask,
                            clip_low=cfg.clip_low,
                            clip_high=cfg.clip_high,
                            kl_beta=cfg.kl_beta,
                            agg=cfg.agg,
                            max_tokens_constant=cfg.max_tokens_constant,
                            nonfinite_old="ratio_one" if cfg.allow_missing_logprobs else "raise",
                        )
                        loss, dlogp, m = lr_.loss, lr_.dlogp, lr_.metrics
                    grads = self.gpt.backward_logprobs(res.cache, dlogp)
                    del res
                    with self.model.lock:
                        gnorm = self.optimizer.step(grads)
                    m = dict(m)
                    m["loss"] = loss
                    m["grad_norm"] = gnorm
                    m["nonfinite_grad"] = float(not np.isfinite(gnorm))
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                    steps += 1
        finally:
            if steps:  # the weights changed: the served policy is a new version, even if a later step failed
                self.updates += 1
                policy_step = self.model.bump_step()
        out = {k: v / steps for k, v in sums.items()}
        out["nonfinite_grad"] = sums["nonfinite_grad"]
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

    def _minibatches(self, batch: TrainBatch, cfg: TrainConfig) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(rows, pair indices)`` per optimiser step: rows shuffled into chunks of ``minibatch_size``
        (GRPO), or pairs shuffled into chunks of ``minibatch_size`` pairs with the rows they touch (DPO)."""
        none = np.zeros(0, dtype=np.int64)
        if cfg.objective == "dpo":
            k = len(batch.pairs)
            size = cfg.minibatch_size or k
            order = np.arange(k) if size >= k else self.rng.permutation(k)
            pair_arr = np.asarray(batch.pairs, dtype=np.int64)
            chunks = [order[i : i + size] for i in range(0, k, size)]
            return [(np.unique(pair_arr[c].reshape(-1)), c) for c in chunks]
        n = len(batch)
        size = cfg.minibatch_size or n
        order = np.arange(n) if size >= n else self.rng.permutation(n)
        return [(order[i : i + size], none) for i in range(0, n, size)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, np.ndarray]:
        """Weights, Adam state, reference weights (if kept), RNG state, update counter and ``model.step``."""
        out: dict[str, np.ndarray] = {"format": np.array(_STATE_FORMAT)}
        with self.model.lock:
            for name, p in self.gpt.params.items():
                out["param/" + name] = p.copy()
            for key, val in self.optimizer.state_dict().items():
                out["optim/" + key] = np.array(val, copy=True)
            out["policy_step"] = np.array(self.model.step, dtype=np.int64)
        if self.reference is not None:
            for name, p in self.reference.params.items():
                out["ref/" + name] = p.copy()
        out["rng"] = np.array(json.dumps(self.rng.bit_generator.state))
        out["updates"] = np.array(self.updates, dtype=np.int64)
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict` into this backend's model (weights copied in place, shapes checked).

        ``weights_only=True`` copies the policy weights alone and bumps ``model.step`` (the served policy
        changed); optimiser, RNG, reference and counters are kept."""
        fmt = str(np.asarray(state.get("format", "")))
        if fmt != _STATE_FORMAT:
            raise ValueError(f"backend state: format {fmt!r} is not {_STATE_FORMAT!r}")
        params = self.gpt.params
        for name, p in params.items():
            key = "param/" + name
            if key not in state:
                raise ValueError(f"backend state lacks {key!r}")
            arr = np.asarray(state[key])
            if arr.shape != p.shape:
                raise ValueError(f"backend state {key!r} has shape {arr.shape}, the model expects {p.shape}")
        extra = sorted(k[6:] for k in state if k.startswith("param/") and k[6:] not in params)
        if extra:
            raise ValueError(f"backend state has parameters the model lacks: {extra}")
        if weights_only:
            with self.model.lock:
                for name, p in params.items():
                    p[...] = np.asarray(state["param/" + name], dtype=p.dtype)
            self.model.bump_step()
            return
        optim = {k[6:]: state[k] for k in state if k.startswith("optim/")}
        ref = {k[4:]: np.asarray(state[k]).copy() for k in state if k.startswith("ref/")}
        with self.model.lock:
            self.optimizer.load_state_dict(optim)
            for name, p in params.items():
                p[...] = np.asarray(state["param/" + name], dtype=p.dtype)
            self.model.step = int(np.asarray(state["policy_step"]))
        self.reference = TinyGPT(self.gpt.config, params=ref, tokenizer=self.gpt.tokenizer) if ref else None
        self.rng.bit_generator.state = json.loads(str(np.asarray(state["rng"])))
        self.updates = int(np.asarray(state["updates"]))


def _select(
    packed: PackedBatch, ref_logp: np.ndarray | None, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows of the packed batch, trimmed to their longest kept length."""
    t = int(packed.lengths[rows].max())
    ids = packed.ids[rows, :t]
    mask = packed.mask[rows, : t - 1]
    old = packed.old_logp[rows, : t - 1]
    ref = ref_logp[rows, : t - 1].astype(np.float64) if ref_logp is not None else None
    return ids, mask, old, ref


def _dpo_grad(
    logp: np.ndarray,
    ref: np.ndarray | None,
    mask: np.ndarray,
    pairs: list[tuple[int, int]],
    rows: np.ndarray,
    cfg: TrainConfig,
) -> tuple[float, np.ndarray, dict[str, float]]:
    """DPO loss over ``pairs`` (trajectory indices); ``rows`` gives the trajectory of each packed row (a
    trajectory may span several rows). Gradient on each row's trainable tokens (a sequence log-prob is the sum
    of its token log-probs over all of its rows)."""
    assert ref is not None
    owners = np.asarray(rows, dtype=np.int64)
    uniq, row_of = np.unique(owners, return_inverse=True)
    pos = {int(t): i for i, t in enumerate(uniq)}
    sel = [(pos[c], pos[r]) for c, r in pairs]
    seq = np.zeros(len(uniq))
    seq_ref = np.zeros(len(uniq))
    np.add.at(seq, row_of, np.where(mask, logp, 0.0).sum(axis=1))
    np.add.at(seq_ref, row_of, np.where(mask, ref, 0.0).sum(axis=1))
    ci = np.asarray([c for c, _ in sel], dtype=np.int64)
    ri = np.asarray([r for _, r in sel], dtype=np.int64)
    res = dpo_loss(seq[ci], seq[ri], seq_ref[ci], seq_ref[ri], beta=cfg.dpo_beta)
    dseq = np.zeros(len(uniq))
    np.add.at(dseq, ci, res.dchosen)
    np.add.at(dseq, ri, res.drejected)
    dlogp = np.where(mask, dseq[row_of][:, None], 0.0)
    metrics = dict(res.metrics)
    metrics["tokens"] = float(mask.sum())
    metrics["seqs"] = float(len(uniq))
    return res.loss, dlogp, metrics
