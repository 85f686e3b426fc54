"""Overhead of gather_trajectory_groups vs raw asyncio.gather, both driving the real openai client against a
loopback OpenAI-compatible server with a fixed latency; also the cost of `import palaestra`.

    python benchmarks/gather_overhead.py [--rollouts 10000] [--concurrency 64] [--latency 0.005] [--quick]

Both sides run the same rollout coroutine (one chat completion, a Trajectory built from the Choice) under the
same concurrency cap; the runs alternate (the side that goes first alternates too) and the medians of the
repeats' wall time and process CPU time are reported. Target: overhead <= 3%.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time

import openai

from palaestra import Trajectory, TrajectoryGroup, gather_trajectory_groups
from palaestra.testing import Reply, ScriptedServer


def import_time(repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import time; t=time.perf_counter(); import palaestra; print(time.perf_counter()-t)",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        best = min(best, float(out.stdout))
    return best


async def rollout(client: openai.AsyncOpenAI, i: int) -> Trajectory:
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": f"q{i}"}])
    resp = await client.chat.completions.create(model="bench", messages=traj.messages(), max_tokens=4)
    traj.messages_and_choices.append(resp.choices[0])
    traj.reward = 1.0
    return traj


async def run_raw(client: openai.AsyncOpenAI, n: int, concurrency: int) -> tuple[float, float]:
    sem = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> Trajectory:
        async with sem:
            return await rollout(client, i)

    t0, c0 = time.perf_counter(), time.process_time()
    out = await asyncio.gather(*(limited(i) for i in range(n)))
    assert len(out) == n
    return time.perf_counter() - t0, time.process_time() - c0


async def run_palaestra(
    client: openai.AsyncOpenAI, n: int, concurrency: int, group_size: int
) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(rollout(client, g * group_size + i) for i in range(group_size))
            for g in range(n // group_size)
        ),
        max_concurrency=concurrency,
        progress=False,
    )
    assert sum(len(g) for g in groups) == n
    return time.perf_counter() - t0, time.process_time() - c0


async def bench(
    args: argparse.Namespace, base_url: str
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(wall, process CPU) of each repeat of both sides; the side that runs first alternates."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    await run_raw(client, min(args.rollouts, 200), args.concurrency)  # warm up connections
    raw, pal = [], []
    for k in range(args.repeats):
        for side in ("raw", "pal") if k % 2 == 0 else ("pal", "raw"):
            if side == "raw":
                raw.append(await run_raw(client, args.rollouts, args.concurrency))
            else:
                pal.append(await run_palaestra(client, args.rollouts, args.concurrency, args.group_size))
    await client.close()
    return raw, pal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--latency", type=float, default=0.005)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="512 rollouts, 3 repeats")
    args = p.parse_args()
    if args.quick:
        args.rollouts, args.repeats = 512, 3
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
        f"date {time.strftime('%Y-%m-%d')}"
    )
    print(f"import palaestra: {import_time():.3f} s (best of 5, fresh interpreter)")
    with ScriptedServer(lambda req, n: Reply(content="ok", delay=args.latency), model="bench") as server:
        raw, pal = asyncio.run(bench(args, server.base_url))
    print(
        f"{args.rollouts} rollouts, concurrency {args.concurrency}, server latency {args.latency * 1000:.1f} ms "
        f"(the stand-in server runs in this process: its CPU is in both sides' process CPU)"
    )
    for what, i in (("wall", 0), ("process CPU", 1)):
        r, q = statistics.median(x[i] for x in raw), statistics.median(x[i] for x in pal)
        print(
            f"{what}: raw asyncio.gather + openai {r:.3f} s (runs: {', '.join(f'{x[i]:.3f}' for x in raw)})"
        )
        print(
            f"{what}: gather_trajectory_groups    {q:.3f} s (runs: {', '.join(f'{x[i]:.3f}' for x in pal)})"
        )
        print(
            f"ratio palaestra/raw ({what}): {q / r:.4f}, overhead {100 * (q / r - 1):+.2f}% (target <= +3%)"
        )


if __name__ == "__main__":
    main()
