"""``palaestra lab two-step``: credit assignment in a two-step decision with a reward only at the end.

Step 1 chooses A or B; step 2 chooses X or Y with a policy conditioned on the first choice; the episode pays
``R[first, second]`` (default ``A->X = 1, A->Y = 0, B->X = B->Y = 0.4``), so the best path needs the right
*first* step. Both steps are softmax policies (``pi1`` over {A, B}; ``pi2[first]`` over {X, Y}) trained by
REINFORCE on batches of episodes: the episode's end reward becomes one advantage (the trainer's
:func:`~palaestra.trainer.advantages.group_advantages` over the batch, or the raw reward without baseline),
and that same advantage multiplies the log-probability gradient of *both* steps' choices, exactly as a token
sequence shares one sequence-level advantage in GRPO.

``credit_step1=False`` (``--no-credit-step1``) drops the step-1 update: step 2 still learns to pick X after A,
but the first choice stays at its initial uniform distribution, so half of the episodes start with B and the
policy earns far less than the optimum. The lab also records the step-1 gradient that was available (and
thrown away) at each step.

Per-turn credit (``--turn-credit returns|turn_group``, ``--step1-rewards A,B``, ``--discount``): step 1 may
earn a per-turn reward (``Trajectory.turn_rewards`` in a real rollout) in addition to the end reward, and
each step's choice gets its own advantage from
:func:`~palaestra.trainer.advantages.turn_advantages`. With end rewards that do not depend on the first
choice (``--rewards 1,0,1,0``) and a per-turn reward for A (``--step1-rewards 0.5,0``), the final reward
alone (``final``) carries nothing about step 1 and p(A) only drifts, while per-turn credit learns A;
``--compare-credit`` runs both on the same seed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.labs.common import (
    ADV_MODES,
    LabRun,
    args_of,
    config_from_args,
    fmt,
    lab_parser,
    parse_floats,
    print_result,
    softmax,
)

__all__ = [
    "TwoStepConfig",
    "TwoStepLabResult",
    "TwoStepRun",
    "expected_reward",
    "register_lab",
    "run_two_step_lab",
    "train_two_step",
]

FIRST = ("A", "B")
SECOND = ("X", "Y")
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
        if self.turn_credit not in TURN_CREDITS:
            raise ValueError(f"turn_credit: expected one of {TURN_CREDITS}, got {self.turn_credit!r}")
        if len(self.step1_rewards) != 2 or not all(np.isfinite(self.step1_rewards)):
            raise ValueError(f"step1_rewards: expected 2 finite numbers (A, B), got {self.step1_rewards!r}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount: must be in [0, 1], got {self.discount}")
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")
        if self.batch < 2:
            raise ValueError(f"batch: must be >= 2 (episodes per update), got {self.batch}")
        if len(self.rewards) != 4 or not all(np.isfinite(self.rewards)):
            raise ValueError(f"rewards: expected 4 finite numbers (AX, AY, BX, BY), got {self.rewards!r}")
        if self.adv_mode not in ADV_MODES:
            raise ValueError(f"adv_mode: expected one of {ADV_MODES}, got {self.adv_mode!r}")
        if not np.isfinite(self.lr):
            raise ValueError(f"lr: must be finite, got {self.lr}")
        if self.noise < 0:
            raise ValueError(f"noise: must be >= 0, got {self.noise}")

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
    from palaestra.trainer.advantages import group_advantages, turn_advantages

    rng = np.random.default_rng(cfg.seed)
    tab = cfg.table()
    th1, th2 = np.zeros(2), np.zeros((2, 2))
    pi1s, pi2s, mean_r, g1s = [softmax(th1)], [softmax(th2)], [], []
    eye = np.eye(2)
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
            adv1 = np.asarray([a[0] for a in per_turn])
            adv2 = np.asarray([a[1] for a in per_turn])
        else:  # the same end advantage credits both choices of each episode (per-turn rewards unused)
            adv = group_advantages(r, mode=cfg.adv_mode) if cfg.baseline else r.copy()  # type: ignore[arg-type]
            adv1 = adv2 = adv
        g1 = (adv1[:, None] * (eye[a1] - p1)).mean(axis=0)
        g2 = np.zeros((2, 2))
        np.add.at(g2, a1, adv2[:, None] * (eye[a2] - p2[a1]))
        g2 /= cfg.batch
        if cfg.credit_step1:
            th1 = th1 + cfg.lr * g1
        th2 = th2 + cfg.lr * g2
        pi1s.append(softmax(th1))
        pi2s.append(softmax(th2))
        mean_r.append(float(r.mean()))
        g1s.append(g1)
        if print_fn is not None:
            counts = {
                f"{FIRST[x]}{SECOND[y]}": int(np.sum((a1 == x) & (a2 == y))) for x in (0, 1) for y in (0, 1)
            }
            print_fn(
                f"step {step:4d}: paths {counts}  mean r={r.mean():.3f}  step-1 grad[A]={g1[0]:+.4f}"
                f"{'' if cfg.credit_step1 else ' (dropped)'}  p(A) {p1[0]:.3f}->{pi1s[-1][0]:.3f}  "
                f"p(X|A) {p2[0, 0]:.3f}->{pi2s[-1][0, 0]:.3f}  p(X|B) {p2[1, 0]:.3f}->{pi2s[-1][1, 0]:.3f}"
            )
    return TwoStepRun(cfg, np.asarray(pi1s), np.asarray(pi2s), np.asarray(mean_r), np.asarray(g1s))


@dataclass
class TwoStepLabResult:
    """What ``palaestra lab two-step`` computed; ``other`` is the opposite-credit run of ``--compare``."""

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
    slow: bool = False,
    plot: bool = True,
    print_fn: Callable[[str], None] | None = None,
    argv: Sequence[str] | None = None,
) -> TwoStepLabResult:
    """Train (and with ``compare`` also the opposite ``credit_step1`` on the same seed); write ``outdir``."""
    run = train_two_step(cfg, print_fn=print_fn if slow else None)
    other = train_two_step(replace(cfg, credit_step1=not cfg.credit_step1)) if compare else None
    if compare_credit:
        alt = "returns" if cfg.turn_credit == "final" else "final"
        other = train_two_step(replace(cfg, turn_credit=alt))
    numbers = _run_numbers(run)
    if other is not None:
        numbers.update({f"other.{k}": v for k, v in _run_numbers(other).items()})
    res = TwoStepLabResult(cfg, run, other, None, numbers)
    if outdir is not None:
        res.outdir = _write(res, Path(outdir), plot=plot, argv=argv)
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


def _write(res: TwoStepLabResult, outdir: Path, *, plot: bool, argv: Sequence[str] | None) -> Path:
    cfg = res.config
    knobs = {**asdict(cfg), "compare": res.other is not None, "paths": PATHS}
    lab = LabRun(outdir, lab="two-step", seed=cfg.seed, knobs=knobs, argv=argv)
    runs = [res.run] + ([res.other] if res.other is not None else [])
    rows = []
    for run in runs:
        exp_r = run.expected_reward()
        for t in range(cfg.steps + 1):
            rows.append(
                {
                    "credit_step1": run.config.credit_step1,
                    "step": t,
                    "p_A": float(run.pi1[t, 0]),
                    "p_X_given_A": float(run.pi2[t, 0, 0]),
                    "p_X_given_B": float(run.pi2[t, 1, 0]),
                    "expected_reward": float(exp_r[t]),
                    "mean_reward": float(run.mean_reward[t - 1]) if t else "",
                    "step1_grad_A": float(run.step1_grad[t - 1, 0]) if t else "",
                }
            )
    lab.write_csv("steps.csv", rows)
    tables: list[tuple[str, Any]] = []
    if res.other is not None:
        cmp_rows = [_run_numbers(r) for r in runs]
        lab.write_csv("compare.csv", cmp_rows)
        tables.append(("With and without step-1 credit (compare.csv)", cmp_rows))

    def draw(plt: Any) -> None:
        fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
        for ax, run in zip(axes[0], runs):
            ax.plot(run.pi1[:, 0], label="p(A) (step 1)")
            ax.plot(run.pi2[:, 0, 0], label="p(X | A) (step 2)")
            ax.plot(run.pi2[:, 1, 0], label="p(X | B) (step 2)", alpha=0.6)
            ax.plot(run.expected_reward(), "k--", label="expected reward")
            title = "with step-1 credit" if run.config.credit_step1 else "no step-1 credit"
            ax.set(xlabel="step", ylim=(0, 1.05), title=title)
            ax.legend(fontsize=8)
        fig.tight_layout()

    lab.plot("two_step.png", draw, enabled=plot)
    knob = "credit_step1 (both runs, same seed)" if res.other else f"credit_step1={cfg.credit_step1}"
    return lab.finish("Two-step lab: credit for the first choice", knob, _shows(res), res.numbers, tables)


def register_lab(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``lab two-step``."""
    p = lab_parser(
        sub, "two-step", help="two-step MDP: end reward credits both choices (--no-credit-step1)", doc=__doc__
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=16, help="episodes per update (one group)")
    p.add_argument(
        "--no-credit-step1",
        dest="credit_step1",
        action="store_false",
        help="do not update the step-1 policy (shows the failure)",
    )
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--adv-mode", choices=ADV_MODES, default="dr_grpo")
    p.add_argument("--rewards", default="1,0,0.4,0.4", help="end rewards of A->X,A->Y,B->X,B->Y")
    p.add_argument("--noise", type=float, default=0.0, help="std of Gaussian noise added to the end reward")
    p.add_argument("--compare", action="store_true", help="also run the opposite --no-credit-step1 setting")
    p.add_argument("--turn-credit", choices=TURN_CREDITS, default="final", help="per-turn credit (see doc)")
    p.add_argument("--step1-rewards", default="0,0", help="per-turn reward of step 1 for A,B")
    p.add_argument("--discount", type=float, default=1.0, help="discount of per-turn returns")
    p.add_argument(
        "--compare-credit", action="store_true", help="also run final vs per-turn credit on the same seed"
    )
    p.add_argument("--slow", action="store_true", help="print every step: paths taken, rewards, policies")
    p.set_defaults(func=two_step_command)


def two_step_command(args: argparse.Namespace) -> int:
    """``palaestra lab two-step``."""
    cfg = config_from_args(
        TwoStepConfig,
        args,
        rewards=tuple(parse_floats(args.rewards, field="--rewards")),
        step1_rewards=tuple(parse_floats(args.step1_rewards, field="--step1-rewards")),
    )
    flags = args_of(args, "compare", "compare_credit", "slow")
    res = run_two_step_lab(cfg, args.outdir, plot=not args.no_plot, print_fn=print, **flags)
    table = [_run_numbers(r) for r in (res.run, res.other)] if res.other is not None else []
    return print_result(res.outdir, quiet=args.quiet, blocks=[*_shows(res), table])
