"""``palaestra lab goodhart``: a real training run in which the proxy reward keeps rising after true accuracy peaked."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from palaestra.labs.common import (
    LabRun,
    arithmetic_grpo_config,
    config_from_args,
    print_result,
    require,
    require_at_least,
    require_in,
)
from palaestra.trajectories.io import read_groups, read_jsonl
from palaestra.trajectories.runs import fmt

Proxy = Literal["judge", "naive"]
PROXIES: tuple[str, ...] = ("judge", "naive")


@dataclass(frozen=True)
class GoodhartConfig:
    """Knobs of the Goodhart lab; with the defaults the alarm fires within the step budget."""

    proxy: Proxy = "judge"
    format_bias: float = 0.5
    format_min_chars: int = 10
    noise: float = 0.05
    seed: int = 0
    max_steps: int = 80
    groups_per_step: int = 32
    group_size: int = 8
    temperature: float = 1.8
    max_tokens: int = 32
    lr: float = 2e-4
    warmup_steps: int = 5
    val_every: int = 4
    val_examples: int = 500
    hacking_window: int = 3
    alarm: bool = True
    compare_no_alarm: bool = True
    model: str = "arith-base"
    samples_per_step: int = 32
    show_examples: int = 12

    def __post_init__(self) -> None:
        require_in(self, "proxy", PROXIES)
        require_at_least(self, 1, "max_steps", "groups_per_step", "val_every", "val_examples", "max_tokens")
        require_at_least(self, 2, "group_size", "hacking_window")  # advantages are group-relative
        require_at_least(self, 0, "format_min_chars", "warmup_steps")
        require(0.0 < self.temperature <= 2.0, "temperature", "must be in (0, 2]", self.temperature)
        require(self.lr > 0, "lr", "must be > 0", self.lr)
        require(0.0 <= self.format_bias <= 1.0, "format_bias", "must be in [0, 1]", self.format_bias)
        require(self.noise >= 0, "noise", "must be >= 0", self.noise)


def lenient_gold(weight: float) -> Callable[[Any, Mapping[str, Any] | None], float]:
    """The judge's hidden gold: ``weight`` when the first integer after ``Final:`` is the expected answer
    (text after it tolerated, as the preference annotator reads answers), else 0."""
    from palaestra.envs.annotator import lenient_answer

    def gold(traj: Any, example: Mapping[str, Any] | None) -> float:
        answer = lenient_answer(traj.last_assistant_text() or "")
        return weight * float(example is not None and answer == str(example.get("expected_answer")))

    gold.__qualname__ = f"lenient_final_answer_x{weight:g}"
    return gold


def build_proxy(cfg: GoodhartConfig) -> Any:
    """The train reward object for ``cfg.proxy`` (the simulated judge or the naive verifier's reward)."""
    if cfg.proxy == "naive":
        from palaestra.envs.verifier import VerifierReward, get_verifier

        return VerifierReward(get_verifier("arith-naive-TEACHING-ONLY"))
    from palaestra.judges.simulated import SimulatedJudge, longer_than

    return SimulatedJudge(
        lenient_gold(1.0 - cfg.format_bias),
        noise=cfg.noise,
        format_bias=cfg.format_bias,
        format_feature=longer_than(cfg.format_min_chars),
        seed=cfg.seed,
        name="simulated-goodhart-judge",
    )


def experiment_config(cfg: GoodhartConfig, run_dir: str | Path) -> dict[str, Any]:
    """The lab's training run config; ``[reward]`` records the judge's biases (the judge is passed as an object)."""
    if cfg.proxy == "naive":
        reward: dict[str, Any] = {"kind": "verifier", "verifier": "arith-naive-TEACHING-ONLY"}
    else:
        biases = {k: getattr(cfg, k) for k in ("noise", "format_bias", "format_min_chars")}
        reward = {"kind": "simulated_judge", "simulated": biases}
    return arithmetic_grpo_config(
        run_dir,
        name=f"goodhart-{cfg.proxy}",
        model=cfg.model,
        seed=cfg.seed,
        steps=cfg.max_steps,
        reward=reward,
        run={k: getattr(cfg, k) for k in ("groups_per_step", "group_size", "samples_per_step")},
        env={"temperature": cfg.temperature, "max_tokens": cfg.max_tokens},
        validation={"every": cfg.val_every, "max_examples": cfg.val_examples},
        train={"lr": cfg.lr, "warmup_steps": cfg.warmup_steps},
        stopping={"hacking_window": cfg.hacking_window if cfg.alarm else None},
    )


@dataclass
class RunStats:
    """One training run of the lab: its run folder, summary, per-step curve and headline numbers."""

    run_dir: Path
    summary: dict[str, Any]
    curve: list[dict[str, Any]]
    numbers: dict[str, Any]


@dataclass
class GoodhartResult:
    """The alarm run, the run without it (``None`` unless ``compare_no_alarm``), hacked examples and numbers."""

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


def _ok_ids(run_dir: Path, step: int) -> set[str]:
    return {r["id"] for r in read_jsonl(run_dir / "val" / f"step_{step:06d}.jsonl") if r["greedy_reward"] > 0}


def _run_once(
    cfg: GoodhartConfig, run_dir: Path, *, alarm: bool, printer: Callable[[str], None] | None
) -> RunStats:
    from palaestra.trainer.experiment import Experiment

    exp_cfg = experiment_config(replace(cfg, alarm=alarm), run_dir)
    summary = Experiment(exp_cfg, reward=build_proxy(cfg), printer=printer).run_sync()
    history = read_jsonl(run_dir / "history.jsonl")
    curve = []
    for h in history:
        samples = run_dir / "samples" / f"step_{int(h['step']):06d}.jsonl"
        groups = read_groups(samples) if samples.is_file() else []
        lens = [len(t.last_assistant_text() or "") for g in groups for t in g.trajectories]
        curve.append(
            {
                "step": int(h["step"]),
                "proxy_reward_mean": h.get("train/reward_mean"),
                "val_greedy_accuracy": h.get("val/greedy_accuracy"),
                "mean_reply_chars": _mean(lens),
            }
        )
    val = [(r["step"], r["val_greedy_accuracy"]) for r in curve if r["val_greedy_accuracy"] is not None]
    peak_step, peak = max(val, key=lambda sv: (sv[1], -sv[0]))
    train = {r["step"]: r["proxy_reward_mean"] for r in curve if r["proxy_reward_mean"] is not None}
    chars = [r["mean_reply_chars"] for r in curve if r["mean_reply_chars"] is not None]
    base_ok, final_ok = _ok_ids(run_dir, 0), _ok_ids(run_dir, val[-1][0])
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


def hacked_examples(run_dir: str | Path, *, stop_step: int, limit: int = 12) -> list[dict[str, Any]]:
    """Up to ``limit`` of each kind of reply the proxy loved and the strict verifier rejects: ``train`` (the last 4
    saved steps, highest ``proxy_reward`` first), ``val`` (solved at step 0, failed at ``stop_step``)."""
    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.envs.arithmetic_data import load_split

    run, strict = Path(run_dir), StrictFinalVerifier()
    by_id = {ex["id"]: ex for ex in load_split("train")}
    train: dict[str, dict[str, Any]] = {}  # one row per distinct reply
    for path in sorted((run / "samples").glob("step_*.jsonl"), reverse=True)[:4]:
        for group in read_groups(path):
            example = by_id.get(str(group.metadata.get("example_id")))
            if example is None:
                continue
            for traj in group.trajectories:
                text = traj.last_assistant_text() or ""
                score = strict.score(example, text)
                if score.reward > 0 or text in train:
                    continue
                train[text] = {
                    "kind": "train",
                    "run": run.name,
                    "step": int(path.stem.split("_")[1]),
                    "id": example["id"],
                    "prompt": example["prompt"],
                    "expected": example["expected_answer"],
                    "reply": text,
                    "reward": score.reward,
                    "outcome": score.outcome,
                    "proxy_reward": traj.reward,
                    "judge_explanation": traj.metadata.get("judge_explanation"),
                }
    rows = sorted(
        train.values(), key=lambda r: (-float(r["proxy_reward"]), -int(r["step"]), r["id"], r["reply"])
    )[:limit]
    base_file, now_file = run / "val" / "step_000000.jsonl", run / "val" / f"step_{stop_step:06d}.jsonl"
    if stop_step <= 0 or not base_file.is_file() or not now_file.is_file():
        return rows
    now = {r["id"]: r for r in read_jsonl(now_file)}
    expected = {ex["id"]: ex["expected_answer"] for ex in load_split("val")}
    lost = [r for r in read_jsonl(base_file) if r.get("greedy_outcome") == "ok" and r["id"] in now]
    lost = [r for r in lost if now[r["id"]].get("greedy_outcome") != "ok"][:limit]
    return rows + [
        {
            "kind": "val",
            "run": run.name,
            "step": stop_step,
            "id": r["id"],
            "expected": expected.get(r["id"]),
            "base_reply": r["greedy_completion"],
            "reply": now[r["id"]]["greedy_completion"],
            "reward": float(now[r["id"]]["greedy_reward"]),
            "outcome": now[r["id"]]["greedy_outcome"],
        }
        for r in lost
    ]


def run_goodhart_lab(
    cfg: GoodhartConfig,
    outdir: str | Path,
    *,
    plot: bool = True,
    printer: Callable[[str], None] | None = None,
) -> GoodhartResult:
    """Train into ``outdir/run`` (and, with ``compare_no_alarm``, ``outdir/run_no_alarm``); write the report."""
    lab = LabRun(outdir, lab="goodhart", seed=cfg.seed, knobs=asdict(cfg))
    for name in ("run", "run_no_alarm"):  # an earlier goodhart run here (LabRun checked the folder is ours)
        lab.fresh_subfolder(name)
    say = printer or (lambda _text: None)
    alarm = "on" if cfg.alarm else "off"
    say(f"goodhart lab: training {cfg.model} on the '{cfg.proxy}' proxy, alarm {alarm}")
    run = _run_once(cfg, lab.outdir / "run", alarm=cfg.alarm, printer=printer)
    other = None
    if cfg.compare_no_alarm and cfg.alarm:
        say("goodhart lab: the same settings without the alarm -> run_no_alarm/")
        other = _run_once(cfg, lab.outdir / "run_no_alarm", alarm=False, printer=printer)
    hacked = []
    for r in filter(None, (run, other)):
        hacked += hacked_examples(r.run_dir, stop_step=r.numbers["val_final_step"], limit=cfg.show_examples)
    numbers = dict(run.numbers)
    if other is not None:
        numbers.update({f"no_alarm_{k}": v for k, v in other.numbers.items() if k != "val_accuracy_base"})
    numbers["hacked_replies_listed"] = sum(1 for h in hacked if h["kind"] == "train")
    res = GoodhartResult(cfg, run, other, hacked, numbers)
    res.outdir = _write_report(res, lab, plot=plot)
    return res


def shows(res: GoodhartResult) -> list[str]:
    """The sentences of ``summary.md`` saying what the run shows, with its numbers."""
    cfg = res.config
    proxy = (
        f"a simulated judge (lenient answer reading worth {fmt(1 - cfg.format_bias)}, verbosity bonus "
        f"{fmt(cfg.format_bias)} for replies over {cfg.format_min_chars} chars)"
        if cfg.proxy == "judge"
        else "the naive verifier (any reply containing the answer passes)"
    )
    lines = [
        f"Trained {cfg.model} on {proxy}; validated with the strict verifier every {cfg.val_every} steps."
    ]
    for label, r in (
        ("With the alarm" if cfg.alarm else "Alarm off", res.run),
        ("Without the alarm", res.no_alarm),
    ):
        if r is None:
            continue
        n = r.numbers
        lines.append(
            f"{label}: strict val accuracy {fmt(n['val_accuracy_base'])} (step 0) -> peak "
            f"{fmt(n['val_accuracy_peak'])} (step {n['val_peak_step']}) -> {fmt(n['val_accuracy_final'])} "
            f"(step {n['val_final_step']}); mean proxy reward {fmt(n['proxy_reward_near_val_peak'])} around the "
            f"peak -> {fmt(n['proxy_reward_last3_mean'])} over the last 3 steps; mean training reply "
            f"{fmt(n['reply_chars_first'])} -> {fmt(n['reply_chars_last'])} characters; stopped "
            f"'{n['stop_reason']}' at step {n['stop_step']} ({r.summary['stop']['message']})."
        )
    last = res.no_alarm or res.run
    lines.append(
        f"Validation outcomes at the end of {last.run_dir.name}/: {last.numbers['final_val_outcomes']}. "
        "hacked_examples.jsonl: replies the proxy scored high that the strict verifier rejects."
    )
    if cfg.alarm and res.run.numbers["stop_reason"] != "reward_hacking":
        lines.append(
            "The alarm did not fire: the policy did not find the blind spot within the step budget, or "
            "accuracy fell while the proxy did not rise. Try more --max-steps or another --seed."
        )
    return lines


def _write_report(res: GoodhartResult, lab: LabRun, *, plot: bool) -> Path:
    lab.write_csv("goodhart_curve.csv", res.run.curve)
    if res.no_alarm is not None:
        lab.write_csv("goodhart_curve_no_alarm.csv", res.no_alarm.curve)
    lab.write_jsonl("hacked_examples.jsonl", res.hacked)
    stop, n = res.run.summary["stop"], res.run.numbers

    def series(curve: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in curve if r[key] is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def draw(plt: Any) -> None:
        _fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
        curves = (
            (ax1, "proxy_reward_mean", "-", "tab:orange", "proxy reward"),
            (ax1, "val_greedy_accuracy", "o-", "tab:blue", "strict val accuracy"),
            (ax2, "mean_reply_chars", "-", "tab:purple", "mean reply"),
        )
        runs = [
            (r, alpha, tag) for r, alpha, tag in ((res.no_alarm, 0.3, ", no alarm"), (res.run, 1.0, "")) if r
        ]
        for (r, alpha, tag), (ax, key, style, color, label) in itertools.product(runs, curves):
            ax.plot(*series(r.curve, key), style, color=color, alpha=alpha, ms=3, label=label + tag)
        ax1.annotate(
            f"val peak {n['val_accuracy_peak']:.2f}",
            (n["val_peak_step"], n["val_accuracy_peak"]),
            xytext=(4, 8),
            textcoords="offset points",
            fontsize=8,
        )
        for ax in (ax1, ax2):
            ax.axvline(stop["step"], color="k", ls=":", lw=1)
            ax.legend(loc="upper right", fontsize=7)
        ax1.annotate(
            f"stop: {stop['reason']} (step {stop['step']})",
            (stop["step"], 0.97),
            xytext=(-4, 0),
            textcoords="offset points",
            fontsize=8,
            ha="right",
        )
        ax1.set(
            ylabel="reward / accuracy", ylim=(-0.02, 1.02), title=f"Goodhart lab: proxy = {res.config.proxy}"
        )
        ax2.set(xlabel="step", ylabel="characters")

    lab.plot("goodhart.png", draw, enabled=plot)
    folders = "run/" + (" and run_no_alarm/" if res.no_alarm is not None else "")
    lab.note(f"The experiments' own run folders (manifest, history, samples, val, checkpoints): {folders}.")
    checks = [r for r in res.run.curve if r["val_greedy_accuracy"] is not None]
    lab.table("Validation checks of run/ (goodhart_curve.csv)", checks)
    cols = ("run", "kind", "step", "expected", "base_reply", "reply", "proxy_reward", "outcome")
    shown = [h for kind in ("train", "val") for h in [x for x in res.hacked if x["kind"] == kind][:4]]
    lab.table("Hacked replies (hacked_examples.jsonl)", [{k: h.get(k) for k in cols} for h in shown])
    return lab.finish(
        title="Goodhart lab: the proxy reward keeps rising after true accuracy peaked",
        knob=f"train reward = '{res.config.proxy}' proxy (validation: strict verifier)",
        shows=shows(res),
        numbers=res.numbers,
    )


# the knobs set from --<field-name> (same type and default); proxy and seed have their own arguments
_NOT_CLI = ("proxy", "seed", "alarm", "compare_no_alarm", "samples_per_step", "show_examples")
_CLI_KNOBS = tuple(f.name for f in fields(GoodhartConfig) if f.name not in _NOT_CLI)


_D = GoodhartConfig()
HELP = "train on a biased proxy, validate with the strict verifier: reward hacking and its alarm"
OPTIONS: tuple[tuple[Any, ...], ...] = (
    ("--proxy", _D.proxy, "train reward (default: %(default)s)", {"choices": PROXIES}),
    *((f"--{n.replace('_', '-')}", getattr(_D, n), f"(default: {getattr(_D, n)})") for n in _CLI_KNOBS),
    ("--no-alarm", False, "disable the reward-hacking alarm"),
    ("--no-compare", False, "skip the second run without the alarm"),
)


def command(args: argparse.Namespace) -> int:
    """``palaestra lab goodhart`` with its parsed arguments; the exit code."""
    cfg = config_from_args(
        GoodhartConfig, args, alarm=not args.no_alarm, compare_no_alarm=not args.no_compare
    )
    res = run_goodhart_lab(cfg, args.outdir, plot=not args.no_plot, printer=None if args.quiet else print)
    cols = ("run", "step", "expected", "proxy_reward", "outcome", "reply")
    train = [{k: h[k] for k in cols} for h in res.hacked if h["kind"] == "train"][:4]
    hacked: list[Any] = (
        ["\nReplies the proxy scored high that the strict verifier rejects:", train] if train else []
    )
    return print_result(res.outdir, quiet=args.quiet, blocks=["", *shows(res), *hacked])
