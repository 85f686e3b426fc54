"""The shipped split files of each task are what its generator makes, and SplitFiles reads and writes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from palaestra.envs import arithmetic_data


def test_shipped_arithmetic_splits_are_the_generated_ones(tmp_path: Path) -> None:
    made = arithmetic_data.make_splits()
    assert {k: len(v) for k, v in made.items()} == {"train": 18_000, "val": 1000, "test": 1000, "dev": 200}
    for name in arithmetic_data.SPLITS:
        assert arithmetic_data.load_split(name) == made[name], name
    ids = {split: {r["id"] for r in made[split]} for split in ("train", "val", "test")}
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["test"] and not ids["val"] & ids["test"]
    counts = arithmetic_data.write_splits(tmp_path)  # the build script writes byte-identical files
    assert counts == {k: len(v) for k, v in made.items()}
    for name in arithmetic_data.SPLITS:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == arithmetic_data.FILES.path(name).read_bytes()
    assert arithmetic_data.write_splits(tmp_path / "other", seed=1) == counts
    assert arithmetic_data.FILES.load("val") != arithmetic_data.make_splits(1)["val"]


def test_unknown_split_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown split 'training'; expected one of train, val, test, dev"):
        arithmetic_data.load_split("training")
