"""HFBackend: trains the LoRA adapters of an :class:`~palaestra.models.hf.model.HFModel` with the SAME loss
code as the embedded backend.

One source of truth for the math: the per-token logprobs are computed in torch, handed to the numpy
:func:`~palaestra.trainer.losses.policy_loss` (or :func:`~palaestra.trainer.losses.dpo_loss`) as float64
arrays, and the analytic gradient ``dloss/dlogp`` it returns is backpropagated through the network as
``(logp * dlogp).sum().backward()``, which gives exactly ``dloss/dtheta`` by the chain rule.

One :meth:`HFBackend.train_step`:

1. renders every trajectory with the model's chat template (:mod:`palaestra.trainer.tokenize`): sampled
   tokens of each ``Choice`` are trainable and keep their sampling-time logprobs; a trajectory whose template
   re-renders an earlier turn differently becomes several rows, each scored in its exact sampling context;
2. scores the batch with the reference policy (the same network with the adapters disabled) when the config
   needs one (``kl_beta > 0`` or DPO);
3. runs the shared update loop (:func:`palaestra.trainer.update.update`) over this backend as its
   :class:`~palaestra.trainer.update.TrainablePolicy`: logprobs, loss and ``dloss/dlogp`` on the whole
   minibatch, backpropagated in micro-batches of ``micro_batch_size`` rows (gradient accumulation: the
   minibatch's logprobs are first computed without a graph, then each micro-batch is re-run with one), then
   the global gradient norm is clipped and one AdamW step taken on the LoRA parameters under ``model.lock``;
4. bumps ``model.step`` and calls ``model.after_update()`` (pushes the adapters to vLLM when configured).

Under ``torchrun`` (a ``torch.distributed`` process group of more than one rank) the update is data-parallel:
rank 0 broadcasts the batch, each rank scores and backpropagates its shard of rows, and the LoRA gradients
are all-reduced before the step; only rank 0 publishes adapters (:mod:`palaestra.trainer.distributed`); with
``fsdp`` the frozen base weights are also sharded over the ranks.

The model stays in eval mode throughout (LoRA dropout is not applied), so training logprobs are the ones the
sampler reports.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from palaestra.models.hf.model import HFModel
from palaestra.trainer import distributed as dist_util
from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.tokenize import PackedBatch, tokenize_batch
from palaestra.trainer.update import check_batch, first_trained_column, update

__all__ = ["HFBackend"]

_STATE_FORMAT = "palaestra.hf_backend/1"


class HFBackend:
    """:class:`~palaestra.trainer.backend.Backend` for an :class:`HFModel` (see the module docstring).

    ``micro_batch_size`` (default: ``model.micro_batch_size``; None = whole minibatch) bounds the rows of one
    forward/backward pass. A later ``train_step`` may pass a config with another ``lr``/``betas``/
    ``weight_decay``/``clip_norm``, which then applies.

    ``fsdp`` (default: ``config.distributed == "fsdp"``; only under a process group of > 1 ranks) shards the
    frozen base weights with FSDP2 (:func:`~palaestra.trainer.distributed.shard_frozen`). Every forward is then
    collective: the model can no longer sample on one rank, so an experiment must generate on vLLM; from
    Python, ``fsdp=True`` leaves sampling to the caller.
    """

    def __init__(
        self,
        model: HFModel,
        config: TrainConfig | None = None,
        *,
        micro_batch_size: int | None = None,
        fsdp: bool | None = None,
    ) -> None:
        self.model = model
        self.config = config if config is not None else TrainConfig()
        self.micro_batch_size = micro_batch_size if micro_batch_size is not None else model.micro_batch_size
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {self.micro_batch_size}")
        self.params = model.trainable_parameters()
        if not self.params:
            raise ValueError("HFBackend: the model has no trainable (LoRA) parameters")
        cfg = self.config
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()),
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.rng = np.random.default_rng(cfg.seed)
        self.updates = 0
        self.dist = dist_util.current()  # data-parallel when a process group of > 1 ranks exists
        self._pending: tuple[np.ndarray, torch.Tensor | None, int] = (np.zeros((0, 0), np.int64), None, 0)
        self.fsdp = (cfg.distributed == "fsdp" if fsdp is None else fsdp) and self.dist is not None
        if self.fsdp and fsdp is None and model.vllm is None:  # an experiment samples from this model
            raise ValueError(
                "train.distributed = 'fsdp': with the base weights sharded over the ranks, rank 0 cannot "
                "sample alone; generate on vLLM servers ([model.hf.vllm]) or use the default 'ddp'"
            )
        if self.dist is not None:
            dist_util.broadcast_params(self.params.values())  # every rank starts from rank 0's adapters
            dist_util.mark_following()
        if self.fsdp:
            dist_util.shard_frozen(model.model, self.params.values())
        if self.dist is not None and self.dist.is_main:
            how = "FSDP, base weights sharded" if self.fsdp else "data parallel, a full model per rank"
            print(f"palaestra: HF backend on {self.dist.world_size} ranks ({how})", flush=True)

    # ------------------------------------------------------------------ helpers
    def _apply_optimizer_config(self, cfg: TrainConfig) -> None:
        for group in self.optimizer.param_groups:
            group.update(
                lr=float(cfg.lr),
                betas=tuple(cfg.betas),
                eps=float(cfg.adam_eps),
                weight_decay=float(cfg.weight_decay),
            )

    def tokenize(
        self, batch: TrainBatch, config: TrainConfig | None = None
    ) -> tuple[PackedBatch, np.ndarray]:
        """The batch rendered and packed (:func:`~palaestra.trainer.tokenize.tokenize_batch`, the embedded
        backend's rules), and the trajectory index of each row."""
        cfg = config if config is not None else self.config
        packed = tokenize_batch(
            batch.trajectories,
            self.model.tokenizer,
            allow_missing_logprobs=cfg.allow_missing_logprobs,
            max_len=self.model.block_size,
            on_drift=cfg.on_token_drift,
        )
        assert packed.owner is not None
        return packed, packed.owner

    def _forward(self, ids: np.ndarray, *, grad: bool, start: int = 0) -> tuple[torch.Tensor, np.ndarray]:
        """Per-token logprobs ``(B, T-1)`` (float32, with a graph when ``grad``) and entropies (numpy). The output
        layer runs only from column ``start`` on (``logits_to_keep``); earlier columns are 0."""
        x = torch.from_numpy(np.ascontiguousarray(ids)).to(self.model.device)
        start = min(max(start, 0), x.shape[1] - 1)
        with torch.set_grad_enabled(grad):
            out = self.model.model(input_ids=x, use_cache=False, logits_to_keep=x.shape[1] - start)
            lsm = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)  # predictions of tokens start+1..T-1
            logp = lsm.gather(-1, x[:, start + 1 :, None]).squeeze(-1)
            logp = torch.nn.functional.pad(logp, (start, 0))
        with torch.no_grad():
            ent = torch.nn.functional.pad(-(lsm.exp() * lsm).sum(-1), (start, 0))
        return logp, ent.cpu().numpy().astype(np.float64)

    def _chunks(self, n: int) -> list[slice]:
        size = self.micro_batch_size or max(n, 1)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _rank_chunks(self, n: int) -> list[slice]:
        """This rank's micro-batches of its shard of ``n`` rows (all of them in one process). Under FSDP every
        forward is collective, so every rank runs as many: empty slices pad the shorter shards."""
        own = dist_util.shard(n, self.dist) if self.dist else slice(0, n)
        out = [slice(own.start + s.start, own.start + s.stop) for s in self._chunks(own.stop - own.start)]
        if self.fsdp and self.dist is not None:
            most = len(self._chunks(-(-n // self.dist.world_size)))
            out += [slice(own.stop, own.stop)] * (most - len(out))
        return out

    def _logp_rows(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Logprobs (float64) and entropies of every row without a graph: each rank scores its micro-batches
        and the ranks all-gather them (an empty FSDP pad scores row 0 and drops it)."""
        width = ids.shape[1] - 1
        parts, ents = [np.zeros((0, width))], [np.zeros((0, width))]
        for sl in self._rank_chunks(ids.shape[0]):
            lp, ent = self._forward(ids[sl] if sl.stop > sl.start else ids[:1], grad=False, start=start)
            if sl.stop > sl.start:
                parts.append(lp.double().cpu().numpy())
                ents.append(ent)
        out = [np.concatenate(parts), np.concatenate(ents)]
        if self.dist is not None:
            out = dist_util.all_gather_rows(out)
        return out[0], out[1]

    def reference_logprobs(self, packed: PackedBatch) -> np.ndarray:
        """Logprobs of the packed rows under the reference policy (adapters disabled); 0 before the first
        trained column, which the KL and DPO terms never read."""
        with self.model.reference():
            return self._logp_rows(packed.ids, first_trained_column(packed.mask))[0]

    # ------------------------------------------------------------------ update
    def train_step(self, batch: TrainBatch, config: TrainConfig | None = None) -> dict[str, float]:
        """One update on ``batch`` (module docstring); returns float metrics averaged over optimiser steps."""
        cfg = config if config is not None else self.config
        if self.dist is not None and self.dist.is_main:
            dist_util.lead("_train_step", batch, cfg)  # the followers take the same step
        return self._train_step(batch, cfg)

    def _train_step(self, batch: TrainBatch, cfg: TrainConfig) -> dict[str, float]:
        t0 = time.perf_counter()
        check_batch(batch, cfg)
        self._apply_optimizer_config(cfg)
        packed, owner = self.tokenize(batch, cfg)
        ref_logp = self.reference_logprobs(packed) if cfg.needs_reference else None
        out = update(self, batch, packed, owner, cfg, self.rng, ref_logp, self.model.step, t0)
        out["batch_tokens"] = float(packed.tokens)
        out["packed_rows"] = float(packed.ids.shape[0])
        out["train_tokens_per_s"] = float(packed.ids.size * cfg.update_epochs) / max(
            out["train_seconds"], 1e-9
        )
        return out

    # ------------------------------------------------------------------ TrainablePolicy (for update())
    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Logprobs (float64) and entropies of ``ids`` (0 before column ``start``): one pass with a graph when
        the rows fit one micro-batch on one rank, else without one (:meth:`train_backward` then re-runs each
        micro-batch)."""
        if len(self._chunks(ids.shape[0])) == 1 and self.dist is None:
            logp_t, ent = self._forward(ids, grad=True, start=start)
            self._pending = (ids, logp_t, start)
            return logp_t.detach().double().cpu().numpy(), ent
        self._pending = (ids, None, start)
        return self._logp_rows(ids, start)

    def train_backward(self, dlogp: np.ndarray) -> None:
        """LoRA gradients of ``(logp * dlogp).sum()``, accumulated over micro-batches of this rank's shard and
        all-reduced across ranks."""
        ids, logp_t, start = self._pending
        self._pending = (ids, None, start)
        self.optimizer.zero_grad(set_to_none=True)
        if logp_t is not None:
            (logp_t * torch.from_numpy(dlogp).to(logp_t)).sum().backward()
            return
        for sl in self._rank_chunks(len(ids)):
            real = sl.stop > sl.start  # else an FSDP pad: row 0 with zero weight, for the collectives
            lp_t, _ = self._forward(ids[sl] if real else ids[:1], grad=True, start=start)
            w = dlogp[sl] if real else np.zeros((1, ids.shape[1] - 1))
            (lp_t * torch.from_numpy(w).to(lp_t)).sum().backward()
        if self.dist is not None:
            dist_util.all_reduce_grads(self.params.values())

    def optimizer_step(self, cfg: TrainConfig) -> float:
        """:meth:`_optimizer_step` (the one a subclass overrides)."""
        return self._optimizer_step(cfg)

    def publish(self) -> int:
        """Count the update, bump ``model.step`` and push the adapters (``model.after_update``, rank 0)."""
        self.updates += 1
        step = self.model.bump_step()
        if self.dist is None or self.dist.is_main:
            self.model.after_update()
        return step

    def _optimizer_step(self, cfg: TrainConfig) -> float:
        """Clip (``clip_norm``), then AdamW under the model lock; a non-finite norm skips the update."""
        params = list(self.params.values())
        clip = float(cfg.clip_norm) if cfg.clip_norm else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if np.isfinite(norm):
            with self.model.lock:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, np.ndarray]:
        """LoRA weights, AdamW state, RNG states, update counter and ``model.step`` (numpy only, no pickle).
        The reference policy is the frozen base model, so no reference weights are stored."""
        out: dict[str, np.ndarray] = {
            "format": np.array(_STATE_FORMAT),
            "model_name": np.array(self.model.name),
        }
        with self.model.lock:
            for name, arr in self.model.adapter_state().items():
                out["lora/" + name] = arr
            for name, p in self.params.items():
                st = self.optimizer.state.get(p)
                if st:
                    out[f"optim/{name}/exp_avg"] = st["exp_avg"].detach().float().cpu().numpy().copy()
                    out[f"optim/{name}/exp_avg_sq"] = st["exp_avg_sq"].detach().float().cpu().numpy().copy()
                    out[f"optim/{name}/step"] = np.array(float(st["step"]), dtype=np.float64)
            out["policy_step"] = np.array(self.model.step, dtype=np.int64)
        out["rng"] = np.array(json.dumps(self.rng.bit_generator.state))
        out["torch_rng"] = torch.get_rng_state().numpy().copy()
        out["updates"] = np.array(self.updates, dtype=np.int64)
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict` (shapes checked). ``weights_only=True`` copies the LoRA weights alone
        and bumps ``model.step`` (the served policy changed); optimiser, RNG and counters are kept."""
        if self.dist is not None and self.dist.is_main:
            dist_util.lead("_load_state_dict", dict(state), weights_only)
        self._load_state_dict(state, weights_only)

    def _load_state_dict(self, state: Mapping[str, Any], weights_only: bool = False) -> None:
        fmt = str(np.asarray(state.get("format", "")))
        if fmt != _STATE_FORMAT:
            raise ValueError(f"backend state: format {fmt!r} is not {_STATE_FORMAT!r}")
        lora = {k[5:]: np.asarray(v) for k, v in state.items() if k.startswith("lora/")}
        self.model.load_adapter_state(lora)  # raises on missing/extra names or shapes
        if weights_only:
            self.model.bump_step()
            if self.dist is None or self.dist.is_main:
                self.model.after_update()
            return
        with self.model.lock:
            self.optimizer.state.clear()
            for name, p in self.params.items():
                key = f"optim/{name}/"
                if key + "exp_avg" not in state:
                    continue
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(np.asarray(state[key + "step"]))),
                    "exp_avg": torch.from_numpy(np.asarray(state[key + "exp_avg"], np.float32)).to(p),
                    "exp_avg_sq": torch.from_numpy(np.asarray(state[key + "exp_avg_sq"], np.float32)).to(p),
                }
            self.model.step = int(np.asarray(state["policy_step"]))
        self.rng.bit_generator.state = json.loads(str(np.asarray(state["rng"])))
        if "torch_rng" in state:
            torch.set_rng_state(torch.from_numpy(np.asarray(state["torch_rng"], dtype=np.uint8).copy()))
        self.updates = int(np.asarray(state["updates"]))
