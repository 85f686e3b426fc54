"""palaestra: reinforcement learning of LLM agents, from a laptop CPU to real LLMs.

Top-level names are loaded lazily so that ``import palaestra`` stays fast; touching ``palaestra.Trajectory``
imports what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Trajectory": "palaestra.trajectories.types",
    "TrajectoryGroup": "palaestra.trajectories.types",
    "ExceptionRecord": "palaestra.trajectories.types",
    "gather_trajectory_groups": "palaestra.trajectories.gather",
    "gather_trajectories": "palaestra.trajectories.gather",
    "GatherError": "palaestra.trajectories.gather",
    "DataError": "palaestra.trajectories.io",
    "read_groups": "palaestra.trajectories.io",
    "write_groups": "palaestra.trajectories.io",
    "retry": "palaestra.trajectories.retry",
    "RewardFunction": "palaestra.trajectories.protocols",
    "ChatModel": "palaestra.trajectories.protocols",
    "ValidationStopping": "palaestra.trainer.stopping",
    "TrainConfig": "palaestra.trainer.config",
    "GRPOTrainer": "palaestra.trainer.grpo",
    "Experiment": "palaestra.trainer.experiment",
    "ExperimentConfig": "palaestra.trainer.expconfig",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

if TYPE_CHECKING:
    from palaestra.trainer.config import TrainConfig
    from palaestra.trainer.expconfig import ExperimentConfig
    from palaestra.trainer.experiment import Experiment
    from palaestra.trainer.grpo import GRPOTrainer
    from palaestra.trainer.stopping import ValidationStopping
    from palaestra.trajectories.gather import GatherError, gather_trajectories, gather_trajectory_groups
    from palaestra.trajectories.io import DataError, read_groups, write_groups
    from palaestra.trajectories.protocols import ChatModel, RewardFunction
    from palaestra.trajectories.retry import retry
    from palaestra.trajectories.types import ExceptionRecord, Trajectory, TrajectoryGroup


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
