"""Group-relative advantages (GRPO family) and preference pairs from a group's scores.

Pure numpy, no I/O. Notation for one group of ``n`` rewards ``r_1..r_n``: ``mean = (1/n) sum_j r_j`` and
``std = sqrt(sum_j (r_j - mean)^2 / (n - 1))`` (sample std, ddof=1, as TRL and verl).

Modes (``AdvantageMode``):

- ``grpo``      ``A_i = (r_i - mean) / (std + eps)``      (DeepSeekMath; TRL ``scale_rewards="group"``)
- ``batch_std`` ``A_i = (r_i - mean) / (std_batch + eps)``, where ``std_batch`` is the sample std of every
  reward in the batch (all groups pooled) and ``mean`` is still the group mean (TRL ``scale_rewards="batch"``)
- ``dr_grpo``   ``A_i = r_i - mean``                                       (Dr. GRPO: no std division)
- ``rloo``      ``A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean)``  (leave-one-out baseline)

In every mode a group of one gets advantage 0 (there is nothing to compare it with) and a group whose rewards
are all equal gets exactly 0 (no learning signal; such groups are "zero-std" and may be dropped, see
:func:`batch_advantages`).

Turn-level credit (``TurnCredit``; :func:`turn_advantages`). A trajectory of ``K`` assistant turns (its
Choices) has its final reward ``R`` (``Trajectory.reward``) and, optionally, per-turn rewards ``r_0..r_{K-1}``
(``Trajectory.turn_rewards``) earned *in addition* to it. The step rewards are ``u_k = r_k`` plus ``R`` on
the last turn, and the discounted return of turn ``k`` is ``G_k = sum_{j >= k} gamma^(j-k) u_j``, so ``G_0``
is the episode return (``R + sum_k r_k`` when ``gamma = 1``). Each turn's advantage multiplies that turn's
tokens:

- ``final``      (default, as before) ``A_{i,k} = A_i`` from the final rewards ``R`` alone with ``mode``;
  per-turn rewards are ignored;
- ``returns``    ``A_{i,k} = (G_{i,k} - b_i) / s``: each turn's own return against the group's episode
  returns ``E_j = G_{j,0}``: ``b_i = mean_j E_j`` (``rloo``: the mean over ``j != i``), ``s = std(E) + eps``
  (``grpo``; 1 for ``dr_grpo`` and ``rloo``). With ``gamma = 1`` and no per-turn rewards it equals ``final``;
- ``turn_group`` ``A_{i,k}`` = ``mode``'s group advantage of ``G_{i,k}`` among the returns at the same turn
  index ``k`` of the group's trajectories that reached turn ``k`` (each step compared with the same step of
  the other attempts).

``batch_std`` is not defined for the per-turn modes (error). A group whose episode returns are all equal
gets 0 in ``returns`` mode; in ``turn_group`` mode a turn index whose returns are all equal gets 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

AdvantageMode = Literal["grpo", "batch_std", "dr_grpo", "rloo"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)
PairStrategy = Literal["all", "best_vs_rest"]
PAIR_STRATEGIES: tuple[str, ...] = get_args(PairStrategy)
TurnCredit = Literal["final", "returns", "turn_group"]
TURN_CREDITS: tuple[str, ...] = get_args(TurnCredit)

__all__ = [
    "ADVANTAGE_MODES",
    "TURN_CREDITS",
    "AdvantageMode",
    "AdvantageResult",
    "PairStrategy",
    "TurnCredit",
    "batch_advantages",
    "group_advantages",
    "ranking_to_pairs",
    "turn_advantages",
    "turn_returns",
]


def float_array(x: object, name: str, ndim: int, expected: str) -> np.ndarray:
    """``x`` as a float64 array with ``ndim`` dimensions, else ValueError naming ``name`` and ``expected``."""
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected {expected} ({exc})") from None
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {expected}, got shape {a.shape}")
    return a


def check_nonneg(name: str, value: float) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite number >= 0."""
    if not (np.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")


def _rewards_array(rewards: Sequence[float] | np.ndarray, what: str = "rewards") -> np.ndarray:
    r = float_array(rewards, what, 1, "a 1-D sequence of numbers")
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(f"{what}[{int(bad[0])}] is {r[bad[0]]!r}; rewards must be finite")
    return r


def _check_mode_eps(mode: str, eps: float) -> None:
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode: unknown advantage mode {mode!r}; expected one of {ADVANTAGE_MODES}")
    check_nonneg("eps", eps)


def _is_zero_std(r: np.ndarray) -> bool:
    """True for groups without signal: fewer than two rewards, or all rewards equal."""
    return r.size < 2 or bool(np.all(r == r[0]))


def _sample_std(r: np.ndarray) -> float:
    return float(np.std(r, ddof=1)) if r.size >= 2 else 0.0


def _group_adv(r: np.ndarray, mode: str, eps: float, batch_std: float | None) -> np.ndarray:
    if _is_zero_std(r):
        return np.zeros_like(r)
    n = r.size
    centred: np.ndarray = r - float(r.mean())
    if mode == "grpo":
        return np.asarray(centred / (_sample_std(r) + eps))
    if mode == "batch_std":
        assert batch_std is not None
        return np.asarray(centred / (batch_std + eps))
    if mode == "dr_grpo":
        return centred
    # rloo: r_i - (sum - r_i)/(n-1), written in the numerically nicer centred form n/(n-1) * (r_i - mean)
    return np.asarray(centred * (n / (n - 1)))


def group_advantages(
    rewards: Sequence[float] | np.ndarray,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-4,
    *,
    batch_std: float | None = None,
) -> np.ndarray:
    """Advantages (float64, one per reward) of one group of rewards (formulas in the module docstring).

    ``eps`` is added to the std. ``mode="batch_std"`` needs the pooled std of the whole batch as
    ``batch_std`` (an error with any other mode). Non-finite rewards raise ``ValueError`` naming the index.
    """
    _check_mode_eps(mode, eps)
    if mode == "batch_std":
        if batch_std is None:
            raise ValueError(
                "batch_std: mode='batch_std' divides by the std of the whole batch; pass batch_std=<float> "
                "or use batch_advantages(groups, mode='batch_std')"
            )
        check_nonneg("batch_std", batch_std)
    elif batch_std is not None:
        raise ValueError(f"batch_std: only used with mode='batch_std', not mode={mode!r}")
    return _group_adv(_rewards_array(rewards), mode, eps, batch_std)


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages of a batch of groups.

    ``advantages[g]``: group ``g``'s advantages in input order, for every group (zeros for zero-std groups).
    ``kept``: the groups to train on (all, or the non-zero-std ones with ``drop_zero_std=True``). ``zero_std``:
    groups with fewer than two rewards or all equal; ``frac_zero_std`` their share (0.0 for an empty batch).
    ``batch_std``: the pooled sample std of ``mode="batch_std"`` (``None`` in other modes).
    """

    advantages: tuple[np.ndarray, ...]
    kept: tuple[int, ...]
    zero_std: tuple[int, ...]
    frac_zero_std: float
    mode: str
    batch_std: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def batch_advantages(
    groups: Sequence[Sequence[float] | np.ndarray],
    mode: AdvantageMode = "grpo",
    eps: float = 1e-4,
    drop_zero_std: bool = False,
) -> AdvantageResult:
    """Advantages for many groups at once, with optional DAPO dynamic filtering.

    Each group is normalised on its own (``group_advantages``); ``batch_std`` pools the rewards of all groups
    before any filtering, so ``drop_zero_std=True`` (keep only groups with a learning signal, DAPO dynamic
    sampling) only removes groups and never changes the others' advantages. Empty groups count as zero-std.

    ``metrics``: ``groups``, ``groups_kept``, ``frac_zero_std``, ``adv_abs_mean`` (mean |A| over kept
    trajectories, 0.0 if none).
    """
    _check_mode_eps(mode, eps)
    arrays = [_rewards_array(g, what=f"groups[{i}]") for i, g in enumerate(groups)]
    std_b: float | None = None
    if mode == "batch_std":
        pooled = np.concatenate(arrays) if arrays else np.zeros(0)
        std_b = _sample_std(pooled)
    advs = tuple(_group_adv(r, mode, eps, std_b) for r in arrays)
    zero = tuple(i for i, r in enumerate(arrays) if _is_zero_std(r))
    kept = tuple(i for i in range(len(arrays)) if not (drop_zero_std and i in zero))
    frac = len(zero) / len(arrays) if arrays else 0.0
    kept_flat = np.concatenate([advs[i] for i in kept]) if kept else np.zeros(0)
    metrics = {
        "groups": float(len(arrays)),
        "groups_kept": float(len(kept)),
        "frac_zero_std": frac,
        "adv_abs_mean": float(np.abs(kept_flat).mean()) if kept_flat.size else 0.0,
    }
    return AdvantageResult(
        advantages=advs,
        kept=kept,
        zero_std=zero,
        frac_zero_std=frac,
        mode=mode,
        batch_std=std_b,
        metrics=metrics,
    )


def ranking_to_pairs(
    rewards: Sequence[float] | np.ndarray,
    *,
    min_margin: float = 0.0,
    max_pairs: int | None = None,
    strategy: PairStrategy = "all",
) -> list[tuple[int, int]]:
    """Preference pairs ``(chosen, rejected)`` (indices into ``rewards``) from one group's scores.

    A pair ``(i, j)`` qualifies when ``r_i - r_j > min_margin`` (strict), so ties never produce a pair.

    - ``strategy="all"``: every qualifying ordered pair (at most ``n(n-1)/2``), as InstructGPT's
      all-comparisons scheme.
    - ``strategy="best_vs_rest"``: the best trajectory (highest reward; the lowest index among equal best)
      against every other trajectory that it beats by more than ``min_margin``.

    Order is deterministic: larger reward gap first, then lower chosen index, then lower rejected index.
    ``max_pairs`` keeps the first ``max_pairs`` pairs of that order (the most clear-cut preferences).
    """
    r = _rewards_array(rewards)
    check_nonneg("min_margin", min_margin)
    if max_pairs is not None and (type(max_pairs) is not int or max_pairs < 0):  # bool is not an int here
        raise ValueError(f"max_pairs: must be None or an int >= 0, got {max_pairs!r}")
    if strategy not in PAIR_STRATEGIES:
        raise ValueError(f"strategy: unknown pair strategy {strategy!r}; expected one of {PAIR_STRATEGIES}")
    n = r.size
    if strategy == "all":
        candidates = [(i, j) for i in range(n) for j in range(n) if i != j]
    else:
        best = int(np.argmax(r)) if n else 0
        candidates = [(best, j) for j in range(n) if j != best]
    pairs = [(i, j) for i, j in candidates if r[i] - r[j] > min_margin]
    pairs.sort(key=lambda p: (-(r[p[0]] - r[p[1]]), p[0], p[1]))
    return pairs if max_pairs is None else pairs[:max_pairs]


# ---------------------------------------------------------------------------------------------- turn credit
def turn_returns(
    turn_rewards: Sequence[float] | np.ndarray | None,
    final_reward: float,
    n_turns: int,
    discount: float = 1.0,
) -> np.ndarray:
    """Discounted returns ``G_k`` (k = 0..n_turns-1) of one trajectory (module docstring).

    ``turn_rewards`` (None: all zero) must have ``n_turns`` values; ``final_reward`` is added to the last
    turn's step reward. A trajectory without turns gets an empty array."""
    if not (np.isfinite(discount) and 0.0 <= discount <= 1.0):
        raise ValueError(f"discount: must be in [0, 1], got {discount!r}")
    if n_turns < 0:
        raise ValueError(f"n_turns: must be >= 0, got {n_turns}")
    u = np.zeros(n_turns) if turn_rewards is None else _rewards_array(turn_rewards, what="turn_rewards")
    if u.size != n_turns:
        raise ValueError(f"turn_rewards: {u.size} values for {n_turns} assistant turns (one per Choice)")
    if not np.isfinite(final_reward):
        raise ValueError(f"final_reward is {final_reward!r}; rewards must be finite")
    u = u.copy()
    if n_turns:
        u[-1] += float(final_reward)
    g = np.zeros(n_turns)
    acc = 0.0
    for k in range(n_turns - 1, -1, -1):  # G_k = u_k + discount * G_{k+1}, from the last turn back
        acc = float(u[k]) + discount * acc
        g[k] = acc
    return g


def turn_advantages(
    final_rewards: Sequence[float] | np.ndarray,
    turn_rewards: Sequence[Sequence[float] | np.ndarray | None],
    n_turns: Sequence[int],
    credit: TurnCredit = "final",
    mode: AdvantageMode = "grpo",
    eps: float = 1e-4,
    discount: float = 1.0,
) -> list[np.ndarray]:
    """Per-turn advantages of one group: ``out[i][k]`` for trajectory ``i``'s turn ``k`` (module docstring).

    ``final_rewards[i]`` is trajectory ``i``'s ``reward``, ``turn_rewards[i]`` its per-turn rewards (None: no
    per-turn rewards) and ``n_turns[i]`` its number of Choices."""
    if credit not in TURN_CREDITS:
        raise ValueError(f"credit: unknown turn credit {credit!r}; expected one of {TURN_CREDITS}")
    _check_mode_eps(mode, eps)
    r = _rewards_array(final_rewards, what="final_rewards")
    n = r.size
    if len(turn_rewards) != n or len(n_turns) != n:
        raise ValueError(
            f"turn_advantages: {n} final rewards, {len(turn_rewards)} turn reward lists, {len(n_turns)} turn counts"
        )
    if credit != "final" and mode == "batch_std":
        raise ValueError("mode='batch_std' is not defined for per-turn credit; use grpo, dr_grpo or rloo")
    if credit == "final":
        a = _group_adv(r, mode, eps, _sample_std(r) if mode == "batch_std" else None)
        return [np.full(int(k), float(a[i])) for i, k in enumerate(n_turns)]
    returns = []
    for i in range(n):
        try:
            returns.append(turn_returns(turn_rewards[i], float(r[i]), int(n_turns[i]), discount))
        except ValueError as exc:
            raise ValueError(f"trajectory {i}: {exc}") from None
    if credit == "returns":
        ep = np.asarray([g[0] if g.size else r[i] for i, g in enumerate(returns)])
        if _is_zero_std(ep):
            return [np.zeros_like(g) for g in returns]
        base = (ep.sum() - ep) / (n - 1) if mode == "rloo" else np.full(n, float(ep.mean()))
        scale = _sample_std(ep) + eps if mode == "grpo" else 1.0
        return [np.asarray((g - base[i]) / scale) for i, g in enumerate(returns)]
    out = [np.zeros_like(g) for g in returns]
    for k in range(max((g.size for g in returns), default=0)):
        who = [i for i, g in enumerate(returns) if g.size > k]
        a = _group_adv(np.asarray([returns[i][k] for i in who]), mode, eps, None)
        for i, v in zip(who, a):
            out[i][k] = v
    return out
