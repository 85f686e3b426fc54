"""Calculator environment: a multi-turn episode in which the policy may call a ``calc`` tool before answering.

An episode (:func:`calculator_rollout`): the user asks ``What is 81*92? Reply with one line: Final: <int>``
(a row of :mod:`palaestra.envs.calculator_data`) and the request offers one tool, :data:`CALC_TOOL`. Each
assistant reply that holds tool calls gets one ``tool`` message per call (the exact, bounded evaluator of
:mod:`palaestra.envs.calc_eval`; an error comes back as ``error: ...`` text, never as an exception), and the
episode goes on; a reply without tool calls ends it, and so do ``max_turns`` replies or a conversation that
no longer fits the model's context. The rollout talks to the model only through ``model.openai_client()``
with the OpenAI tools API, so it runs unchanged against the embedded policy, vLLM or OpenAI.

Reward: the strict ``Final: <int>`` verifier on the content of the **last** assistant message, minus
``tool_cost`` per tool call (0 by default). Metrics: ``correct``, ``turns``, ``tool_calls``, ``tool_errors``,
``used_tool``, ``tool_correct`` (some call returned the expected answer, i.e. the tool was used correctly),
``outcome/<code>``; metadata: ``outcome``, ``end_reason`` (``answered``, ``max_turns``, ``context``),
``example_id``, ``family``, ``model``. :func:`evaluate_calculator` is the environment's validation (greedy
and sampled episodes on a split).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.calc_eval import run_calc
from palaestra.envs.verifier import Verifier, get_verifier
from palaestra.trajectories.protocols import ChatModel
from palaestra.trajectories.types import Trajectory

__all__ = [
    "CALC_TOOL",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_TURNS",
    "TOOLS",
    "calculator_group_rollout",
    "calculator_rollout",
    "call_tool",
    "evaluate_calculator",
]

CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an integer arithmetic expression exactly: + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+7)*3"}},
            "required": ["expression"],
        },
    },
}
TOOLS: list[dict[str, Any]] = [CALC_TOOL]
DEFAULT_MAX_TURNS = 3
DEFAULT_MAX_TOKENS = 24
_STRICT = StrictFinalVerifier()


def call_tool(name: str | None, arguments: Any) -> str:
    """Run one tool call; the result text (``error: ...`` on any problem). Never raises."""
    if name != "calc":
        return f"error: no tool named {str(name)[:40]!r}; the only tool is calc"
    return run_calc(arguments if isinstance(arguments, (str, Mapping)) else None)


def _seed(seed: int | None, *parts: int) -> int | None:
    if seed is None:
        return None
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def _context_exhausted(exc: BaseException) -> bool:
    return (
        getattr(exc, "status_code", None) == 400 and getattr(exc, "code", None) == "context_length_exceeded"
    )


async def _ask(
    model: ChatModel,
    messages: list[dict[str, Any]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int | None,
) -> list[Any]:
    kwargs: dict[str, Any] = {
        "model": model.name,
        "messages": messages,
        "tools": TOOLS,
        "n": n,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "logprobs": True,
    }
    if seed is not None:
        kwargs["seed"] = seed
    response = await model.openai_client().chat.completions.create(**kwargs)
    choices = sorted(response.choices, key=lambda c: c.index)
    if len(choices) != n:
        raise RuntimeError(f"model {model.name!r} returned {len(choices)} choices, asked for {n}")
    return choices


def _start(model: ChatModel, example: Mapping[str, Any], temperature: float, seed: int | None) -> Trajectory:
    prompt = example.get("prompt") if isinstance(example, Mapping) else None
    if not isinstance(prompt, str):
        raise ValueError(f"example field 'prompt' must be a string, got {type(prompt).__name__}")
    ex_id, family = example.get("id"), example.get("family")
    return Trajectory(
        messages_and_choices=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        metadata={
            "example_id": ex_id if isinstance(ex_id, str) else str(ex_id),
            "family": family if isinstance(family, str) else None,
            "model": model.name,
            "temperature": float(temperature),
            "seed": seed,
        },
    )


async def _play(
    model: ChatModel,
    traj: Trajectory,
    example: Mapping[str, Any],
    first: Any | None,
    *,
    temperature: float,
    max_tokens: int,
    seed: int | None,
    max_turns: int,
    tool_cost: float,
    verifier: Verifier,
) -> Trajectory:
    """Run the episode from its user turn (``first``: an already sampled first reply) and score it."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    expected = str(example.get("expected_answer"))
    calls = errors = turns = 0
    tool_correct = False
    end_reason = "max_turns"
    while turns < max_turns:
        if turns == 0 and first is not None:
            choice = first
        else:
            try:
                (choice,) = await _ask(
                    model,
                    traj.messages(),
                    n=1,
                    temperature=temperature,
                    max_tokens=max_tokens,
                    seed=_seed(seed, turns),
                )
            except Exception as exc:
                if not _context_exhausted(exc):
                    raise
                end_reason = "context"
                traj.log(f"turn {turns + 1}: the conversation no longer fits the model's context")
                break
        traj.messages_and_choices.append(choice)
        turns += 1
        tool_calls = choice.message.tool_calls or []
        if not tool_calls:
            end_reason = "answered"
            break
        for call in tool_calls:
            fn = getattr(call, "function", None)
            result = call_tool(getattr(fn, "name", None), getattr(fn, "arguments", None))
            calls += 1
            errors += result.startswith("error:")
            tool_correct = tool_correct or result == expected
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    score = verifier.score(example, traj.last_assistant_text() or "")
    traj.reward = float(score.reward) - float(tool_cost) * calls
    traj.metrics.update(
        {
            "correct": score.reward > 0.0,
            "turns": turns,
            "tool_calls": calls,
            "tool_errors": errors,
            "used_tool": calls > 0,
            "tool_correct": tool_correct,
            f"outcome/{score.outcome}": 1,
        }
    )
    traj.metadata.update({"outcome": score.outcome, "end_reason": end_reason, "tool_cost": float(tool_cost)})
    return traj.finish()


