"""Reporting half of ``palaestra lab goodhart``: hacked examples read back from a run folder, the summary
sentences and the plot (the runs themselves are in :mod:`palaestra.labs.goodhart`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.labs.common import LabRun, fmt
from palaestra.trajectories.io import read_jsonl

if TYPE_CHECKING:
    from palaestra.labs.goodhart import GoodhartResult

__all__ = ["hacked_examples", "shows", "write_report"]


def hacked_examples(
    run_dir: str | Path,
    *,
    stop_step: int,
    limit: int = 12,
    train_split: str = "train",
    val_split: str = "val",
) -> list[dict[str, Any]]:
    """Replies the proxy loved that the strict verifier rejects, read from a finished run folder.

    ``reward`` and ``outcome`` are the strict verifier's (so ``palaestra show`` browses these rows); the
    judge's score of a training reply is ``proxy_reward``. At most ``limit`` rows of each kind:
    ``kind="train"``: distinct saved training replies of the last 4 saved steps that the strict verifier
    rejects, highest proxy reward first (with the judge's explanation when there is one); ``kind="val"``:
    validation prompts the base policy (step 0) answered correctly, with the base reply and the greedy reply
    of the policy at ``stop_step``.
    """
    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.envs.arithmetic_data import load_split
    from palaestra.trajectories.io import read_groups

    run = Path(run_dir)
    strict = StrictFinalVerifier()
    by_id = {ex["id"]: ex for ex in load_split(train_split)}
    train: list[dict[str, Any]] = []
    seen: set[str] = set()
    for path in sorted((run / "samples").glob("step_*.jsonl"), reverse=True)[:4]:
        step = int(path.stem.split("_")[1])
        for group in read_groups(path):
            example = by_id.get(str(group.metadata.get("example_id")))
            if example is None:
                continue
            for traj in group.trajectories:
                text = traj.last_assistant_text() or ""
                score = strict.score(example, text)
                if score.reward > 0 or text in seen:
                    continue
                seen.add(text)
                train.append(
                    {
                        "kind": "train",
                        "run": run.name,
                        "step": step,
                        "id": example["id"],
                        "prompt": example["prompt"],
                        "expected": example["expected_answer"],
                        "reply": text,
                        "reward": score.reward,
                        "outcome": score.outcome,
                        "proxy_reward": traj.reward,
                        "judge_explanation": traj.metadata.get("judge_explanation"),
                    }
                )
    train.sort(key=lambda r: (-float(r["proxy_reward"]), -int(r["step"]), r["id"], r["reply"]))
    out = train[:limit]
    base_file, now_file = run / "val" / "step_000000.jsonl", run / "val" / f"step_{stop_step:06d}.jsonl"
    if stop_step > 0 and base_file.is_file() and now_file.is_file():
        now = {r["id"]: r for r in read_jsonl(now_file)}
        expected = {ex["id"]: ex["expected_answer"] for ex in load_split(val_split)}
        val_rows = []
        for r in read_jsonl(base_file):
            later = now.get(r["id"])
            if r.get("greedy_outcome") == "ok" and later is not None and later.get("greedy_outcome") != "ok":
                val_rows.append(
                    {
                        "kind": "val",
                        "run": run.name,
                        "step": stop_step,
                        "id": r["id"],
                        "expected": expected.get(r["id"]),
                        "base_reply": r["greedy_completion"],
                        "reply": later["greedy_completion"],
                        "reward": float(later["greedy_reward"]),
                        "outcome": later["greedy_outcome"],
                    }
                )
        out += val_rows[:limit]
    return out


def shows(res: GoodhartResult) -> list[str]:
    cfg = res.config
    proxy = {
        "judge": f"a simulated judge (gold = strict verifier, length bias {fmt(cfg.length_bias)}, verbosity "
        f"bonus {fmt(cfg.format_bias)} for replies over {cfg.format_min_chars} chars)",
        "length": f"a simulated judge (gold = strict verifier, length bias {fmt(cfg.length_bias)})",
        "naive": "the naive verifier (any reply containing the answer passes)",
    }[cfg.proxy]
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
            f"(step {n['val_final_step']}); mean proxy reward "
            f"{fmt(n['proxy_reward_near_val_peak'])} around the peak -> {fmt(n['proxy_reward_last3_mean'])} "
            "over the last 3 steps; mean training reply "
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
            "The alarm did not fire: accuracy fell while the proxy did not rise (a group-relative length "
            "bonus can be hacked without raising the mean), or the step budget ran out. Try more "
            "--max-steps, a larger --format-bias or another --seed."
        )
    return lines


def _series(curve: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in curve if r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(res: GoodhartResult, lab: LabRun, *, plot: bool) -> Path:
    lab.write_csv("goodhart_curve.csv", res.run.curve)
    if res.no_alarm is not None:
        lab.write_csv("goodhart_curve_no_alarm.csv", res.no_alarm.curve)
    lab.write_jsonl("hacked_examples.jsonl", res.hacked)
    stop, n = res.run.stop, res.run.numbers

    def draw(plt: Any) -> None:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
        if res.no_alarm is not None:
            c = res.no_alarm.curve
            ax1.plot(
                *_series(c, "proxy_reward_mean"), color="tab:orange", alpha=0.3, lw=1, label="proxy, no alarm"
            )
            ax1.plot(
                *_series(c, "val_greedy_accuracy"), color="tab:blue", alpha=0.3, lw=1, label="val, no alarm"
            )
            ax2.plot(*_series(c, "mean_reply_chars"), color="tab:purple", alpha=0.3, lw=1, label="no alarm")
        c = res.run.curve
        ax1.plot(
            *_series(c, "proxy_reward_mean"), color="tab:orange", lw=1.4, label="proxy reward (train mean)"
        )
        ax1.plot(
            *_series(c, "val_greedy_accuracy"), "o-", color="tab:blue", ms=3, label="strict val accuracy"
        )
        ax2.plot(*_series(c, "mean_reply_chars"), color="tab:purple", lw=1.4, label="mean training reply")
        ax1.annotate(
            f"val peak {n['val_accuracy_peak']:.2f}",
            (n["val_peak_step"], n["val_accuracy_peak"]),
            xytext=(4, 8),
            textcoords="offset points",
            fontsize=8,
        )
        for ax in (ax1, ax2):
            ax.axvline(stop["step"], color="k", ls=":", lw=1)
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
        ax1.legend(loc="upper left", fontsize=7)
        ax2.legend(loc="upper left", fontsize=7)
        fig.tight_layout()

    lab.plot("goodhart.png", draw, enabled=plot)
    folders = "run/" + (" and run_no_alarm/" if res.no_alarm is not None else "")
    lab.note(f"The experiments' own run folders (manifest, history, samples, val, checkpoints): {folders}.")
    train = [h for h in res.hacked if h["kind"] == "train"][:4]
    val = [h for h in res.hacked if h["kind"] == "val"][:4]
    shown = [
        {
            k: h.get(k)
            for k in (
                "run",
                "kind",
                "step",
                "expected",
                "base_reply",
                "reply",
                "proxy_reward",
                "outcome",
            )
        }
        for h in train + val
    ]
    return lab.finish(
        title="Goodhart lab: the proxy reward rises while true accuracy falls",
        knob=f"train reward = '{res.config.proxy}' proxy (validation: strict verifier)",
        shows=shows(res),
        numbers=res.numbers,
        tables=[
            (
                "Validation checks of run/ (goodhart_curve.csv)",
                [r for r in res.run.curve if r["val_greedy_accuracy"] is not None],
            ),
            ("Hacked replies (hacked_examples.jsonl)", shown),
        ],
    )
