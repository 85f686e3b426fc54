"""``palaestra lab goodhart``: a real training run in which the proxy reward rises while true accuracy falls.

The embedded policy (``arith-base``) is trained by an :class:`~palaestra.trainer.experiment.Experiment` whose
train reward is a *proxy*, and validated every few steps with the strict verifier (the instrument). Proxies:

* ``judge`` (default): a simulated judge whose hidden gold is the strict verifier, with two classic judge
  defects: a length bias (``length_bias * len / longest in the group``) and a verbosity bonus
  (``format_bias`` for a reply longer than ``format_min_chars`` characters). A padded reply scores about
  ``length_bias + format_bias`` whatever it says, so once the policy finds padding, padding pays better than
  trying to be right.
* ``length``: the same judge with the length bias only. Its bonus is group-relative (padding *more than the
  others* pays), so the mean proxy reward need not rise while the policy is hacked: the alarm may miss it.
* ``naive``: the teaching-only naive verifier (any completion containing the answer passes).

Training samples at a high temperature so that the policy explores replies longer than ``Final: <int>``. The
run stops when the experiment's reward-hacking alarm (:mod:`palaestra.trainer.stopping`) sees validation
accuracy (the mean of the checks since its peak, among the last ``hacking_window``) fall below the peak by more
than 3 binomial standard errors for the validation size (and by more than ``hacking_drop``) while the train
reward rose by more than twice its standard error (and by more than ``hacking_min_rise``); ``patience`` is set
beyond the step budget so that plateau stopping cannot end the run first. With ``compare_no_alarm`` (default)
the same settings run again without the alarm, to show what it prevented. The folder holds the experiments'
own run folders (``run/``, ``run_no_alarm/``), the curves (``goodhart_curve*.csv``), ``goodhart.png`` with the
stop marked, and ``hacked_examples.jsonl``: training replies the proxy scored high that the strict verifier
rejects, and validation prompts the base policy answered correctly next to what the trained policy answers.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from palaestra.judges.simulated import longer_than
from palaestra.labs.common import LabRun, add_common_args, print_table
from palaestra.labs.goodhart_report import hacked_examples, shows, write_report
from palaestra.trajectories.io import DataError, read_jsonl

__all__ = [
    "PROXIES",
    "GoodhartConfig",
    "GoodhartResult",
    "RunStats",
    "build_proxy",
    "experiment_config",
    "hacked_examples",
    "register_lab",
    "run_goodhart_lab",
    "verbosity_feature",
]

Proxy = Literal["judge", "length", "naive"]
PROXIES: tuple[str, ...] = ("judge", "length", "naive")


def verbosity_feature(min_chars: int) -> Callable[[str], bool]:
    """The judge's verbosity defect: True when the stripped reply is longer than ``min_chars`` characters.

    A correct reply of the arithmetic task (``Final: <int>``, answers in -99..198) has at most 10 characters,
    so ``min_chars >= 10`` marks only replies that say more than the answer line.
    """
    if min_chars < 0:
        raise DataError(f"format_min_chars: must be >= 0, got {min_chars}")
    return longer_than(min_chars)


@dataclass(frozen=True)
class GoodhartConfig:
    """Knobs of the Goodhart lab. Defaults: the policy finds padding and the alarm fires within the step
    budget (see benchmarks/stopping_alarm.py for where, run to run)."""

    proxy: Proxy = "judge"
    length_bias: float = 0.5
    format_bias: float = 0.5
    format_min_chars: int = 12
    noise: float = 0.05
    seed: int = 0
    max_steps: int = 120
    groups_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.5
    max_tokens: int = 32
    lr: float = 4e-4
    val_every: int = 2
    val_examples: int = 300
    hacking_window: int = 3
    hacking_drop: float = 0.05
    hacking_min_rise: float = 0.05
    alarm: bool = True
    compare_no_alarm: bool = True
    model: str = "arith-base"
    samples_per_step: int = 32
    show_examples: int = 12

    def check(self) -> None:
        """Raise ``DataError`` naming the first bad knob."""
        if self.proxy not in PROXIES:
            raise DataError(f"proxy: expected one of {', '.join(PROXIES)}, got {self.proxy!r}")
        for name in ("max_steps", "groups_per_step", "val_every", "val_examples", "max_tokens"):
            if getattr(self, name) < 1:
                raise DataError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise DataError(
                f"group_size: must be >= 2 (advantages are group-relative), got {self.group_size}"
            )
        if self.hacking_window < 2:
            raise DataError(f"hacking_window: must be >= 2, got {self.hacking_window}")
        if not 0.0 < self.temperature <= 2.0:
            raise DataError(f"temperature: must be in (0, 2], got {self.temperature}")
        if self.lr <= 0:
            raise DataError(f"lr: must be > 0, got {self.lr}")
        if self.noise < 0 or self.format_min_chars < 0 or self.hacking_min_rise < 0 or self.hacking_drop < 0:
            raise DataError("noise, format_min_chars, hacking_drop and hacking_min_rise must be >= 0")


def build_proxy(cfg: GoodhartConfig) -> Any:
    """The train reward object for ``cfg.proxy`` (a simulated judge or the naive verifier's reward)."""
    if cfg.proxy == "naive":
        from palaestra.envs.verifier import VerifierReward, get_verifier

        return VerifierReward(get_verifier("arith-naive-TEACHING-ONLY"))
    from palaestra.judges.simulated import SimulatedJudge
    from palaestra.trainer.builders import verifier_gold

    return SimulatedJudge(
        verifier_gold("arith-strict"),
        noise=cfg.noise,
        length_bias=cfg.length_bias,
        format_bias=cfg.format_bias if cfg.proxy == "judge" else 0.0,
        format_feature=verbosity_feature(cfg.format_min_chars),
        seed=cfg.seed,
        name=f"simulated-goodhart-{cfg.proxy}",
    )


def experiment_config(cfg: GoodhartConfig, run_dir: str | Path) -> dict[str, Any]:
    """The experiment config (a plain dict) of the lab's training run (the judge itself is passed as an
    object: its verbosity feature is not a config option)."""
    if cfg.proxy == "naive":
        reward: dict[str, Any] = {"kind": "verifier", "verifier": "arith-naive-TEACHING-ONLY"}
    else:
        reward = {
            "kind": "simulated_judge",
            "simulated": {
                "gold": "arith-strict",
                "noise": cfg.noise,
                "length_bias": cfg.length_bias,
                "format_bias": cfg.format_bias if cfg.proxy == "judge" else 0.0,
            },
        }
    return {
        "run": {
            "name": f"goodhart-{cfg.proxy}",
            "seed": cfg.seed,
            "output_dir": str(run_dir),
            "groups_per_step": cfg.groups_per_step,
            "group_size": cfg.group_size,
            "max_steps": cfg.max_steps,
            "samples_per_step": cfg.samples_per_step,
        },
        "model": {"name": cfg.model},
        "env": {"name": "arithmetic", "temperature": cfg.temperature, "max_tokens": cfg.max_tokens},
        "reward": reward,
        "validation": {"every": cfg.val_every, "max_examples": cfg.val_examples, "sampled": False},
        "train": {"lr": cfg.lr, "seed": cfg.seed},
        "stopping": {
            "patience": cfg.max_steps + 1,
            "hacking_window": cfg.hacking_window if cfg.alarm else None,
            "hacking_drop": cfg.hacking_drop,
            "hacking_min_rise": cfg.hacking_min_rise,
            "collapse_window": None,
        },
    }


@dataclass
class RunStats:
    """One training run of the lab: its run folder, summary, per-step curve and headline numbers."""

    run_dir: Path
    summary: dict[str, Any]
    curve: list[dict[str, Any]]
    numbers: dict[str, Any]

    @property
    def stop(self) -> dict[str, Any]:
        return dict(self.summary["stop"])


@dataclass
class GoodhartResult:
    """The alarm run, the run without the alarm (``None`` unless ``compare_no_alarm``), hacked examples and
    the headline numbers (the alarm run's, plus ``no_alarm_*``)."""

    config: GoodhartConfig
    run: RunStats
    no_alarm: RunStats | None
    hacked: list[dict[str, Any]]
    numbers: dict[str, Any]
    outdir: Path | None = None

    @property
    def stop_reason(self) -> str:
        return str(self.run.summary["stop"]["reason"])


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _run_once(
    cfg: GoodhartConfig, run_dir: Path, *, alarm: bool, printer: Callable[[str], None] | None
) -> RunStats:
    from palaestra.trainer.experiment import Experiment
    from palaestra.trajectories.io import read_groups

    exp_cfg = experiment_config(replace(cfg, alarm=alarm), run_dir)
    summary = Experiment(exp_cfg, reward=build_proxy(cfg), printer=printer).run_sync()
    history = read_jsonl(run_dir / "history.jsonl")
    curve = []
    for h in history:
        step = int(h["step"])
        samples = run_dir / "samples" / f"step_{step:06d}.jsonl"
        groups = read_groups(samples) if samples.is_file() else []
        lens = [len(t.last_assistant_text() or "") for g in groups for t in g.trajectories]
        curve.append(
            {
                "step": step,
                "proxy_reward_mean": h.get("train/reward_mean"),
                "val_greedy_accuracy": h.get("val/greedy_accuracy"),
                "mean_reply_chars": _mean(lens),
            }
        )
    val = [(r["step"], r["val_greedy_accuracy"]) for r in curve if r["val_greedy_accuracy"] is not None]
    peak_step, peak = max(val, key=lambda sv: (sv[1], -sv[0]))
    train = {r["step"]: r["proxy_reward_mean"] for r in curve if r["proxy_reward_mean"] is not None}
    chars = [r["mean_reply_chars"] for r in curve if r["mean_reply_chars"] is not None]
    final = val[-1][0]
    base_ok = {r["id"] for r in read_jsonl(run_dir / "val" / "step_000000.jsonl") if r["greedy_reward"] > 0}
    final_ok = {
        r["id"] for r in read_jsonl(run_dir / "val" / f"step_{final:06d}.jsonl") if r["greedy_reward"] > 0
    }
    outcomes = {
        k.removeprefix("val/outcome/"): v for k, v in history[-1].items() if k.startswith("val/outcome/")
    }
    numbers = {
        "stop_reason": summary["stop"]["reason"],
        "stop_step": summary["stop"]["step"],
        "wall_seconds": round(float(summary["wall_seconds"]), 1),
        "val_accuracy_base": val[0][1],
        "val_accuracy_peak": peak,
        "val_peak_step": peak_step,
        "val_accuracy_final": val[-1][1],
        "val_final_step": val[-1][0],
        "proxy_reward_near_val_peak": _mean([v for s, v in train.items() if abs(s - peak_step) <= 2]),
        "proxy_reward_last3_mean": _mean([train[s] for s in sorted(train)[-3:]]),
        "reply_chars_first": chars[0] if chars else None,
        "reply_chars_last": chars[-1] if chars else None,
        "val_prompts_lost": len(base_ok - final_ok),
        "val_prompts_gained": len(final_ok - base_ok),
        "final_val_outcomes": ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())),
    }
    return RunStats(run_dir, summary, curve, numbers)


