"""Time to accuracy: verifier-trained GRPO from the shipped arith-base, validation accuracy vs wall time.

    python benchmarks/time_to_accuracy.py [--seconds 120] [--rollout generate|openai] [--csv out.csv] [--quick]

Each step: ``--groups`` train prompts (a seeded draw per step), ``--group-size`` samples of each from ONE
request with ``n=group_size`` (``palaestra.trainer.validation.sample_group``), scored by the strict verifier
(``VerifierReward``), then one ``GRPOTrainer.step`` with the ``TrainConfig`` defaults except the lr schedule:
by default (``--schedule time``) the lr follows a cosine from ``TrainConfig.lr`` down to
``lr * lr_min_ratio`` over the RL time budget, so a slower or faster machine still anneals by the deadline.

Rollouts: ``--rollout generate`` (default) calls ``EmbeddedModel.generate`` and builds the same ``Choice``
objects the server returns (identical samples for the same seeds); ``--rollout openai`` sends the requests
through the model's in-process ``openai.AsyncOpenAI`` client (HTTP semantics, JSON, client-side parsing).

Every ``--eval-every`` steps: greedy (and, unless ``--no-sampled``, temperature-1 pass@1) accuracy on the first
``--val-n`` val examples through ``EmbeddedModel.generate`` (one batched pass each). The clock ``rl_s``
counts rollouts + scoring + updates and EXCLUDES validation; ``wall_s`` and ``cpu_s`` (process CPU time) include
it. Target: greedy val >= 0.80 within 120 s of ``rl_s`` on 2 cores. ``--shuffle-rewards`` permutes rewards
across the batch every step (control: must not learn).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import io
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split
from palaestra.envs.verifier import VerifierReward
from palaestra.models.registry import load
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.grpo import GRPOTrainer
from palaestra.trainer.validation import evaluate_accuracy, sample_group
from palaestra.trajectories.io import atomic_write_text

CONFIG_FLAGS = ("lr", "clip_high", "clip_low", "advantage_mode", "negative_advantage_scale", "minibatch_size")


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


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = load(args.model)
    cfg = make_config(args)
    trainer = GRPOTrainer(model, cfg)
    train = load_split("train")
    val = load_split("val")[: args.val_n]
    reward = VerifierReward(StrictFinalVerifier())
    rows: list[dict[str, Any]] = []
    totals = {"rollout": 0.0, "score": 0.0, "update": 0.0}
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

    async def collect(step: int) -> list[Any]:
        """Seeded rollouts of one step, scored (rewards shuffled across the batch for the control)."""
        t0 = time.perf_counter()
        step_rng = np.random.default_rng([args.seed, step])
        examples = [train[i] for i in step_rng.choice(len(train), size=args.groups, replace=False)]
        base_seed = args.seed * 1_000_003 + step * 1_000
        groups = await asyncio.gather(
            *(
                sample_group(
                    model,
                    ex,
                    args.group_size,
                    temperature=args.temperature,
                    max_tokens=args.max_tokens,
                    seed=base_seed + g,
                    method=args.rollout,
                )
                for g, ex in enumerate(examples)
            )
        )
        t1 = time.perf_counter()
        for g, ex in zip(groups, examples):
            await reward.score_group(g, ex)
        if args.shuffle_rewards:
            flat = [t for g in groups for t in g.trajectories]
            for t, r in zip(flat, step_rng.permutation([t.reward for t in flat])):
                t.reward = float(r)
        totals["rollout"] += t1 - t0
        totals["score"] += time.perf_counter() - t1
        return list(groups)

    print(f"{'step':>6} {'rl_s':>8} {'wall_s':>8} {'cpu_s':>8} {'greedy':>8} {'sampled':>8} {'reward':>8}")
    await validate(0)
    step = 0
    while clock["rl_s"] < args.seconds and step < args.max_steps:
        step += 1
        t0 = time.perf_counter()
        groups = await collect(step)
        if args.schedule == "time":  # cosine over the RL time budget, from lr down to lr * lr_min_ratio
            frac = min(1.0, clock["rl_s"] / args.seconds)
            m = cfg.lr_min_ratio
            scale = m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * frac))
            trainer.config = cfg.model_copy(update={"lr": cfg.lr * scale, "lr_schedule": "constant"})
        t2 = time.perf_counter()
        result = await trainer.step(groups)
        t3 = time.perf_counter()
        totals["update"] += t3 - t2
        clock["rl_s"] += t3 - t0
        clock["reward"] = result.metrics["reward_mean"]
        if step % args.eval_every == 0:
            await validate(step)
    if not rows or rows[-1]["step"] != step:
        await validate(step)
    n = max(step, 1)
    print(
        f"per step: rollout {totals['rollout'] / n * 1e3:.1f} ms, score {totals['score'] / n * 1e3:.1f} ms, "
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
        "--rollout", choices=["generate", "openai"], default="generate", help="rollout path (see above)"
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
    p.add_argument("--quick", action="store_true", help="smoke run: 5 steps of 4x4, 100 val examples")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.max_steps, args.groups, args.group_size = 5.0, 5, 4, 4
        args.val_n, args.eval_every = 100, 5
    print(
        f"time_to_accuracy: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}, python "
        f"{platform.python_version()}, numpy {np.__version__}, {platform.machine()} with {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.2f}; model {args.model}; {args.groups}x{args.group_size} per step; "
        f"rollout {args.rollout}; schedule {args.schedule}; budget {args.seconds:.0f} s of RL time "
        f"(validation excluded); val n={args.val_n}; {make_config(args).model_dump_json()}"
    )
    rows = asyncio.run(run(args))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(args.csv, buf.getvalue())
    hit = next((r for r in rows if r["greedy"] is not None and r["greedy"] >= 0.80), None)
    best = max(rows, key=lambda r: r["greedy"] or 0.0)
    print(
        f"base greedy {rows[0]['greedy']:.3f}; final {rows[-1]['greedy']:.3f} at rl_s {rows[-1]['rl_s']:.1f}; "
        f"best {best['greedy']:.3f} at rl_s {best['rl_s']:.1f} (step {best['step']}); "
        + (f"0.80 first seen at rl_s {hit['rl_s']:.1f}" if hit else "0.80 not reached")
        + f"; CSV: {args.csv}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
