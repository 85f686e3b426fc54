"""The learned judge: a reward model behind score_group (deterministic, relative within a group, versioned,
cached), its wiring into experiment configs, and the ``palaestra rm`` commands (pairs from rankings, train,
eval)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from palaestra.cli import main
from palaestra.judges.cache import JudgeCache
from palaestra.judges.learned import LearnedJudge, TextScorer, relative_scores
from palaestra.models.reward_model import RewardModel, read_pairs
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer
from palaestra.trajectories.io import write_groups
from palaestra.trajectories.protocols import RewardFunction
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

PROMPT = "What is 12+7? Reply with one line: Final: <int>"
REPLIES = ["Final: 19", "Final: 18", "Final: 19 since 12+7=19", "Final: 91", "Final: 19"]


def small_rm(seed: int = 0) -> RewardModel:
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, d_model=16, n_layer=1, n_head=2, d_ff=32)
    rm = RewardModel.from_policy(TinyGPT(cfg, tokenizer=tok, seed=seed), seed=seed, name="tiny-rm")
    rng = np.random.default_rng(seed)
    rm.params["rm.w"] += rng.normal(0, 1.0, rm.params["rm.w"].shape).astype(rm.dtype)
    rm.weights_changed()
    return rm


class Shifted:
    """A scorer whose raw scores are another's plus a constant (same preferences, other offset)."""

    def __init__(self, inner: RewardModel, shift: float) -> None:
        self.inner, self.shift, self.name = inner, shift, "shifted"

    @property
    def fingerprint(self) -> str:
        return f"{self.inner.fingerprint}+{self.shift}"

    def score_texts(
        self, prompt: str | Sequence[Mapping[str, Any]], completions: Sequence[str]
    ) -> list[float]:
        return [s + self.shift for s in self.inner.score_texts(prompt, completions)]


def group_of(replies: Sequence[str]) -> TrajectoryGroup:
    return TrajectoryGroup(
        [
            Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": PROMPT},
                    {"role": "assistant", "content": r},
                ]
            )
            for r in replies
        ]
    )


def rewards(judge: LearnedJudge, replies: Sequence[str]) -> list[float]:
    scored = asyncio.run(judge.score_group(group_of(replies), {"expected_answer": "19"}))
    assert scored is not None
    return [float(t.reward) for t in scored.trajectories]


def test_protocols() -> None:
    judge = LearnedJudge(small_rm())
    assert isinstance(judge, RewardFunction)
    assert isinstance(small_rm(), TextScorer)
    with pytest.raises(TypeError):
        LearnedJudge(object())  # type: ignore[arg-type]


def test_scores_are_deterministic_and_relative_within_the_group() -> None:
    rm = small_rm()
    judge = LearnedJudge(rm, min_span=0.0)
    first, second = rewards(judge, REPLIES), rewards(judge, REPLIES)
    assert first == second
    assert max(first) == pytest.approx(1.0) and min(first) == pytest.approx(0.0)
    assert first[0] == first[4]  # duplicates share a score
    raw = rm.score_texts(PROMPT, REPLIES)
    assert [a > b for a, b in itertools.pairwise(first)] == [a > b for a, b in itertools.pairwise(raw)]
    # relative: the same preferences with another offset give the same rewards
    assert rewards(LearnedJudge(Shifted(rm, 7.5), min_span=0.0), REPLIES) == pytest.approx(first, abs=1e-9)


def test_min_span_keeps_small_differences_small() -> None:
    assert relative_scores([0.0, 0.1], 1.0) == pytest.approx([0.45, 0.55])
    assert relative_scores([0.0, 3.0], 1.0) == pytest.approx([0.0, 1.0])
    assert relative_scores([2.0, 2.0], 0.0) == [0.5, 0.5]


class Fixed:
    """A scorer that answers every group with the same list (right or wrong), whatever the completions."""

    name, fingerprint = "fixed", "fixed-1"

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores

    def score_texts(
        self, prompt: str | Sequence[Mapping[str, Any]], completions: Sequence[str]
    ) -> list[float]:
        return list(self.scores)


