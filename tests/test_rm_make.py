"""``palaestra rm make`` at toy size: the shipped recipe's steps run end to end, and ``--trunk-steps`` starts the
reward model from a separately pretrained judge trunk recorded in the card."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic_data import load_split
from palaestra.models.reward_model import Pair, RewardModel, read_pairs, write_pairs
from palaestra.trainer.reward_modeling import make_arith_rm, pairs_from_rankings, train_from_pairs
from palaestra.trajectories.io import write_groups
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

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


def rm_cli(*args: str) -> tuple[int, str, str]:
    """``palaestra rm ARGS`` through the real CLI entry point: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["rm", *args])
    return code, out.getvalue(), err.getvalue()


def scored_group(prompt: str, replies: list[str], rewards: list[float]) -> TrajectoryGroup:
    return TrajectoryGroup(
        [
            Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": reply},
                ],
                reward=reward,
            )
            for reply, reward in zip(replies, rewards)
        ]
    )


def test_rankings_without_any_usable_group_are_refused_by_name(tmp_path: Path) -> None:
    groups = [
        scored_group("What is 1+1?", ["Final: 2"], [1.0]),  # a single trajectory: skipped
        scored_group("What is 2+2?", ["Final: 4", "Final: 5"], [0.5, 0.5]),  # a tie: no pair
        scored_group("What is 3+3?", ["Final: 6", "Final: 6"], [1.0, 0.0]),  # equal texts: no pair
    ]
    path = tmp_path / "groups.jsonl"
    write_groups(path, groups)
    code, _, err = rm_cli("pairs", "--from-rankings", str(path), "--out", str(tmp_path / "p.jsonl"))
    assert code == 2 and f"{path}: no group has two differently scored trajectories" in err
    assert not (tmp_path / "p.jsonl").exists()
    # the single-trajectory group is skipped, not an error: a usable group next to it still gives its pair
    write_groups(path, [groups[0], scored_group("What is 4+4?", ["Final: 8", "Final: 9"], [1.0, 0.0])])
    pairs = pairs_from_rankings(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("What is 4+4?", "Final: 8", "Final: 9")]


def test_rm_pairs_from_policy_samples(tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl"
    code, stdout, _ = rm_cli(
        "pairs",
        "--out",
        str(out),
        "--limit",
        "3",
        "--samples",
        "2",
        "--reference",
        "--noise",
        "0",
        "--seed",
        "1",
    )
    pairs = read_pairs(out)
    assert code == 0 and pairs and all(p.chosen != p.rejected for p in pairs)
    assert stdout.strip().startswith(f"{len(pairs)} pairs from arith-base samples on 3 train prompts")
    examples = {ex["id"]: ex for ex in load_split("train")[:3]}
    assert {p.extra["example_id"] for p in pairs if p.extra} <= set(examples)
    # --reference: every prompt's correct answer is a candidate, and the noiseless annotator prefers it
    for ex_id, ex in examples.items():
        assert f"Final: {ex['expected_answer']}" in {
            p.chosen for p in pairs if p.extra["example_id"] == ex_id
        }


def test_rm_pairs_refuses_a_bad_noise_before_sampling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import palaestra.trainer.reward_modeling as rm

    sampled: list[str] = []
    monkeypatch.setattr(rm, "sample_policy", lambda policy, *a, **k: sampled.append(policy))
    code, _, err = rm_cli("pairs", "--out", str(tmp_path / "p.jsonl"), "--noise", "0.7")
    assert code == 2 and "--noise: noise must be in [0, 0.5), got 0.7" in err
    assert sampled == [] and not (tmp_path / "p.jsonl").exists()


def test_rm_eval_needs_a_question_and_prints_a_table(tmp_path: Path) -> None:
    code, _, err = rm_cli("eval", "--model", "arith-rm")
    assert code == 2 and "rm eval: give --pairs (pair accuracy) and/or --policy" in err
    pairs = tmp_path / "p.jsonl"
    write_pairs(pairs, [Pair("What is 2+2?", "Final: 4", "Final: 5"), Pair("What is 1+2?", "Final: 3", "3?")])
    code, stdout, _ = rm_cli(
        "eval", "--pairs", str(pairs), "--policy", "arith-base", "--limit", "3", "--samples", "2"
    )
    lines = stdout.splitlines()
    assert code == 0 and lines[0].startswith("reward model arith-rm (")
    assert re.fullmatch(
        rf"  pair accuracy on {re.escape(str(pairs))}: (0|0\.5|1)\.\d{{3}} \(2 pairs\)", lines[1]
    )
    assert lines[2].startswith("  agreement with arith-strict") and "arith-base samples (3 x 2)" in lines[2]


def test_rm_make_cli_records_its_flags_in_the_card(tmp_path: Path) -> None:
    code, _, _ = rm_cli(
        "make",
        "--out-dir",
        str(tmp_path),
        "--pairs-out",
        str(tmp_path / "pairs.jsonl.gz"),
        "--prompts",
        "8",
        "--epochs",
        "1",
        "--lr",
        "0.002",
        "--seed",
        "3",
    )
    assert code == 0
    card = json.loads((tmp_path / "arith-rm.json").read_text())
    assert {k: card["recipe"][k] for k in ("prompts", "epochs", "lr", "seed")} == {
        "prompts": 8,
        "epochs": 1,
        "lr": 0.002,
        "seed": 3,
    }
    assert "judge_trunk" not in card["recipe"] and card["init"] == "arith-base"  # no --trunk-steps
    assert card["fingerprint"] == RewardModel.load(tmp_path / "arith-rm.npz").fingerprint


def test_unknown_training_setting_is_named() -> None:
    pair = Pair("What is 2+2?", "Final: 4", "Final: 5")
    with pytest.raises(TypeError, match=r"unknown training settings \['warmup'\]; known: epochs, batch_size"):
        train_from_pairs([pair], epochs=1, warmup=10)
