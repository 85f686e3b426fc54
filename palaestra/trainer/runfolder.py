"""The run folder of an experiment: history, samples, summary, run note and curves.

Layout::

    RUN/
      config.json          resolved ExperimentConfig (resume reads it)
      manifest.json        locked-room facts: fingerprints, scorer/judge, sampling, code version, seed, config
      history.jsonl        one line per step (train/*, judge/*, faults/*, and val/* when validated)
      samples/step_000012.jsonl   sampled trajectory groups of that step (capped)
      val/step_000010.jsonl       greedy validation outputs (id, outcome, reward, completion)
      checkpoints/latest.npz, checkpoints/best.npz
      summary.json, README.md, curves.png (or curves.txt without matplotlib)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from palaestra.trajectories.io import append_jsonl, atomic_write_text, iter_jsonl, write_jsonl
from palaestra.trajectories.types import TrajectoryGroup


class RunFolder:
    """Paths and writers of one run folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def history(self) -> Path:
        return self.root / "history.jsonl"

    @property
    def latest(self) -> Path:
        return self.root / "checkpoints" / "latest.npz"

    @property
    def best(self) -> Path:
        return self.root / "checkpoints" / "best.npz"

    def create(self) -> None:
        for sub in ("", "samples", "checkpoints", "val"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for tmp in (self.root / "checkpoints").glob(".*.npz.*.tmp"):  # a writer killed before its rename
            tmp.unlink(missing_ok=True)

    def read_history(self) -> list[dict[str, Any]]:
        """History rows in order (empty when there is none yet)."""
        if not self.history.exists():
            return []
        return [row for _, row in iter_jsonl(self.history)]

    def truncate_history(self, last_step: int) -> int:
        """Keep rows with ``step <= last_step`` (what the checkpoint covers); returns how many were dropped."""
        rows = self.read_history()
        keep = [r for r in rows if int(r.get("step", -1)) <= last_step]
        if len(keep) != len(rows):
            write_jsonl(self.history, keep)
        return len(rows) - len(keep)

    def append_history(self, row: dict[str, Any]) -> None:
        append_jsonl(self.history, [row])

    def write_samples(self, step: int, groups: Sequence[TrajectoryGroup], cap: int) -> None:
        """Save up to ``cap`` trajectories of this step, whole groups first (with their advantages if set)."""
        if cap <= 0:
            return
        kept, n = [], 0
        for g in groups:
            if n >= cap:
                break
            take = g.model_copy(update={"trajectories": g.trajectories[: cap - n]})
            kept.append(take)
            n += len(take.trajectories)
        path = self.root / "samples" / f"step_{step:06d}.jsonl"
        atomic_write_text(path, "".join(g.model_dump_json() + "\n" for g in kept))

    def write_val(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        write_jsonl(self.root / "val" / f"step_{step:06d}.jsonl", rows)


def plot_curves(history: Sequence[dict[str, Any]], out_png: Path, *, stop: dict[str, Any] | None) -> Path:
    """Train reward, validation accuracy and KL against step, with the stop marker.

    Uses matplotlib (the ``plot`` extra); without it writes ``curves.txt``, a terminal summary, and returns it.
    """
    steps = [r["step"] for r in history if "train/reward_mean" in r]
    reward = [r["train/reward_mean"] for r in history if "train/reward_mean" in r]
    kl = [r.get("train/kl", float("nan")) for r in history if "train/reward_mean" in r]
    val = [
        (r["step"], r.get("val/greedy_accuracy"), r.get("val/sampled_accuracy"))
        for r in history
        if "val/n" in r
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines = ["step  train_reward  val_greedy  val_sampled"]
        vals = {s: (g, p) for s, g, p in val}
        for s, r in zip(steps, reward):
            g, p = vals.get(s, (None, None))
            lines.append(
                f"{s:>4}  {r:12.3f}  {'' if g is None else f'{g:10.3f}'}  {'' if p is None else f'{p:.3f}'}"
            )
        if stop:
            lines.append(f"stopped at step {stop.get('step')}: {stop.get('reason')}")
        txt = out_png.with_suffix(".txt")
        atomic_write_text(txt, "\n".join(lines) + "\n")
        return txt
    fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    ax = axes[0]
    ax.plot(steps, reward, color="tab:orange", lw=1, label="train reward (mean)")
    if val:
        vs = [v[0] for v in val]
        if any(v[1] is not None for v in val):
            ax.plot(vs, [v[1] for v in val], "o-", color="tab:blue", label="val accuracy (greedy)")
        if any(v[2] is not None for v in val):
            ax.plot(vs, [v[2] for v in val], "s--", color="tab:green", label="val pass@1 (T=1)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left", fontsize=8)
    if any(k == k for k in kl):  # some finite KL values: a reference policy was kept
        axes[1].plot(steps, kl, color="tab:red", lw=1, label="KL to reference (k3)")
        axes[1].set_ylabel("KL")
    else:
        entropy = [r.get("train/entropy", float("nan")) for r in history if "train/reward_mean" in r]
        axes[1].plot(steps, entropy, color="tab:purple", lw=1, label="policy entropy (nats/token)")
        axes[1].set_ylabel("entropy")
        axes[1].set_title("KL not measured (train.kl_beta = 0 keeps no reference policy)", fontsize=8)
    axes[1].legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("step")
    if stop and stop.get("step") is not None:
        for a in axes:
            a.axvline(stop["step"], color="k", ls=":", lw=1)
        axes[0].annotate(f"stop: {stop.get('reason')} ", (stop["step"], 0.05), fontsize=8, ha="right")
    if stop and stop.get("best_step") is not None:
        axes[0].axvline(stop["best_step"], color="tab:blue", ls=":", lw=0.8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def dumps_compact(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def prefixed(prefix: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {
        f"{prefix}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float, bool, str)) or v is None
    }


def judge_usage(groups: list[TrajectoryGroup]) -> dict[str, float]:
    usage: dict[str, float] = {}
    for g in groups:
        for k, v in g.metrics.items():
            if k.startswith("judge_") and isinstance(v, (int, float)):
                usage[k.removeprefix("judge_")] = usage.get(k.removeprefix("judge_"), 0.0) + float(v)
    return usage


def accumulate_totals(totals: dict[str, Any], row: Mapping[str, Any]) -> None:
    for k, v in row.items():
        summable = k.startswith("faults/") or (k.startswith("judge/") and "std" not in k)
        if summable and isinstance(v, (int, float)):
            totals[k] = totals.get(k, 0) + v


def progress_line(row: Mapping[str, Any]) -> str:
    text = (
        f"step {row['step']:>4}  reward {row.get('train/reward_mean', float('nan')):.3f}  "
        f"kept {row.get('train/groups_kept', '-')}  t {row.get('time', 0):6.1f}s"
    )
    if "val/greedy_accuracy" in row:
        text += f"  | val greedy {row['val/greedy_accuracy']:.3f}"
    if "val/sampled_accuracy" in row:
        text += f" sampled {row['val/sampled_accuracy']:.3f}"
    if "val/greedy_tool_correct" in row:
        text += f" tool-correct {row['val/greedy_tool_correct']:.3f}"
    return text