@pytest.mark.parametrize("scores", [[0.0, 1.0], [0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0]])
def test_a_scorer_with_a_wrong_count_or_non_finite_score_leaves_the_group_unscored(
    scores: list[float],
) -> None:
    from palaestra.judges.base import JudgeError

    replies = ["Final: 19", "Final: 18", "Final: 17"]
    dropping = LearnedJudge(Fixed(scores))
    group = group_of(replies)
    assert asyncio.run(dropping.score_group(group)) is None
    assert dropping.usage.unscored == 1 and all(t.reward == 0.0 for t in group.trajectories)
    raising = LearnedJudge(Fixed(scores), on_failure="raise")
    with pytest.raises(JudgeError, match=r"scorer fixed returned \[.*\] for 3 completions"):
        asyncio.run(raising.score_group(group_of(replies)))
    # the right count of finite scores is used (in presentation order, a seeded shuffle)
    assert sorted(rewards(LearnedJudge(Fixed([0.0, 1.0, 2.0]), min_span=0.0), replies)) == [0.0, 0.5, 1.0]


def test_min_span_must_not_be_negative_and_no_scores_map_to_none() -> None:
    with pytest.raises(ValueError, match=r"min_span must be >= 0, got -0\.5"):
        LearnedJudge(Fixed([]), min_span=-0.5)
    assert relative_scores([], 1.0) == []


def test_raw_and_absolute_scores_are_recorded_and_the_fingerprint_is_the_version() -> None:
    rm = small_rm()
    judge = LearnedJudge(rm)
    scored = asyncio.run(judge.score_group(group_of(REPLIES[:2])))
    assert scored is not None
    raw = rm.score_texts(PROMPT, REPLIES[:2])
    for t, r in zip(scored.trajectories, raw):
        assert t.metrics["judge_raw"] == pytest.approx(r, rel=1e-5)
        assert t.metrics["judge_absolute"] == pytest.approx(1 / (1 + np.exp(-r)), rel=1e-5)
    assert scored.metrics["judge_absolute_n"] == 2
    assert rm.fingerprint in judge.info()["prompt_version"] and judge.info()["fingerprint"] == rm.fingerprint
    other = small_rm(seed=1)
    assert LearnedJudge(other).cache_key() != judge.cache_key()


def test_cached_group_makes_no_model_call(tmp_path: Path) -> None:
    with JudgeCache(tmp_path / "cache.sqlite") as cache:
        judge = LearnedJudge(small_rm(), cache=cache)
        first = rewards(judge, REPLIES)
        assert judge.scorer_calls == 1
        group = group_of(list(reversed(REPLIES)))  # same content, other order
        again = asyncio.run(judge.score_group(group))
        assert again is not None
        assert judge.scorer_calls == 1  # served from the cache
        assert again.metrics["judge_cache_hit"] == 1
        assert [t.reward for t in again.trajectories] == list(reversed(first))
        assert "judge_raw" in again.trajectories[0].metrics


def test_experiment_config_builds_the_learned_judge(tmp_path: Path) -> None:
    from palaestra.trainer.builders import build_reward, reward_info
    from palaestra.trainer.expconfig import config_from_dict

    path = tmp_path / "rm.npz"
    small_rm().save(path)
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(tmp_path / "run")},
            "reward": {"kind": "learned_judge", "learned": {"model": str(path)}, "judge_cache": "off"},
        }
    )
    judge = build_reward(cfg, tmp_path)
    assert isinstance(judge, LearnedJudge) and judge.cache is None
    info = reward_info(cfg, judge)
    assert (
        info["kind"] == "learned_judge" and info["judge"]["fingerprint"] == RewardModel.load(path).fingerprint
    )


