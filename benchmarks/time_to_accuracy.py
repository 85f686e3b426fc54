"""Time to accuracy: verifier-trained GRPO from the shipped arith-base, through the front door and raw.

    python benchmarks/time_to_accuracy.py [--seconds 120] [--path framework|processes|raw] [--compare-steps 20]
        [--rollout-processes 2] [--quick]

Each step: ``--groups`` train prompts (a seeded draw per step), ``--group-size`` samples of each, scored by the
strict verifier (``VerifierReward``), then one ``GRPOTrainer.step`` with the ``TrainConfig`` defaults except
the lr schedule: by default (``--schedule time``) the lr follows a cosine from ``TrainConfig.lr`` down to
``lr * lr_min_ratio`` over the RL time budget, so a slower or faster machine still anneals by the deadline.

Two rollout paths:

* ``framework`` (default): what ``Experiment`` does and what a user's code runs. Each group is the arithmetic
  environment's group rollout (``single_turn_group_rollout``: one chat-completions request with ``n`` choices
  through the model's real ``openai.AsyncOpenAI`` client, in process (no socket) to the OpenAI-compatible server and
  its batching engine), gathered by ``gather_trajectory_groups`` with the verifier scoring each group as it
  finishes (``after_each``).
* ``processes``: the framework path with the rollout function run in ``--rollout-processes`` worker processes
  (what ``[run] rollout_processes = N`` does in an ``Experiment``: each step the live weights go to the workers,
  which run the same group rollouts through their own openai client, server and engine; the trainer gathers
  the trajectories, scores them and updates; the same samples as ``framework`` for the same seeds). As in an
  ``Experiment``, step ``k + 1``'s calls are sent when step ``k`` starts, without weights: the workers build
  and queue their requests during update ``k`` and generate once the weights of step ``k + 1`` arrive.
* ``raw``: ``EmbeddedModel.generate`` called directly, building the same ``Choice`` objects the server returns
  (``sample_group(method="generate")``; identical samples for the same seeds), then scored.

First, unless ``--compare-steps 0``, the paths run the same ``--compare-steps`` steps (after one warm-up step)
from fresh copies of the base, taking turns in ``--compare-rounds`` blocks so that a slow spell of a shared machine
falls on every path. The heap is frozen as ``train()`` does (``frozen_heap``; ``--no-frozen-heap`` leaves it as
it is). Printed: the per-step wall and CPU times of each path, the full garbage collections of this process in
those steps, and their ratio to raw (target: framework <= 1.2x raw; CPU time is the fairer figure on a busy
machine; for ``processes`` the CPU of the trainer and of the workers, and their total); then the CPU the
``openai`` client itself spends on one step's requests (answered by a mock transport with a canned reply), on the
route of the shipped rollouts (``request_choices``: the client's ``post`` and a pydantic-validated
``ChatCompletion``) and through ``chat.completions.create`` (its typed-parameter transform and lenient response
building cost about 1 ms more a request), and what is left of the difference for the server, its transport and
the gather: the client's part is the floor of the ratio that no server can remove. ``--profile FILE``
writes a cProfile of the framework steps and prints the top functions. Then the time-to-accuracy run uses
``--path``. ``--experiment-steps`` more steps run through a real ``Experiment`` (run folder, history, samples,
checkpoints every ``checkpoint_every``) and its per-step wall time is printed beside them, then the same with
``[run] rollout_processes = --rollout-processes``.

Every ``--eval-every`` steps: greedy (and, unless ``--no-sampled``, temperature-1 pass@1) accuracy on the first
``--val-n`` val examples through ``EmbeddedModel.generate`` (one batched pass each). The clock ``rl_s``
counts rollouts + scoring + updates and EXCLUDES validation; ``wall_s`` and ``cpu_s`` (process CPU time) include
it. Printed at the end: the ``rl_s`` at which greedy val first reached 0.75 and 0.80 (target: 0.80 within
120 s on 2 cores). ``--shuffle-rewards`` permutes rewards across the batch every step (control: must not
learn).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import csv
import datetime as dt
import gc
import io
import json
import math
import os
import platform
import pstats
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split
from palaestra.envs.rollouts import single_turn_group_rollout
from palaestra.envs.verifier import VerifierReward
from palaestra.models.embedded import EmbeddedModel
from palaestra.models.registry import load
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.loop import GRPOTrainer
from palaestra.trainer.pipeline import RolloutProcess
from palaestra.trainer.validation import evaluate_accuracy, sample_group
from palaestra.trajectories.executors import frozen_heap
from palaestra.trajectories.gather import gather_trajectory_groups
from palaestra.trajectories.io import atomic_write_text
from palaestra.trajectories.types import TrajectoryGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_throughput import client_cpu_ms, proc_cpu_s

CONFIG_FLAGS = ("lr", "clip_high", "clip_low", "advantage_mode", "negative_advantage_scale", "minibatch_size")
TARGETS = (0.75, 0.80)
Collect = Callable[[EmbeddedModel, int], Awaitable[list[TrajectoryGroup]]]


def make_config(args: argparse.Namespace) -> TrainConfig:
    overrides: dict[str, Any] = {"seed": args.seed}
    for key in CONFIG_FLAGS:
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.no_filter:
        overrides["drop_zero_std"] = False
    if args.schedule == "constant":
        overrides["lr_schedule"] = "constant"
    return TrainConfig(**overrides)


def collector(
    args: argparse.Namespace, path: str, train: list[dict[str, Any]], proc: RolloutProcess | None = None
) -> Collect:
    """The rollout + scoring of step ``step`` on ``path`` ("framework", "processes" (needs ``proc``) or
    "raw"); returns the scored groups."""
    reward = VerifierReward(StrictFinalVerifier())
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    ahead: dict[int, list[Any]] = {}  # processes: the next step's calls, launched before this step's update

    def calls(step: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        examples, seeds = step_examples(args, train, step)
        return [((ex, args.group_size), {"seed": sd, **sampling}) for ex, sd in zip(examples, seeds)]

    async def framework(model: EmbeddedModel, step: int) -> list[TrajectoryGroup]:
        examples, seeds = step_examples(args, train, step)
        by_index = dict(enumerate(examples))

        async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
            scored: TrajectoryGroup | None = await reward.score_group(group, by_index[group.metadata["g"]])
            return scored

        if proc is None:
            rollouts: list[Any] = [
                single_turn_group_rollout(model, ex, args.group_size, seed=sd, **sampling)
                for ex, sd in zip(examples, seeds)
            ]
        else:  # the same calls, in the worker processes, on the live weights (as Experiment does)
            if step in ahead:  # launched during the last update: its requests wait for these weights
                rollouts = ahead.pop(step)
                proc.publish(step, model.step, model.gpt.params)
            else:
                rollouts = proc.launch(step, model.step, model.gpt.params, calls(step), 1 << 30, record=False)
            proc.end(step)  # the workers drop the step's model once its rollouts are done
            ahead[step + 1] = proc.launch(step + 1, None, None, calls(step + 1), 1 << 30, record=False)
        groups = [TrajectoryGroup([r], metadata={"g": g}) for g, r in enumerate(rollouts)]
        return await gather_trajectory_groups(groups, after_each=score, progress=False)

    async def raw(model: EmbeddedModel, step: int) -> list[TrajectoryGroup]:
        examples, seeds = step_examples(args, train, step)
        groups = await asyncio.gather(
            *(
                sample_group(model, ex, args.group_size, seed=sd, method="generate", **sampling)
                for ex, sd in zip(examples, seeds)
            )
        )
        for g, ex in zip(groups, examples):
            await reward.score_group(g, ex)
        return list(groups)

    return raw if path == "raw" else framework


def gc_watch(pauses: list[float]) -> Callable[[str, dict[str, Any]], None]:
    """A ``gc.callbacks`` hook that appends the seconds of each full (generation 2) collection to ``pauses``."""
    started: list[float] = []

    def hook(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                pauses.append(time.perf_counter() - started[0])

    return hook


def step_examples(
    args: argparse.Namespace, train: list[dict[str, Any]], step: int
) -> tuple[list[Any], list[int]]:
    """The seeded prompts of one step and the sampling seed of each group."""
    rng = np.random.default_rng([args.seed, step])
    examples = [train[i] for i in rng.choice(len(train), size=args.groups, replace=False)]
    base_seed = args.seed * 1_000_003 + step * 1_000
    return examples, [base_seed + g for g in range(len(examples))]


async def compare(args: argparse.Namespace, train: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-step wall and CPU time of each path over the same steps, from fresh copies of the base. The paths
    take turns, ``--compare-rounds`` blocks of steps each, so that a slow spell of a shared machine falls on
    all of them rather than on one."""
    out: dict[str, dict[str, float]] = {}
    cfg = make_config(args).model_copy(update={"lr_schedule": "constant"})
    n_proc = args.rollout_processes
    paths = ("raw", "framework", *(["processes"] if n_proc > 0 else []))
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        model = load(args.model)
        proc = RolloutProcess(model, single_turn_group_rollout, n_proc) if path == "processes" else None
        runs[path] = {
            "model": model,
            "trainer": GRPOTrainer(model, cfg),
            "proc": proc,
            "pids": proc.pids if proc is not None else [],
            "collect": collector(args, path, train, proc),
            "step": 0,
            "wall": 0.0,
            "cpu": 0.0,
            "wcpu": 0.0,
            "pauses": [],  # this process's full (generation 2) collections during the path's timed steps
        }
    prof = cProfile.Profile() if args.profile else None
    current: list[float] = []
    watch = gc_watch(current)

    async def steps(path: str, k: int, timed: bool = True) -> None:
        run = runs[path]
        for _ in range(k):
            t0, c0, w0 = time.perf_counter(), time.process_time(), proc_cpu_s(*run["pids"])
            current.clear()
            if prof is not None and timed and path == "framework":
                prof.enable()
            groups = await run["collect"](run["model"], run["step"])
            await run["trainer"].step(groups)
            if prof is not None:
                prof.disable()
            run["step"] += 1
            if timed:
                run["wall"] += time.perf_counter() - t0
                run["cpu"] += time.process_time() - c0
                run["wcpu"] += proc_cpu_s(*run["pids"]) - w0
                run["pauses"] += current

    rounds = max(1, min(args.compare_rounds, args.compare_steps))
    frozen = contextlib.nullcontext() if args.no_frozen_heap else frozen_heap()
    with frozen:  # as train() does (unless --no-frozen-heap): no full collection walks the heap mid-run
        for path in paths:  # step 0 warms each path up (server start, first allocations)
            await steps(path, 1, timed=False)
        gc.callbacks.append(watch)
        for r in range(rounds):  # the same steps in the same order per path, the paths taking turns
            share = args.compare_steps * (r + 1) // rounds - args.compare_steps * r // rounds
            for path in paths:
                await steps(path, share)
        gc.callbacks.remove(watch)
    n = max(args.compare_steps, 1)
    heap = "not frozen" if args.no_frozen_heap else "frozen"
    for path in paths:
        run = runs[path]
        if run["proc"] is not None:
            await run["proc"].aclose()
        out[path] = {
            "wall_ms": run["wall"] / n * 1e3,
            "cpu_ms": (run["cpu"] + run["wcpu"]) / n * 1e3,
            "workers_cpu_ms": run["wcpu"] / n * 1e3,
        }
        name = f"framework, rollouts in {n_proc} processes" if run["proc"] is not None else path
        me = out[path]
        split = (
            f" (trainer {run['cpu'] / n * 1e3:.1f} + workers {run['wcpu'] / n * 1e3:.1f})"
            if run["proc"]
            else ""
        )
        pauses = run["pauses"]
        print(
            f"{name:>9}: {me['wall_ms']:.1f} ms wall, {me['cpu_ms']:.1f} ms CPU{split} per step "
            f"({args.compare_steps} steps of {args.groups}x{args.group_size} after 1 warm-up, in {rounds} turns); "
            f"heap {heap}: {len(pauses)} full garbage collections in this process, {sum(pauses) * 1e3:.1f} ms in all",
            flush=True,
        )
    if prof is not None:
        prof.dump_stats(str(args.profile))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"cProfile of {args.compare_steps} framework steps (top 25 by own time; {args.profile}):")
        print(text.getvalue().split("\n", 6)[-1])
    fw, rw = out["framework"], out["raw"]
    print(
        f"ratio framework/raw per step: {fw['wall_ms'] / rw['wall_ms']:.2f} wall, "
        f"{fw['cpu_ms'] / rw['cpu_ms']:.2f} CPU (target <= 1.2)",
        flush=True,
    )
    if "processes" in out:
        pr = out["processes"]
        print(
            f"ratio framework with {n_proc} rollout processes/raw per step: {pr['wall_ms'] / rw['wall_ms']:.2f} "
            f"wall, {pr['cpu_ms'] / rw['cpu_ms']:.2f} CPU of all processes (target <= 1.2 wall; "
            f"{os.cpu_count()} cores here)",
            flush=True,
        )
    examples, seeds = step_examples(args, train, 0)
    kw = {
        "model": model.name,
        "messages": [{"role": "user", "content": examples[0]["prompt"]}],
        "n": args.group_size,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "logprobs": True,
        "seed": seeds[0],
    }
    client = await client_cpu_ms(model.openai_client(), kw, args.groups, 8 * args.groups, "request_choices")
    create = await client_cpu_ms(model.openai_client(), kw, args.groups, 8 * args.groups, "create")
    client, create = client * args.groups, create * args.groups
    out["client_cpu_ms"] = {"cpu_ms": client, "create_cpu_ms": create}
    if args.compare_json is not None:  # for scripts that run this one (isa_compare)
        atomic_write_text(args.compare_json, json.dumps(out, indent=1))
    print(
        f"of which the openai client's own work (its {args.groups} requests answered by a mock transport, on the "
        f"route of the shipped rollouts, request_choices): {client:.1f} ms CPU per step (through "
        f"chat.completions.create, as a user's own rollout may call it: {create:.1f} ms); framework - raw - client "
        f"= {fw['cpu_ms'] - rw['cpu_ms'] - client:.1f} ms (server, transport, gather); with a server that cost "
        f"nothing the CPU ratio would be {(rw['cpu_ms'] + client) / rw['cpu_ms']:.2f}",
        flush=True,
    )
    return out


