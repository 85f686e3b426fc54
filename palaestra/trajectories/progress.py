"""A tqdm progress bar with running means of reward, exceptions and numeric metrics (lazy tqdm import)."""

from __future__ import annotations

import sys
import time
from typing import Any

from palaestra.trajectories.types import Trajectory


class Progress:
    """Counts finished rollouts; shows done/total and running means when stderr is a terminal."""

    def __init__(
        self, desc: str = "gather", *, enabled: bool | None = None, min_interval: float = 0.2
    ) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total = 0
        self.done = 0
        self.exceptions = 0
        self.groups_done = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._bar: Any = None
        self._last = 0.0
        self._min_interval = min_interval
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=desc, dynamic_ncols=True)

    def add_total(self, n: int) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        """Running mean of reward and every numeric metric seen so far, plus the exception count."""
        out = {k: self.sums[k] / self.counts[k] for k in self.sums}
        out["exceptions"] = float(self.exceptions)
        return out

    def rollout_done(self, trajectory: Trajectory) -> None:
        self.done += 1
        self._add("reward", float(trajectory.reward))
        for key, value in trajectory.metrics.items():
            if isinstance(value, (int, float)):
                self._add(key, float(value))
        self._tick()

    def rollout_failed(self) -> None:
        self.done += 1
        self.exceptions += 1
        self._tick()

    def group_done(self) -> None:
        self.groups_done += 1

    def _tick(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.monotonic()
        if now - self._last >= self._min_interval or self.done == self.total:
            self._last = now
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in self.means().items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
