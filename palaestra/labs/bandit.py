"""``palaestra lab bandit``: REINFORCE on a K-armed bandit, the smallest Loop C there is."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.labs.common import (
    ADV_MODES,
    LabRun,
    config_from_args,
    parse_floats,
    print_result,
    reinforce_grad,
    require,
    require_in,
    softmax,
)
from palaestra.trainer import advantages
from palaestra.trajectories.runs import args_of, fmt


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
        require(k >= 2, "arms", "need at least 2 arms", k)
        require(self.steps >= 1, "steps", "must be >= 1", self.steps)
        rule = "must be >= 1, and >= 2 with a baseline (a group of one has advantage 0)"
        require(self.batch >= 1 + self.baseline, "batch", rule, self.batch)
        require(np.isfinite(self.lr), "lr", "must be finite", self.lr)
        require_in(self, "adv_mode", ADV_MODES)
        require_in(self, "reward", ("bernoulli", "gaussian"))
        ok = self.reward != "bernoulli" or all(0.0 <= m <= 1.0 for m in self.arm_means())
        require(ok, "means", "Bernoulli arm means must lie in [0, 1]", self.means)
        require(self.noise >= 0, "noise", "must be >= 0", self.noise)

    def arm_means(self) -> np.ndarray:
        """Expected reward of each arm."""
        return np.linspace(0.1, 0.9, self.arms) if self.means is None else np.asarray(self.means, dtype=float)

    @property
    def best_arm(self) -> int:
        return int(np.argmax(self.arm_means()))


def _rewards(cfg: BanditConfig, arms: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    mu = cfg.arm_means()[arms]
    if cfg.reward == "bernoulli":
        return np.asarray((rng.random(arms.shape) < mu).astype(np.float64))
    return np.asarray(mu + cfg.noise * rng.standard_normal(arms.shape))


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
    def locked_on(self) -> int | None:
        """Arm holding more than 0.99 of the final policy, or None."""
        top = int(np.argmax(self.probs[-1]))
        return top if self.probs[-1, top] > 0.99 else None

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
    theta = np.zeros(len(cfg.arm_means()))
    probs = [softmax(theta)]
    mean_r: list[float] = []
    pulls: list[dict[str, Any]] = []
    for step in range(cfg.steps):
        pi = probs[-1]
        arms = rng.choice(pi.size, size=cfg.batch, p=pi)
        r = _rewards(cfg, arms, rng)
        adv = advantages.group_advantages(r, mode=cfg.adv_mode) if cfg.baseline else r  # type: ignore[arg-type]
        old_theta = theta
        theta = theta + cfg.lr * reinforce_grad(pi, arms, adv)
        new_pi = softmax(theta)
        probs.append(new_pi)
        mean_r.append(float(r.mean()))
        if not record_pulls and print_fn is None:
            continue
        # the value each reward was compared with: 0 without baseline; grpo's (r - mean) / std compares with
        # the mean, then rescales; dr_grpo and rloo: r - A
        base = r - adv if cfg.adv_mode != "grpo" else np.full(r.shape, r.mean())
        base = base if cfg.baseline else np.zeros(r.shape)
        # row i: pull i's own term of the batch mean, applied alone
        solo = softmax(old_theta + cfg.lr * reinforce_grad(pi, arms[:, None], adv[:, None]) / cfg.batch)
        for i, a in enumerate(arms):
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
                "dp_this_pull": float(solo[i, a] - pi[a]),
            }
            if record_pulls:
                pulls.append(row)
            if print_fn is not None:
                sign = "+" if adv[i] > 0 else "-" if adv[i] < 0 else "0"
                print_fn(
                    f"step {step:4d} pull {i:2d}: arm {a}  r={r[i]:+.2f}  baseline={base[i]:+.3f}  "
                    f"A={adv[i]:+.3f} ({sign})  p[arm] {pi[a]:.3f} -> {new_pi[a]:.3f} (batch "
                    f"{row['dp_batch']:+.4f}, this pull alone {row['dp_this_pull']:+.4f})"
                )
        if print_fn is not None:
            print_fn(
                f"step {step:4d} done: mean r={r.mean():.3f}  p(best arm {cfg.best_arm})="
                f"{pi[cfg.best_arm]:.3f} -> {new_pi[cfg.best_arm]:.3f}"
            )
    return BanditRun(config=cfg, probs=np.asarray(probs), mean_reward=np.asarray(mean_r), pulls=pulls)


@dataclass(frozen=True)
class GradientVariance:
    """Spread of the REINFORCE estimate at one policy with and without baseline, on the same pulls: total
    variance and noise-to-signal (variance / squared norm of the mean: scale-free, as ``grpo`` rescales)."""

    samples: int
    exact_grad: tuple[float, ...]
    var_with: float
    var_without: float
    mean_with: tuple[float, ...]
    mean_without: tuple[float, ...]
    noise_to_signal_with: float
    noise_to_signal_without: float
    estimates_with: np.ndarray = field(repr=False, compare=False)
    estimates_without: np.ndarray = field(repr=False, compare=False)

    @property
    def ratio(self) -> float:
        """``var_with / var_without`` (< 1: the baseline reduces variance)."""
        return self.var_with / self.var_without if self.var_without > 0 else float("nan")


def measure_gradient_variance(
    cfg: BanditConfig, logits: Sequence[float] | np.ndarray | None = None, *, samples: int = 2000
) -> GradientVariance:
    """Draw ``samples`` REINFORCE estimate pairs (with/without baseline, same ``cfg.batch`` pulls) at
    ``pi = softmax(logits)`` (default uniform) and measure their spread next to the exact gradient."""
    k = len(cfg.arm_means())
    theta = np.zeros(k) if logits is None else np.asarray(logits, dtype=np.float64)
    require(theta.shape == (k,), "logits", f"expected {k} values", theta.shape)
    require(samples >= 2, "samples", "need at least 2", samples)
    pi = softmax(theta)
    rng = np.random.default_rng([cfg.seed, 7919])
    arms = rng.choice(k, size=(samples, cfg.batch), p=pi)
    r = _rewards(cfg, arms, rng)
    adv = np.stack(advantages.batch_advantages(list(r), mode=cfg.adv_mode).advantages)  # type: ignore[arg-type]
    g_with, g_without = reinforce_grad(pi, arms, adv), reinforce_grad(pi, arms, r)
    mu = cfg.arm_means()

    def total_var(g: np.ndarray) -> float:
        return float(g.var(axis=0, ddof=1).sum())

    def nts(g: np.ndarray) -> float:
        m = g.mean(axis=0)
        sq = float(m @ m)
        return total_var(g) / sq if sq > 0 else float("inf")

    return GradientVariance(
        samples=samples,
        exact_grad=tuple((pi * (mu - pi @ mu)).tolist()),
        var_with=total_var(g_with),
        var_without=total_var(g_without),
        mean_with=tuple(g_with.mean(axis=0).tolist()),
        mean_without=tuple(g_without.mean(axis=0).tolist()),
        noise_to_signal_with=nts(g_with),
        noise_to_signal_without=nts(g_without),
        estimates_with=g_with,
        estimates_without=g_without,
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


def compare_bandit(
    cfg: BanditConfig, *, seeds: int = 20, large_lr: float | None = None
) -> tuple[list[VariantSummary], dict[str, list[BanditRun]]]:
    """Run the four variants (large lr: default 50 x lr) on ``seeds`` seeds from ``cfg.seed``; return table, runs."""
    require(seeds >= 1, "seeds", "must be >= 1", seeds)
    big = large_lr if large_lr is not None else 50.0 * abs(cfg.lr)
    variants = {
        "baseline": replace(cfg, baseline=True),
        "no-baseline": replace(cfg, baseline=False),
        "negative-lr": replace(cfg, baseline=True, lr=-abs(cfg.lr)),
        "large-lr": replace(cfg, baseline=True, lr=big),
    }
    table: list[VariantSummary] = []
    runs: dict[str, list[BanditRun]] = {}
    for name, vcfg in variants.items():
        runs[name] = rs = [train_bandit(replace(vcfg, seed=vcfg.seed + s)) for s in range(seeds)]
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


@dataclass
class BanditLabResult:
    """What ``palaestra lab bandit`` computed (and wrote to ``outdir`` when given)."""

    config: BanditConfig
    run: BanditRun
    variance_start: GradientVariance
    variance_end: GradientVariance
    compare: list[VariantSummary] | None
    outdir: Path | None
    numbers: dict[str, Any]


def run_bandit_lab(
    cfg: BanditConfig,
    outdir: str | Path | None = None,
    *,
    compare: bool = False,
    compare_seeds: int = 20,
    large_lr: float | None = None,
    plot: bool = True,
    variance_samples: int = 2000,
    print_fn: Callable[[str], None] | None = None,
) -> BanditLabResult:
    """Train one run, measure the gradient variance at the start and end policies, optionally compare the
    variants over seeds, and (with ``outdir``) write the run folder; ``print_fn`` gets the --slow trace."""
    run = train_bandit(cfg, record_pulls=outdir is not None, print_fn=print_fn)
    v0 = measure_gradient_variance(cfg, samples=variance_samples)
    final_logits = np.log(np.clip(run.probs[-1], 1e-300, None))
    v1 = measure_gradient_variance(cfg, final_logits, samples=variance_samples)
    table, runs = compare_bandit(cfg, seeds=compare_seeds, large_lr=large_lr) if compare else (None, None)
    tail = max(1, cfg.steps // 10)
    numbers: dict[str, Any] = {
        "best_arm": cfg.best_arm,
        "initial_best_prob": float(run.best_prob[0]),
        "final_best_prob": float(run.best_prob[-1]),
        "final_expected_reward": float(run.expected_reward()[-1]),
        "best_possible_reward": float(cfg.arm_means().max()),
        "mean_reward_last_10pct": float(run.mean_reward[-tail:].mean()),
        "locked_on_arm": run.locked_on,
        "grad_var_with_baseline": v0.var_with,
        "grad_var_without_baseline": v0.var_without,
        "grad_var_ratio": v0.ratio,
        "noise_to_signal_with_baseline": v0.noise_to_signal_with,
        "noise_to_signal_without_baseline": v0.noise_to_signal_without,
        "grad_var_with_baseline_final_policy": v1.var_with,
        "grad_var_without_baseline_final_policy": v1.var_without,
    }
    for row in table or []:
        numbers[f"{row.variant}.final_best_prob_mean"] = row.final_best_prob_mean
        numbers[f"{row.variant}.wrong_lockin_rate"] = row.wrong_lockin_rate
    result = BanditLabResult(cfg, run, v0, v1, table, None, numbers)
    if outdir is not None:
        flags = {"compare": compare, "compare_seeds": compare_seeds, "large_lr": large_lr}
        knobs = {**asdict(cfg), **flags, "variance_samples": variance_samples}
        lab = LabRun(outdir, lab="bandit", seed=cfg.seed, knobs=knobs)
        result.outdir = _write(lab, result, runs, plot=plot)
    return result


def _shows(res: BanditLabResult) -> list[str]:
    cfg, v0, run = res.config, res.variance_start, res.run
    mode = cfg.adv_mode
    out = [
        f"Gradient variance at the uniform policy, same {v0.samples} groups of {cfg.batch} pulls: "
        f"{fmt(v0.var_with)} with the {mode} baseline vs {fmt(v0.var_without)} without "
        f"(ratio {fmt(v0.ratio)}; noise-to-signal {fmt(v0.noise_to_signal_with)} vs "
        f"{fmt(v0.noise_to_signal_without)}).",
        f"This run (lr={fmt(cfg.lr)}, baseline={cfg.baseline}): p(best arm {cfg.best_arm}) went from "
        f"{fmt(run.best_prob[0])} to {fmt(run.best_prob[-1])} in {cfg.steps} steps; expected reward "
        f"{fmt(run.expected_reward()[0])} -> {fmt(run.expected_reward()[-1])} (best arm pays "
        f"{fmt(float(cfg.arm_means().max()))}).",
    ]
    if cfg.lr < 0:
        out.append(
            "The lr is negative: every step moves against the gradient, so the best arm loses probability."
        )
    if run.wrong_lockin:
        out.append(f"The policy collapsed onto arm {run.locked_on}, which is not the best arm.")
    if mode == "grpo":
        out.append(
            "grpo divides each group by its std, which rescales the estimate: compare the scale-free "
            "noise-to-signal figures rather than the raw variances."
        )
    if mode == "dr_grpo" and cfg.baseline:
        out.append(
            "dr_grpo's baseline includes the pull itself, so its mean is (B-1)/B = "
            f"{fmt((cfg.batch - 1) / cfg.batch)} of the exact gradient (a step-size change, same direction); "
            "rloo is exactly unbiased."
        )
    for row in res.compare or []:
        out.append(
            f"{row.variant} (lr={fmt(row.lr)}, baseline={row.baseline}) over {row.seeds} seeds: "
            f"final p(best) mean {fmt(row.final_best_prob_mean)} (min {fmt(row.final_best_prob_min)}), "
            f"wrong-arm lock-in {fmt(row.wrong_lockin_rate)}, "
            f"update variance at start {fmt(row.update_var_at_start)}."
        )
    return out


def _write(lab: LabRun, res: BanditLabResult, runs: dict[str, list[BanditRun]] | None, *, plot: bool) -> Path:
    cfg, run = res.config, res.run
    ent = -(run.probs * np.log(np.clip(run.probs, 1e-300, None))).sum(axis=1)
    exp_r = run.expected_reward()
    rows = [
        {
            "step": t,
            "mean_reward": float(run.mean_reward[t - 1]) if t else "",
            "expected_reward": float(exp_r[t]),
            "p_best": float(run.best_prob[t]),
            "entropy": float(ent[t]),
            **{f"p_{j}": float(p) for j, p in enumerate(run.probs[t])},
        }
        for t in range(cfg.steps + 1)
    ]
    lab.write_csv("steps.csv", rows)
    lab.write_jsonl("pulls.jsonl", run.pulls)
    var_rows = [
        {
            "policy": name,
            "estimator": est,
            "adv_mode": cfg.adv_mode if est == "baseline" else "none",
            "batch": cfg.batch,
            "samples": v.samples,
            "total_variance": var,
            "noise_to_signal": nts,
        }
        for name, v in (("uniform (start)", res.variance_start), ("final", res.variance_end))
        for est, var, nts in (
            ("baseline", v.var_with, v.noise_to_signal_with),
            ("no baseline", v.var_without, v.noise_to_signal_without),
        )
    ]
    lab.write_csv(
        "gradient_variance.csv", var_rows, table="Gradient variance (same pulls, with vs without baseline)"
    )
    if res.compare is not None:
        lab.write_csv("compare.csv", [asdict(r) for r in res.compare], table="Variants (compare.csv)")
    v0, b = res.variance_start, cfg.best_arm
    g_with, g_without = v0.estimates_with[:, b], v0.estimates_without[:, b]

    def draw(plt: Any) -> None:
        _fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        if runs:
            for name, rs in runs.items():
                ax1.plot(
                    np.mean([r.best_prob for r in rs], axis=0), label=f"{name} (mean of {len(rs)} seeds)"
                )
        else:
            ax1.plot(run.best_prob, label=f"lr={fmt(cfg.lr)}, baseline={cfg.baseline}")
        ax1.set(xlabel="step", ylabel=f"p(best arm {b})", ylim=(0, 1), title="Learning the best arm")
        ax1.legend(fontsize=8)
        both = np.concatenate([g_with, g_without])
        bins = np.linspace(both.min(), both.max(), 40)
        ax2.hist(g_without, bins=bins, alpha=0.6, label=f"no baseline (var {fmt(v0.var_without)})")
        ax2.hist(g_with, bins=bins, alpha=0.6, label=f"{cfg.adv_mode} baseline (var {fmt(v0.var_with)})")
        ax2.set(
            xlabel=f"gradient estimate for arm {b}'s logit",
            ylabel="groups",
            title="Same pulls, with and without baseline",
        )
        ax2.legend(fontsize=8)

    lab.plot("bandit.png", draw, enabled=plot)
    knob = f"lr={fmt(cfg.lr)}, baseline={cfg.baseline} ({cfg.adv_mode})"
    if res.compare:
        knob = "variant (baseline / no baseline / negative lr / large lr)"
    return lab.finish("Bandit lab: REINFORCE with and without a baseline", knob, _shows(res), res.numbers)


HELP = "REINFORCE on a K-armed bandit: baseline, lr sign and size"
OPTIONS: tuple[tuple[Any, ...], ...] = (
    ("--arms", 5, "number of arms (means linspace(0.1, 0.9, K))"),
    ("--means", None, "comma-separated arm means (overrides --arms)"),
    ("--steps", 200, "training steps"),
    ("--lr", 1.0, "learning rate (negative: learn the wrong way)"),
    ("--batch", 8, "pulls per step (one group)"),
    ("--baseline", True, "group-relative baseline from the trainer's advantages (default on)"),
    ("--adv-mode", "dr_grpo", "advantage mode with --baseline", {"choices": ADV_MODES}),
    ("--reward", "bernoulli", "reward distribution of an arm", {"choices": ("bernoulli", "gaussian")}),
    ("--noise", 1.0, "std of Gaussian rewards"),
    ("--slow", False, "print every pull: arm, reward, baseline, advantage, dp"),
    ("--compare", False, "also run baseline / no-baseline / negative-lr / large-lr over several seeds"),
    ("--compare-seeds", 20, "seeds per variant of --compare"),
    ("--large-lr", None, "lr of the large-lr variant (default 50 x |lr|)", {"type": float}),
    ("--variance-samples", 2000, "groups drawn to measure gradient variance"),
)


def command(args: argparse.Namespace) -> int:
    """``palaestra lab bandit`` with its parsed arguments; the exit code."""
    means = tuple(parse_floats(args.means, field="--means")) if args.means else None
    cfg = config_from_args(BanditConfig, args, means=means)
    flags = args_of(args, "compare", "compare_seeds", "large_lr", "variance_samples")
    slow = print if args.slow else None
    res = run_bandit_lab(cfg, args.outdir, plot=not args.no_plot, print_fn=slow, **flags)
    return print_result(
        res.outdir, quiet=args.quiet, blocks=[*_shows(res), [asdict(r) for r in res.compare or []]]
    )
