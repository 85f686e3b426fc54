"""Distributed training of the HF backend with ``torch.distributed`` (docs/scaling.md, "Several GPUs"): rank 0
is the experiment, the other ranks (*followers*) only run what it broadcasts (:func:`lead`, :func:`follow`) and
write no files. Nothing here imports torch until a process group is needed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["DistInfo", "broadcast_object", "current", "follow", "init_from_env", "lead", "release_followers"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the process group."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_FOLLOWING: list[bool] = [False]  # a backend joined collective updates: rank 0 must release the followers


def init_from_env() -> DistInfo | None:
    """Join the process group described by the launcher's environment (``WORLD_SIZE > 1``), once; None when
    the process runs alone. NCCL when CUDA is available (one GPU per ``LOCAL_RANK``), else gloo."""
    if int(os.environ.get("WORLD_SIZE") or 1) <= 1:
        return None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(_leave_group)  # at exit: rank 0 releases the followers first (atexit runs in reverse)
        atexit.register(release_followers)
    return current()


def _leave_group() -> None:
    """All ranks leave together (a barrier), then tear the process group and the sub-groups FSDP's device
    mesh made down before interpreter shutdown: a rank that exited while its peer still held the group
    aborted one of them (SIGABRT in gloo's threads, seen under FSDP). A dead peer fails the barrier at once."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a finished rank: release the followers (rank 0), leave the group, flush stdio and ``os._exit(code)``,
    skipping the interpreter's finalisation, where torch's C++ threads could still abort it ("terminate called
    without an active exception", SIGABRT) after all its files were written."""
    release_followers()
    _leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def current() -> DistInfo | None:
    """The process group this process belongs to (world size > 1), or None."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        return None
    return DistInfo(dist.get_rank(), dist.get_world_size())


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; rank 0's data only, never read from a follower)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mark_following() -> None:
    """Called by a backend that takes part in collective calls: rank 0 releases the followers at exit."""
    _FOLLOWING[0] = True


def lead(method: str, *args: Any, **kwargs: Any) -> None:
    """Rank 0: have every follower call ``backend.<method>(*args, **kwargs)`` (then rank 0 calls it too)."""
    broadcast_object((method, args, kwargs))


def release_followers() -> None:
    """Rank 0: tell followers the run is over (registered at exit; harmless when nobody follows). A follower
    never broadcasts: rank 0 would be waiting in another collective."""
    info = current()
    if _FOLLOWING[0] and info is not None and info.is_main:
        _FOLLOWING[0] = False
        with contextlib.suppress(Exception):  # the group is already gone: followers exit with it
            broadcast_object(("stop",))


def follow(backend: Any) -> int:
    """Follower loop: call on ``backend`` what rank 0 broadcasts until it says stop; returns the updates taken."""
    updates = 0
    while (msg := broadcast_object())[0] != "stop":
        method, args, kwargs = msg
        getattr(backend, method)(*args, **kwargs)
        updates += method == "train_step"
    return updates


def follow_command(args: Any) -> int:
    """``palaestra train`` on a follower rank: build the run's model and backend, then :func:`follow`."""
    from palaestra.trainer.builders import build_model, resolve_backend
    from palaestra.trainer.expconfig import config_from_dict, load_config
    from palaestra.trajectories.runs import read_json

    if args.resume:
        path = Path(args.resume) / "config.json"
        cfg = config_from_dict(read_json(path), source=str(path))
    else:
        cfg = load_config(args.config)
    if resolve_backend(cfg.model.backend, cfg.model.name)[0] != "hf":
        print(
            f"palaestra train: rank {current()}: only the hf backend trains distributed; rank 0 trains alone"
        )
        return 0
    from palaestra.trainer.hf_backend import HFBackend

    follow(HFBackend(build_model(cfg), cfg.train))
    return 0
