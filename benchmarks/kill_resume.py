"""Kill-and-resume: SIGKILL ``palaestra train`` at seeded random moments, resume each time, check nothing is lost.

    python benchmarks/kill_resume.py [--kills 10] [--steps 40] [--seed 0] [--model PATH] [--quick] [--keep DIR]

First an uninterrupted run (the reference). Then the same config in a second folder: ``palaestra train
--config`` is started and killed, then ``palaestra train --resume`` is started and killed, ``--kills`` times
in all, and finally resumed to the end. Each kill happens at a random moment drawn from ``--seed``:

* ``startup``: a uniform random delay after the process starts (imports, loading, the first validation);
* ``step``: at a uniform random instant inside a randomly chosen later step (rollouts, scoring, the update,
  validation, the history append or the checkpoint write);
* ``checkpoint``: with ``PALAESTRA_FAULT_CHECKPOINT_DELAY`` set, when the process announces "writing
  checkpoint", i.e. after the temp file is written and before its rename.

At least a third of the kills are of the checkpoint kind (and, from 5 kills, one is at start-up). After every kill: every ``checkpoints/*.npz`` loads
(no half-written checkpoint is ever visible), history lines are whole and their steps are 0, 1, 2, ...
without gap or repeat. At the end: history steps are exactly 0..steps, every step sampled the same
completions with the same rewards as the reference (bitwise), and the final weights equal the reference's.
Weights are compared with atol 1e-5: the embedded server batches concurrent requests differently across
processes, which moves sampling-time logprobs by float32 rounding (~1e-7), so a resumed run agrees to ~1e-7,
not bit for bit; the printed figure is the largest absolute difference.

Exit code 0 when every check holds, 1 otherwise. ``--quick``: 3 kills, 8 steps (about 20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.trainer.runfolder import RunFolder

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_DELAY = 1.5  # seconds a fault-injected checkpoint writer waits before its rename


def config_text(model: str, out: Path, steps: int, seed: int) -> str:
    return f"""
[run]
name = "kill-resume"
seed = {seed}
output_dir = "{out}"
groups_per_step = 3
group_size = 4
max_steps = {steps}
checkpoint_every = 1

[model]
name = "{model}"

[env]
max_tokens = 6

[reward]
kind = "simulated_judge"

[validation]
every = 4
max_examples = 10

