"""The shipped dataset splits of a task: one JSONL file per split in the task's data folder.

Each task module (:mod:`palaestra.envs.arithmetic_data`, :mod:`palaestra.envs.calculator_data`) generates its
problems and splits deterministically and keeps the result in ``palaestra/envs/data/<task>/<split>.jsonl``;
:class:`SplitFiles` names, reads and (re)writes those files for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.trajectories.io import read_jsonl, write_jsonl

SPLITS = ("train", "val", "test", "dev")


@dataclass(frozen=True)
class SplitFiles:
    """The split files ``<data_dir>/<name>.jsonl`` of one task."""

    data_dir: Path
    names: tuple[str, ...] = SPLITS

    def path(self, name: str) -> Path:
        """Path of a shipped split file (ValueError naming the splits if ``name`` is not one)."""
        if name not in self.names:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(self.names)}")
        return self.data_dir / f"{name}.jsonl"

    def load(self, name: str) -> list[dict[str, Any]]:
        """The rows (example dicts) of a shipped split."""
        return read_jsonl(self.path(name))

    def write(
        self, splits: Mapping[str, Sequence[dict[str, Any]]], out_dir: Path | None = None
    ) -> dict[str, int]:
        """Write every split of ``splits`` to ``out_dir`` (default: the data folder); rows per split."""
        folder = Path(out_dir) if out_dir is not None else self.data_dir
        counts = {}
        for name, rows in splits.items():
            write_jsonl(folder / f"{name}.jsonl", list(rows))
            counts[name] = len(rows)
        return counts
