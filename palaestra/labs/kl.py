"""``palaestra lab kl``: the KL-regularised objective on a small discrete table, solved exactly."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.labs.common import LabRun, config_from_args, parse_floats, print_result
from palaestra.trajectories.io import DataError
from palaestra.trajectories.runs import fmt

Floats = Sequence[float] | np.ndarray

DEFAULT_REWARDS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 1.0)
DEFAULT_REF: tuple[float, ...] = (0.25, 0.2, 0.15, 0.12, 0.1, 0.08, 0.06, 0.04)
DEFAULT_BETAS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0)


def _check_table(rewards: Floats, ref: Floats) -> tuple[np.ndarray, np.ndarray]:
    r, q = np.asarray(rewards, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if r.ndim != 1 or r.size < 2:
        raise DataError(f"rewards: need at least 2 candidates, got {r.size}")
    if q.shape != r.shape:
        raise DataError(f"ref: expected {r.size} probabilities (one per reward), got {q.size}")
    if not (np.all(np.isfinite(r)) and np.all(np.isfinite(q))):
        raise DataError("rewards/ref: values must be finite")
    if np.any(q < 0) or q.sum() <= 0:
        raise DataError(f"ref: probabilities must be >= 0 with a positive sum, got {q.tolist()}")
    return r, q / q.sum()


def kl_divergence(p: Sequence[float] | np.ndarray, q: Sequence[float] | np.ndarray) -> float:
    """``KL(p || q)`` in nats; terms with ``p(y) = 0`` count 0; ``inf`` when ``p`` puts mass where ``q`` has none."""
    pa, qa = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    mask = pa > 0
    if np.any(qa[mask] <= 0):
        return float("inf")
    return float(max(0.0, np.sum(pa[mask] * (np.log(pa[mask]) - np.log(qa[mask])))))


def kl_optimal_policy(rewards: Floats, ref: Floats, beta: float) -> np.ndarray:
    """``pi*_beta = pi_ref * exp(r / beta) / Z_beta``, the maximiser of ``E_pi[r] - beta * KL(pi || pi_ref)``
    (value ``beta * log Z_beta``), computed in log space (stable for tiny beta)."""
    if not (np.isfinite(beta) and beta > 0):
        raise DataError(f"beta: must be a finite number > 0, got {beta!r}")
    r, q = _check_table(rewards, ref)
    with np.errstate(divide="ignore"):
        logits = np.log(q) + r / beta
    logits -= logits[np.isfinite(logits)].max()
    w = np.exp(logits)
    return np.asarray(w / w.sum())


@dataclass(frozen=True)
class KLPoint:
    """One beta of the trade-off: the optimal policy, its expected reward, KL to the reference, objective."""

    beta: float
    expected_reward: float
    kl: float
    objective: float
    policy: tuple[float, ...]

    def row(self) -> dict[str, Any]:
        head = {k: v for k, v in asdict(self).items() if k != "policy"}
        return {**head, **{f"pi_{i}": p for i, p in enumerate(self.policy)}}


def kl_tradeoff(rewards: Floats, ref: Floats, betas: Sequence[float]) -> list[KLPoint]:
    """The optimal policy's expected reward, KL and objective for each beta, in the order given."""
    r, q = _check_table(rewards, ref)
    out = []
    for beta in betas:
        pi = kl_optimal_policy(r, q, beta)
        er, kl = float(pi @ r), kl_divergence(pi, q)
        out.append(KLPoint(float(beta), er, kl, er - beta * kl, tuple(float(x) for x in pi)))
    return out


def default_candidates(rewards: Floats, ref: Floats) -> dict[str, np.ndarray]:
    """The choice rule's default candidates: reference, uniform, greedy, top-2 half-half, optima at beta 0.1 and 1."""
    r, q = _check_table(rewards, ref)
    onehot = np.eye(r.size)[np.argsort(-r, kind="stable")]  # row i: all mass on the i-th best candidate
    return {
        "reference": q,
        "uniform": np.full(r.size, 1.0 / r.size),
        "greedy": onehot[0],
        "top-2 half-half": onehot[:2].mean(axis=0),
        "optimum@beta=0.1": kl_optimal_policy(r, q, 0.1),
        "optimum@beta=1": kl_optimal_policy(r, q, 1.0),
    }


@dataclass(frozen=True)
class Choice:
    """The choice rule at one beta: each candidate's score ``E[r] - beta * KL`` and the winner."""

    beta: float
    winner: str
    scores: dict[str, float]
    optimum: float


