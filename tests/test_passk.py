"""Unbiased pass@k estimator: hand-computed values, exact binomials, edge cases and errors."""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.evals.passk import mean_pass_at_k, pass_at_k, pass_at_k_array


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 1, 0.3),  # k=1 is the fraction correct
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (6, 2, 3, 1 - 4 / 20),  # 1 - C(4,3)/C(6,3)
        (10, 0, 5, 0.0),  # nothing correct
        (10, 10, 1, 1.0),  # everything correct
        (5, 4, 2, 1.0),  # n - c < k: every draw of 2 holds a correct one
        (3, 1, 3, 1.0),  # k = n with one correct
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
    ],
)
def test_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 150).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_exact_binomial_formula(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-10, abs=1e-14)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_monotone_in_k_and_k1_is_fraction_correct(nc: tuple[int, int]) -> None:
    n, c = nc
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert values[0] == pytest.approx(c / n)
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(values))


def test_large_n_keeps_small_values_precise() -> None:
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5, rel=1e-10)
    assert pass_at_k(2000, 3, 10) == pytest.approx(
        float(1 - Fraction(comb(1997, 10), comb(2000, 10))), rel=1e-10
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((5, 2, 6), "k > n"),
        ((5, 6, 1), "c > n"),
        ((-1, 0, 1), "n: number of samples must be >= 0, got -1"),  # its own message, not that of c > n
        ((5, -1, 1), "c: number of correct samples must be >= 0, got -1"),
        ((5, 2, 0), "k: must be >= 1"),
        ((5, 2, -2), "k: must be >= 1"),
        ((5.0, 2, 1), "n: expected an int"),
        ((5, True, 1), "c: expected an int"),
        ((0, 0, 1), "k > n"),
    ],
)
def test_errors(args: tuple[object, object, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pass_at_k(*args)  # type: ignore[arg-type]


def test_numpy_integers_accepted() -> None:
    assert pass_at_k(np.int64(5), np.int32(2), np.int64(2)) == pytest.approx(0.7)


def test_vectorised_helpers() -> None:
    out = pass_at_k_array([5, 10, 4], [2, 3, 1], 2)
    np.testing.assert_allclose(out, [0.7, 1 - comb(7, 2) / comb(10, 2), 0.5])
    # one n for every problem
    np.testing.assert_allclose(pass_at_k_array(10, [0, 3, 10], 1), [0.0, 0.3, 1.0])
    # integral floats are fine (e.g. counts read from JSON)
    np.testing.assert_allclose(pass_at_k_array(np.array([5.0]), np.array([2.0]), 2), [0.7])
    assert mean_pass_at_k(10, [0, 3, 10], 1) == pytest.approx((0.0 + 0.3 + 1.0) / 3)
    assert pass_at_k_array([], [], 1).shape == (0,)


def test_vectorised_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"c\[2\]"):
        pass_at_k_array([5, 5, 5], [1, 2, 6], 1)
    with pytest.raises(ValueError, match=r"n\[1\]"):
        pass_at_k_array([5, 1, 5], [1, 0, 2], 2)
    with pytest.raises(ValueError, match=r"c\[1\]: expected an integer"):
        pass_at_k_array([5, 5], [1, 2.5], 1)
    with pytest.raises(ValueError, match="expected integers"):
        pass_at_k_array([5], [True], 1)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], [], 1)


def test_vectorised_counts_must_be_numbers() -> None:
    # numeric strings would convert to int64 silently: the dtype check refuses them, naming the argument
    with pytest.raises(ValueError, match="n: expected integers, got dtype <U2"):
        pass_at_k_array(["10"], [3], 1)
    with pytest.raises(ValueError, match="c: expected integers, got dtype <U1"):
        pass_at_k_array([10], ["3"], 1)
    with pytest.raises(ValueError, match=r"n\[0\]: number of samples must be >= 0, got -2"):
        pass_at_k_array([-2], [0], 1)
