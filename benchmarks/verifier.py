"""Throughput of the strict arithmetic verifier on a realistic mix of completions (one core, one process).

Usage: ``python benchmarks/verifier.py [--quick] [--n N] [--seed S]``. Prints scores per second overall and per
completion kind, the naive verifier for comparison, and the cost of the VerifierReward adapter per trajectory.
Target: >= 200,000 strict scores/s on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.arithmetic_data import all_problems
from palaestra.envs.verifier import VerifierReward
from palaestra.trajectories import Trajectory, TrajectoryGroup

TARGET = 200_000

# kind -> (share of the mix, completion maker)
MIX: dict[str, tuple[float, Callable[[str, random.Random], str]]] = {
    "correct": (0.50, lambda gold, rng: f"Final: {gold}"),
    "correct_newline": (0.10, lambda gold, rng: f"Final: {gold}\n"),
    "wrong_answer": (0.15, lambda gold, rng: f"Final: {int(gold) + rng.choice([-10, -1, 1, 2, 10])}"),
    "reasoning_line": (0.08, lambda gold, rng: f"The sum is {gold}.\nFinal: {gold}"),
    "think_then_answer": (0.05, lambda gold, rng: f"<think>compute carefully, {gold}</think>\nFinal: {gold}"),
    "format_error": (
        0.10,
        lambda gold, rng: rng.choice(
            [
                f"Final:{gold}",
                f"final: {gold}",
                f"Final: 0{gold}",
                f"Final:  {gold}",
                f"{gold}",
                f"Final: +{gold}",
                f"Answer: {gold}",
                "Final:",
                f"Final: {gold}.0",
            ]
        ),
    ),
    "unicode_or_empty": (
        0.02,
        lambda gold, rng: rng.choice(["", "Final: \uff14\uff12", f"Final: {gold}\u200b"]),
    ),
}


def build_mix(n: int, seed: int) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    rng = random.Random(seed)
    problems = all_problems()
    kinds = list(MIX)
    weights = [MIX[k][0] for k in kinds]
    examples, completions, labels = [], [], []
    for _ in range(n):
        ex = problems[rng.randrange(len(problems))]
        kind = rng.choices(kinds, weights)[0]
        examples.append(ex)
        completions.append(MIX[kind][1](ex["expected_answer"], rng))
        labels.append(kind)
    return examples, completions, labels


def rate(
    score: Callable[[Any, str], Any], examples: list[Any], completions: list[str], repeats: int
) -> float:
    """Best-of-``repeats`` scores per second over the whole list."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for ex, comp in zip(examples, completions):
            score(ex, comp)
        best = min(best, time.perf_counter() - start)
    return len(examples) / best


def adapter_cost(n_groups: int, group_size: int, examples: list[Any], completions: list[str]) -> float:
    """Microseconds per trajectory for VerifierReward.score_group (includes metadata JSON)."""
    reward = VerifierReward(StrictFinalVerifier())
    groups = []
    for g in range(n_groups):
        ex = examples[g]
        trajs = [
            Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": ex["prompt"]},
                    {"role": "assistant", "content": completions[(g * group_size + i) % len(completions)]},
                ]
            )
            for i in range(group_size)
        ]
        groups.append((TrajectoryGroup(trajs), ex))

    async def run() -> float:
        start = time.perf_counter()
        for group, ex in groups:
            await reward.score_group(group, ex)
        return time.perf_counter() - start

    return asyncio.run(run()) / (n_groups * group_size) * 1e6


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run for CI smoke tests (about a second)")
    parser.add_argument(
        "--n", type=int, default=None, help="completions in the mix (default 200000, quick 20000)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n = args.n or (20_000 if args.quick else 200_000)
    repeats = 1 if args.quick else 3

    print(f"# strict verifier throughput  {dt.datetime.now().isoformat(timespec='seconds')}")
    print(
        f"# {cpu_name()} | {os.cpu_count()} cpus | Python {platform.python_version()} | {platform.platform()}"
    )
    examples, completions, labels = build_mix(n, args.seed)
    strict = StrictFinalVerifier()
    naive = NaiveVerifier()

    overall = rate(strict.score, examples, completions, repeats)
    outcomes: dict[str, int] = {}
    for ex, comp in zip(examples, completions):
        outcome = strict.score(ex, comp).outcome
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(
        f"mix: n={n}, seed={args.seed}, outcomes: "
        + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items()))
    )
    print(
        f"strict  {strict.name}@{strict.version}: {overall:>12,.0f} scores/s  ({1e6 / overall:.2f} us/score)"
    )
    print(
        f"naive   {naive.name}@{naive.version}: {rate(naive.score, examples, completions, repeats):>12,.0f} scores/s"
    )
    for kind in MIX:
        idx = [i for i, label in enumerate(labels) if label == kind]
        if idx:
            r = rate(strict.score, [examples[i] for i in idx], [completions[i] for i in idx], repeats)
            print(f"  strict on {kind:<18} ({len(idx):>6}): {r:>12,.0f} scores/s")
    groups = 200 if args.quick else 2000
    print(
        f"VerifierReward.score_group: {adapter_cost(groups, 8, examples, completions):.2f} us/trajectory "
        f"({groups} groups of 8)"
    )
    verdict = "PASS" if overall >= TARGET else "FAIL"
    print(f"target >= {TARGET:,} scores/s on one core: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
