"""``palaestra lab bandit``: REINFORCE on a K-armed bandit, the smallest Loop C there is.

The policy is a softmax over K logits ``theta``. Each step pulls B arms from ``pi = softmax(theta)`` (one
group), scores them, turns rewards into advantages and moves ``theta`` along the REINFORCE estimate

    g = (1/B) * sum_i A_i * grad log pi(a_i) = (1/B) * sum_i A_i * (onehot(a_i) - pi),     theta += lr * g

With ``baseline=True`` the advantages come from the trainer's
:func:`~palaestra.trainer.advantages.group_advantages` (default ``dr_grpo``: ``A_i = r_i - mean(r)``; ``rloo``
and ``grpo`` also accepted); without it ``A_i = r_i``.
The exact gradient of the expected reward is ``pi_k * (mu_k - sum_j pi_j mu_j)``, which the lab uses to show
what each estimator aims at.

What the lab measures:

- the variance of the gradient estimator with and without baseline, at the same policy, on the *same* pulls
  (common random numbers), so the only difference is the baseline;
- negative ``lr``: the update follows ``-g``, so the best arm's probability falls;
- too large ``lr``: the first lucky group throws the policy onto one arm, which may not be the best, and
  the policy cannot leave it (the pulls all hit that arm, so the group-relative advantage is zero): measured
  as the rate of "wrong-arm lock-in" over several seeds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.labs.bandit_core import (
    BASELINE_MODES,
    BanditConfig,
    BanditRun,
    GradientVariance,
    VariantSummary,
    compare_bandit,
    default_variants,
    gradient_samples,
    measure_gradient_variance,
    train_bandit,
)
from palaestra.labs.common import LabRun, add_common_args, fmt, parse_floats, print_table
from palaestra.trajectories.io import DataError

__all__ = [
    "BanditConfig",
    "BanditLabResult",
    "BanditRun",
    "GradientVariance",
    "VariantSummary",
    "compare_bandit",
    "default_variants",
    "gradient_samples",
    "measure_gradient_variance",
    "register_lab",
    "run_bandit_lab",
    "train_bandit",
]


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
    slow: bool = False,
    plot: bool = True,
    variance_samples: int = 2000,
    print_fn: Callable[[str], None] | None = None,
    argv: Sequence[str] | None = None,
) -> BanditLabResult:
    """Train one run, measure the gradient variance with/without baseline at the start and end policies,
    optionally compare the variants over seeds, and (with ``outdir``) write the run folder."""
    run = train_bandit(cfg, record_pulls=outdir is not None, print_fn=print_fn if slow else None)
    v0 = measure_gradient_variance(cfg, samples=variance_samples)
    final_logits = np.log(np.clip(run.final_probs, 1e-300, None))
    v1 = measure_gradient_variance(cfg, final_logits, samples=variance_samples)
    table = runs = None
    if compare:
        table, runs = compare_bandit(cfg, seeds=compare_seeds, large_lr=large_lr)
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
        result.outdir = _write_bandit(
            cfg,
            result,
            runs,
            Path(outdir),
            plot=plot,
            argv=argv,
            variance_samples=variance_samples,
            compare_seeds=compare_seeds,
            large_lr=large_lr,
        )
    return result


def _shows(cfg: BanditConfig, res: BanditLabResult) -> list[str]:
    v0, run = res.variance_start, res.run
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


def _write_bandit(
    cfg: BanditConfig,
    res: BanditLabResult,
    runs: dict[str, list[BanditRun]] | None,
    outdir: Path,
    *,
    plot: bool,
    argv: Sequence[str] | None,
    variance_samples: int,
    compare_seeds: int,
    large_lr: float | None,
) -> Path:
    knobs = {
        **asdict(cfg),
        "compare": res.compare is not None,
        "compare_seeds": compare_seeds,
        "large_lr": large_lr,
        "variance_samples": variance_samples,
    }
    lab = LabRun(outdir, lab="bandit", seed=cfg.seed, knobs=knobs, argv=argv)
    run = res.run
    k = run.probs.shape[1]
    ent = -(run.probs * np.log(np.clip(run.probs, 1e-300, None))).sum(axis=1)
    exp_r = run.expected_reward()
    rows = []
    for t in range(cfg.steps + 1):
        row: dict[str, Any] = {
            "step": t,
            "mean_reward": float(run.mean_reward[t - 1]) if t else "",
            "expected_reward": float(exp_r[t]),
            "p_best": float(run.best_prob[t]),
            "entropy": float(ent[t]),
        }
        row.update({f"p_{j}": float(run.probs[t, j]) for j in range(k)})
        rows.append(row)
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
    lab.write_csv("gradient_variance.csv", var_rows)
    tables: list[tuple[str, Any]] = [("Gradient variance (same pulls, with vs without baseline)", var_rows)]
    if res.compare is not None:
        cmp_rows = [r.row() for r in res.compare]
        lab.write_csv("compare.csv", cmp_rows)
        tables.append(("Variants (compare.csv)", cmp_rows))
    _, g_with, g_without = gradient_samples(cfg, samples=variance_samples)

    def draw(plt: Any) -> None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        if runs:
            for name, rs in runs.items():
                ax1.plot(
                    np.mean([r.best_prob for r in rs], axis=0), label=f"{name} (mean of {len(rs)} seeds)"
                )
        else:
            ax1.plot(run.best_prob, label=f"lr={fmt(cfg.lr)}, baseline={cfg.baseline}")
        ax1.set(
            xlabel="step", ylabel=f"p(best arm {cfg.best_arm})", ylim=(0, 1), title="Learning the best arm"
        )
        ax1.legend(fontsize=8)
        b = cfg.best_arm
        bins = np.linspace(
            min(g_with[:, b].min(), g_without[:, b].min()), max(g_with[:, b].max(), g_without[:, b].max()), 40
        )
        ax2.hist(
            g_without[:, b],
            bins=bins,
            alpha=0.6,
            label=f"no baseline (var {fmt(res.variance_start.var_without)})",
        )
        ax2.hist(
            g_with[:, b],
            bins=bins,
            alpha=0.6,
            label=f"{cfg.adv_mode} baseline (var {fmt(res.variance_start.var_with)})",
        )
        ax2.set(
            xlabel=f"gradient estimate for arm {b}'s logit",
            ylabel="groups",
            title="Same pulls, with and without baseline",
        )
        ax2.legend(fontsize=8)
        fig.tight_layout()

    lab.plot("bandit.png", draw, enabled=plot)
    knob = (
        "variant (baseline / no baseline / negative lr / large lr)"
        if res.compare
        else (f"lr={fmt(cfg.lr)}, baseline={cfg.baseline} ({cfg.adv_mode})")
    )
    return lab.finish(
        title="Bandit lab: REINFORCE with and without a baseline",
        knob=knob,
        shows=_shows(cfg, res),
        numbers=res.numbers,
        tables=tables,
    )


def register_lab(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``lab bandit``."""
    p = sub.add_parser(
        "bandit",
        help="REINFORCE on a K-armed bandit: baseline, lr sign and size",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_common_args(p, lab="bandit")
    p.add_argument("--arms", type=int, default=5, help="number of arms (means linspace(0.1, 0.9, K))")
    p.add_argument("--means", default=None, help="comma-separated arm means (overrides --arms)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1.0, help="learning rate (negative: learn the wrong way)")
    p.add_argument("--batch", type=int, default=8, help="pulls per step (one group)")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="group-relative baseline from the trainer's advantages (default on)",
    )
    p.add_argument(
        "--adv-mode", choices=BASELINE_MODES, default="dr_grpo", help="advantage mode with --baseline"
    )
    p.add_argument("--reward", choices=("bernoulli", "gaussian"), default="bernoulli")
    p.add_argument("--noise", type=float, default=1.0, help="std of Gaussian rewards")
    p.add_argument(
        "--slow", action="store_true", help="print every pull: arm, reward, baseline, advantage, dp"
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run baseline / no-baseline / negative-lr / large-lr over several seeds",
    )
    p.add_argument("--compare-seeds", type=int, default=20)
    p.add_argument(
        "--large-lr", type=float, default=None, help="lr of the large-lr variant (default 50 x |lr|)"
    )
    p.add_argument(
        "--variance-samples", type=int, default=2000, help="groups drawn to measure gradient variance"
    )
    p.set_defaults(func=bandit_command)


def bandit_command(args: argparse.Namespace) -> int:
    """``palaestra lab bandit``."""
    means = tuple(parse_floats(args.means, field="--means")) if args.means else None
    try:
        cfg = BanditConfig(
            arms=args.arms,
            steps=args.steps,
            lr=args.lr,
            batch=args.batch,
            baseline=args.baseline,
            adv_mode=args.adv_mode,
            reward=args.reward,
            noise=args.noise,
            means=means,
            seed=args.seed,
        )
    except ValueError as exc:
        raise DataError(str(exc)) from None
    res = run_bandit_lab(
        cfg,
        args.outdir,
        compare=args.compare,
        compare_seeds=args.compare_seeds,
        large_lr=args.large_lr,
        slow=args.slow,
        plot=not args.no_plot,
        variance_samples=args.variance_samples,
        print_fn=print,
    )
    if not args.quiet:
        for line in _shows(cfg, res):
            print(line)
        if res.compare:
            print_table([r.row() for r in res.compare])
    print(f"wrote {res.outdir}")
    return 0
