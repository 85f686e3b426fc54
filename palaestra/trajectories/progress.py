"""A tqdm progress bar with running means of reward, exceptions and numeric metrics (lazy tqdm import)."""

from __future__ import annotations

import sys
import time
from typing import Any

from palaestra.trajectories.types import Trajectory

_MIN_INTERVAL = 0.2  # seconds between refreshes of the running means


class Progress:
    """Counts finished rollouts; shows done/total and running means when stderr is a terminal."""

    def __init__(self, desc: str = "gather", *, enabled: bool | None = None) -> None:
        self.total = self.done = self.exceptions = 0
        self.sums: dict[str, list[float]] = {}  # key -> [sum, count]
        self._bar: Any = None
        self._last = 0.0
        if sys.stderr.isatty() if enabled is None else enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=desc, dynamic_ncols=True)

    def add_total(self, n: int) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def means(self) -> dict[str, float]:
        """Running mean of reward and every numeric metric seen so far, plus the exception count."""
        return {**{k: s / n for k, (s, n) in self.sums.items()}, "exceptions": float(self.exceptions)}

    def rollout_done(self, trajectory: Trajectory) -> None:
        self.done += 1
        for key, value in [("reward", trajectory.reward), *trajectory.metrics.items()]:
            if isinstance(value, (int, float)):
                acc = self.sums.setdefault(key, [0.0, 0])
                acc[0] += float(value)
                acc[1] += 1
        self._tick()

    def rollout_failed(self) -> None:
        self.done += 1
        self.exceptions += 1
        self._tick()

    def _tick(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.monotonic()
        if now - self._last >= _MIN_INTERVAL or self.done == self.total:
            self._last = now
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in self.means().items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
