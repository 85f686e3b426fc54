"""Writing your own rollouts: an async single-turn rollout and a multi-turn rollout with tool calls.

    python examples/custom_rollout.py                      # offline (see below)
    python examples/custom_rollout.py --base-url http://127.0.0.1:8000/v1 --model my-model --api-key-env KEY

A rollout is an ``async`` function ``(model, scenario, *, seed) -> Trajectory``. It talks to the model only
through ``model.name`` and ``model.openai_client()`` (an ``openai.AsyncOpenAI``), appends the ``Choice``
objects it gets back (they carry the sampling-time logprobs a trainer needs), sets ``reward`` and
``metrics``, and returns ``traj.finish()``. ``TrajectoryGroup`` + ``gather_trajectory_groups`` run many at
once; a rollout that raises is recorded as an exception of its group, never scored 0.

Offline, the single-turn part runs on the embedded ``arith-base`` policy, and the tool part runs against a
local ``ScriptedServer``: a real OpenAI-compatible HTTP server whose script calls the calculator tool and then
answers with the tool's result, so every branch of the loop is exercised deterministically. (The embedded
``calc-base`` policy emits real tool calls too: see ``examples/agentic_calculator.py``.) With ``--base-url``
both parts use your endpoint (the tool part needs a model that supports tool calling).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from palaestra import Trajectory, TrajectoryGroup, gather_trajectory_groups, write_groups
from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split

VERIFIER = StrictFinalVerifier()

# ---------------------------------------------------------------------------------------------- single turn


async def single_turn(model: Any, example: dict[str, Any], *, seed: int, max_tokens: int = 16) -> Trajectory:
    """One question, one sampled answer, scored by the strict verifier."""
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": example["prompt"]}],
        metadata={"example_id": example["id"], "seed": seed},
    )
    response = await model.openai_client().chat.completions.create(
        model=model.name,
        messages=traj.messages(),
        temperature=1.0,
        max_tokens=max_tokens,
        logprobs=True,
        seed=seed,
    )
    choice = response.choices[0]
    traj.messages_and_choices.append(choice)
    score = VERIFIER.score(example, choice.message.content or "")
    traj.reward = score.reward
    traj.metrics["correct"] = score.reward > 0
    traj.metadata["outcome"] = score.outcome
    return traj.finish()


# ---------------------------------------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an integer expression 'a+b' or 'a-b' and return the result.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "for example 12+30"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "Use the calculator tool to compute the answer, then reply with one line: Final: <int>"
_EXPR = re.compile(r"^\s*(-?\d{1,6})\s*([+-])\s*(-?\d{1,6})\s*$")


def calculator(arguments: str) -> str:
    """The tool itself. Bad arguments give an error text for the model to read (not an exception)."""
    try:
        expression = json.loads(arguments)["expression"]
        a, op, b = _EXPR.match(expression).groups()  # type: ignore[union-attr]
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"error: expected {{'expression': 'a+b'}}, got {arguments[:80]!r}"
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))


async def tool_rollout(model: Any, example: dict[str, Any], *, seed: int, max_turns: int = 4) -> Trajectory:
    """Multi-turn: the model may call the calculator; each call's result goes back as a ``tool`` message."""
    traj = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": example["prompt"]},
        ],
        tools=TOOLS,
        metadata={"example_id": example["id"], "seed": seed},
    )
    client = model.openai_client()
    calls = 0
    for turn in range(max_turns):
        response = await client.chat.completions.create(
            model=model.name,
            messages=traj.messages(),
            tools=TOOLS,
            temperature=1.0,
            max_tokens=64,
            seed=seed + turn,
        )
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        tool_calls = choice.message.tool_calls or []
        if not tool_calls:
            break
        for call in tool_calls:
            calls += 1
            result = (
                calculator(call.function.arguments)
                if call.function.name == "calculator"
                else "error: no such tool"
            )
            traj.log(f"turn {turn}: {call.function.name}({call.function.arguments}) -> {result}")
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    score = VERIFIER.score(example, traj.last_assistant_text() or "")
    traj.reward = score.reward
    traj.metrics.update(correct=score.reward > 0, tool_calls=calls, turns=turn + 1)
    traj.metadata["outcome"] = score.outcome
    return traj.finish()


