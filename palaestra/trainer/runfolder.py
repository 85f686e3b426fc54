"""The run folder of an experiment: history, samples, checkpoints, summary, run note and curves (layout:
docs/guide.md, "Read the run folder"; safety: docs/reliability.md, "Run folders, config and CLI")."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from palaestra.trainer.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from palaestra.trajectories.io import DataError, append_jsonl, atomic_write_text, iter_jsonl, write_jsonl
from palaestra.trajectories.types import TrajectoryGroup

_SUBDIRS = ("", "checkpoints", "samples", "val")


def _warn(text: str) -> None:
    print(f"palaestra: {text}", file=sys.stderr, flush=True)


class RunFolder:
    """Paths and writers of one run folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.history = self.root / "history.jsonl"
        ckpt = self.root / "checkpoints"
        self.latest, self.previous, self.best = ckpt / "latest.npz", ckpt / "previous.npz", ckpt / "best.npz"
        self._lock_fh: IO[str] | None = None
        self._latest_step: int | None = None  # the step of the latest.npz this object wrote or resumed from
        self.history_dropped = 0  # rows dropped by the last check_history (written after the checkpoint)

    def holds_run(self) -> bool:
        """Whether this folder already holds (part of) a run (``train --config`` refuses to write over it)."""
        run_files = (self.root / "config.json", self.root / "manifest.json", self.history)
        return any(path.exists() for path in (*run_files, self.latest, self.previous))

    def check_same_config(self, config: Mapping[str, Any]) -> None:
        """Refuse (:class:`DataError`) to start a run with ``config`` where a run with another config is."""
        hint = f"continue it with `palaestra train --resume {self.root}`, or set another run.output_dir"
        try:
            old = json.loads((self.root / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict):
            raise DataError(f"already holds a run (without a readable config.json); {hint}", path=self.root)
        diffs = _config_diffs(old, dict(config))
        if diffs:
            shown = ", ".join(diffs[:3]) + (f" and {len(diffs) - 3} more" if len(diffs) > 3 else "")
            raise DataError(f"already holds a run with another config ({shown}); {hint}", path=self.root)

    def create(self) -> None:
        for sub in _SUBDIRS:
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def acquire(self) -> None:
        """Create, lock and probe the folder (else :class:`DataError`), then clean killed writers' temp files."""
        try:
            self.create()
            fh = open(self.root / ".lock", "a+", encoding="utf-8")  # noqa: SIM115 - held for the whole run
        except OSError as exc:
            raise DataError(f"cannot write the run folder ({exc.strerror or exc})", path=self.root) from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip()
            fh.close()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise DataError(
                f"run folder is in use by another palaestra process{who}; wait for it to finish",
                path=self.root,
            ) from None
        self._lock_fh = fh
        probe = self.root / "checkpoints" / f".probe.{os.getpid()}.tmp"
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(str(os.getpid()))
            fh.flush()
            with open(probe, "wb") as out:  # a read-only folder or a full disk fails now, before any work
                out.write(b"\0" * (1 << 20))  # 1 MiB
                out.flush()
                os.fsync(out.fileno())
        except BaseException as exc:
            self.release()
            if isinstance(exc, OSError):
                raise DataError(
                    f"cannot write the run folder ({exc.strerror or exc}); free space or choose another output_dir",
                    path=self.root,
                ) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        for sub in _SUBDIRS:  # temp files of atomic writes killed before their rename
            for tmp in (self.root / sub).glob(".*.tmp"):
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def release(self) -> None:
        """Drop the lock taken by :meth:`acquire` (the file stays; the lock is what counts)."""
        fh, self._lock_fh = self._lock_fh, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()

    def remove_unfinished(self, keep: set[str] | None) -> None:
        """Undo a fresh run that failed before its first step: remove the whole folder when it did not exist
        before (``keep`` None), else only the entries not in ``keep`` (a user's own files stay)."""
        if keep is None:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for child in self.root.iterdir() if self.root.exists() else ():
            if child.name in keep:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)

    def save_latest(self, state: dict[str, Any]) -> None:
        """Write ``checkpoints/latest.npz``, keeping the one it replaces as ``previous.npz`` (hard-linked first,
        so a whole latest exists at every moment) unless it is of the same step (the final checkpoint)."""
        step = state.get("counters", {}).get("step")
        rotate = self.latest.exists() and (step is None or step != self._latest_step)
        self._latest_step = step
        if rotate:
            tmp = self.previous.with_name(f".previous.npz.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(self.latest, tmp)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(self.latest, tmp)
            os.replace(tmp, self.previous)
        save_checkpoint(self.latest, state)

    def _set_aside(self, path: Path, exc: Exception) -> None:
        aside = path.with_name(path.name + ".damaged")
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        _warn(f"{exc}; moved aside to {aside.name}")

    def load_resume_state(self) -> dict[str, Any] | None:
        """The state to resume from: ``latest.npz``, else ``previous.npz`` (a damaged file moved aside as
        ``*.damaged``), with the history checked; ``None`` without a checkpoint, an error if all are damaged."""
        existing = [path for path in (self.latest, self.previous) if path.exists()]
        if not existing:
            return None
        damaged: list[tuple[Path, CheckpointError]] = []
        for path in existing:
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:
                damaged.append((path, exc))
                continue
            step = int(state["counters"]["step"])
            self.check_history(step)  # may refuse: then nothing was changed
            for bad, why in damaged:
                self._set_aside(bad, why)
            if path == self.previous:
                _warn(f"resuming from {path} (step {step}): latest.npz was missing or damaged")
                os.replace(path, self.latest)
            self._latest_step = step
            return state
        first = damaged[0][1]
        others = "; previous.npz is damaged too" if len(damaged) > 1 else "; there is no previous.npz"
        raise CheckpointError(f"{first}{others}: no good checkpoint to resume from (start a new run)")

    def load_best_trainer(self) -> dict[str, Any] | None:
        """The trainer state in ``best.npz``, or ``None`` (with a warning, the file moved aside) when damaged."""
        if not self.best.exists():
            return None
        try:
            state: dict[str, Any] = load_checkpoint(self.best)["trainer"]
        except CheckpointError as exc:
            self._set_aside(self.best, exc)
            return None
        return state

    def check_history(self, step: int) -> None:
        """Make ``history.jsonl`` agree with a checkpoint at ``step``: rows ``0..step`` must be there in order
        (else :class:`DataError`); later rows and a torn last line are dropped (:attr:`history_dropped`)."""
        rows: list[dict[str, Any]] = []
        torn = 0
        lines = self.history.read_bytes().split(b"\n") if self.history.exists() else []
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise ValueError("no integer 'step'")
            except ValueError as exc:
                if i == len(lines) - 1:  # the last line, without its newline: an append cut by a kill
                    torn = 1
                    break
                raise DataError(f"unreadable history line ({exc})", path=self.history, line=i + 1) from None
            rows.append(row)
        keep = [r for r in rows if r["step"] <= step]
        if [r["step"] for r in keep] != list(range(step + 1)):
            have = _ranges([r["step"] for r in keep])
            raise DataError(
                f"holds steps {have or 'none'} but the checkpoint is at step {step} (expected 0..{step}); "
                "the history was cut or edited, so this run cannot be resumed consistently",
                path=self.history,
            )
        if len(keep) != len(rows) or torn:
            write_jsonl(self.history, keep)
        self.history_dropped = len(rows) - len(keep) + torn

    def read_history(self) -> list[dict[str, Any]]:
        """History rows in order (empty when there is none yet)."""
        if not self.history.exists():
            return []
        return [row for _, row in iter_jsonl(self.history)]

    def has_trained(self) -> bool:
        """Whether the history holds a finished training step (then the run is worth resuming)."""
        try:
            return any(int(r.get("step", 0)) >= 1 for r in self.read_history())
        except (ValueError, OSError):  # DataError is a ValueError
            return True  # unreadable: keep it, the user decides

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
            kept.append(g.model_copy(update={"trajectories": g.trajectories[: cap - n]}))
            n += len(kept[-1].trajectories)
        path = self.root / "samples" / f"step_{step:06d}.jsonl"
        atomic_write_text(path, "".join(g.model_dump_json() + "\n" for g in kept))

    def write_val(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        write_jsonl(self.root / "val" / f"step_{step:06d}.jsonl", rows)


_NOT_COMPARED = {("run", "output_dir"), ("run", "progress")}


def _config_diffs(old: Mapping[str, Any], new: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[str]:
    """Dotted fields whose values differ between two config dicts (``run.max_steps: 12 -> 20``)."""
    out: list[str] = []
    for key in sorted(set(old) | set(new)):
        path = (*prefix, str(key))
        if path in _NOT_COMPARED:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping) and len(path) < 2:
            out += _config_diffs(a, b, path)
        elif a != b:
            out.append(f"{'.'.join(path)}: {a!r} -> {b!r}")
    return out


def _ranges(steps: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0..2, 5, 7..8"``."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def plot_curves(history: Sequence[dict[str, Any]], out_png: Path, *, stop: dict[str, Any] | None) -> Path:
    """Plot reward, validation accuracy and KL against step; without matplotlib write ``curves.txt`` instead."""
    trained = [r for r in history if "train/reward_mean" in r]
    steps, reward = [r["step"] for r in trained], [r["train/reward_mean"] for r in trained]
    val = [r for r in history if "val/n" in r]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines = [progress_line(r) for r in trained]
        if stop:
            lines.append(f"stopped at step {stop.get('step')}: {stop.get('reason')}")
        txt = out_png.with_suffix(".txt")
        atomic_write_text(txt, "\n".join(lines) + "\n")
        return txt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    top.plot(steps, reward, color="tab:orange", lw=1, label="train reward (mean)")
    absolute = [
        (r["step"], r["judge/absolute_sum"] / r["judge/absolute_n"])
        for r in history
        if r.get("judge/absolute_n")
    ]
    if absolute:  # a learned judge: its absolute score sigmoid(raw), comparable across steps
        top.plot(*zip(*absolute), color="tab:red", lw=1.5, label="judge reward (learned, absolute)")
    for key, style, color, label in (
        ("val/greedy_accuracy", "o-", "tab:blue", "val accuracy (greedy)"),
        ("val/sampled_accuracy", "s--", "tab:green", "val pass@1 (T=1)"),
    ):
        if any(r.get(key) is not None for r in val):
            top.plot([r["step"] for r in val], [r.get(key) for r in val], style, color=color, label=label)
    top.set_ylabel("reward / accuracy")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="upper left", fontsize=8)
    kl = [r.get("train/kl", float("nan")) for r in trained]
    if any(k == k for k in kl):  # some finite KL values: a reference policy was kept
        bottom.plot(steps, kl, color="tab:red", lw=1, label="KL to reference (k3)")
        bottom.set_ylabel("KL")
    else:
        entropy = [r.get("train/entropy", float("nan")) for r in trained]
        bottom.plot(steps, entropy, color="tab:purple", lw=1, label="policy entropy (nats/token)")
        bottom.set_ylabel("entropy")
        bottom.set_title("KL not measured (train.kl_beta = 0 keeps no reference policy)", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    bottom.set_xlabel("step")
    if stop and stop.get("step") is not None:
        for a in (top, bottom):
            a.axvline(stop["step"], color="k", ls=":", lw=1)
        top.annotate(f"stop: {stop.get('reason')} ", (stop["step"], 0.05), fontsize=8, ha="right")
    if stop and stop.get("best_step") is not None:
        top.axvline(stop["best_step"], color="tab:blue", ls=":", lw=0.8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


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


def count_text(value: Any) -> str:
    """A count for people: ``19`` (never ``19.0``); ``-`` when absent."""
    if isinstance(value, bool) or value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def progress_line(row: Mapping[str, Any]) -> str:
    text = (
        f"step {row['step']:>4}  reward {row.get('train/reward_mean', float('nan')):.3f}  "
        f"kept {count_text(row.get('train/groups_kept'))}  t {row.get('time', 0):6.1f}s"
    )
    if "val/greedy_accuracy" in row:
        text += f"  | val greedy {row['val/greedy_accuracy']:.3f}"
    if "val/sampled_accuracy" in row:
        text += f" sampled {row['val/sampled_accuracy']:.3f}"
    if "val/greedy_tool_correct" in row:
        text += f" tool-correct {row['val/greedy_tool_correct']:.3f}"
    return text