def test_rm_pairs_from_rankings_train_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a "judge" ranking: prefers the right answer, and explanations among right answers
    groups = []
    for a, b in [(12, 7), (30, 5), (4, 9), (21, 13), (8, 8), (40, 2)] * 4:
        right = a + b
        replies = [f"Final: {right}", f"Final: {right} since {a}+{b}={right}", f"Final: {right + 1}"]
        g = TrajectoryGroup(
            [
                Trajectory(
                    messages_and_choices=[
                        {"role": "user", "content": f"What is {a}+{b}? Reply with one line: Final: <int>"},
                        {"role": "assistant", "content": r},
                    ],
                    reward=s,
                )
                for r, s in zip(replies, [0.7, 1.0, 0.0])
            ],
            metadata={"judge": "ruler:some-model"},
        )
        groups.append(g)
    write_groups(tmp_path / "groups.jsonl", groups)
    assert (
        main(
            [
                "rm",
                "pairs",
                "--from-rankings",
                str(tmp_path / "groups.jsonl"),
                "--out",
                str(tmp_path / "p.jsonl"),
            ]
        )
        == 0
    )
    pairs = read_pairs(tmp_path / "p.jsonl")
    assert len(pairs) == 3 * len(groups)
    first = pairs[0]
    assert "since" in first.chosen and first.rejected.endswith(str(12 + 7 + 1))  # largest gap first
    assert {p.extra["source"] for p in pairs if p.extra} == {"ruler:some-model"}

    out = tmp_path / "rm"
    code = main(
        [
            "rm",
            "train",
            "--pairs",
            str(tmp_path / "p.jsonl"),
            "--outdir",
            str(out),
            "--epochs",
            "1",
            "--heldout",
            "0.25",
        ]
    )
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert 0.0 <= manifest["heldout_pair_accuracy"] <= 1.0 and manifest["training"]["heldout_pairs"] > 0
    assert manifest["fingerprint"] == RewardModel.load(out / "reward_model.npz").fingerprint
    capsys.readouterr()
    code = main(
        [
            "rm",
            "eval",
            "--model",
            str(out / "reward_model.npz"),
            "--pairs",
            str(tmp_path / "p.jsonl"),
            "--policy",
            "arith-base",
            "--limit",
            "5",
            "--samples",
            "4",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["pairs"]["pair_accuracy"] <= 1.0
    agreement = result["verifier_agreement"]
    assert agreement["verifier"].startswith("arith-strict") and agreement["samples_per_example"] == 4


def test_annotator_prefers_correct_then_shown_work_with_seeded_noise() -> None:
    from palaestra.envs.annotator import Annotator, show_work_variant

    ex = {"prompt": PROMPT, "expected_answer": "19"}
    clean = Annotator(noise=0.0)
    assert clean.prefer(ex, "Final: 19", "Final: 18") == 0
    assert clean.prefer(ex, "Final: 19", "Final: 19 since 12+7=19") == 1  # shown work wins among correct
    assert clean.prefer(ex, "Final: 18 since 12+7=18", "Final: 18") == 0  # the equation is not checked
    assert clean.prefer(ex, "Final: 18", "Final: 17") is None  # equal quality: no label
    assert show_work_variant(ex, "Final: 18") == "Final: 18 since 12+7=18"
    noisy = Annotator(noise=0.3, seed=5)
    labels = [noisy.prefer(ex, "Final: 19", f"Final: {n}", key=str(n)) for n in range(20, 220)]
    assert labels == [noisy.prefer(ex, "Final: 19", f"Final: {n}", key=str(n)) for n in range(20, 220)]
    flipped = sum(label == 1 for label in labels) / len(labels)
    assert 0.2 < flipped < 0.4  # about the noise rate, the same on every call


def test_annotator_edges_unreadable_answers_and_bad_noise() -> None:
    from palaestra.envs.annotator import Annotator, lenient_answer, show_work_variant

    ex = {"prompt": PROMPT, "expected_answer": "19"}
    assert lenient_answer("Final: 007 and more") == "7"
    huge = "Final: " + "9" * 5000  # more digits than int() reads: no answer, not an exception
    assert lenient_answer(huge) is None and Annotator(noise=0.0).tier(ex, huge) == (False, False)
    assert show_work_variant(ex, "I think nineteen") is None  # no answer to explain
    assert show_work_variant({"prompt": "Add twelve and seven."}, "Final: 19") is None  # no question to quote
    assert show_work_variant({}, "Final: 19") is None
    for noise in (-0.01, 0.5, 0.9):
        with pytest.raises(ValueError, match=rf"noise must be in \[0, 0\.5\), got {noise}"):
            Annotator(noise=noise)