def scripted_tool_user(request: dict[str, Any], n: int) -> Any:
    """Offline stand-in for a tool-calling model: call the calculator once, then answer with its result."""
    from palaestra.testing import Reply

    messages = request["messages"]
    if messages[-1]["role"] == "tool":
        return Reply(f"Final: {messages[-1]['content']}")
    question = next(m["content"] for m in messages if m["role"] == "user")
    expression = re.search(r"What is (\d+[+-]\d+)\?", question).group(1)  # type: ignore[union-attr]
    call = {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return Reply(None, tool_calls=[call])


# ---------------------------------------------------------------------------------------------- driver


class Endpoint:
    """The smallest model object rollouts need: a served model name and an ``openai`` client."""

    def __init__(self, base_url: str, model: str, api_key: str) -> None:
        import openai

        self.name = model
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)

    def openai_client(self) -> Any:
        return self._client


@contextlib.contextmanager
def tool_model(args: argparse.Namespace) -> Iterator[Any]:
    if args.base_url:
        yield Endpoint(args.base_url, args.model, os.environ.get(args.api_key_env, "not-needed"))
        return
    from palaestra.testing import ScriptedServer

    with ScriptedServer(scripted_tool_user, model="scripted-tool-user") as server:
        yield Endpoint(server.base_url, "scripted-tool-user", "offline")


async def run_part(
    name: str, model: Any, rollout: Any, examples: list[dict[str, Any]], args: argparse.Namespace
) -> list[TrajectoryGroup]:
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(
                (rollout(model, ex, seed=args.seed * 1000 + 10 * g + i) for i in range(args.group_size))
            )
            for g, ex in enumerate(examples)
        ),
        max_concurrency=args.concurrency,
        max_exceptions=0.25,
        progress=False,
    )
    n = sum(len(g) for g in groups)
    correct = sum(t.reward > 0 for g in groups for t in g)
    print(
        f"[{name}] model {model.name}: {n} trajectories in {len(groups)} groups, "
        f"accuracy {correct / max(n, 1):.3f}, failed rollouts {sum(len(g.exceptions) for g in groups)}"
    )
    first = groups[0].trajectories[0] if groups and groups[0].trajectories else None
    if first is not None:
        for m in first.messages():
            shown = m.get("content") or json.dumps(m.get("tool_calls"))
            print(f"    {m['role']:>9}: {str(shown)[:100]!s}")
    return groups


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint (default: offline)")
    parser.add_argument("--model", default="arith-base", help="model name (embedded name offline)")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the key (if any)")
    parser.add_argument("--part", choices=("single", "tools", "both"), default="both")
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the groups of every part to this JSONL file")
    parser.add_argument("--quick", action="store_true", help="small settings (CI)")
    args = parser.parse_args()
    if args.quick:
        args.examples, args.group_size = 3, 2
    examples = load_split("dev")[: args.examples]
    groups: list[TrajectoryGroup] = []
    if args.part in ("single", "both"):
        if args.base_url:
            model: Any = Endpoint(args.base_url, args.model, os.environ.get(args.api_key_env, "not-needed"))
        else:
            from palaestra.models.registry import load

            model = load(args.model)
        groups += await run_part("single-turn", model, single_turn, examples, args)
    if args.part in ("tools", "both"):
        with tool_model(args) as model:
            tool_groups = await run_part("tool calls", model, tool_rollout, examples, args)
        calls = [t.metrics.get("tool_calls", 0) for g in tool_groups for t in g]
        print(f"[tool calls] tool calls per rollout: {sum(calls) / max(len(calls), 1):.2f}")
        groups += tool_groups
    if args.out:
        write_groups(args.out, groups)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
