"""Clipped surrogate, k3 KL, aggregation modes and DPO: hand-derived values and finite differences."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.trainer.losses import AGG_MODES, dpo_loss, kl_k3, kl_k3_grad, policy_loss

# --------------------------------------------------------------------------- k3


def test_k3_of_equal_policies_is_zero() -> None:
    lp = np.log(np.array([[0.5, 0.1, 0.999], [1e-6, 0.3, 0.7]]))
    assert np.all(kl_k3(lp, lp) == 0.0)
    assert np.all(kl_k3_grad(lp, lp) == 0.0)


def test_k3_by_hand() -> None:
    # ref prob half the policy's: d = ref - logp = -ln 2 -> 0.5 + ln 2 - 1; grad 1 - 0.5
    assert kl_k3(math.log(0.5), math.log(0.25)) == pytest.approx(0.5 + math.log(2) - 1, rel=1e-12)
    assert kl_k3_grad(math.log(0.5), math.log(0.25)) == pytest.approx(0.5)
    # ref prob twice the policy's: d = ln 2 -> 2 - ln 2 - 1; grad 1 - 2
    assert kl_k3(math.log(0.25), math.log(0.5)) == pytest.approx(1 - math.log(2), rel=1e-12)
    assert kl_k3_grad(math.log(0.25), math.log(0.5)) == pytest.approx(-1.0)


@settings(max_examples=80, deadline=None)
@given(st.floats(-30, 0), st.floats(-30, 0))
def test_k3_nonnegative_and_gradient_matches_finite_difference(logp: float, ref: float) -> None:
    assert kl_k3(logp, ref) >= 0.0
    h = 1e-6
    fd = (kl_k3(logp + h, ref) - kl_k3(logp - h, ref)) / (2 * h)
    g = float(kl_k3_grad(logp, ref))
    assert fd == pytest.approx(g, rel=1e-4, abs=1e-4 * (1 + abs(g)))


# --------------------------------------------------------------------------- clipped surrogate, one token


@pytest.mark.parametrize(
    ("adv", "ratio", "loss", "grad", "clip_low_frac", "clip_high_frac"),
    [
        (1.0, 1.5, -1.28, 0.0, 0.0, 1.0),  # A>0 above 1+clip_high: clipped, no gradient
        (1.0, 1.1, -1.1, -1.1, 0.0, 0.0),  # inside the range
        (1.0, 0.5, -0.5, -0.5, 0.0, 0.0),  # A>0 below 1-clip_low: unclipped term is the min, gradient flows
        (-1.0, 0.5, 0.8, 0.0, 1.0, 0.0),  # A<0 below 1-clip_low: clipped, no gradient
        (-1.0, 0.9, 0.9, 0.9, 0.0, 0.0),  # inside
        (-1.0, 1.5, 1.5, 1.5, 0.0, 0.0),  # A<0 above 1+clip_high: unclipped is pessimistic, gradient flows
        (2.0, 1.3, -2.56, 0.0, 0.0, 1.0),  # |A| scales the clipped value
        (-2.0, 0.7, 1.6, 0.0, 1.0, 0.0),
        (0.0, 3.0, 0.0, 0.0, 0.0, 0.0),
    ],
)
def test_single_token_both_sides_of_the_clip(
    adv: float, ratio: float, loss: float, grad: float, clip_low_frac: float, clip_high_frac: float
) -> None:
    old = np.array([[-1.0]])
    res = policy_loss(old + math.log(ratio), old, None, [adv], [[True]], clip_low=0.2, clip_high=0.28)
    assert res.loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
    assert res.dlogp[0, 0] == pytest.approx(grad, rel=1e-12, abs=1e-12)
    assert res.metrics["clip_low_frac"] == clip_low_frac
    assert res.metrics["clip_high_frac"] == clip_high_frac
    assert res.metrics["clip_frac"] == clip_low_frac + clip_high_frac
    assert res.metrics["ratio_mean"] == pytest.approx(ratio)


def test_symmetric_clip_when_clip_high_equals_clip_low() -> None:
    old = np.zeros((1, 1))
    res = policy_loss(old + math.log(1.25), old, None, [1.0], [[1]], clip_low=0.2, clip_high=0.2)
    assert res.loss == pytest.approx(-1.2) and res.dlogp[0, 0] == 0.0


def test_clip_low_zero_is_allowed() -> None:
    # clip_low = 0: the ratio of a negative-advantage token cannot fall below 1; A = -1, ratio 0.5 -> loss 1
    old = np.zeros((1, 1))
    res = policy_loss(old + math.log(0.5), old, None, [-1.0], [[True]], clip_low=0.0)
    assert res.loss == pytest.approx(1.0) and res.dlogp[0, 0] == 0.0
    assert res.metrics["clip_low_frac"] == 1.0


def test_clip_and_ratio_metrics_over_several_tokens() -> None:
    # (A, ratio): (1, 1.5) clipped high; (-1, 0.5) clipped low; (1, 1.1) inside; (0.5, 2.0) clipped high;
    # (-1, 0.9) inside -> 2 of 5 high, 1 of 5 low; ratios mean 6 / 5, min 0.5, max 2
    ratios = np.array([[1.5, 0.5, 1.1, 2.0, 0.9]])
    adv = np.array([[1.0, -1.0, 1.0, 0.5, -1.0]])
    old = np.full((1, 5), -2.0)
    res = policy_loss(old + np.log(ratios), old, None, adv, np.ones((1, 5), dtype=bool))
    assert res.metrics["clip_high_frac"] == pytest.approx(2 / 5)
    assert res.metrics["clip_low_frac"] == pytest.approx(1 / 5)
    assert res.metrics["clip_frac"] == pytest.approx(3 / 5)
    assert res.metrics["ratio_mean"] == pytest.approx(6 / 5)
    assert res.metrics["ratio_min"] == pytest.approx(0.5) and res.metrics["ratio_max"] == pytest.approx(2.0)


# --------------------------------------------------------------------------- aggregation by hand

MASK = np.array([[1, 1, 0], [1, 0, 0]], dtype=bool)
ADV = np.array([1.0, -3.0])  # ratio 1: per-token loss -A -> row 0: -1, -1; row 1: +3


@pytest.mark.parametrize(
    ("agg", "const", "loss", "grad_row0", "grad_row1"),
    [
        ("token_mean", None, (-2 + 3) / 3, -1 / 3, 3 / 3),
        ("seq_mean_token_mean", None, (-1 + 3) / 2, -1 / (2 * 2), 3 / (2 * 1)),
        ("seq_sum_constant", None, (-2 + 3) / (2 * 3), -1 / 6, 3 / 6),
        ("seq_sum_constant", 10, (-2 + 3) / (2 * 10), -1 / 20, 3 / 20),
    ],
)
def test_aggregation_modes_by_hand(
    agg: str, const: int | None, loss: float, grad_row0: float, grad_row1: float
) -> None:
    logp = np.full((2, 3), -0.7)
    res = policy_loss(logp, logp, None, ADV, MASK, agg=agg, max_tokens_constant=const)  # type: ignore[arg-type]
    assert res.loss == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(res.dlogp, [[grad_row0, grad_row0, 0.0], [grad_row1, 0.0, 0.0]], rtol=1e-12)
    assert res.metrics["tokens"] == 3 and res.metrics["seqs"] == 2


def test_single_sequence_weights_and_constant_of_one() -> None:
    # B = 1, two trainable tokens, A = 2 at ratio 1: per-token loss -2
    logp = np.full((1, 3), -0.7)
    mask = np.array([[True, True, False]])
    res = policy_loss(logp, logp, None, [2.0], mask, agg="seq_mean_token_mean")  # w = 1 / (1 * 2)
    assert res.loss == pytest.approx(-2.0)
    np.testing.assert_allclose(res.dlogp, [[-1.0, -1.0, 0.0]])
    res = policy_loss(logp, logp, None, [2.0], mask, agg="seq_sum_constant")  # w = 1 / (1 * T), T = 3
    assert res.loss == pytest.approx(-4 / 3)
    res = policy_loss(logp, logp, None, [2.0], mask, agg="seq_sum_constant", max_tokens_constant=1)  # w = 1
    assert res.loss == pytest.approx(-4.0)
    np.testing.assert_allclose(res.dlogp, [[-2.0, -2.0, 0.0]])


def test_integer_mask_and_rows_without_tokens() -> None:
    logp = np.full((2, 3), -0.7)
    as_bool = policy_loss(logp, logp, None, ADV, MASK)
    as_int = policy_loss(logp, logp, None, ADV, MASK.astype(np.int64))  # 0/1 integers mean the same
    assert as_int.loss == as_bool.loss
    np.testing.assert_array_equal(as_int.dlogp, as_bool.dlogp)
    one_row = policy_loss(logp, logp, None, ADV, [[1, 1, 1], [0, 0, 0]])
    assert one_row.metrics["seqs"] == 1.0 and one_row.metrics["tokens"] == 3.0


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_empty_batches_give_zero_in_every_mode(agg: str, shape: tuple[int, int]) -> None:
    z = np.zeros(shape)
    res = policy_loss(z, z, None, np.zeros(shape[0]), np.zeros(shape, dtype=bool), agg=agg)  # type: ignore[arg-type]
    assert res.loss == 0.0 and res.dlogp.shape == shape


def test_kl_metric_is_the_token_mean_k3() -> None:
    k3 = 0.5 + math.log(2) - 1  # policy prob 0.5, reference 0.25 (test_k3_by_hand)
    lp = np.full((1, 1), math.log(0.5))
    res = policy_loss(lp, lp, np.full((1, 1), math.log(0.25)), [1.0], [[1]])
    assert res.metrics["kl"] == pytest.approx(k3) and res.metrics["kl_loss"] == pytest.approx(k3)
    none = policy_loss(lp, lp, np.full((1, 1), math.log(0.25)), [1.0], [[0]])
    assert none.metrics["kl"] == 0.0 and none.metrics["kl_loss"] == 0.0


def test_reference_with_zero_beta_never_touches_loss_or_gradient() -> None:
    # a reference far above the policy: k3 overflows to inf, which kl_beta = 0 must not turn into nan
    lp = np.full((1, 1), -800.0)
    res = policy_loss(lp, lp, np.zeros((1, 1)), [1.0], [[1]], kl_beta=0.0)
    assert res.metrics["kl"] == math.inf
    assert res.loss == -1.0 and res.dlogp[0, 0] == -1.0


def test_kl_term_added_with_beta() -> None:
    logp = np.full((2, 3), math.log(0.5))
    ref = np.full((2, 3), math.log(0.25))
    k3 = 0.5 + math.log(2) - 1
    res = policy_loss(logp, logp, ref, ADV, MASK, kl_beta=0.1)
    assert res.loss == pytest.approx(1 / 3 + 0.1 * k3, rel=1e-12)
    assert res.metrics["kl"] == pytest.approx(k3) and res.metrics["pg_loss"] == pytest.approx(1 / 3)
    # gradient of the KL part: beta * (1 - exp(ref - logp)) / N = 0.1 * 0.5 / 3
    np.testing.assert_allclose(res.dlogp[MASK], np.array([-1, -1, 3]) / 3 + 0.1 * 0.5 / 3, rtol=1e-12)
    # beta 0: reference only reported
    res0 = policy_loss(logp, logp, ref, ADV, MASK, kl_beta=0.0)
    assert res0.loss == pytest.approx(1 / 3) and res0.metrics["kl"] == pytest.approx(k3)
    same = policy_loss(logp, logp, logp, ADV, MASK, kl_beta=0.5)
    assert same.metrics["kl"] == 0.0 and same.loss == pytest.approx(1 / 3)


# --------------------------------------------------------------------------- finite differences


def _fd_case(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    b, t = 4, 6
    logp = rng.uniform(-3.0, -0.05, size=(b, t))
    old = logp + rng.uniform(-0.6, 0.6, size=(b, t))
    ratio = np.exp(logp - old)
    # keep every ratio well away from the clip boundaries so the loss is smooth at the point
    for bound in (0.8, 1.28):
        near = np.abs(ratio - bound) < 1e-3
        old[near] -= 0.01
        ratio = np.exp(logp - old)
    ref = logp + rng.uniform(-0.5, 0.5, size=(b, t))
    adv = rng.normal(size=(b,))
    mask = rng.uniform(size=(b, t)) < 0.7
    mask[0] = True
    mask[1, 3:] = False
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dlogp_matches_finite_difference(agg: str, seed: int) -> None:
    logp, old, ref, adv, mask = _fd_case(seed)
    kw = {"clip_low": 0.2, "clip_high": 0.28, "kl_beta": 0.3, "agg": agg}
    res = policy_loss(logp, old, ref, adv, mask, **kw)  # type: ignore[arg-type]
    assert 0.0 < res.metrics["clip_frac"] < 1.0  # both clipped and unclipped tokens are exercised
    h = 1e-6
    fd = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        up, dn = logp.copy(), logp.copy()
        up[idx] += h
        dn[idx] -= h
        lu = policy_loss(up, old, ref, adv, mask, **kw).loss  # type: ignore[arg-type]
        ld = policy_loss(dn, old, ref, adv, mask, **kw).loss  # type: ignore[arg-type]
        fd[idx] = (lu - ld) / (2 * h)
    np.testing.assert_allclose(res.dlogp, fd, rtol=1e-5, atol=1e-8)
    assert np.all(res.dlogp[~mask] == 0.0)


def test_per_token_advantages_match_broadcast_per_sequence() -> None:
    logp, old, ref, adv, mask = _fd_case(3)
    a = policy_loss(logp, old, ref, adv, mask, kl_beta=0.1)
    b = policy_loss(logp, old, ref, np.repeat(adv[:, None], logp.shape[1], axis=1), mask, kl_beta=0.1)
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.dlogp, b.dlogp)


# --------------------------------------------------------------------------- masked, non-finite, errors


def test_masked_positions_are_ignored_even_if_nan() -> None:
    logp, old, ref, adv, mask = _fd_case(4)
    clean = policy_loss(logp, old, ref, adv, mask, kl_beta=0.2)
    dirty = [x.copy() for x in (logp, old, ref)]
    for x in dirty:
        x[~mask] = np.nan
    res = policy_loss(dirty[0], dirty[1], dirty[2], adv, mask, kl_beta=0.2)
    assert res.loss == clean.loss
    np.testing.assert_array_equal(res.dlogp, clean.dlogp)


def test_nonfinite_old_logp_is_on_policy_or_raises() -> None:
    logp = np.log(np.array([[0.5, 0.4, 0.3]]))
    old = np.log(np.array([[0.25, 0.4, 0.3]]))
    bad = old.copy()
    bad[0, 0] = -np.inf
    res = policy_loss(logp, bad, None, [1.0], [[1, 1, 1]])
    on_policy = old.copy()
    on_policy[0, 0] = logp[0, 0]
    expected = policy_loss(logp, on_policy, None, [1.0], [[1, 1, 1]])
    assert res.loss == expected.loss == pytest.approx(-1.0)
    np.testing.assert_array_equal(res.dlogp, expected.dlogp)
    assert res.metrics["nonfinite_old"] == 1.0 and expected.metrics["nonfinite_old"] == 0.0
    bad[0, 1] = np.nan
    assert policy_loss(logp, bad, None, [1.0], [[1, 1, 1]]).metrics["nonfinite_old"] == 2.0
    with pytest.raises(ValueError, match=r"old_logp\[0, 0\]"):
        policy_loss(logp, bad, None, [1.0], [[1, 1, 1]], nonfinite_old="raise")


def test_no_trainable_tokens_gives_zero() -> None:
    logp = np.full((2, 2), -1.0)
    res = policy_loss(logp, logp - 0.3, logp, [1.0, -1.0], np.zeros((2, 2), dtype=bool), kl_beta=0.1)
    assert res.loss == 0.0 and np.all(res.dlogp == 0.0)
    assert res.metrics["tokens"] == 0.0 and res.metrics["clip_frac"] == 0.0
    empty = policy_loss(np.zeros((0, 4)), np.zeros((0, 4)), None, np.zeros(0), np.zeros((0, 4), dtype=bool))
    assert empty.loss == 0.0 and empty.dlogp.shape == (0, 4)


def test_policy_loss_errors() -> None:
    lp = np.full((1, 2), -1.0)
    m = [[1, 1]]
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(lp, lp, None, [1.0], m, kl_beta=0.1)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(lp, lp, None, [1.0], m, agg="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens_constant"):
        policy_loss(lp, lp, None, [1.0], m, max_tokens_constant=8)
    with pytest.raises(ValueError, match="max_tokens_constant"):
        policy_loss(lp, lp, None, [1.0], m, agg="seq_sum_constant", max_tokens_constant=0)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, lp, None, [1.0], [[1, 2]])
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, lp, None, [1.0], [[1, 1, 1]])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, None, [1.0, 2.0], m)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(lp, np.zeros((2, 2)), None, [1.0], m)
    with pytest.raises(ValueError, match=r"logp\[0, 1\]"):
        policy_loss(np.array([[-1.0, np.nan]]), lp, None, [1.0], m)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(lp, lp, None, [1.0], m, clip_low=1.0)
    with pytest.raises(ValueError, match="kl_beta"):
        policy_loss(lp, lp, lp, [1.0], m, kl_beta=-0.1)


def test_huge_ratio_with_negative_advantage_is_not_hidden() -> None:
    old = np.array([[-900.0]])
    res = policy_loss(np.array([[-1.0]]), old, None, [-1.0], [[1]])
    assert res.loss == math.inf and res.metrics["ratio_max"] == math.inf
    pos = policy_loss(np.array([[-1.0]]), old, None, [1.0], [[1]])
    assert pos.loss == pytest.approx(-1.28) and pos.dlogp[0, 0] == 0.0


# --------------------------------------------------------------------------- DPO


def test_dpo_by_hand() -> None:
    # h_w = -1 - (-1.5) = .5, h_l = -2 - (-1.5) = -.5, z = .5 * 1 = .5
    res = dpo_loss(-1.0, -2.0, -1.5, -1.5, beta=0.5)
    assert res.loss == pytest.approx(math.log1p(math.exp(-0.5)), rel=1e-12)
    sig_neg = 1 / (1 + math.exp(0.5))
    assert float(res.dchosen) == pytest.approx(-0.5 * sig_neg, rel=1e-12)
    assert float(res.drejected) == pytest.approx(0.5 * sig_neg, rel=1e-12)
    assert res.metrics["margin"] == pytest.approx(0.5) and res.metrics["reward_accuracy"] == 1.0
    assert res.metrics["chosen_reward"] == pytest.approx(0.25)
    assert res.metrics["rejected_reward"] == pytest.approx(-0.25)


def test_dpo_default_beta_is_0_1() -> None:
    # h_w - h_l = 1 (test_dpo_by_hand), z = 0.1
    res = dpo_loss(-1.0, -2.0, -1.5, -1.5)
    assert res.loss == pytest.approx(math.log1p(math.exp(-0.1)), rel=1e-12)
    assert float(res.dchosen) == pytest.approx(-0.1 / (1 + math.exp(0.1)), rel=1e-12)


def test_dpo_equal_policy_and_reference_is_log2() -> None:
    x = np.array([-3.0, -5.0, -1.0, -2.0])
    res = dpo_loss(x, x - 1, x, x - 1, beta=0.1)
    assert res.loss == pytest.approx(math.log(2))
    assert res.metrics["reward_accuracy"] == 0.0 and res.metrics["margin"] == 0.0  # z = 0 is no win
    np.testing.assert_allclose(res.dchosen, -0.1 * 0.5 / 4)
    np.testing.assert_allclose(res.drejected, 0.1 * 0.5 / 4)


def test_dpo_is_stable_for_extreme_margins() -> None:
    res = dpo_loss([0.0, 0.0], [-1e4, 1e4], [0.0, 0.0], [0.0, 0.0], beta=0.1)
    assert np.isfinite(res.loss)
    assert res.loss == pytest.approx(1000.0 / 2, rel=1e-9)  # pair 1: z=+1000 -> ~0; pair 2: z=-1000 -> 1000
    np.testing.assert_allclose(res.dchosen, [0.0, -0.1 / 2], atol=1e-300)
    assert res.metrics["reward_accuracy"] == 0.5


def test_dpo_gradient_matches_finite_difference() -> None:
    rng = np.random.default_rng(7)
    pc, pr, rc, rr = (rng.uniform(-40, -5, size=6) for _ in range(4))
    beta = 0.2
    res = dpo_loss(pc, pr, rc, rr, beta)
    h = 1e-6
    for i in range(6):
        e = np.zeros(6)
        e[i] = h
        fd_c = (dpo_loss(pc + e, pr, rc, rr, beta).loss - dpo_loss(pc - e, pr, rc, rr, beta).loss) / (2 * h)
        fd_r = (dpo_loss(pc, pr + e, rc, rr, beta).loss - dpo_loss(pc, pr - e, rc, rr, beta).loss) / (2 * h)
        assert res.dchosen[i] == pytest.approx(fd_c, rel=1e-5, abs=1e-10)
        assert res.drejected[i] == pytest.approx(fd_r, rel=1e-5, abs=1e-10)


def test_dpo_errors_and_empty() -> None:
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(0.0, 0.0, 0.0, 0.0, beta=0.0)
    with pytest.raises(ValueError, match="ref_rejected_logp"):
        dpo_loss([0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0])
    with pytest.raises(ValueError, match=r"policy_rejected_logp\[1\]"):
        dpo_loss([0.0, 1.0], [0.0, np.nan], [0.0, 1.0], [0.0, 1.0])
    with pytest.raises(
        ValueError, match=r"policy_rejected_logp: shape \(1,\) does not match policy_chosen_logp's \(2,\)"
    ):
        dpo_loss([0.0, 1.0], [0.0], [0.0, 1.0], [0.0, 1.0])
    empty = dpo_loss([], [], [], [])
    assert empty.loss == 0.0 and empty.dchosen.shape == (0,) and empty.metrics["pairs"] == 0.0


def test_bad_option_values_are_named() -> None:
    lp = np.full((1, 2), -1.0)
    with pytest.raises(ValueError, match="nonfinite_old: expected 'ratio_one' or 'raise', got 'skip'"):
        policy_loss(lp, lp, None, [1.0], [[1, 1]], nonfinite_old="skip")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"policy_chosen_logp: expected a scalar or 1-D array, got shape \(1, 2\)"
    ):
        dpo_loss([[0.0, 1.0]], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0])
    with pytest.raises(
        ValueError, match=r"ref_rejected_logp: expected a scalar or 1-D array, got shape \(2, 1\)"
    ):
        dpo_loss([0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [[0.0], [1.0]])


def test_results_are_immutable() -> None:
    lp = np.zeros((1, 1))
    res = policy_loss(lp, lp, None, [1.0], [[1]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.loss = 0.0  # type: ignore[misc]
    dpo = dpo_loss(0.0, 0.0, 0.0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dpo.loss = 0.0  # type: ignore[misc]