def run_goodhart_lab(
    cfg: GoodhartConfig,
    outdir: str | Path,
    *,
    plot: bool = True,
    printer: Callable[[str], None] | None = None,
    argv: Sequence[str] | None = None,
) -> GoodhartResult:
    """Train into ``outdir/run`` (and, with ``compare_no_alarm``, ``outdir/run_no_alarm``); write the
    curves, hacked examples, summary and plot."""
    cfg.check()
    lab = LabRun(outdir, lab="goodhart", seed=cfg.seed, knobs=asdict(cfg), argv=argv)
    for name in ("run", "run_no_alarm"):  # an earlier goodhart run here (LabRun checked the folder is ours)
        if (lab.outdir / name).exists():
            shutil.rmtree(lab.outdir / name)
    say = printer or (lambda _text: None)
    say(
        f"goodhart lab: training {cfg.model} on the '{cfg.proxy}' proxy, alarm {'on' if cfg.alarm else 'off'}"
    )
    run = _run_once(cfg, lab.outdir / "run", alarm=cfg.alarm, printer=printer)
    other = None
    if cfg.compare_no_alarm and cfg.alarm:
        say("goodhart lab: the same settings without the alarm -> run_no_alarm/")
        other = _run_once(cfg, lab.outdir / "run_no_alarm", alarm=False, printer=printer)
    hacked = []
    for r in (run, other):
        if r is not None:
            hacked += hacked_examples(
                r.run_dir, stop_step=r.numbers["val_final_step"], limit=cfg.show_examples
            )
    numbers = dict(run.numbers)
    if other is not None:
        numbers.update({f"no_alarm_{k}": v for k, v in other.numbers.items() if k != "val_accuracy_base"})
    numbers["hacked_replies_listed"] = sum(1 for h in hacked if h["kind"] == "train")
    res = GoodhartResult(cfg, run, other, hacked, numbers)
    res.outdir = write_report(res, lab, plot=plot)
    return res


