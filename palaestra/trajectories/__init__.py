"""Layer 1: trajectory records, gathering, JSONL files, run-folder records. Imports no other palaestra package."""

from palaestra.trajectories.gather import GatherError, gather_trajectories, gather_trajectory_groups
from palaestra.trajectories.io import DataError, read_groups, read_jsonl, write_groups, write_jsonl
from palaestra.trajectories.protocols import ChatModel, RewardFunction
from palaestra.trajectories.retry import retry
from palaestra.trajectories.types import ExceptionRecord, Trajectory, TrajectoryGroup

__all__ = [
    "ChatModel",
    "DataError",
    "ExceptionRecord",
    "GatherError",
    "RewardFunction",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectories",
    "gather_trajectory_groups",
    "read_groups",
    "read_jsonl",
    "retry",
    "write_groups",
    "write_jsonl",
]
