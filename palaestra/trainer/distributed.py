"""Data-parallel training of the HF backend with ``torch.distributed`` (``torchrun``, gloo on CPU, NCCL on GPU).

Launch the same command on every rank::

    torchrun --nproc-per-node 2 -m palaestra train --config exp.toml

Rank 0 is the experiment: it owns the run folder, rollouts, judging, validation, checkpoints and LoRA
publishing, exactly as in a single process. The other ranks (*followers*) build the same model and an
:class:`~palaestra.trainer.hf_backend.HFBackend`, then only take part in updates; they write no files.

One update (inside ``HFBackend.train_step``): rank 0 broadcasts the batch and the step's config; every rank
tokenises it identically, computes the logprobs of its contiguous shard of rows without a graph and all-gathers
them, so each rank evaluates the loss and its analytic gradient ``dloss/dlogp`` on the whole minibatch (the
``token_mean`` weights need the global token count), backpropagates only its own rows, and the LoRA gradients
are summed with ``all_reduce`` before clipping and the AdamW step. Every rank therefore takes the same step as
one process would on the global batch (equal up to float summation order). This is what
``DistributedDataParallel`` does for a one-pass loss; palaestra reduces the gradients itself because its
update is two-pass (score, then backpropagate ``dloss/dlogp``) and uses the adapter-disabled network as the
reference.

Nothing here imports torch until a process group is actually needed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DistInfo",
    "all_gather_rows",
    "all_reduce_grads",
    "broadcast_object",
    "broadcast_params",
    "current",
    "follow",
    "init_from_env",
    "shard",
    "shard_frozen",
]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the process group."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_FOLLOWING: list[bool] = [False]  # a backend joined collective updates: rank 0 must release the followers


def _env_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init_from_env(backend: str | None = None) -> DistInfo | None:
    """Join the process group described by torchrun's environment (``WORLD_SIZE > 1``), once; None when the
    process runs alone. ``backend`` defaults to NCCL when CUDA is available, else gloo."""
    if _env_world() <= 1:
        return None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        name = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if name == "nccl":  # one GPU per rank: "cuda" then means this rank's device
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=name)
        if dist.get_rank() == 0:
            atexit.register(release_followers)
    return current()


def current() -> DistInfo | None:
    """The process group this process belongs to (world size > 1), or None."""
    if _env_world() <= 1 and "torch.distributed" not in __import__("sys").modules:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        return None
    return DistInfo(dist.get_rank(), dist.get_world_size())


def shard(n: int, info: DistInfo) -> slice:
    """The contiguous rows ``[rank*n/world, (rank+1)*n/world)`` of ``n`` that this rank handles."""
    return slice(info.rank * n // info.world_size, (info.rank + 1) * n // info.world_size)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; rank 0's data only, never read from a follower)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_params(params: Iterable[Any]) -> None:
    """Copy rank 0's parameter values to every rank (so all start from the same adapters)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def all_gather_rows(local: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Concatenate each array of ``local`` (this rank's rows) over the ranks, in rank order."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, [np.asarray(a) for a in local])
    return [np.concatenate([p[i] for p in parts if len(p[i])]) for i in range(len(local))]


def all_reduce_grads(params: Iterable[Any]) -> None:
    """Sum the gradients of ``params`` over the ranks (a missing gradient counts as zeros)."""
    import torch
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def shard_frozen(module: Any, keep: Iterable[Any]) -> None:
    """FSDP2 (``fully_shard``) over every rank: each transformer block (the classes the model names in
    ``_no_split_modules``) is one unit, the root the rest. The frozen base weights become shards; the parameters
    in ``keep`` (the LoRA adapters) stay whole on every rank, and their gradients are all-reduced by
    :func:`all_reduce_grads` as without FSDP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(module.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    ignored = set(keep)
    blocks = set(getattr(module.get_base_model(), "_no_split_modules", None) or ())
    for sub in [m for m in module.modules() if type(m).__name__ in blocks]:
        fully_shard(sub, mesh=mesh, ignored_params=ignored)
    fully_shard(module, mesh=mesh, ignored_params=ignored)


def release_followers() -> None:
    """Rank 0: tell followers the run is over (registered at exit; harmless when nobody follows)."""
    if not _FOLLOWING[0]:
        return
    _FOLLOWING[0] = False
    with contextlib.suppress(Exception):  # the group is already gone: followers exit with it
        broadcast_object(("stop",))


def mark_following() -> None:
    """Called by a backend that takes part in collective updates."""
    _FOLLOWING[0] = True


def follow(backend: Any) -> int:
    """Follower loop: apply what rank 0 broadcasts (updates, state loads) until it says stop; returns the
    number of updates taken. Writes no files."""
    updates = 0
    while True:
        msg = broadcast_object()
        kind = msg[0]
        if kind == "stop":
            return updates
        if kind == "step":
            backend._train_step(msg[1], msg[2])
            updates += 1
        elif kind == "load":
            backend._load_state_dict(msg[1], weights_only=msg[2])
        else:  # pragma: no cover - protocol error
            raise RuntimeError(f"distributed follower: unknown message {kind!r}")


def follow_experiment(cfg: Any) -> int:
    """A follower rank of ``palaestra train``: build the model and backend named by ``cfg`` and follow."""
    from palaestra.trainer.builders import build_model, resolve_backend

    if resolve_backend(cfg.model.backend, cfg.model.name)[0] != "hf":
        print(
            f"palaestra train: rank {current() or '?'}: only the hf backend trains data-parallel; "
            "this rank has nothing to do (rank 0 trains alone)"
        )
        return 0
    from palaestra.trainer.hf_backend import HFBackend

    model = build_model(cfg)
    follow(HFBackend(model, cfg.train))
    return 0


def follow_command(args: Any) -> int:
    """``palaestra train`` on a follower rank: the config from ``--config`` or the run's config.json (read
    only), then :func:`follow_experiment`."""
    from pathlib import Path

    from palaestra.trainer.expconfig import config_from_dict, load_config
    from palaestra.trajectories.runs import read_json

    if getattr(args, "resume", None):
        path = Path(args.resume) / "config.json"
        cfg = config_from_dict(read_json(path), source=str(path))
    else:
        cfg = load_config(args.config)
    return follow_experiment(cfg)
