"""palaestra: reinforcement learning of LLM agents, from a laptop CPU to real LLMs. Top-level names and
subpackages are imported on first touch, so that ``import palaestra`` stays fast."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    name: module
    for module, names in {
        "palaestra.trajectories.types": ("Trajectory", "TrajectoryGroup", "ExceptionRecord"),
        "palaestra.trajectories.gather": ("gather_trajectory_groups", "gather_trajectories", "GatherError"),
        "palaestra.trajectories.io": ("DataError", "read_groups", "write_groups"),
        "palaestra.trajectories.retry": ("retry",),
        "palaestra.trajectories.protocols": ("RewardFunction", "ChatModel"),
        "palaestra.trainer.stopping": ("ValidationStopping",),
        "palaestra.trainer.config": ("TrainConfig",),
        "palaestra.trainer.loop": ("GRPOTrainer",),
        "palaestra.trainer.experiment": ("Experiment",),
        "palaestra.trainer.expconfig": ("ExperimentConfig",),
    }.items()
    for name in names
}

_SUBPACKAGES = ("envs", "evals", "judges", "labs", "models", "testing", "trainer", "trajectories")

__all__ = [*sorted(_EXPORTS), *_SUBPACKAGES, "__version__"]

if TYPE_CHECKING:
    from palaestra.trainer.config import TrainConfig
    from palaestra.trainer.expconfig import ExperimentConfig
    from palaestra.trainer.experiment import Experiment
    from palaestra.trainer.loop import GRPOTrainer
    from palaestra.trainer.stopping import ValidationStopping
    from palaestra.trajectories.gather import GatherError, gather_trajectories, gather_trajectory_groups
    from palaestra.trajectories.io import DataError, read_groups, write_groups
    from palaestra.trajectories.protocols import ChatModel, RewardFunction
    from palaestra.trajectories.retry import retry
    from palaestra.trajectories.types import ExceptionRecord, Trajectory, TrajectoryGroup


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"palaestra.{name}")  # the import binds it as an attribute
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
