"""Hello rollout: a custom async rollout against any OpenAI-compatible endpoint, gathered in groups.

    python examples/hello_rollout.py --base-url http://127.0.0.1:8000/v1 --model arith-base
    python examples/hello_rollout.py --quick        # offline: the shipped arith-base, in process, no server

(`palaestra serve --model arith-base --port 8000` gives you such an endpoint offline.) Each scenario is an
addition; each group holds --group-size attempts at it; the reward is 1 when the reply is exactly
``Final: <sum>``. The groups are written to --out as JSONL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from typing import Any

import openai

from palaestra import Trajectory, TrajectoryGroup, gather_trajectory_groups, write_groups


class Endpoint:
    """The smallest model object rollouts need: a served model name and an openai client."""

    def __init__(self, base_url: str, model: str, api_key: str) -> None:
        self.name = model
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)

    def openai_client(self) -> openai.AsyncOpenAI:
        return self._client


async def rollout(model: Any, scenario: dict[str, int], seed: int) -> Trajectory:
    a, b = scenario["a"], scenario["b"]
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": f"What is {a}+{b}? Reply with one line: Final: <int>"}
        ],
        metadata={"a": a, "b": b},
    )
    response = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages(), max_tokens=16, temperature=1.0, logprobs=True, seed=seed
    )
    choice = response.choices[0]
    traj.messages_and_choices.append(choice)
    traj.reward = float((choice.message.content or "").strip() == f"Final: {a + b}")
    traj.metrics["correct"] = traj.reward == 1.0
    return traj.finish()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint (default: the model in process)")
    parser.add_argument("--model", default="arith-base", help="served model name (in process: a shipped one)")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the key (if any)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="hello_groups.jsonl")
    parser.add_argument("--quick", action="store_true", help="small settings (CI): 2 groups of 2")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.group_size = 2, 2

    model: Any
    if args.base_url:
        model = Endpoint(args.base_url, args.model, os.environ.get(args.api_key_env, "not-needed"))
    else:  # the embedded policy, served in process by the same OpenAI-compatible app as `palaestra serve`
        from palaestra.models import load

        model = load(args.model)
        print(f"no --base-url: sampling {args.model} in process (the shipped tiny policy, offline)")
    rng = random.Random(args.seed)
    scenarios = [{"a": rng.randrange(100), "b": rng.randrange(100)} for _ in range(args.groups)]
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(
                (rollout(model, s, seed=args.seed * 1000 + 10 * g + i) for i in range(args.group_size)),
                metadata={"scenario": f"{s['a']}+{s['b']}"},
            )
            for g, s in enumerate(scenarios)
        ),
        max_concurrency=args.concurrency,
        max_exceptions=0.25,
    )
    write_groups(args.out, groups)
    for g in groups:
        print(f"{g.metadata['scenario']:>7}: rewards {g.rewards()}  failures {len(g.exceptions)}")
    n = sum(len(g) for g in groups)
    print(
        f"{n} trajectories in {len(groups)} groups, mean reward {sum(sum(g.rewards()) for g in groups) / max(n, 1):.3f}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
