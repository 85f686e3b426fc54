"""Group-relative advantages and ranking-to-pairs against hand-derived values."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.trainer.advantages import (
    ADVANTAGE_MODES,
    batch_advantages,
    group_advantages,
    ranking_to_pairs,
)

# --------------------------------------------------------------------------- single group, by hand


def test_grpo_one_correct_of_four() -> None:
    # mean 0.25, deviations (.75, -.25, -.25, -.25), sample var = (.5625 + 3 * .0625) / 3 = .25, std .5
    np.testing.assert_allclose(group_advantages([1, 0, 0, 0], "grpo", eps=0.0), [1.5, -0.5, -0.5, -0.5])
    np.testing.assert_allclose(
        group_advantages([1, 0, 0, 0]), np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4), rtol=1e-12
    )


def test_grpo_pair_and_triple() -> None:
    # [1, 0]: std = sqrt(.5), A = +-.5 / sqrt(.5) = +-1/sqrt(2)
    np.testing.assert_allclose(group_advantages([1.0, 0.0], eps=0.0), [1 / math.sqrt(2), -1 / math.sqrt(2)])
    # [0, 1, 2]: mean 1, std 1
    np.testing.assert_allclose(
        group_advantages([0, 1, 2], eps=1e-4), [-1 / 1.0001, 0.0, 1 / 1.0001], rtol=1e-12
    )


def test_grpo_with_ties() -> None:
    # [1, 1, 0]: mean 2/3, var = (1/9 + 1/9 + 4/9) / 2 = 1/3
    std = math.sqrt(1 / 3)
    np.testing.assert_allclose(group_advantages([1, 1, 0], eps=0.0), [1 / 3 / std, 1 / 3 / std, -2 / 3 / std])


def test_dr_grpo_and_rloo_by_hand() -> None:
    np.testing.assert_allclose(group_advantages([1, 0, 0, 0], "dr_grpo"), [0.75, -0.25, -0.25, -0.25])
    np.testing.assert_allclose(group_advantages([3.0, 1.0], "dr_grpo"), [1.0, -1.0])
    # rloo: r_i minus the mean of the others
    np.testing.assert_allclose(group_advantages([1, 0, 0, 0], "rloo"), [1.0, -1 / 3, -1 / 3, -1 / 3])
    np.testing.assert_allclose(group_advantages([0, 1, 2], "rloo"), [-1.5, 0.0, 1.5])
    # eps plays no role without std division
    np.testing.assert_array_equal(
        group_advantages([0, 1, 2], "rloo", eps=5.0), group_advantages([0, 1, 2], "rloo")
    )


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_group_of_one_and_empty(mode: str) -> None:
    np.testing.assert_array_equal(group_advantages([0.7], mode), [0.0])
    assert group_advantages([], mode).shape == (0,)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("value", [0.1, 1 / 3, -7.3, 0.0, 1e9])
def test_all_equal_group_is_exactly_zero(mode: str, value: float) -> None:
    adv = group_advantages([value] * 7, mode)
    assert np.all(adv == 0.0)
    assert group_advantages([value] * 3, "batch_std", batch_std=0.4).tolist() == [0.0, 0.0, 0.0]


def test_single_group_batch_std_needs_the_batch_std() -> None:
    with pytest.raises(ValueError, match="batch_std"):
        group_advantages([1, 0], "batch_std")
    np.testing.assert_allclose(group_advantages([1, 0], "batch_std", eps=0.0, batch_std=0.25), [2.0, -2.0])
    with pytest.raises(ValueError, match="only used with mode='batch_std'"):
        group_advantages([1, 0], "grpo", batch_std=0.5)
    with pytest.raises(ValueError, match="batch_std"):
        group_advantages([1, 0], "batch_std", batch_std=float("nan"))


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages([1, 0], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        group_advantages([1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages([[1.0, 0.0]])
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1.0, 0.0], eps=-1.0)
    with pytest.raises(ValueError, match=r"groups\[1\]\[0\]|groups\[1\]"):
        batch_advantages([[1.0, 0.0], [float("inf"), 0.0]])


# --------------------------------------------------------------------------- properties


rewards_lists = st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(rewards_lists)
def test_rloo_matches_leave_one_out_definition(rewards: list[float]) -> None:
    r = np.array(rewards)
    expected = [r[i] - (r.sum() - r[i]) / (len(r) - 1) for i in range(len(r))]
    if np.all(r == r[0]):
        expected = [0.0] * len(r)
    np.testing.assert_allclose(group_advantages(r, "rloo"), expected, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(rewards_lists, st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_advantages_sum_to_zero_and_keep_order(rewards: list[float], mode: str) -> None:
    adv = group_advantages(rewards, mode)  # type: ignore[arg-type]
    assert abs(adv.sum()) < 1e-6 * (1 + np.abs(adv).sum())
    r = np.array(rewards)
    # a higher reward never gets a lower advantage
    order = np.argsort(r, kind="stable")
    assert np.all(np.diff(adv[order]) >= -1e-9)


# --------------------------------------------------------------------------- batched


def test_batch_std_pools_all_rewards() -> None:
    groups = [[1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    # pooled [1,0,0,0,0,1]: mean 1/3, sample var = (2*(2/3)^2 + 4*(1/3)^2)/5 = 4/15
    std = math.sqrt(4 / 15)
    res = batch_advantages(groups, "batch_std", eps=0.0)
    assert res.batch_std == pytest.approx(std)
    np.testing.assert_allclose(res.advantages[0], [0.5 / std, -0.5 / std])
    np.testing.assert_allclose(res.advantages[1], np.array([-0.25, -0.25, -0.25, 0.75]) / std)
    # identical to the single-group form given the batch std
    np.testing.assert_allclose(
        res.advantages[1], group_advantages(groups[1], "batch_std", eps=0.0, batch_std=std)
    )


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_batch_matches_single_group_form(mode: str) -> None:
    groups = [[1, 0, 0, 1], [0.5, 0.25], [2, 2], [3]]
    res = batch_advantages(groups, mode)  # type: ignore[arg-type]
    for g, adv in zip(groups, res.advantages):
        kw = {"batch_std": res.batch_std} if mode == "batch_std" else {}
        np.testing.assert_allclose(adv, group_advantages(g, mode, **kw))  # type: ignore[arg-type]


def test_zero_std_groups_counted_and_dropped_on_request() -> None:
    groups = [[1, 1], [0, 1], [5], [], [2, 2, 2], [0.5, 0.0, 0.25]]
    res = batch_advantages(groups)
    assert res.zero_std == (0, 2, 3, 4)
    assert res.frac_zero_std == pytest.approx(4 / 6)
    assert res.kept == (0, 1, 2, 3, 4, 5)
    assert all(np.all(res.advantages[i] == 0.0) for i in res.zero_std)
    dropped = batch_advantages(groups, drop_zero_std=True)
    assert dropped.kept == (1, 5)
    assert dropped.frac_zero_std == res.frac_zero_std
    assert [a.tolist() for a in (dropped.advantages[g] for g in dropped.kept)] == [
        res.advantages[1].tolist(),
        res.advantages[5].tolist(),
    ]
    assert dropped.metrics["groups"] == 6 and dropped.metrics["groups_kept"] == 2


def test_dropping_never_changes_the_kept_groups_in_batch_std_mode() -> None:
    groups = [[1, 1, 1], [0, 1, 0], [0.2, 0.9]]
    keep_all = batch_advantages(groups, "batch_std")
    drop = batch_advantages(groups, "batch_std", drop_zero_std=True)
    assert drop.kept == (1, 2)
    for g in drop.kept:
        np.testing.assert_array_equal(drop.advantages[g], keep_all.advantages[g])


def test_empty_batch() -> None:
    res = batch_advantages([], "batch_std")
    assert res.advantages == () and res.kept == () and res.frac_zero_std == 0.0
    assert res.metrics["adv_abs_mean"] == 0.0
    assert res.batch_std == 0.0  # no pair of rewards: no spread (not a made-up unit std)


def test_batch_std_divides_by_the_batch_std_plus_eps() -> None:
    # eps is added to the given std: (+-0.5) / (0.25 + 0.25)
    np.testing.assert_allclose(group_advantages([1, 0], "batch_std", eps=0.25, batch_std=0.25), [1.0, -1.0])
    res = batch_advantages([[1.0, 0.0], [0.0, 0.0, 0.0, 1.0]], "batch_std", eps=0.1)
    std = math.sqrt(4 / 15)  # the pooled sample std of test_batch_std_pools_all_rewards
    np.testing.assert_allclose(res.advantages[0], [0.5 / (std + 0.1), -0.5 / (std + 0.1)], rtol=1e-12)
    # a batch of one reward has no spread: batch_std 0, advantage 0; other modes report no batch std
    one = batch_advantages([[0.3]], "batch_std")
    assert one.batch_std == 0.0 and one.advantages[0].tolist() == [0.0]
    assert batch_advantages([[1.0, 0.0]], "grpo").batch_std is None


def test_advantage_result_is_immutable() -> None:
    res = batch_advantages([[1.0, 0.0]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.kept = ()  # type: ignore[misc]


# --------------------------------------------------------------------------- ranking -> pairs


def test_all_pairs_skip_ties_and_order_by_gap() -> None:
    r = [0.25, 1.0, 0.5, 1.0]
    # gaps: (1,0)=.75 (3,0)=.75 (1,2)=.5 (3,2)=.5 (2,0)=.25; (1,3) is a tie
    assert ranking_to_pairs(r) == [(1, 0), (3, 0), (1, 2), (3, 2), (2, 0)]
    assert ranking_to_pairs(r, max_pairs=3) == [(1, 0), (3, 0), (1, 2)]
    assert ranking_to_pairs(r, min_margin=0.5) == [(1, 0), (3, 0)]  # a gap of exactly .5 does not qualify
    assert ranking_to_pairs(r, max_pairs=0) == []


def test_best_vs_rest() -> None:
    r = [0.25, 1.0, 0.5, 1.0]
    assert ranking_to_pairs(r, strategy="best_vs_rest") == [(1, 0), (1, 2)]
    assert ranking_to_pairs([3.0, 1.0, 2.0], strategy="best_vs_rest", min_margin=1.5) == [(0, 1)]
    # every other trajectory is compared, the last one included
    assert ranking_to_pairs([1.0, 0.0], strategy="best_vs_rest") == [(0, 1)]
    assert ranking_to_pairs([2.0, 0.5, 1.0, 0.0], strategy="best_vs_rest") == [(0, 3), (0, 1), (0, 2)]


def test_equal_gaps_order_by_chosen_then_rejected_index() -> None:
    # r = [1, 2, 1, 0]: gap 2 for (1, 3); gap 1 for (0, 3), (1, 0), (1, 2), (2, 3)
    assert ranking_to_pairs([1.0, 2.0, 1.0, 0.0]) == [(1, 3), (0, 3), (1, 0), (1, 2), (2, 3)]


def test_degenerate_groups_give_no_pairs() -> None:
    assert ranking_to_pairs([]) == []
    assert ranking_to_pairs([0.4]) == []
    assert ranking_to_pairs([0.4, 0.4, 0.4]) == []
    assert ranking_to_pairs([0.4, 0.4], strategy="best_vs_rest") == []


def test_ranking_to_pairs_errors() -> None:
    with pytest.raises(ValueError, match="min_margin"):
        ranking_to_pairs([1, 0], min_margin=-0.1)
    with pytest.raises(ValueError, match="max_pairs"):
        ranking_to_pairs([1, 0], max_pairs=-1)
    with pytest.raises(ValueError, match="strategy"):
        ranking_to_pairs([1, 0], strategy="adjacent")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rewards\[0\]"):
        ranking_to_pairs([float("nan"), 0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=9))
def test_all_pairs_are_exactly_the_strictly_ordered_pairs(scores: list[int]) -> None:
    pairs = ranking_to_pairs([float(s) for s in scores])
    expected = {(i, j) for i in range(len(scores)) for j in range(len(scores)) if scores[i] > scores[j]}
    assert set(pairs) == expected and len(pairs) == len(expected)
    assert pairs == ranking_to_pairs([float(s) for s in scores])  # deterministic


def test_non_numeric_rewards_are_named() -> None:
    # a judge or reward function handing back text or a ragged list: the error names the argument
    with pytest.raises(ValueError, match=r"rewards: expected a 1-D sequence of numbers \(could not convert"):
        group_advantages(["0.5", "high"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"rewards: expected a 1-D sequence of numbers \(.*inhomogeneous"):
        group_advantages([[1.0, 0.0], [1.0]])  # type: ignore[list-item]