async def calculator_rollout(
    model: ChatModel,
    example: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seed: int | None = None,
    max_turns: int = DEFAULT_MAX_TURNS,
    tool_cost: float = 0.0,
    verifier: Verifier | None = None,
) -> Trajectory:
    """One episode (module docstring). ``seed`` is the sampling seed; turn ``t`` uses a seed derived from
    ``(seed, t)``. ``max_tokens`` bounds each reply. ``verifier`` defaults to the strict arithmetic one."""
    traj = _start(model, example, temperature, seed)
    return await _play(
        model,
        traj,
        example,
        None,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        max_turns=max_turns,
        tool_cost=tool_cost,
        verifier=verifier or _STRICT,
    )


async def calculator_group_rollout(
    model: ChatModel,
    example: Mapping[str, Any],
    n: int,
    *,
    temperature: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seed: int | None = None,
    max_turns: int = DEFAULT_MAX_TURNS,
    tool_cost: float = 0.0,
    verifier: Verifier | None = None,
) -> list[Trajectory]:
    """``n`` episodes on one example: their first replies come from ONE request with ``n`` choices, then
    each episode goes on by itself (episode ``i``, turn ``t`` seeded from ``(seed, i, t)``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    start = _start(model, example, temperature, seed)
    firsts = await _ask(
        model, start.messages(), n=n, temperature=temperature, max_tokens=max_tokens, seed=seed
    )
    trajs = []
    for i, choice in enumerate(firsts):
        traj = _start(model, example, temperature, seed)
        traj.metadata["choice_index"] = i
        trajs.append(
            _play(
                model,
                traj,
                example,
                choice,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=_seed(seed, i),
                max_turns=max_turns,
                tool_cost=tool_cost,
                verifier=verifier or _STRICT,
            )
        )
    return list(await asyncio.gather(*trajs))


async def evaluate_calculator(
    model: ChatModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    seed: int = 0,
    greedy: bool = True,
    sampled: bool = True,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_turns: int = DEFAULT_MAX_TURNS,
    verifier: str = "arith-strict",
    max_concurrency: int = 256,
) -> dict[str, Any]:
    """Validation of the calculator environment: one greedy (temperature 0) and/or one sampled (temperature 1,
    seeded per example) episode per example, at most ``max_concurrency`` at once.

    Returns a flat dict: ``n``, ``greedy_accuracy`` / ``sampled_accuracy`` (fraction with reward > 0 before
    tool costs), ``greedy_tool_use`` / ``sampled_tool_use`` (fraction that called the tool),
    ``greedy_tool_correct`` / ``sampled_tool_correct`` (fraction whose call returned the expected answer),
    ``greedy_tool_calls`` (mean calls per episode), ``method``, ``policy_step``, ``outcome/<code>`` (greedy)
    and ``rows`` (per example: ``id``, ``greedy_completion``, ``greedy_outcome``, ``greedy_reward``,
    ``greedy_tool_calls``, ``sampled_correct``).
    """
    t0 = time.perf_counter()
    scorer = get_verifier(verifier)
    sem = asyncio.Semaphore(max_concurrency)

    async def one(i: int, ex: Mapping[str, Any], temp: float, sd: int | None) -> Trajectory:
        async with sem:
            return await calculator_rollout(
                model,
                ex,
                temperature=temp,
                max_tokens=max_tokens,
                seed=sd,
                max_turns=max_turns,
                verifier=scorer,
            )

    out: dict[str, Any] = {"n": len(examples), "method": "rollout"}
    rows: list[dict[str, Any]] = [{"id": ex.get("id", i)} for i, ex in enumerate(examples)]
    n = max(len(examples), 1)
    for kind, on, temp in (("greedy", greedy, 0.0), ("sampled", sampled, 1.0)):
        if not on:
            continue
        seeds = [seed if kind == "greedy" else _seed(seed, 1, i) for i in range(len(examples))]
        trajs = await asyncio.gather(*(one(i, ex, temp, s) for i, (ex, s) in enumerate(zip(examples, seeds))))
        ok = [bool(t.metrics["correct"]) for t in trajs]
        out[f"{kind}_accuracy"] = sum(ok) / n
        out[f"{kind}_tool_use"] = sum(bool(t.metrics["used_tool"]) for t in trajs) / n
        out[f"{kind}_tool_correct"] = sum(bool(t.metrics["tool_correct"]) for t in trajs) / n
        if kind == "greedy":
            out["greedy_tool_calls"] = sum(int(t.metrics["tool_calls"]) for t in trajs) / n
            codes = Counter(str(t.metadata["outcome"]) for t in trajs)
            out.update({f"outcome/{k}": c for k, c in sorted(codes.items())})
            for row, t in zip(rows, trajs):
                row.update(
                    greedy_completion=t.last_assistant_text(),
                    greedy_outcome=t.metadata["outcome"],
                    greedy_reward=float(t.metrics["correct"]),
                    greedy_tool_calls=int(t.metrics["tool_calls"]),
                )
        else:
            for row, good in zip(rows, ok):
                row["sampled_correct"] = int(good)
    step = getattr(model, "step", None)
    if isinstance(step, int):
        out["policy_step"] = step
    out["seconds"] = time.perf_counter() - t0
    out["rows"] = rows
    return out