async def through_experiment(args: argparse.Namespace, processes: int = 0) -> float:
    """Per-step wall time of the same steps run by ``Experiment`` itself (run folder, history, checkpoints)."""
    from palaestra.trainer.experiment import Experiment

    n = args.experiment_steps
    with tempfile.TemporaryDirectory() as tmp:
        config = {
            "run": {
                "name": "tta-bench",
                "seed": args.seed,
                "output_dir": str(Path(tmp) / "run"),
                "groups_per_step": args.groups,
                "group_size": args.group_size,
                "max_steps": n + 1,
                "progress": False,
                "rollout_processes": processes,
            },
            "model": {"name": args.model},
            "env": {"name": "arithmetic", "temperature": args.temperature, "max_tokens": args.max_tokens},
            "reward": {"kind": "verifier"},
            "validation": {"every": 10 * (n + 1), "max_examples": 10, "sampled": False},
        }
        exp = Experiment(config, printer=None)
        await exp.run()
        times = {r["step"]: r["time"] for r in exp.folder.read_history()}
    per_step = (times[n] - times[1]) / (n - 1) * 1e3  # steps 2..n: no validation, no warm-up in them
    where = f"rollout_processes = {processes}" if processes else "rollouts in process"
    print(
        f"Experiment ({where}): {per_step:.1f} ms wall per step (steps 2..{n} of a real run; validation excluded)"
    )
    return per_step


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    train = load_split("train")
    val = load_split("val")[: args.val_n]
    if args.compare_steps > 0:
        await compare(args, train)
    if args.experiment_steps >= 2:
        await through_experiment(args)
        if args.rollout_processes > 0:
            await through_experiment(args, args.rollout_processes)
    model = load(args.model)
    cfg = make_config(args)
    trainer = GRPOTrainer(model, cfg)
    proc = None
    if args.path == "processes":
        proc = RolloutProcess(model, single_turn_group_rollout, max(1, args.rollout_processes))
    collect = collector(args, args.path, train, proc)
    rows: list[dict[str, Any]] = []
    totals = {"rollout_and_score": 0.0, "update": 0.0}
    clock = {"rl_s": 0.0, "reward": float("nan")}
    t_wall, c_start = time.perf_counter(), time.process_time()

    async def validate(step: int) -> None:
        res = await evaluate_accuracy(model, val, greedy=True, samples=1 if args.sampled else 0, seed=10_000)
        row = {
            "step": step,
            "rl_s": round(clock["rl_s"], 2),
            "wall_s": round(time.perf_counter() - t_wall, 2),
            "cpu_s": round(time.process_time() - c_start, 2),
            "greedy": res.greedy,
            "sampled": res.sampled,
            "train_reward": round(clock["reward"], 4),
            "lr": trainer.config.lr,
            "val_s": round(res.seconds, 3),
        }
        rows.append(row)
        samp = "" if res.sampled is None else f"{res.sampled:.3f}"
        print(
            f"{step:6d} {row['rl_s']:8.1f} {row['wall_s']:8.1f} {row['cpu_s']:8.1f} {res.greedy:8.3f} {samp:>8} "
            f"{clock['reward']:8.3f}",
            flush=True,
        )

    print(f"{'step':>6} {'rl_s':>8} {'wall_s':>8} {'cpu_s':>8} {'greedy':>8} {'sampled':>8} {'reward':>8}")
    await validate(0)
    step = 0
    with frozen_heap():  # as train() does
        while clock["rl_s"] < args.seconds and step < args.max_steps:
            step += 1
            t0 = time.perf_counter()
            groups = await collect(model, step)
            if args.shuffle_rewards:
                flat = [t for g in groups for t in g.trajectories]
                perm = np.random.default_rng([args.seed, step, 1]).permutation([t.reward for t in flat])
                for t, r in zip(flat, perm):
                    t.reward = float(r)
            if args.schedule == "time":  # cosine over the RL time budget, from lr down to lr * lr_min_ratio
                frac = min(1.0, clock["rl_s"] / args.seconds)
                m = cfg.lr_min_ratio
                scale = m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * frac))
                trainer.config = cfg.model_copy(update={"lr": cfg.lr * scale, "lr_schedule": "constant"})
            t2 = time.perf_counter()
            result = await trainer.step(groups)
            t3 = time.perf_counter()
            totals["rollout_and_score"] += t2 - t0
            totals["update"] += t3 - t2
            clock["rl_s"] += t3 - t0
            clock["reward"] = result.metrics["reward_mean"]
            if step % args.eval_every == 0:
                await validate(step)
    if not rows or rows[-1]["step"] != step:
        await validate(step)
    if proc is not None:
        await proc.aclose()
    n = max(step, 1)
    print(
        f"per step ({args.path}): rollout + score {totals['rollout_and_score'] / n * 1e3:.1f} ms, "
        f"update {totals['update'] / n * 1e3:.1f} ms ({step} steps, {args.groups}x{args.group_size} samples each)"
    )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="arith-base", help="shipped model name or .npz path")
    p.add_argument("--seconds", type=float, default=120.0, help="RL time budget (validation excluded)")
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--groups", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (n of each request)")
    p.add_argument("--max-tokens", type=int, default=8, help="max new tokens per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument(
        "--path",
        choices=["framework", "processes", "raw"],
        default="framework",
        help="rollout path of the run (see above)",
    )
    p.add_argument(
        "--compare-steps", type=int, default=20, help="steps timed on both paths first (0: no comparison)"
    )
    p.add_argument(
        "--rollout-processes",
        type=int,
        default=2,
        help="worker processes of the 'processes' path (compared, and --path processes); 0: not compared",
    )
    p.add_argument(
        "--compare-json", type=Path, default=None, help="write the per-path step times of the comparison here"
    )
    p.add_argument("--profile", type=Path, default=None, help="write a cProfile of the framework steps here")
    p.add_argument(
        "--compare-rounds", type=int, default=4, help="turns the paths take over the compared steps"
    )
    p.add_argument(
        "--no-frozen-heap",
        action="store_true",
        help="compare the paths without frozen_heap (what train() does): its full garbage collections show",
    )
    p.add_argument(
        "--experiment-steps", type=int, default=10, help="steps timed through a real Experiment (< 2: skip)"
    )
    p.add_argument(
        "--schedule",
        choices=["time", "config", "constant"],
        default="time",
        help="time: cosine lr decay over the RL time budget (default); config: TrainConfig's step schedule; "
        "constant: the peak lr throughout",
    )
    p.add_argument("--lr", type=float, default=None, help="peak lr (default: TrainConfig's)")
    p.add_argument("--clip-high", type=float, default=None)
    p.add_argument("--clip-low", type=float, default=None)
    p.add_argument("--advantage-mode", default=None)
    p.add_argument("--negative-advantage-scale", type=float, default=None)
    p.add_argument("--minibatch-size", type=int, default=None)
    p.add_argument("--no-filter", action="store_true", help="keep zero-std groups (no dynamic filtering)")
    p.add_argument("--shuffle-rewards", action="store_true", help="control: permute rewards across the batch")
    p.add_argument("--val-n", type=int, default=1000, help="validation examples (first N of val)")
    p.add_argument("--eval-every", type=int, default=200, help="validate every N steps")
    p.add_argument(
        "--sampled", action=argparse.BooleanOptionalAction, default=True, help="also pass@1 at T=1"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=Path("time_to_accuracy.csv"), help="CSV output path")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 3 compared steps and 5 run steps of 4x4, 100 val examples",
    )
    args = p.parse_args()
    if args.quick:
        args.seconds, args.max_steps, args.groups, args.group_size = 5.0, 5, 4, 4
        args.val_n, args.eval_every, args.compare_steps = 100, 5, min(args.compare_steps, 3)
        args.experiment_steps = min(args.experiment_steps, 3)
    print(
        f"time_to_accuracy: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}, python "
        f"{platform.python_version()}, numpy {np.__version__}, {platform.machine()} with {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.2f}; model {args.model}; {args.groups}x{args.group_size} per step; "
        f"path {args.path}; schedule {args.schedule}; budget {args.seconds:.0f} s of RL time "
        f"(validation excluded); val n={args.val_n}; {make_config(args).model_dump_json()}"
    )
    rows = asyncio.run(run(args))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(args.csv, buf.getvalue())
    best = max(rows, key=lambda r: r["greedy"] or 0.0)
    reached = []
    for target in TARGETS:
        hit = next((r for r in rows if r["greedy"] is not None and r["greedy"] >= target), None)
        reached.append(
            f"{target:.2f} first reached at rl_s {hit['rl_s']:.1f} (step {hit['step']})"
            if hit
            else f"{target:.2f} not reached"
        )
    print(
        f"base greedy {rows[0]['greedy']:.3f}; final {rows[-1]['greedy']:.3f} at rl_s {rows[-1]['rl_s']:.1f}; "
        f"best {best['greedy']:.3f} at rl_s {best['rl_s']:.1f} (step {best['step']}); {args.path} path; "
        + "; ".join(reached)
        + f"; CSV: {args.csv}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
