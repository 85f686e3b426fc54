"""The shipped dataset splits of a task: one JSONL file per split in ``palaestra/envs/data/<task>/``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.trajectories.io import read_jsonl, write_jsonl

SPLITS = ("train", "val", "test", "dev")


@dataclass(frozen=True)
class SplitFiles:
    """The split files ``<data_dir>/<name>.jsonl`` of one task, and how to make them again."""

    data_dir: Path  # the task's folder of shipped split files
    make: Callable[[int], Mapping[str, Sequence[dict[str, Any]]]]  # seed -> {split: rows}, deterministic
    seed: int  # the seed the shipped files were made with
    names: tuple[str, ...] = SPLITS

    def path(self, name: str) -> Path:
        """Path of a shipped split file (ValueError naming the splits if ``name`` is not one)."""
        if name not in self.names:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(self.names)}")
        return self.data_dir / f"{name}.jsonl"

    def load(self, name: str) -> list[dict[str, Any]]:
        """The rows (example dicts) of a shipped split."""
        return read_jsonl(self.path(name))

    def write(self, out_dir: Path | None = None, seed: int | None = None) -> dict[str, int]:
        """Make the splits (default: the shipped seed) and write them to ``out_dir`` (default: the data
        folder); returns the rows per split."""
        folder = Path(out_dir) if out_dir is not None else self.data_dir
        counts = {}
        for name, rows in self.make(self.seed if seed is None else seed).items():
            write_jsonl(folder / f"{name}.jsonl", list(rows))
            counts[name] = len(rows)
        return counts