[stopping]
patience = 1000
"""


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "palaestra", "train", *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def tiny_model(path: Path) -> Path:
    """A small random TinyGPT (fast; the checks do not need a good policy)."""
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64)
    TinyGPT(cfg, tokenizer=tok, seed=0).save(path)
    return path


@dataclass
class Kill:
    """One planned kill and what was found after it."""

    index: int
    mode: str  # "startup", "step" or "checkpoint"
    delay: float = 0.0  # startup: seconds after the start; step: seconds after the trigger line
    advance: int = 0  # step: kill during the advance-th step this process runs
    killed: bool = False  # False: the process ended by itself before the moment came
    seconds: float = 0.0
    checkpoint_step: int | None = None
    history_steps: int = 0
    temp_files: int = 0
    problems: list[str] = field(default_factory=list)

    def moment(self) -> str:
        if self.mode == "startup":
            return f"{self.delay:.2f}s after start"
        if self.mode == "step":
            return f"step +{self.advance}, +{self.delay * 1000:.0f}ms"
        return "in a ckpt write"


def plan_kills(n: int, seed: int, startup: float, step_seconds: float, steps: int) -> list[Kill]:
    """Seeded kill moments; at least a third during a checkpoint write, and (from 5 kills) one at start-up.

    * ``startup``: ``u`` seconds after the process starts, ``u`` uniform in ``[0.1, startup]``;
    * ``step``: once the process has reported the step before its ``advance``-th step, a further uniform
      ``[0, 1.5 step_seconds]`` seconds, so the kill lands anywhere in that step (rollouts, judge, update,
      validation, history append, checkpoint write);
    * ``checkpoint``: at the first "writing checkpoint" the process announces (fault injection: the temp
      file is complete, the rename has not happened)."""
    rng = random.Random(seed)
    modes = [rng.choices(["checkpoint", "step", "startup"], weights=[0.35, 0.5, 0.15])[0] for _ in range(n)]
    free = [i for i, m in enumerate(modes) if m == "step"]
    rng.shuffle(free)
    while modes.count("checkpoint") < max(1, n // 3) and free:
        modes[free.pop()] = "checkpoint"
    if n >= 5 and "startup" not in modes and free:
        modes[free.pop()] = "startup"
    max_advance = max(1, (2 * steps) // max(1, n))
    kills = []
    for i, mode in enumerate(modes):
        kill = Kill(i + 1, mode)
        if mode == "startup":
            kill.delay = round(rng.uniform(0.1, startup), 3)
        elif mode == "step":
            kill.advance = rng.randint(1, max_advance)
            kill.delay = round(rng.uniform(0.0, 1.5 * step_seconds), 4)
        kills.append(kill)
    return kills


def _pump(stream: Any, tag: str, q: queue.Queue[tuple[str, str]]) -> None:
    for line in stream:
        q.put((tag, line))
    q.put((tag, ""))  # end of stream


def run_and_kill(cmd: list[str], kill: Kill, timeout: float = 300.0) -> None:
    """Start ``cmd``; SIGKILL it at the planned moment (or let it finish if it ends first)."""
    extra = {"PYTHONUNBUFFERED": "1"}
    if kill.mode == "checkpoint":
        extra["PALAESTRA_FAULT_CHECKPOINT_DELAY"] = str(CHECKPOINT_DELAY)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(extra), cwd=ROOT
    )
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    for stream, tag in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=_pump, args=(stream, tag, lines), daemon=True).start()
    tail: list[str] = []
    first_step: int | None = None  # the step this process starts from
    deadline = t0 + kill.delay if kill.mode == "startup" else None
    open_streams = 2
    while open_streams and not kill.killed:
        wait = 0.05 if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            tag, line = lines.get(timeout=wait)
        except queue.Empty:
            tag, line = "", None  # type: ignore[assignment]
        if deadline is not None and time.monotonic() >= deadline:
            proc.send_signal(signal.SIGKILL)
            kill.killed = True
            break
        if time.monotonic() - t0 > timeout:
            proc.send_signal(signal.SIGKILL)
            kill.problems.append("timed out")
            break
        if line is None:
            continue
        if line == "":
            open_streams -= 1
            continue
        tail.append(line)
        if kill.mode == "checkpoint" and tag == "err" and "writing checkpoint" in line:
            proc.send_signal(signal.SIGKILL)
            kill.killed = True
        elif kill.mode == "step" and tag == "out" and deadline is None:
            found = re.match(r"(?:resumed .* at step (\d+)|step\s+(\d+)\b)", line.strip())
            if found:
                step = int(found.group(1) or found.group(2))
                first_step = step if first_step is None else first_step
                if step >= first_step + kill.advance - 1:
                    deadline = time.monotonic() + kill.delay
    proc.wait(timeout=60)
    kill.seconds = time.monotonic() - t0
    if not kill.killed and proc.returncode != 0:
        kill.problems.append(f"exited {proc.returncode} before the kill: {''.join(tail)[-2000:]}")


def inspect_folder(run: Path, kill: Kill) -> None:
    """After a kill: every checkpoint loads, history is whole and gap-free."""
    from palaestra.trainer.checkpoints import load_checkpoint
    from palaestra.trajectories.io import DataError, read_jsonl

    ckpts = run / "checkpoints"
    for path in sorted(ckpts.glob("*.npz")) if ckpts.exists() else []:
        try:
            state = load_checkpoint(path)
        except DataError as exc:
            kill.problems.append(f"{path.name} does not load: {exc}")
            continue
        if path.name == "latest.npz":
            kill.checkpoint_step = int(state["counters"]["step"])
    kill.temp_files = len(list(ckpts.glob(".*.tmp"))) if ckpts.exists() else 0
    if (run / "history.jsonl").exists():
        try:
            steps = [int(r["step"]) for r in read_jsonl(run / "history.jsonl")]
        except DataError as exc:
            kill.problems.append(f"history.jsonl is torn: {exc}")
            return
        kill.history_steps = len(steps)
        if steps != list(range(len(steps))):
            kill.problems.append(f"history steps are not 0..n: {steps}")
        if kill.checkpoint_step is not None and len(steps) - 1 not in (
            kill.checkpoint_step,
            kill.checkpoint_step + 1,
        ):
            kill.problems.append(f"history ends at {len(steps) - 1}, checkpoint at {kill.checkpoint_step}")


def step_seconds(run: Path) -> float:
    """Median wall time of one training step of a finished run (from its history)."""
    import statistics

    from palaestra.trajectories.io import read_jsonl

    times = [float(r["time"]) for r in read_jsonl(run / "history.jsonl")]
    return statistics.median(b - a for a, b in itertools.pairwise(times[1:])) if len(times) > 2 else 0.1


def final_params(run: Path) -> dict[str, Any]:
    from palaestra.trainer.checkpoints import load_checkpoint

    state = load_checkpoint(run / "checkpoints" / "latest.npz")
    return {k: v for k, v in state["trainer"].items() if k.startswith("backend/param/")}


def texts_and_rewards(path: Path) -> list[tuple[str | None, float]]:
    from palaestra.trajectories.io import read_groups

    return [(t.last_assistant_text(), t.reward) for g in read_groups(path) for t in g.trajectories]


def compare(clean: Path, broken: Path, steps: int) -> dict[str, Any]:
    """Final checks of the resumed run against the uninterrupted one."""
    import numpy as np

    from palaestra.trajectories.io import read_jsonl

    problems: list[str] = []
    hist = [int(r["step"]) for r in read_jsonl(broken / "history.jsonl")]
    if hist != list(range(steps + 1)):
        problems.append(f"history steps {hist} != 0..{steps}")
    same_samples = 0
    for step in range(1, steps + 1):
        name = f"samples/step_{step:06d}.jsonl"
        if texts_and_rewards(clean / name) == texts_and_rewards(broken / name):
            same_samples += 1
        else:
            problems.append(f"step {step}: sampled completions or rewards differ")
    a, b = final_params(clean), final_params(broken)
    max_diff = 0.0
    if not a or a.keys() != b.keys():
        problems.append("parameter sets differ")
    else:
        max_diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
        if max_diff > 1e-5:
            problems.append(f"final weights differ by {max_diff:.3g} > 1e-5")
    return {
        "problems": problems,
        "same_samples": same_samples,
        "max_weight_diff": max_diff,
        "bitwise_equal": bool(a) and a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a),
    }


def run(kills: int, steps: int, seed: int, model: str | None, workdir: Path) -> dict[str, Any]:
    """The whole procedure; returns the report (``ok`` says whether every check held)."""
    workdir.mkdir(parents=True, exist_ok=True)
    model = model or str(tiny_model(workdir / "tiny.npz"))
    clean, broken = workdir / "clean", workdir / "broken"
    (workdir / "clean.toml").write_text(config_text(model, clean, steps, seed))
    (workdir / "broken.toml").write_text(config_text(model, broken, steps, seed))

    t0 = time.monotonic()
    ref = subprocess.run(
        train_cmd("--config", str(workdir / "clean.toml"), "--quiet"),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    if ref.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{ref.stderr}")
    clean_seconds = time.monotonic() - t0

    t0 = time.monotonic()
    subprocess.run(train_cmd("--help"), capture_output=True, env=child_env(), cwd=ROOT, check=True)
    startup = time.monotonic() - t0
    plan = plan_kills(kills, seed, startup, step_seconds(clean), steps)
    t0 = time.monotonic()
    for kill in plan:
        # a folder that holds any part of a run (even one killed before its first checkpoint) is resumed:
        # `train --config` refuses to write over it
        started = RunFolder(broken).holds_run()
        cmd = (
            train_cmd("--resume", str(broken))
            if started
            else train_cmd("--config", str(workdir / "broken.toml"))
        )
        run_and_kill(cmd, kill)
        inspect_folder(broken, kill)
    final = subprocess.run(
        train_cmd("--resume", str(broken)), capture_output=True, text=True, env=child_env(), cwd=ROOT
    )
    broken_seconds = time.monotonic() - t0
    problems = [f"kill {k.index}: {p}" for k in plan for p in k.problems]
    if final.returncode != 0:
        problems.append(f"the final resume failed:\n{final.stderr[-3000:]}")
        result: dict[str, Any] = {
            "problems": [],
            "same_samples": 0,
            "max_weight_diff": float("nan"),
            "bitwise_equal": False,
        }
    else:
        result = compare(clean, broken, steps)
    problems += result.pop("problems")
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "steps": steps,
        "seed": seed,
        "kills_planned": len(plan),
        "kills_done": sum(k.killed for k in plan),
        "kills_during_checkpoint_write": sum(k.killed and k.mode == "checkpoint" for k in plan),
        "leftover_temp_files": max((k.temp_files for k in plan), default=0),
        "clean_seconds": clean_seconds,
        "interrupted_seconds": broken_seconds,
        "kills": [k.__dict__ for k in plan],
        **result,
        "problems": problems,
        "ok": not problems,
    }


def print_report(rep: dict[str, Any]) -> None:
    print(f"# kill-and-resume  {rep['date']}  {rep['machine']}")
    print(
        f"{'kill':>4}  {'mode':<10}  {'moment':>22}  {'killed':>6}  {'ckpt step':>9}  {'history':>7}  {'tmp':>3}"
    )
    for k in rep["kills"]:
        moment = Kill(**k).moment()
        step = "-" if k["checkpoint_step"] is None else k["checkpoint_step"]
        print(
            f"{k['index']:>4}  {k['mode']:<10}  {moment:>22}  {k['killed']!s:>6}  {step:>9}  "
            f"{k['history_steps']:>7}  {k['temp_files']:>3}"
        )
    print(
        f"kills: {rep['kills_done']} of {rep['kills_planned']} landed "
        f"({rep['kills_during_checkpoint_write']} during a checkpoint write)"
    )
    print(
        f"history: steps 0..{rep['steps']}, none lost or repeated: {not any('history' in p for p in rep['problems'])}"
    )
    print(f"samples identical to the uninterrupted run: {rep['same_samples']} of {rep['steps']} steps")
    print(
        f"final weights: max |diff| = {rep['max_weight_diff']:.3g} (bitwise equal: {rep['bitwise_equal']}; "
        f"tolerance 1e-5)"
    )
    print(f"half-written temp files left in checkpoints/ (never loaded): up to {rep['leftover_temp_files']}")
    print(
        f"wall: uninterrupted {rep['clean_seconds']:.1f}s, killed+resumed {rep['interrupted_seconds']:.1f}s"
    )
    print("RESULT: " + ("ok" if rep["ok"] else "FAILED\n  " + "\n  ".join(rep["problems"])))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model name or .npz (default: a small random TinyGPT)")
    ap.add_argument("--quick", action="store_true", help="3 kills, 8 steps")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.kills, args.steps = 3, 8
    if args.keep is not None:
        rep = run(args.kills, args.steps, args.seed, args.model, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="palaestra-kill-") as tmp:
            rep = run(args.kills, args.steps, args.seed, args.model, Path(tmp))
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print_report(rep)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
