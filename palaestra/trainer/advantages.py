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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

AdvantageMode = Literal["grpo", "batch_std", "dr_grpo", "rloo"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)
PairStrategy = Literal["all", "best_vs_rest"]

__all__ = [
    "ADVANTAGE_MODES",
    "AdvantageMode",
    "AdvantageResult",
    "PairStrategy",
    "batch_advantages",
    "group_advantages",
    "ranking_to_pairs",
]


def _rewards_array(rewards: Sequence[float] | np.ndarray, what: str = "rewards") -> np.ndarray:
    try:
        r = np.asarray(rewards, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: expected a 1-D sequence of numbers ({exc})") from None
    if r.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D sequence of numbers, got shape {r.shape}")
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(f"{what}[{int(bad[0])}] is {r[bad[0]]!r}; rewards must be finite")
    return r


def _check_mode(mode: str) -> None:
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode: unknown advantage mode {mode!r}; expected one of {ADVANTAGE_MODES}")


def _check_eps(eps: float) -> None:
    if not (np.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")


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
    """Advantages of one group of rewards (see the module docstring for each mode's formula).

    ``eps`` is added to the std (``grpo``, ``batch_std``; unused otherwise). ``mode="batch_std"`` needs the
    pooled std of the whole batch, passed as ``batch_std`` (``batch_advantages`` computes it for you); passing
    ``batch_std`` with any other mode is an error. Returns a float64 array with one advantage per reward.
    Non-finite rewards raise ``ValueError`` naming the index.
    """
    _check_mode(mode)
    _check_eps(eps)
    if mode == "batch_std":
        if batch_std is None:
            raise ValueError(
                "batch_std: mode='batch_std' divides by the std of the whole batch; pass batch_std=<float> "
                "or use batch_advantages(groups, mode='batch_std')"
            )
        if not (np.isfinite(batch_std) and batch_std >= 0.0):
            raise ValueError(f"batch_std: must be a finite number >= 0, got {batch_std!r}")
    elif batch_std is not None:
        raise ValueError(f"batch_std: only used with mode='batch_std', not mode={mode!r}")
    return _group_adv(_rewards_array(rewards), mode, eps, batch_std)


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages of a batch of groups.

    ``advantages[g]`` holds group ``g``'s advantages in input order, for every input group (zero-std groups
    get zeros). ``kept`` lists the indices of groups to train on (all groups, or the non-zero-std ones when
    ``drop_zero_std=True``). ``zero_std`` lists groups with fewer than two rewards or all rewards equal;
    ``frac_zero_std = len(zero_std) / number of groups`` (0.0 for an empty batch). ``batch_std`` is the
    pooled sample std used by ``mode="batch_std"`` (``None`` in other modes).
    """

    advantages: tuple[np.ndarray, ...]
    kept: tuple[int, ...]
    zero_std: tuple[int, ...]
    frac_zero_std: float
    mode: str
    batch_std: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def kept_advantages(self) -> list[np.ndarray]:
        """Advantages of the kept groups, in the order of ``kept``."""
        return [self.advantages[g] for g in self.kept]


def batch_advantages(
    groups: Sequence[Sequence[float] | np.ndarray],
    mode: AdvantageMode = "grpo",
    eps: float = 1e-4,
    drop_zero_std: bool = False,
) -> AdvantageResult:
    """Advantages for many groups at once, with optional DAPO dynamic filtering.

    Each group is normalised on its own (``group_advantages``); in ``batch_std`` mode the std is the sample
    std (ddof=1) of all rewards of all groups pooled, computed before any filtering, so turning
    ``drop_zero_std`` on only removes groups and never changes the advantages of the others.
    ``drop_zero_std=True`` keeps only groups with a learning signal (DAPO dynamic sampling: a group whose
    rewards are all equal has zero advantage everywhere). Empty groups are allowed and count as zero-std.

    ``metrics``: ``groups``, ``groups_kept``, ``frac_zero_std``, ``adv_abs_mean`` (mean |A| over kept
    trajectories, 0.0 if none).
    """
    _check_mode(mode)
    _check_eps(eps)
    arrays = [_rewards_array(g, what=f"groups[{i}]") for i, g in enumerate(groups)]
    std_b: float | None = None
    if mode == "batch_std":
        pooled = np.concatenate(arrays) if arrays else np.zeros(0)
        std_b = _sample_std(pooled)
    advs = tuple(_group_adv(r, mode, eps, std_b) for r in arrays)
    zero = tuple(i for i, r in enumerate(arrays) if _is_zero_std(r))
    zero_set = set(zero)
    kept = tuple(i for i in range(len(arrays)) if not (drop_zero_std and i in zero_set))
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
    if not (np.isfinite(min_margin) and min_margin >= 0.0):
        raise ValueError(f"min_margin: must be a finite number >= 0, got {min_margin!r}")
    if max_pairs is not None and (
        isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 0
    ):
        raise ValueError(f"max_pairs: must be None or an int >= 0, got {max_pairs!r}")
    if strategy not in get_args(PairStrategy):
        raise ValueError(
            f"strategy: unknown pair strategy {strategy!r}; expected one of {get_args(PairStrategy)}"
        )
    n = r.size
    if strategy == "all":
        candidates = [(i, j) for i in range(n) for j in range(n) if i != j]
    else:
        best = int(np.argmax(r)) if n else 0
        candidates = [(best, j) for j in range(n) if j != best]
    pairs = [(i, j) for i, j in candidates if r[i] - r[j] > min_margin]
    pairs.sort(key=lambda p: (-(r[p[0]] - r[p[1]]), p[0], p[1]))
    return pairs if max_pairs is None else pairs[:max_pairs]
