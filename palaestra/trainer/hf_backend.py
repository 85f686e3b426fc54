"""HFBackend: trains the LoRA adapters of an :class:`~palaestra.models.hf.model.HFModel` with the embedded
backend's update, backpropagating its ``dloss/dlogp`` as ``(logp * dlogp).sum()``; several ranks: docs/scaling.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from palaestra.models.hf.model import HFModel, token_logprobs
from palaestra.trainer import distributed as dist_util
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.tokenize import PackedBatch
from palaestra.trainer.update import CountedUpdates, PolicyBackend, first_trained_column


def row_logprobs(net: Any, ids: np.ndarray, *, grad: bool, start: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Logprobs (a tensor, with a graph when ``grad``) and entropies (numpy float64) of numpy rows ``ids``."""
    x = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(next(net.parameters()).device)
    logp, ent = token_logprobs(net, x, grad=grad, start=start)
    return logp, ent.cpu().numpy().astype(np.float64)


class TorchPolicy(CountedUpdates):
    """:class:`~palaestra.trainer.update.TrainablePolicy` over a ``transformers`` causal LM ``net``: its parameters
    that require a gradient, trained by ``optimizer`` (settings from each step's config) under ``lock``."""

    def __init__(
        self,
        net: Any,
        optimizer: Callable[[list[Any]], torch.optim.Optimizer] = torch.optim.Adam,
        lock: Any = None,
    ) -> None:
        self.net = net
        self.params = {name: p for name, p in net.named_parameters() if p.requires_grad}
        self.optimizer = optimizer(list(self.params.values()))
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self._graph: torch.Tensor | None = None  # the logprobs of train_logprobs, for train_backward

    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Logprobs (float64) and entropies of ``ids`` (0 before column ``start``), keeping the graph."""
        self._graph, ent = row_logprobs(self.net, ids, grad=True, start=start)
        return self._graph.detach().double().cpu().numpy(), ent

    def train_backward(self, dlogp: np.ndarray) -> None:
        """Gradients of ``(logp * dlogp).sum()``, i.e. ``dloss/dtheta`` by the chain rule."""
        assert self._graph is not None, "train_backward needs train_logprobs first"
        self.optimizer.zero_grad(set_to_none=True)
        (self._graph * torch.from_numpy(dlogp).to(self._graph)).sum().backward()
        self._graph = None

    def optimizer_step(self, cfg: TrainConfig) -> float:
        """Clip to ``cfg.clip_norm``, then one optimiser step under ``lock`` (none when the norm is not finite)."""
        settings = {"lr": float(cfg.lr), "betas": tuple(cfg.betas), "eps": float(cfg.adam_eps)}
        for group in self.optimizer.param_groups:
            group.update(settings, weight_decay=float(cfg.weight_decay))
        params = list(self.params.values())
        norm = float(torch.nn.utils.clip_grad_norm_(params, float(cfg.clip_norm or "inf")))
        if np.isfinite(norm):
            with self.lock:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


class HFBackend(PolicyBackend, TorchPolicy):
    """:class:`~palaestra.trainer.backend.Backend` for an :class:`HFModel`: AdamW on its LoRA parameters, at most
    ``micro_batch_size`` rows per forward/backward pass. ``fsdp`` (default: ``config.distributed == "fsdp"``)
    shards the frozen base weights, so an experiment must generate on vLLM (``fsdp=True``: the caller samples)."""

    STATE_FORMAT = "palaestra.hf_backend/1"

    def __init__(
        self,
        model: HFModel,
        config: TrainConfig | None = None,
        *,
        micro_batch_size: int | None = None,
        fsdp: bool | None = None,
    ) -> None:
        PolicyBackend.__init__(self, model, config, model.block_size)
        self.micro_batch_size = micro_batch_size if micro_batch_size is not None else model.micro_batch_size
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {self.micro_batch_size}")
        if not model.trainable_parameters():
            raise ValueError("HFBackend: the model has no trainable (LoRA) parameters")
        TorchPolicy.__init__(self, model.model, torch.optim.AdamW, lock=model.lock)
        self._rows: tuple[np.ndarray, int] = (np.zeros((0, 0), np.int64), 0)  # micro-batched train_logprobs
        self.dist = dist_util.current()  # data-parallel when a process group of > 1 ranks exists
        self.fsdp = (self.config.distributed == "fsdp" if fsdp is None else fsdp) and self.dist is not None
        if self.fsdp and fsdp is None and model.vllm is None:  # an experiment samples from this model
            raise ValueError(
                "train.distributed = 'fsdp': with the base weights sharded over the ranks, rank 0 cannot "
                "sample alone; generate on vLLM servers ([model.hf.vllm]) or use the default 'ddp'"
            )
        if self.dist is not None:
            with torch.no_grad():  # every rank starts from rank 0's adapters
                for p in self.params.values():
                    tdist.broadcast(p.data, src=0)
            dist_util.mark_following()
        if self.fsdp:  # FSDP2: a unit per transformer block, the root the rest; LoRA adapters stay whole
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(next(self.net.parameters()).device.type, (tdist.get_world_size(),))
            ignored = set(self.params.values())
            blocks = set(getattr(self.net.get_base_model(), "_no_split_modules", None) or ())
            for sub in [m for m in self.net.modules() if type(m).__name__ in blocks]:
                fully_shard(sub, mesh=mesh, ignored_params=ignored)
            fully_shard(self.net, mesh=mesh, ignored_params=ignored)
        if self.dist is not None and self.dist.is_main:
            how = "FSDP, base weights sharded" if self.fsdp else "data parallel, a full model per rank"
            print(f"palaestra: HF backend on {self.dist.world_size} ranks ({how})", flush=True)

    def _chunks(self, n: int) -> list[slice]:
        size = self.micro_batch_size or max(n, 1)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _rank_chunks(self, n: int) -> list[slice]:
        """This rank's micro-batches of its shard of ``n`` rows. Under FSDP every forward is collective, so every
        rank runs as many: empty slices pad the shorter shards."""
        rank, world = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
        own = slice(rank * n // world, (rank + 1) * n // world)  # contiguous rows
        out = [slice(own.start + s.start, own.start + s.stop) for s in self._chunks(own.stop - own.start)]
        if self.fsdp and self.dist is not None:
            most = len(self._chunks(-(-n // self.dist.world_size)))
            out += [slice(own.stop, own.stop)] * (most - len(out))
        return out

    def _logp_rows(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Logprobs (float64) and entropies of every row without a graph, all-gathered from the ranks."""
        width = ids.shape[1] - 1
        parts, ents = [np.zeros((0, width))], [np.zeros((0, width))]
        for sl in self._rank_chunks(ids.shape[0]):
            real = sl.stop > sl.start  # else an FSDP pad: scored with the other ranks, then dropped
            lp, ent = row_logprobs(self.net, ids[sl] if real else ids[:1], grad=False, start=start)
            if real:
                parts.append(lp.double().cpu().numpy())
                ents.append(ent)
        out = [np.concatenate(parts), np.concatenate(ents)]
        if self.dist is not None:  # concatenated over the ranks, in rank order
            ranks: list[Any] = [None] * self.dist.world_size
            tdist.all_gather_object(ranks, out)
            out = [np.concatenate([r[i] for r in ranks if len(r[i])]) for i in range(2)]
        return out[0], out[1]

    def reference_logprobs(self, packed: PackedBatch) -> np.ndarray:
        """Logprobs of the packed rows with the adapters disabled; 0 before the first trained column."""
        with self.model.reference():
            return self._logp_rows(packed.ids, first_trained_column(packed.mask))[0]

    def train_step(self, batch: Any, config: TrainConfig | None = None) -> dict[str, float]:
        """One update (:meth:`PolicyBackend.train_step`); rank 0 has the followers take the same step."""
        cfg = config if config is not None else self.config
        if self.dist is not None and self.dist.is_main:
            dist_util.lead("train_step", batch, cfg)
        return super().train_step(batch, cfg)

    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One pass with a graph when the rows fit one micro-batch on one rank, else scored without one
        (:meth:`train_backward` re-runs each micro-batch)."""
        if len(self._chunks(ids.shape[0])) == 1 and self.dist is None:
            return super().train_logprobs(ids, start)
        self._graph, self._rows = None, (ids, start)
        return self._logp_rows(ids, start)

    def train_backward(self, dlogp: np.ndarray) -> None:
        """LoRA gradients of ``(logp * dlogp).sum()`` over this rank's micro-batches, all-reduced across ranks."""
        if self._graph is not None:
            return super().train_backward(dlogp)
        ids, start = self._rows
        self.optimizer.zero_grad(set_to_none=True)
        for sl in self._rank_chunks(len(ids)):
            real = sl.stop > sl.start  # else an FSDP pad: row 0 with zero weight, for the collectives
            lp_t, _ = row_logprobs(self.net, ids[sl] if real else ids[:1], grad=True, start=start)
            w = dlogp[sl] if real else np.zeros((1, ids.shape[1] - 1))
            (lp_t * torch.from_numpy(w).to(lp_t)).sum().backward()
        if self.dist is not None:
            for p in self.params.values():  # summed over the ranks; a missing gradient counts as zeros
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                tdist.all_reduce(p.grad, op=tdist.ReduceOp.SUM)

    def publish(self) -> int:
        """Count the update, bump ``model.step`` and push the adapters (``model.after_update``, rank 0)."""
        step = super().publish()
        if self.dist is None or self.dist.is_main:
            self.model.after_update()
        return step

    def state_dict(self) -> dict[str, np.ndarray]:
        """LoRA weights, AdamW state, RNG states, update counter and ``model.step`` (numpy only, no pickle)."""
        out: dict[str, np.ndarray] = {"model_name": np.array(self.model.name)}
        with self.model.lock:
            out.update({"lora/" + name: arr for name, arr in self.model.adapter_state().items()})
            for name, p in self.params.items():
                st = self.optimizer.state.get(p)
                if st:
                    out[f"optim/{name}/exp_avg"] = st["exp_avg"].detach().float().cpu().numpy().copy()
                    out[f"optim/{name}/exp_avg_sq"] = st["exp_avg_sq"].detach().float().cpu().numpy().copy()
                    out[f"optim/{name}/step"] = np.array(float(st["step"]), dtype=np.float64)
            out["policy_step"] = np.array(self.model.step, dtype=np.int64)
        out["torch_rng"] = torch.get_rng_state().numpy().copy()
        return self._state(out)

    def load_state_dict(self, state: Mapping[str, Any], *, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict` on every rank (``weights_only``: the LoRA weights alone; bumps the step)."""
        if self.dist is not None and self.dist.is_main:
            dist_util.lead("load_state_dict", dict(state), weights_only=weights_only)
        self._check_format(state)
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
        self._load_counters(state)
        if "torch_rng" in state:
            torch.set_rng_state(torch.from_numpy(np.asarray(state["torch_rng"], dtype=np.uint8).copy()))