def choose_by_objective(
    candidates: Mapping[str, Sequence[float] | np.ndarray],
    rewards: Floats,
    ref: Floats,
    betas: Sequence[float],
) -> list[Choice]:
    """For each beta pick the candidate maximising ``E[r] - beta * KL(pi || pi_ref)`` (first name on ties);
    ``optimum`` is the closed-form best value ``beta * log Z_beta`` that no candidate can beat."""
    r, q = _check_table(rewards, ref)
    cands = {name: np.asarray(p, dtype=np.float64) for name, p in candidates.items()}
    if not cands:
        raise DataError("candidates: need at least one candidate policy")
    for name, arr in cands.items():
        if arr.shape != r.shape or not np.all(np.isfinite(arr) & (arr >= 0)) or abs(arr.sum() - 1.0) > 1e-6:
            raise DataError(
                f"candidate {name!r}: expected {r.size} probabilities >= 0 summing to 1, got {arr.tolist()}"
            )
    out = []
    for beta in betas:
        scores = {n: float(p @ r) - beta * kl_divergence(p, q) for n, p in cands.items()}
        winner = max(scores, key=lambda n: scores[n])
        best = kl_tradeoff(r, q, [beta])[0].objective
        out.append(Choice(float(beta), winner, scores, best))
    return out


