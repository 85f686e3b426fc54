"""EmbeddedBackend: trains an :class:`~palaestra.models.embedded.EmbeddedModel` (numpy TinyGPT) in place.

It is the numpy model's :class:`~palaestra.trainer.update.TrainablePolicy` (forward logprobs keeping the cache,
backward from ``dloss/dlogp``, one Adam step under ``model.lock`` so a rollout never sees half-updated weights,
``model.step`` bumped once per update). :meth:`EmbeddedBackend.train_step` renders the batch with the exact
sampled tokens (:mod:`palaestra.trainer.tokenize`), scores it with the frozen reference when the config needs
one (``kl_beta > 0`` or DPO) and runs the shared :func:`~palaestra.trainer.update.update`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.optim import Adam
from palaestra.models.tinygpt import ChunkedCache, ForwardCache, TinyGPT
from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.tokenize import PackedBatch, tokenize_batch
from palaestra.trainer.update import check_batch, update

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
        self._cache: ForwardCache | ChunkedCache | None = None  # between train_logprobs and train_backward
        self._grads: dict[str, np.ndarray] = {}  # between train_backward and optimizer_step

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
        opt.lr, opt.eps, opt.weight_decay = float(cfg.lr), float(cfg.adam_eps), float(cfg.weight_decay)
        opt.betas = (float(cfg.betas[0]), float(cfg.betas[1]))
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
        check_batch(batch, cfg)
        self._apply_optimizer_config(cfg)
        if cfg.needs_reference and self.reference is None:
            self.reference = self._snapshot()
        packed = self.tokenize(batch, cfg)
        owner = packed.owner if packed.owner is not None else np.arange(len(batch), dtype=np.int64)
        ref_logp = self.reference.logprobs_of(packed.ids) if cfg.needs_reference and self.reference else None
        return update(self, batch, packed, owner, cfg, self.rng, ref_logp, self.model.step, t0)

    # ------------------------------------------------------------------ TrainablePolicy (for update())
    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Logprobs (float64) and entropies of ``ids`` (every column: the numpy model is small enough that
        ``start`` saves nothing), keeping the forward cache for :meth:`train_backward`."""
        res = self.gpt.forward_logprobs(ids, need_cache=True)
        self._cache = res.cache
        return res.logp.astype(np.float64), res.entropy

    def train_backward(self, dlogp: np.ndarray) -> None:
        """Parameter gradients from ``dloss/dlogp`` of the last :meth:`train_logprobs` rows."""
        self._grads = self.gpt.backward_logprobs(self._cache, dlogp)
        self._cache = None

    def optimizer_step(self, cfg: TrainConfig) -> float:
        """One Adam step (clipping set by ``cfg``) under ``model.lock``; returns the gradient norm."""
        with self.model.lock:
            gnorm = self.optimizer.step(self._grads)
        self._grads = {}
        return float(gnorm)

    def publish(self) -> int:
        """Count the update and bump ``model.step``."""
        self.updates += 1
        return self.model.bump_step()

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
