"""``palaestra lab two-step``: credit assignment in a two-step decision with a reward only at the end."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
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
from palaestra.trainer.advantages import group_advantages, turn_advantages
from palaestra.trajectories.runs import args_of, fmt

PATHS = ("AX", "AY", "BX", "BY")
TURN_CREDITS = ("final", "returns", "turn_group")


@dataclass(frozen=True)
class TwoStepConfig:
    """Every knob of one two-step run; ``rewards`` are the end rewards of A->X, A->Y, B->X, B->Y."""

    steps: int = 300
    lr: float = 1.0
    batch: int = 16
    credit_step1: bool = True
    baseline: bool = True
    adv_mode: str = "dr_grpo"
    rewards: tuple[float, float, float, float] = (1.0, 0.0, 0.4, 0.4)
    noise: float = 0.0
    seed: int = 0
    turn_credit: str = "final"
    step1_rewards: tuple[float, float] = (0.0, 0.0)
    discount: float = 1.0

    def __post_init__(self) -> None:
        require_in(self, "turn_credit", TURN_CREDITS)
        ok = len(self.step1_rewards) == 2 and all(np.isfinite(self.step1_rewards))
        require(ok, "step1_rewards", "expected 2 finite numbers (A, B)", self.step1_rewards)
        require(0.0 <= self.discount <= 1.0, "discount", "must be in [0, 1]", self.discount)
        require(self.steps >= 1, "steps", "must be >= 1", self.steps)
        require(self.batch >= 2, "batch", "must be >= 2 (episodes per update)", self.batch)
        ok = len(self.rewards) == 4 and all(np.isfinite(self.rewards))
        require(ok, "rewards", "expected 4 finite numbers (AX, AY, BX, BY)", self.rewards)
        require_in(self, "adv_mode", ADV_MODES)
        require(np.isfinite(self.lr), "lr", "must be finite", self.lr)
        require(self.noise >= 0, "noise", "must be >= 0", self.noise)

    def table(self) -> np.ndarray:
        """End rewards as a 2x2 array ``R[first, second]``."""
        return np.asarray(self.rewards, dtype=np.float64).reshape(2, 2)


def expected_reward(pi1: np.ndarray, pi2: np.ndarray, table: np.ndarray) -> float:
    """``sum_a pi1[a] * sum_b pi2[a, b] * R[a, b]``."""
    return float(pi1 @ (pi2 * table).sum(axis=1))


@dataclass
class TwoStepRun:
    """History of one run: ``pi1[t]`` (2,) and ``pi2[t]`` (2, 2) before step ``t`` (``steps + 1`` entries);
    ``step1_grad[t]`` is the step-1 REINFORCE estimate of step ``t`` (applied only with credit)."""

    config: TwoStepConfig
    pi1: np.ndarray
    pi2: np.ndarray
    mean_reward: np.ndarray
    step1_grad: np.ndarray

    def expected_reward(self) -> np.ndarray:
        tab = self.config.table()
        return np.asarray([expected_reward(a, b, tab) for a, b in zip(self.pi1, self.pi2)])

    @property
    def p_first_a(self) -> np.ndarray:
        return np.asarray(self.pi1[:, 0])


def train_two_step(cfg: TwoStepConfig, *, print_fn: Callable[[str], None] | None = None) -> TwoStepRun:
    """Train both steps from uniform policies; ``print_fn`` receives one line per step (``--slow``)."""
    rng = np.random.default_rng(cfg.seed)
    tab = cfg.table()
    th1, th2 = np.zeros(2), np.zeros((2, 2))
    pi1s, pi2s, mean_r, g1s = [softmax(th1)], [softmax(th2)], [], []
    for step in range(cfg.steps):
        p1, p2 = softmax(th1), softmax(th2)
        a1 = rng.choice(2, size=cfg.batch, p=p1)
        a2 = np.array([rng.choice(2, p=p2[a]) for a in a1])
        r = tab[a1, a2] + (cfg.noise * rng.standard_normal(cfg.batch) if cfg.noise else 0.0)
        s1 = np.asarray(cfg.step1_rewards, dtype=np.float64)[a1]  # per-turn reward of step 1
        if cfg.turn_credit != "final" and cfg.baseline:
            per_turn = turn_advantages(
                r,
                [[float(x), 0.0] for x in s1],
                [2] * cfg.batch,
                credit=cfg.turn_credit,  # type: ignore[arg-type]
                mode=cfg.adv_mode,  # type: ignore[arg-type]
                discount=cfg.discount,
            )
            adv1, adv2 = np.stack(per_turn).T
        else:  # the same end advantage credits both choices of each episode (per-turn rewards unused)
            adv = group_advantages(r, mode=cfg.adv_mode) if cfg.baseline else r.copy()  # type: ignore[arg-type]
            adv1 = adv2 = adv
        g1 = reinforce_grad(p1, a1, adv1)
        g2 = np.zeros((2, 2))
        np.add.at(g2, a1, adv2[:, None] * (np.eye(2)[a2] - p2[a1]))
        g2 /= cfg.batch
        if cfg.credit_step1:
            th1 = th1 + cfg.lr * g1
        th2 = th2 + cfg.lr * g2
        pi1s.append(softmax(th1))
        pi2s.append(softmax(th2))
        mean_r.append(float(r.mean()))
        g1s.append(g1)
        if print_fn is not None:
            counts = {path: int(np.sum(2 * a1 + a2 == i)) for i, path in enumerate(PATHS)}
            print_fn(
                f"step {step:4d}: paths {counts}  mean r={r.mean():.3f}  step-1 grad[A]={g1[0]:+.4f}"
                f"{'' if cfg.credit_step1 else ' (dropped)'}  p(A) {p1[0]:.3f}->{pi1s[-1][0]:.3f}  "
                f"p(X|A) {p2[0, 0]:.3f}->{pi2s[-1][0, 0]:.3f}  p(X|B) {p2[1, 0]:.3f}->{pi2s[-1][1, 0]:.3f}"
            )
    return TwoStepRun(cfg, np.asarray(pi1s), np.asarray(pi2s), np.asarray(mean_r), np.asarray(g1s))


@dataclass
class TwoStepLabResult:
    """What ``palaestra lab two-step`` computed; ``other``: the run of ``--compare`` or ``--compare-credit``."""

    config: TwoStepConfig
    run: TwoStepRun
    other: TwoStepRun | None
    outdir: Path | None
    numbers: dict[str, Any]


def _run_numbers(run: TwoStepRun) -> dict[str, Any]:
    tail = max(1, run.config.steps // 10)
    exp_r = run.expected_reward()
    return {
        "credit_step1": run.config.credit_step1,
        "turn_credit": run.config.turn_credit,
        "initial_p_A": float(run.p_first_a[0]),
        "final_p_A": float(run.p_first_a[-1]),
        "max_abs_p_A_minus_initial": float(np.abs(run.p_first_a - run.p_first_a[0]).max()),
        "final_p_X_given_A": float(run.pi2[-1, 0, 0]),
        "final_p_X_given_B": float(run.pi2[-1, 1, 0]),
        "initial_expected_reward": float(exp_r[0]),
        "final_expected_reward": float(exp_r[-1]),
        "optimal_reward": float(run.config.table().max()),
        "final_regret": float(run.config.table().max() - exp_r[-1]),
        "mean_reward_last_10pct": float(run.mean_reward[-tail:].mean()),
        "mean_step1_grad_A": float(run.step1_grad[:, 0].mean()),
    }


def run_two_step_lab(
    cfg: TwoStepConfig,
    outdir: str | Path | None = None,
    *,
    compare: bool = False,
    compare_credit: bool = False,
    plot: bool = True,
    print_fn: Callable[[str], None] | None = None,
) -> TwoStepLabResult:
    """Train (and the opposite ``credit_step1`` or turn credit, same seed); write ``outdir``; ``print_fn``: --slow."""
    require(
        not (compare and compare_credit), "compare_credit", "cannot be combined with compare", compare_credit
    )
    run = train_two_step(cfg, print_fn=print_fn)
    other = train_two_step(replace(cfg, credit_step1=not cfg.credit_step1)) if compare else None
    if compare_credit:
        alt = "returns" if cfg.turn_credit == "final" else "final"
        other = train_two_step(replace(cfg, turn_credit=alt))
    numbers = _run_numbers(run)
    if other is not None:
        numbers.update({f"other.{k}": v for k, v in _run_numbers(other).items()})
    res = TwoStepLabResult(cfg, run, other, None, numbers)
    if outdir is not None:
        res.outdir = _write(res, Path(outdir), plot=plot, compare=compare, by_credit=compare_credit)
    return res


def _shows(res: TwoStepLabResult) -> list[str]:
    out = []
    for run in [res.run] + ([res.other] if res.other is not None else []):
        n = _run_numbers(run)
        label = "with step-1 credit" if run.config.credit_step1 else "WITHOUT step-1 credit"
        label += f" (turn credit {run.config.turn_credit})"
        out.append(
            f"{label}: p(A) {fmt(n['initial_p_A'])} -> {fmt(n['final_p_A'])}, "
            f"p(X|A) -> {fmt(n['final_p_X_given_A'])}, "
            f"expected reward {fmt(n['initial_expected_reward'])} -> {fmt(n['final_expected_reward'])} "
            f"(optimum {fmt(n['optimal_reward'])}, regret {fmt(n['final_regret'])})."
        )
        if not run.config.credit_step1:
            out.append(
                "Without credit the first choice never moves although its gradient was there: the step-1 "
                f"estimate for A averaged {fmt(n['mean_step1_grad_A'])} per step and was thrown away; step 2 "
                "learned its part, yet every episode that starts with B still pays at most "
                f"{fmt(float(res.config.table()[1].max()))}."
            )
    return out


def _write(res: TwoStepLabResult, outdir: Path, *, plot: bool, compare: bool, by_credit: bool) -> Path:
    cfg = res.config
    knobs = {**asdict(cfg), "compare": compare, "compare_credit": by_credit, "paths": PATHS}
    lab = LabRun(outdir, lab="two-step", seed=cfg.seed, knobs=knobs)
    runs = [res.run] + ([res.other] if res.other is not None else [])
    rows = [
        {
            "credit_step1": run.config.credit_step1,
            "turn_credit": run.config.turn_credit,
            "step": t,
            "p_A": float(run.pi1[t, 0]),
            "p_X_given_A": float(run.pi2[t, 0, 0]),
            "p_X_given_B": float(run.pi2[t, 1, 0]),
            "expected_reward": float(exp_r),
            "mean_reward": float(run.mean_reward[t - 1]) if t else "",
            "step1_grad_A": float(run.step1_grad[t - 1, 0]) if t else "",
        }
        for run in runs
        for t, exp_r in enumerate(run.expected_reward())
    ]
    lab.write_csv("steps.csv", rows)
    if res.other is not None:
        cmp_rows = [_run_numbers(r) for r in runs]
        heading = "Final vs per-turn credit" if by_credit else "With and without step-1 credit"
        lab.write_csv("compare.csv", cmp_rows, table=f"{heading} (compare.csv)")

    def draw(plt: Any) -> None:
        _fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
        for ax, run in zip(axes[0], runs):
            ax.plot(run.pi1[:, 0], label="p(A) (step 1)")
            ax.plot(run.pi2[:, 0, 0], label="p(X | A) (step 2)")
            ax.plot(run.pi2[:, 1, 0], label="p(X | B) (step 2)", alpha=0.6)
            ax.plot(run.expected_reward(), "k--", label="expected reward")
            title = "with step-1 credit" if run.config.credit_step1 else "no step-1 credit"
            title += f", turn credit {run.config.turn_credit}" if by_credit else ""
            ax.set(xlabel="step", ylim=(0, 1.05), title=title)
            ax.legend(fontsize=8)

    lab.plot("two_step.png", draw, enabled=plot)
    if by_credit and res.other is not None:
        knob = f"turn_credit ({cfg.turn_credit} vs {res.other.config.turn_credit}, same seed)"
    else:
        knob = "credit_step1 (both runs, same seed)" if compare else f"credit_step1={cfg.credit_step1}"
    return lab.finish("Two-step lab: credit for the first choice", knob, _shows(res), res.numbers)


_NO_CREDIT = {"dest": "credit_step1", "action": "store_false"}


HELP = "two-step MDP: end reward credits both choices (--no-credit-step1)"
OPTIONS: tuple[tuple[Any, ...], ...] = (
    ("--steps", 300, "training steps"),
    ("--lr", 1.0, "learning rate"),
    ("--batch", 16, "episodes per update (one group)"),
    ("--no-credit-step1", True, "do not update the step-1 policy (shows the failure)", _NO_CREDIT),
    ("--baseline", True, "group-relative baseline from the trainer's advantages (default on)"),
    ("--adv-mode", "dr_grpo", "advantage mode with --baseline", {"choices": ADV_MODES}),
    ("--rewards", "1,0,0.4,0.4", "end rewards of A->X,A->Y,B->X,B->Y"),
    ("--noise", 0.0, "std of Gaussian noise added to the end reward"),
    ("--compare", False, "also run the opposite --no-credit-step1 setting"),
    ("--turn-credit", "final", "per-turn credit (docs/labs.md)", {"choices": TURN_CREDITS}),
    ("--step1-rewards", "0,0", "per-turn reward of step 1 for A,B"),
    ("--discount", 1.0, "discount of per-turn returns"),
    ("--compare-credit", False, "also run final vs per-turn credit on the same seed"),
    ("--slow", False, "print every step: paths taken, rewards, policies"),
)


def command(args: argparse.Namespace) -> int:
    """``palaestra lab two-step`` with its parsed arguments; the exit code."""
    cfg = config_from_args(
        TwoStepConfig,
        args,
        rewards=tuple(parse_floats(args.rewards, field="--rewards")),
        step1_rewards=tuple(parse_floats(args.step1_rewards, field="--step1-rewards")),
    )
    flags = args_of(args, "compare", "compare_credit")
    slow = print if args.slow else None
    res = run_two_step_lab(cfg, args.outdir, plot=not args.no_plot, print_fn=slow, **flags)
    table = [_run_numbers(r) for r in (res.run, res.other)] if res.other is not None else []
    return print_result(res.outdir, quiet=args.quiet, blocks=[*_shows(res), table])