@dataclass(frozen=True)
class KLConfig:
    """Knobs of the KL lab; ``random_candidates > 0`` draws the table from ``seed`` (U(0,1) rewards, Dirichlet ref)."""

    rewards: tuple[float, ...] = DEFAULT_REWARDS
    ref: tuple[float, ...] = DEFAULT_REF
    betas: tuple[float, ...] = DEFAULT_BETAS
    random_candidates: int = 0
    seed: int | None = None
    extra_candidates: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rewards, normalised ref)``, drawn from ``seed`` when ``random_candidates > 0``."""
        if self.random_candidates:
            if self.random_candidates < 2:
                raise DataError(f"random_candidates: need at least 2, got {self.random_candidates}")
            rng = np.random.default_rng(self.seed)
            return rng.random(self.random_candidates), rng.dirichlet(np.ones(self.random_candidates))
        return _check_table(self.rewards, self.ref)


@dataclass
class KLLabResult:
    """What ``palaestra lab kl`` computed: the trade-off (betas sorted high to low) and the choices."""

    config: KLConfig
    rewards: np.ndarray
    ref: np.ndarray
    points: list[KLPoint]
    choices: list[Choice]
    outdir: Path | None
    numbers: dict[str, Any]


def run_kl_lab(cfg: KLConfig, outdir: str | Path | None = None, *, plot: bool = True) -> KLLabResult:
    """Tabulate the trade-off for every beta (largest first) and run the choice rule; write ``outdir``."""
    r, q = cfg.table()
    if not cfg.betas:
        raise DataError("betas: need at least one beta")
    betas = sorted({float(b) for b in cfg.betas}, reverse=True)
    points = kl_tradeoff(r, q, betas)
    cands = {**default_candidates(r, q), **{k: np.asarray(v) for k, v in cfg.extra_candidates.items()}}
    choices = choose_by_objective(cands, r, q, betas)
    kls = [p.kl for p in points]
    ers = [p.expected_reward for p in points]
    numbers: dict[str, Any] = {
        "candidates": int(r.size),
        "max_reward": float(r.max()),
        "reference_expected_reward": float(q @ r),
        "beta_max": betas[0],
        "beta_min": betas[-1],
        "expected_reward_at_beta_max": ers[0],
        "expected_reward_at_beta_min": ers[-1],
        "kl_at_beta_max": kls[0],
        "kl_at_beta_min": kls[-1],
        "kl_monotone_as_beta_falls": bool(np.all(np.diff(kls) >= -1e-12)),
        "reward_monotone_as_beta_falls": bool(np.all(np.diff(ers) >= -1e-12)),
    }
    numbers.update({f"winner@beta={fmt(c.beta)}": c.winner for c in choices})
    res = KLLabResult(cfg, r, q, points, choices, None, numbers)
    if outdir is not None:
        res.outdir = _write(res, Path(outdir), plot=plot)
    return res


def _shows(res: KLLabResult) -> list[str]:
    n, pts = res.numbers, res.points
    ranges = []  # consecutive betas with the same winner: "beta 10 .. 2: reference"
    for winner, group in itertools.groupby(res.choices, key=lambda c: c.winner):
        run = list(group)
        span = fmt(run[0].beta) if len(run) == 1 else f"{fmt(run[0].beta)} .. {fmt(run[-1].beta)}"
        ranges.append(f"beta {span}: {winner}")
    return [
        f"As beta falls from {fmt(n['beta_max'])} to {fmt(n['beta_min'])}, the optimal policy's KL to the "
        f"reference grows {fmt(n['kl_at_beta_max'])} -> {fmt(n['kl_at_beta_min'])} nats and its expected "
        f"reward {fmt(n['expected_reward_at_beta_max'])} -> {fmt(n['expected_reward_at_beta_min'])} "
        f"(reference {fmt(n['reference_expected_reward'])}, best candidate {fmt(n['max_reward'])}); "
        f"both monotone: KL {n['kl_monotone_as_beta_falls']}, reward {n['reward_monotone_as_beta_falls']}.",
        "Each beta buys reward with KL at its own price: "
        + "; ".join(
            f"beta {fmt(p.beta)}: E[r] {fmt(p.expected_reward)} at KL {fmt(p.kl)}"
            for p in pts[:: max(1, len(pts) // 4)]
        )
        + ".",
        "Choice rule (max E[r] - beta*KL over the candidates) picks " + "; ".join(ranges) + ".",
        "No candidate beats the closed-form optimum at any beta (its score is beta * log Z_beta).",
    ]


def _write(res: KLLabResult, outdir: Path, *, plot: bool) -> Path:
    knobs = {**asdict(res.config), "table_rewards": res.rewards, "table_ref": res.ref}
    lab = LabRun(outdir, lab="kl", seed=res.config.seed, knobs=knobs)
    lab.table(
        "Table",
        [{"candidate": i, "reward": r, "ref": q} for i, (r, q) in enumerate(zip(res.rewards, res.ref))],
    )
    lab.write_csv("kl_tradeoff.csv", [p.row() for p in res.points], table="Trade-off (kl_tradeoff.csv)")
    choice_rows = [
        {"beta": c.beta, "candidate": n, "score": s, "winner": n == c.winner, "optimum_score": c.optimum}
        for c in res.choices
        for n, s in c.scores.items()
    ]
    lab.write_csv("kl_choice.csv", choice_rows)
    win_rows = [
        {"beta": c.beta, "winner": c.winner, "score": c.scores[c.winner], "optimum": c.optimum}
        for c in res.choices
    ]
    lab.table("Choice rule winners (kl_choice.csv)", win_rows)
    cands = {**default_candidates(res.rewards, res.ref), **res.config.extra_candidates}

    def draw(plt: Any) -> None:
        _fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        xs = np.array([p.kl for p in res.points])
        ys = np.array([p.expected_reward for p in res.points])
        bs = [p.beta for p in res.points]
        ax1.plot(xs, ys, "o-", label="optimum pi*_beta")
        span = np.array([max(np.ptp(xs), 1e-12), max(np.ptp(ys), 1e-12)])
        last = None
        for p in res.points:  # label the betas that do not sit on top of the previous label
            here = np.array([p.kl, p.expected_reward]) / span
            if last is not None and np.hypot(*(here - last)) < 0.06:
                continue
            last = here
            ax1.annotate(
                f"β={fmt(p.beta, 2)}",
                (p.kl, p.expected_reward),
                fontsize=7,
                xytext=(3, -8),
                textcoords="offset points",
            )
        for name, pol in cands.items():
            pol = np.asarray(pol)
            ax1.scatter([kl_divergence(pol, res.ref)], [float(pol @ res.rewards)], marker="x", label=name)
        ax1.set(xlabel="KL(pi || pi_ref) [nats]", ylabel="expected reward", title="Reward bought with KL")
        ax1.legend(fontsize=7)
        ax2.semilogx(bs, ys, "o-", color="C0", label="expected reward")
        ax2.set(xlabel="beta", ylabel="expected reward", title="Per beta")
        ax3 = ax2.twinx()
        ax3.semilogx(bs, xs, "s--", color="C3", label="KL")
        ax3.set_ylabel("KL [nats]")
        ax2.legend(loc="upper right", fontsize=8)
        ax3.legend(loc="center right", fontsize=8)

    lab.plot("kl_tradeoff.png", draw, enabled=plot)
    return lab.finish(
        "KL lab: reward vs KL to the reference", "beta (the KL coefficient)", _shows(res), res.numbers
    )


_REPEAT = {"action": "append", "default": [], "metavar": "NAME=P1,P2,..."}


HELP = "KL-regularised optimum pi* ∝ pi_ref exp(r/beta) per beta; choice rule"
OPTIONS: tuple[tuple[Any, ...], ...] = (
    ("--rewards", ",".join(map(str, DEFAULT_REWARDS)), "comma-separated rewards"),
    ("--ref", ",".join(map(str, DEFAULT_REF)), "comma-separated reference probabilities (normalised)"),
    ("--betas", ",".join(map(str, DEFAULT_BETAS)), "comma-separated betas > 0"),
    ("--random", 0, "draw a random table of N candidates instead (uses --seed)", {"metavar": "N"}),
    ("--seed", None, "seed for --random", {"type": int}),
    ("--candidate", None, "extra candidate policy for the choice rule (repeatable)", _REPEAT),
)


def command(args: argparse.Namespace) -> int:
    """``palaestra lab kl`` with its parsed arguments; the exit code."""
    extra = {}
    for item in args.candidate:
        name, sep, probs = item.partition("=")
        if not sep or not name:
            raise DataError(f"--candidate: expected NAME=P1,P2,..., got {item!r}")
        extra[name] = tuple(parse_floats(probs, field=f"--candidate {name}"))
    lists = {
        name: tuple(parse_floats(getattr(args, name), field=f"--{name}"))
        for name in ("rewards", "ref", "betas")
    }
    cfg = config_from_args(KLConfig, args, random_candidates=args.random, extra_candidates=extra, **lists)
    res = run_kl_lab(cfg, args.outdir, plot=not args.no_plot)
    table = [{k: v for k, v in p.row().items() if not k.startswith("pi_")} for p in res.points]
    return print_result(res.outdir, quiet=args.quiet, blocks=[table, *_shows(res)])
