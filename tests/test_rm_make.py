"""``palaestra rm make`` at toy size: the shipped recipe's steps run end to end, and ``--trunk-steps`` starts the
reward model from a separately pretrained judge trunk recorded in the card."""

from __future__ import annotations

import json
from pathlib import Path

from palaestra.models.reward_model import RewardModel
from palaestra.trainer.reward_modeling import make_arith_rm

TOY = {"prompts": 12, "samples_per_prompt": 2, "epochs": 1, "batch_size": 8, "agreement_examples": 4}


def test_rm_make_toy_from_arith_base(tmp_path: Path) -> None:
    card = make_arith_rm(
        out_dir=tmp_path, pairs_path=tmp_path / "pairs.jsonl.gz", recipe=TOY, log=lambda m: None
    )
    assert card["init"] == "arith-base" and card["pairs"]["count"] > 0
    saved = json.loads((tmp_path / "arith-rm.json").read_text())
    assert saved["fingerprint"] == RewardModel.load(tmp_path / "arith-rm.npz").fingerprint
    assert "judge_trunk" not in saved["recipe"]  # the shipped recipe is unchanged


def test_rm_make_with_a_pretrained_judge_trunk(tmp_path: Path) -> None:
    recipe = {**TOY, "judge_trunk": {"steps": 3, "seed": 1}}
    card = make_arith_rm(
        out_dir=tmp_path, pairs_path=tmp_path / "pairs.jsonl.gz", recipe=recipe, log=lambda m: None
    )
    assert card["init"]["sft_steps"] == 3 and card["init"]["seed"] == 1
    assert 0.0 <= card["init"]["val_accuracy_greedy"] <= 1.0
    assert card["training"]["init"] == card["init"]
