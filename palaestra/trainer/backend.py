"""The Backend protocol (what a trainer needs from whatever holds the weights) and the TrainBatch it consumes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from palaestra.trajectories.types import Trajectory

if TYPE_CHECKING:
    from palaestra.trainer.config import TrainConfig

__all__ = ["Backend", "TrainBatch"]


@dataclass
class TrainBatch:
    """What one update trains on: ``trajectories[i]`` with ``advantages[i]`` from group ``group_index[i]``, DPO's
    ``(chosen, rejected)`` index ``pairs``, per-turn credit's ``turn_advantages[i][k]`` (its ``k``-th Choice)."""

    trajectories: list[Trajectory]
    advantages: np.ndarray
    group_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pairs: list[tuple[int, int]] = field(default_factory=list)
    turn_advantages: list[np.ndarray] | None = None

    def __post_init__(self) -> None:
        n = len(self.trajectories)
        self.advantages = np.asarray(self.advantages, dtype=np.float64).reshape(-1)
        gi = np.asarray(self.group_index, dtype=np.int64).reshape(-1)
        self.group_index = gi if gi.size else np.zeros(n, dtype=np.int64)
        for name, size in (("advantages", self.advantages.size), ("group_index", self.group_index.size)):
            if size != n:
                raise ValueError(f"{name}: expected {n} values (one per trajectory), got {size}")
        if self.turn_advantages is not None:
            if len(self.turn_advantages) != n:
                raise ValueError(
                    f"turn_advantages: expected {n} arrays (one per trajectory), got {len(self.turn_advantages)}"
                )
            self.turn_advantages = [np.asarray(a, dtype=np.float64).reshape(-1) for a in self.turn_advantages]
        turns = [bool(np.isfinite(a).all()) for a in self.turn_advantages or []]
        for name, ok in (("advantages", np.isfinite(self.advantages).tolist()), ("turn_advantages", turns)):
            if not all(ok):
                i = ok.index(False)
                raise ValueError(f"{name}[{i}] is not finite (trajectory {self.trajectories[i].id})")
        for k, (c, r) in enumerate(self.pairs):
            if not (0 <= c < n and 0 <= r < n) or c == r:
                raise ValueError(f"pairs[{k}] = {(c, r)} must name two different trajectories in 0..{n - 1}")

    def __len__(self) -> int:
        return len(self.trajectories)

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[Sequence[Trajectory]],
        advantages: Sequence[Sequence[float] | np.ndarray],
        turn_advantages: Sequence[Sequence[np.ndarray]] | None = None,
    ) -> TrainBatch:
        """Flatten groups of trajectories and their per-group advantages (and per-turn ones) into one batch."""
        if len(groups) != len(advantages):
            raise ValueError(f"{len(groups)} groups but {len(advantages)} advantage arrays")
        advs = [np.asarray(adv, dtype=np.float64).reshape(-1) for adv in advantages]
        for g, (group, a) in enumerate(zip(groups, advs)):
            if a.size != len(group):
                raise ValueError(f"group {g}: {len(group)} trajectories but {a.size} advantages")
        trajs = [t for group in groups for t in group]
        gidx = np.repeat(np.arange(len(groups), dtype=np.int64), [len(group) for group in groups])
        turns = [np.asarray(a) for g in turn_advantages for a in g] if turn_advantages is not None else None
        return cls(trajs, np.concatenate([np.zeros(0), *advs]), gidx, turn_advantages=turns)

    def token_advantages(self, turn: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """Advantage per packed token ``(B, T)`` of rows of trajectories ``owner`` (B,) whose tokens belong to
        turns ``turn`` (B, T; -1 on context): the turn's, or without ``turn_advantages`` the trajectory's."""
        owner = np.asarray(owner, dtype=np.int64)
        out = np.repeat(self.advantages[owner][:, None], turn.shape[1], axis=1)
        if self.turn_advantages is None:
            return out
        for b, i in enumerate(owner):
            a = self.turn_advantages[int(i)]
            row = turn[b]
            used = row >= 0
            if used.any() and int(row[used].max()) >= a.size:
                raise ValueError(
                    f"trajectory {self.trajectories[int(i)].id}: turn {int(row[used].max())} has no advantage "
                    f"(turn_advantages has {a.size})"
                )
            out[b] = np.where(used, a[np.where(used, row, 0)] if a.size else 0.0, 0.0)
        return out


@runtime_checkable
class Backend(Protocol):
    """Holds a trainable policy: ``train_step`` runs one (synchronous) update and returns float metrics;
    ``state_dict`` (str -> numpy array) is everything needed to continue bit-identically."""

    def train_step(self, batch: TrainBatch, config: TrainConfig) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: Mapping[str, np.ndarray], *, weights_only: bool = False) -> None: ...
