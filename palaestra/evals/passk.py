"""Unbiased pass@k (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)``, the
product (no huge binomials) evaluated as ``-expm1(sum log1p(-k/i))`` so that small values keep their precision."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _check_int(name: str, value: object, low: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {int(value)}")
    return int(value)


def _estimate(n: int, c: int, k: int, where: str = "") -> float:
    """pass@k of one problem, after checking its counts (``where``: the problem's index, for errors)."""
    if n < 0:
        raise ValueError(f"n{where}: number of samples must be >= 0, got {n}")
    if c < 0:
        raise ValueError(f"c{where}: number of correct samples must be >= 0, got {c}")
    if c > n:
        raise ValueError(f"c{where}: {c} correct samples out of n={n} (c > n)")
    if k > n:
        raise ValueError(f"k: pass@{k} needs at least k samples, n{where}={n} (k > n)")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(-np.expm1(np.sum(np.log1p(-k / i))))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` of them correct (formula in the module
    docstring). Raises ``ValueError`` for non-integers, negatives, ``k < 1``, ``c > n`` or ``k > n``."""
    return _estimate(_check_int("n", n), _check_int("c", c), _check_int("k", k, 1))


def _int_array(name: str, x: ArrayLike) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"{name}: expected integers, got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(a.reshape(-1)) | (a.reshape(-1) != np.round(a.reshape(-1))))
        if bad.size:
            raise ValueError(f"{name}[{int(bad[0])}]: expected an integer, got {a.reshape(-1)[bad[0]]!r}")
    return a.astype(np.int64)


def pass_at_k_array(n: ArrayLike, c: ArrayLike, k: int) -> np.ndarray:
    """Per-problem pass@k: ``n`` (one int, or one per problem) and ``c`` (one per problem) broadcast together;
    errors name the index of the first offending problem."""
    k = _check_int("k", k, 1)
    n_arr, c_arr = np.broadcast_arrays(_int_array("n", n), _int_array("c", c))
    out = np.empty(n_arr.shape, dtype=np.float64)
    for idx in np.ndindex(n_arr.shape):
        out[idx] = _estimate(int(n_arr[idx]), int(c_arr[idx]), k, f"[{', '.join(map(str, idx))}]")
    return out


def mean_pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float:
    """Benchmark pass@k: the mean over problems of :func:`pass_at_k_array` (raises on zero problems)."""
    values = pass_at_k_array(n, c, k)
    if values.size == 0:
        raise ValueError("c: no problems to average pass@k over")
    return float(values.mean())
