"""Bandit lab core: the K-armed bandit, REINFORCE training, gradient-variance measurement, variants.

Pure computation (numpy, the trainer's advantage functions); the run folder and the CLI live in
:mod:`palaestra.labs.bandit`, which re-exports these names. See that module for what the lab shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "BASELINE_MODES",
    "BanditConfig",
    "BanditRun",
    "GradientVariance",
    "VariantSummary",
    "compare_bandit",
    "default_variants",
    "gradient_samples",
    "measure_gradient_variance",
    "softmax",
    "train_bandit",
]

BASELINE_MODES = ("dr_grpo", "rloo", "grpo")
LOCK_PROB = 0.99  # a policy with more than this on one arm counts as collapsed onto it


@dataclass(frozen=True)
class BanditConfig:
    """Every knob of one bandit run. ``means`` overrides ``arms`` (default: ``linspace(0.1, 0.9, arms)``)."""

    arms: int = 5
    steps: int = 200
    lr: float = 1.0
    batch: int = 8
    baseline: bool = True
    adv_mode: str = "dr_grpo"
    reward: str = "bernoulli"
    noise: float = 1.0
    means: tuple[float, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        k = len(self.means) if self.means is not None else self.arms
        if k < 2:
            raise ValueError(f"arms: need at least 2 arms, got {k}")
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")
        if self.batch < 1 or (self.baseline and self.batch < 2):
            raise ValueError(
                f"batch: must be >= 1, and >= 2 with a baseline (a group of one has advantage 0), "
                f"got {self.batch}"
            )
        if not np.isfinite(self.lr):
            raise ValueError(f"lr: must be finite, got {self.lr}")
        if self.adv_mode not in BASELINE_MODES:
            raise ValueError(f"adv_mode: expected one of {BASELINE_MODES}, got {self.adv_mode!r}")
        if self.reward not in ("bernoulli", "gaussian"):
            raise ValueError(f"reward: expected 'bernoulli' or 'gaussian', got {self.reward!r}")
        if self.reward == "bernoulli" and any(not 0.0 <= m <= 1.0 for m in self.arm_means()):
            raise ValueError("means: Bernoulli arm means must lie in [0, 1]")
        if self.noise < 0:
            raise ValueError(f"noise: must be >= 0, got {self.noise}")

    def arm_means(self) -> np.ndarray:
        """Expected reward of each arm."""
        if self.means is not None:
            return np.asarray(self.means, dtype=np.float64)
        return np.linspace(0.1, 0.9, self.arms)

    @property
    def best_arm(self) -> int:
        return int(np.argmax(self.arm_means()))


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(z / z.sum(axis=-1, keepdims=True))


def _rewards(cfg: BanditConfig, arms: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    mu = cfg.arm_means()[arms]
    if cfg.reward == "bernoulli":
        return np.asarray((rng.random(arms.shape) < mu).astype(np.float64))
    return np.asarray(mu + cfg.noise * rng.standard_normal(arms.shape))


def _advantages(cfg: BanditConfig, rewards: np.ndarray) -> np.ndarray:
    """Advantages of one group (the trainer's function with a baseline, the raw reward without)."""
    from palaestra.trainer.advantages import group_advantages

    if not cfg.baseline:
        return np.array(rewards, dtype=np.float64)
    return group_advantages(rewards, mode=cfg.adv_mode)  # type: ignore[arg-type]


def _baselines(cfg: BanditConfig, rewards: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """The value each reward was compared with (for display): 0 without baseline, group/leave-one-out mean."""
    if not cfg.baseline:
        return np.zeros(rewards.shape)
    if cfg.adv_mode == "grpo":  # (r - mean) / std: the baseline is the mean, then rescaled
        return np.full(rewards.shape, float(rewards.mean()))
    return np.asarray(rewards - adv)


def _grad(pi: np.ndarray, arms: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """REINFORCE estimate ``(1/B) sum_i A_i (onehot(a_i) - pi)``."""
    k = pi.shape[-1]
    onehot = np.eye(k)[arms]
    return np.asarray((adv[:, None] * (onehot - pi)).mean(axis=0))


@dataclass
class BanditRun:
    """History of one training run: ``probs[t]`` is the policy before step ``t`` (``steps + 1`` rows)."""

    config: BanditConfig
    probs: np.ndarray
    mean_reward: np.ndarray
    pulls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def best_prob(self) -> np.ndarray:
        return np.asarray(self.probs[:, self.config.best_arm])

    @property
    def final_probs(self) -> np.ndarray:
        return np.asarray(self.probs[-1])

    @property
    def locked_on(self) -> int | None:
        """Arm holding more than 0.99 of the final policy, or None."""
        top = int(np.argmax(self.final_probs))
        return top if self.final_probs[top] > LOCK_PROB else None

    @property
    def wrong_lockin(self) -> bool:
        return self.locked_on is not None and self.locked_on != self.config.best_arm

    def expected_reward(self) -> np.ndarray:
        """Expected reward of the policy at every step (``probs @ means``)."""
        return np.asarray(self.probs @ self.config.arm_means())


def train_bandit(
    cfg: BanditConfig, *, record_pulls: bool = False, print_fn: Callable[[str], None] | None = None
) -> BanditRun:
    """Train the softmax policy from uniform for ``cfg.steps`` steps; ``print_fn`` gets the --slow trace."""
    rng = np.random.default_rng(cfg.seed)
    k = len(cfg.arm_means())
    theta = np.zeros(k)
    probs = [softmax(theta)]
    mean_r: list[float] = []
    pulls: list[dict[str, Any]] = []
    for step in range(cfg.steps):
        pi = softmax(theta)
        arms = rng.choice(k, size=cfg.batch, p=pi)
        r = _rewards(cfg, arms, rng)
        adv = _advantages(cfg, r)
        old_theta = theta
        theta = theta + cfg.lr * _grad(pi, arms, adv)
        new_pi = softmax(theta)
        probs.append(new_pi)
        mean_r.append(float(r.mean()))
        if record_pulls or print_fn is not None:
            base = _baselines(cfg, r, adv)
            for i, a in enumerate(arms):
                # this pull's own term of the batch mean, applied alone
                solo = softmax(old_theta + cfg.lr * _grad(pi, arms[i : i + 1], adv[i : i + 1]) / cfg.batch)
                row = {
                    "step": step,
                    "pull": i,
                    "arm": int(a),
                    "reward": float(r[i]),
                    "baseline": float(base[i]),
                    "advantage": float(adv[i]),
                    "p_before": float(pi[a]),
                    "p_after": float(new_pi[a]),
                    "dp_batch": float(new_pi[a] - pi[a]),
                    "dp_this_pull": float(solo[a] - pi[a]),
                }
                if record_pulls:
                    pulls.append(row)
                if print_fn is not None:
                    print_fn(_slow_line(row))
            if print_fn is not None:
                print_fn(
                    f"step {step:4d} done: mean r={r.mean():.3f}  p(best arm {cfg.best_arm})="
                    f"{pi[cfg.best_arm]:.3f} -> {new_pi[cfg.best_arm]:.3f}"
                )
    return BanditRun(config=cfg, probs=np.asarray(probs), mean_reward=np.asarray(mean_r), pulls=pulls)


def _slow_line(row: dict[str, Any]) -> str:
    a = row["advantage"]
    sign = "+" if a > 0 else "-" if a < 0 else "0"
    return (
        f"step {row['step']:4d} pull {row['pull']:2d}: arm {row['arm']}  r={row['reward']:+.2f}  "
        f"baseline={row['baseline']:+.3f}  A={a:+.3f} ({sign})  p[arm] {row['p_before']:.3f} -> "
        f"{row['p_after']:.3f} (batch {row['dp_batch']:+.4f}, this pull alone {row['dp_this_pull']:+.4f})"
    )


@dataclass(frozen=True)
class GradientVariance:
    """Spread of the REINFORCE estimate at one policy, with and without baseline, on the same pulls.

    ``var_*`` is the total variance (trace of the covariance) of the estimate; ``noise_to_signal_*`` divides
    it by the squared norm of the estimator's mean, a scale-free figure (``grpo`` rescales advantages, so its
    raw variance is on another scale). ``bias_*`` is the distance of the estimator's mean from
    ``exact_grad * expected_scale`` where ``dr_grpo`` shrinks the exact gradient by ``(B-1)/B`` and ``rloo``
    and no-baseline are unbiased.
    """

    samples: int
    batch: int
    adv_mode: str
    policy: tuple[float, ...]
    exact_grad: tuple[float, ...]
    var_with: float
    var_without: float
    mean_with: tuple[float, ...]
    mean_without: tuple[float, ...]
    noise_to_signal_with: float
    noise_to_signal_without: float

    @property
    def ratio(self) -> float:
        """``var_with / var_without`` (< 1: the baseline reduces variance)."""
        return self.var_with / self.var_without if self.var_without > 0 else float("nan")


def gradient_samples(
    cfg: BanditConfig,
    logits: Sequence[float] | np.ndarray | None = None,
    *,
    samples: int = 2000,
    seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pi, g_with, g_without)``: ``samples`` REINFORCE estimates (rows) with and without baseline, each
    pair computed on the same group of ``cfg.batch`` pulls at ``pi = softmax(logits)`` (default uniform)."""
    from palaestra.trainer.advantages import batch_advantages

    k = len(cfg.arm_means())
    theta = np.zeros(k) if logits is None else np.asarray(logits, dtype=np.float64)
    if theta.shape != (k,):
        raise ValueError(f"logits: expected {k} values, got shape {theta.shape}")
    pi = softmax(theta)
    rng = np.random.default_rng([cfg.seed if seed is None else seed, 7919])
    arms = rng.choice(k, size=(samples, cfg.batch), p=pi)
    r = _rewards(cfg, arms, rng)
    adv = np.stack(batch_advantages(list(r), mode=cfg.adv_mode).advantages)  # type: ignore[arg-type]
    onehot = np.eye(k)[arms]  # (samples, B, k)
    g_with = (adv[..., None] * (onehot - pi)).mean(axis=1)
    g_without = (r[..., None] * (onehot - pi)).mean(axis=1)
    return pi, g_with, g_without


def measure_gradient_variance(
    cfg: BanditConfig,
    logits: Sequence[float] | np.ndarray | None = None,
    *,
    samples: int = 2000,
    seed: int | None = None,
) -> GradientVariance:
    """Draw ``samples`` groups of ``cfg.batch`` pulls at policy ``softmax(logits)`` (uniform by default) and
    compute both estimates on each group; the groups come from ``seed`` (default ``cfg.seed``)."""
    if samples < 2:
        raise ValueError(f"samples: need at least 2, got {samples}")
    pi, g_with, g_without = gradient_samples(cfg, logits, samples=samples, seed=seed)
    mu = cfg.arm_means()
    exact = pi * (mu - pi @ mu)

    def total_var(g: np.ndarray) -> float:
        return float(g.var(axis=0, ddof=1).sum())

    def nts(g: np.ndarray) -> float:
        m = g.mean(axis=0)
        sq = float(m @ m)
        return total_var(g) / sq if sq > 0 else float("inf")

    return GradientVariance(
        samples=samples,
        batch=cfg.batch,
        adv_mode=cfg.adv_mode,
        policy=tuple(float(x) for x in pi),
        exact_grad=tuple(float(x) for x in exact),
        var_with=total_var(g_with),
        var_without=total_var(g_without),
        mean_with=tuple(float(x) for x in g_with.mean(axis=0)),
        mean_without=tuple(float(x) for x in g_without.mean(axis=0)),
        noise_to_signal_with=nts(g_with),
        noise_to_signal_without=nts(g_without),
    )


@dataclass(frozen=True)
class VariantSummary:
    """One row of the comparison table: a variant run over ``seeds`` seeds."""

    variant: str
    lr: float
    baseline: bool
    seeds: int
    initial_best_prob: float
    final_best_prob_mean: float
    final_best_prob_min: float
    final_expected_reward_mean: float
    collapse_rate: float
    wrong_lockin_rate: float
    grad_var_at_start: float
    update_var_at_start: float

    def row(self) -> dict[str, Any]:
        return asdict(self)


def default_variants(cfg: BanditConfig, large_lr: float | None = None) -> list[tuple[str, BanditConfig]]:
    """The four variants of ``--compare``: baseline, no baseline, negative lr, too-large lr (50 x lr)."""
    big = large_lr if large_lr is not None else 50.0 * abs(cfg.lr)
    return [
        ("baseline", replace(cfg, baseline=True)),
        ("no-baseline", replace(cfg, baseline=False)),
        ("negative-lr", replace(cfg, baseline=True, lr=-abs(cfg.lr))),
        ("large-lr", replace(cfg, baseline=True, lr=big)),
    ]


def compare_bandit(
    cfg: BanditConfig, *, seeds: int = 20, large_lr: float | None = None
) -> tuple[list[VariantSummary], dict[str, list[BanditRun]]]:
    """Run every variant on seeds ``cfg.seed .. cfg.seed + seeds - 1``; return the table and the runs."""
    if seeds < 1:
        raise ValueError(f"seeds: must be >= 1, got {seeds}")
    table: list[VariantSummary] = []
    runs: dict[str, list[BanditRun]] = {}
    for name, vcfg in default_variants(cfg, large_lr):
        rs = [train_bandit(replace(vcfg, seed=vcfg.seed + s)) for s in range(seeds)]
        runs[name] = rs
        gv = measure_gradient_variance(vcfg)
        var = gv.var_with if vcfg.baseline else gv.var_without
        finals = np.array([r.best_prob[-1] for r in rs])
        table.append(
            VariantSummary(
                variant=name,
                lr=vcfg.lr,
                baseline=vcfg.baseline,
                seeds=seeds,
                initial_best_prob=float(rs[0].best_prob[0]),
                final_best_prob_mean=float(finals.mean()),
                final_best_prob_min=float(finals.min()),
                final_expected_reward_mean=float(np.mean([r.expected_reward()[-1] for r in rs])),
                collapse_rate=float(np.mean([r.locked_on is not None for r in rs])),
                wrong_lockin_rate=float(np.mean([r.wrong_lockin for r in rs])),
                grad_var_at_start=var,
                update_var_at_start=var * vcfg.lr**2,
            )
        )
    return table, runs