def register_lab(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``lab goodhart``."""
    d = GoodhartConfig()
    p = sub.add_parser(
        "goodhart",
        help="train on a biased proxy, validate with the strict verifier: reward hacking and its alarm",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_common_args(p, lab="goodhart")
    p.add_argument("--proxy", choices=PROXIES, default=d.proxy, help="train reward (default: %(default)s)")
    p.add_argument("--length-bias", type=float, default=d.length_bias, help="judge length bias")
    p.add_argument("--format-bias", type=float, default=d.format_bias, help="judge verbosity bonus")
    p.add_argument(
        "--format-min-chars", type=int, default=d.format_min_chars, help="verbose = longer than this"
    )
    p.add_argument("--noise", type=float, default=d.noise, help="judge noise std")
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--temperature", type=float, default=d.temperature, help="training sampling temperature")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--val-every", type=int, default=d.val_every)
    p.add_argument("--val-examples", type=int, default=d.val_examples)
    p.add_argument("--hacking-window", type=int, default=d.hacking_window)
    p.add_argument("--hacking-drop", type=float, default=d.hacking_drop)
    p.add_argument("--hacking-min-rise", type=float, default=d.hacking_min_rise)
    p.add_argument("--no-alarm", action="store_true", help="disable the reward-hacking alarm")
    p.add_argument("--no-compare", action="store_true", help="skip the second run without the alarm")
    p.add_argument("--model", default=d.model, help="embedded model name or .npz path")
    p.set_defaults(func=goodhart_command)


def goodhart_command(args: argparse.Namespace) -> int:
    """``palaestra lab goodhart``."""
    cfg = GoodhartConfig(
        proxy=args.proxy,
        length_bias=args.length_bias,
        format_bias=args.format_bias,
        format_min_chars=args.format_min_chars,
        noise=args.noise,
        seed=args.seed,
        max_steps=args.max_steps,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        lr=args.lr,
        val_every=args.val_every,
        val_examples=args.val_examples,
        hacking_window=args.hacking_window,
        hacking_drop=args.hacking_drop,
        hacking_min_rise=args.hacking_min_rise,
        alarm=not args.no_alarm,
        compare_no_alarm=not args.no_compare,
        model=args.model,
    )
    res = run_goodhart_lab(cfg, args.outdir, plot=not args.no_plot, printer=None if args.quiet else print)
    if not args.quiet:
        print()
        for line in shows(res):
            print(line)
        train = [h for h in res.hacked if h["kind"] == "train"][:4]
        if train:
            print("\nReplies the proxy scored high that the strict verifier rejects:")
            print_table(
                [
                    {k: h[k] for k in ("run", "step", "expected", "proxy_reward", "outcome", "reply")}
                    for h in train
                ]
            )
    print(f"wrote {res.outdir}")
    return 0
