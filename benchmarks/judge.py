"""Group judge cost: calls and prompt size per group, RulerJudge vs a one-call-per-trajectory judge, and cache
replay. Everything goes over real HTTP (the real openai client against a loopback ScriptedServer) and is
counted on the wire: prompt characters are the JSON of the request's messages, prompt tokens are what the
server reports (about chars / 4, since there is no real tokenizer behind it).

    python benchmarks/judge.py [--groups 40] [--group-size 8] [--quick]

Compared on the same groups:
  * per-trajectory: one call per trajectory, each with the full conversation (system prompt, question, answer);
  * group, no dedup: one call per group, every candidate sent in full (what prefix dedup saves);
  * RulerJudge: one call per group, shared prefix sent once, duplicates sent once;
  * RulerJudge + JudgeCache, second run of the same groups.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import tempfile
import time

import openai

from palaestra.judges.cache import JudgeCache
from palaestra.judges.faults import good_scores
from palaestra.judges.prompt import DEFAULT_RUBRIC, build_messages
from palaestra.judges.ruler import RulerJudge
from palaestra.testing import Reply, ScriptedServer
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

SYSTEM = (
    "You are a careful arithmetic assistant. Work through the problem step by step, check each step, and end "
    "with exactly one line of the form 'Final: <int>'. Do not add anything after that line. Negative answers "
    "keep their sign. If the question is ambiguous, answer the most literal reading. "
) * 2


def make_groups(k: int, n: int, seed: int = 0) -> list[TrajectoryGroup]:
    """Arithmetic groups; about one answer in eight is an exact duplicate of another (as sampling produces)."""
    rng = random.Random(seed)
    groups = []
    for _ in range(k):
        a, b = rng.randrange(100), rng.randrange(100)
        prefix = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {a}+{b}? Reply with one line: Final: <int>"},
        ]
        answers: list[str] = []
        for _ in range(n):
            if answers and rng.random() < 0.125:
                answers.append(rng.choice(answers))
                continue
            guess = a + b + rng.choice([0, 0, 1, -1, 10])
            steps = " ".join(
                f"Step {s}: add the {w}."
                for s, w in enumerate(["ones", "tens", "carry"][: rng.randint(1, 3)])
            )
            answers.append(f"{steps}\nFinal: {guess}")
        groups.append(
            TrajectoryGroup(
                [
                    Trajectory(messages_and_choices=[*prefix, {"role": "assistant", "content": ans}])
                    for ans in answers
                ]
            )
        )
    return groups


def script(request: dict, n: int) -> Reply:
    chars = len(json.dumps(request.get("messages", [])))
    if "<candidate id=" in json.dumps(request.get("messages", [])):
        content = json.dumps({"scores": good_scores(request)})
    else:
        content = json.dumps({"explanation": "fine", "score": 0.5})
    return Reply(content, prompt_tokens=max(1, chars // 4), completion_tokens=max(1, len(content) // 4))


class NoDedupJudge(RulerJudge):
    """RulerJudge that sends every candidate in full (no shared context block), for comparison only."""

    def build_request(self, cands):  # type: ignore[no-untyped-def]
        return build_messages(self.rubric, [], cands[0].tools, [(c.cid, c.messages, None) for c in cands])


async def per_trajectory(server: ScriptedServer, groups: list[TrajectoryGroup]) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    sem = asyncio.Semaphore(8)

    async def one(traj: Trajectory) -> None:
        messages = [
            {"role": "system", "content": "Score this conversation between 0 and 1.\n" + DEFAULT_RUBRIC},
            {"role": "user", "content": json.dumps(traj.messages())},
        ]
        async with sem:
            resp = await client.chat.completions.create(
                model="judge", messages=messages, response_format={"type": "json_object"}
            )
        traj.reward = float(json.loads(resp.choices[0].message.content or "{}")["score"])

    await asyncio.gather(*(one(t) for g in groups for t in g.trajectories))
    await client.close()


async def run_judge(judge: RulerJudge, groups: list[TrajectoryGroup]) -> float:
    sem = asyncio.Semaphore(8)

    async def one(g: TrajectoryGroup) -> None:
        async with sem:
            await judge.score_group(g)

    start = time.perf_counter()
    await asyncio.gather(*(one(g) for g in groups))
    return time.perf_counter() - start


def measure(server: ScriptedServer, since: int) -> tuple[int, int, int]:
    reqs = server.requests[since:]
    chars = sum(len(json.dumps(r.get("messages", []))) for r in reqs)
    return len(reqs), chars, chars // 4


async def main_async(k: int, n: int) -> None:
    print(
        f"# judge benchmark  {dt.datetime.now().isoformat(timespec='seconds')}  {platform.platform()}  "
        f"python {platform.python_version()}  cpus={os.cpu_count()}"
    )
    print(f"# {k} groups x {n} trajectories; tokens = chars/4 as counted on the wire")
    rows = {}
    with ScriptedServer(script) as server:
        mark = server.calls
        await per_trajectory(server, make_groups(k, n))
        rows["per-trajectory"] = measure(server, mark)

        mark = server.calls
        await run_judge(NoDedupJudge("judge", base_url=server.base_url), make_groups(k, n))
        rows["group, no prefix dedup"] = measure(server, mark)

        mark = server.calls
        await run_judge(RulerJudge("judge", base_url=server.base_url), make_groups(k, n))
        rows["RulerJudge"] = measure(server, mark)

        with tempfile.TemporaryDirectory() as tmp:
            cache = JudgeCache(os.path.join(tmp, "judge.sqlite"))
            mark = server.calls
            cold = await run_judge(
                RulerJudge("judge", base_url=server.base_url, cache=cache), make_groups(k, n)
            )
            cold_calls = server.calls - mark
            mark = server.calls
            warm = await run_judge(
                RulerJudge("judge", base_url=server.base_url, cache=cache), make_groups(k, n)
            )
            rows["RulerJudge + cache (replay)"] = measure(server, mark)
            cache.close()

    base_calls, _, base_tokens = rows["per-trajectory"]
    print(
        f"{'judge':32s} {'calls/group':>12s} {'prompt tok/group':>17s} {'calls ratio':>12s} {'tokens ratio':>13s}"
    )
    for name, (calls, _chars, tokens) in rows.items():
        print(
            f"{name:32s} {calls / k:12.2f} {tokens / k:17.0f} {calls / base_calls:12.3f} "
            f"{tokens / base_tokens:13.3f}"
        )
    ruler_tokens = rows["RulerJudge"][2]
    print(
        f"prefix dedup saves {1 - ruler_tokens / rows['group, no prefix dedup'][2]:.1%} of a group call's prompt; "
        f"RulerJudge uses {base_tokens / ruler_tokens:.1f}x fewer prompt tokens and "
        f"{base_calls / rows['RulerJudge'][0]:.1f}x fewer calls than per-trajectory judging"
    )
    print(
        f"cache replay: {rows['RulerJudge + cache (replay)'][0]} calls (cold run {cold_calls}); "
        f"wall {warm * 1000:.1f} ms vs {cold * 1000:.1f} ms cold ({cold / max(warm, 1e-9):.0f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="6 groups (a few seconds)")
    args = parser.parse_args()
    asyncio.run(main_async(6 if args.quick else args.groups, args.group_size))


if __name__ == "__main__":
    main()
