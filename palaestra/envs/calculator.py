"""Calculator environment: a multi-turn episode in which the policy may call a ``calc`` tool (or an MCP server's
tools) before answering ``Final: <int>`` (docs/environments.md, "The calculator episode")."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.calc_eval import run_calc
from palaestra.envs.calculator_data import difficulty_of
from palaestra.envs.mcp import MCPTools
from palaestra.envs.rollouts import request_choices, single_turn_start
from palaestra.envs.verifier import Verifier, get_verifier
from palaestra.trajectories.protocols import ChatModel
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import Trajectory

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
_RATES = {"accuracy": "correct", "tool_use": "used_tool", "tool_correct": "tool_correct"}  # key: metric


def call_tool(name: str | None, arguments: Any) -> str:
    """Run one tool call; the result text (``error: ...`` on any problem). Never raises."""
    if name != "calc":
        return f"error: no tool named {str(name)[:40]!r}; the only tool is calc"
    return run_calc(arguments if isinstance(arguments, (str, Mapping)) else None)


_MCP: dict[tuple[int, str, float], MCPTools] = {}
_MCP_LOCKS: dict[tuple[int, str, float], asyncio.Lock] = {}


async def mcp_tools(spec: str, timeout: float = 10.0) -> MCPTools:
    """The shared, started :class:`~palaestra.envs.mcp.MCPTools` for ``spec`` (a stdio command, or an
    ``http(s)://`` URL) in the running event loop."""
    key = (id(asyncio.get_running_loop()), spec, float(timeout))
    async with _MCP_LOCKS.setdefault(key, asyncio.Lock()):
        tools = _MCP.get(key)
        if tools is None or not tools.connected:  # stale: a closed loop whose id was reused, a lost server
            _MCP.pop(key, None)
            is_url = spec.startswith(("http://", "https://"))
            tools = MCPTools(url=spec, timeout=timeout) if is_url else MCPTools(spec, timeout=timeout)
            await tools.start()
            _MCP[key] = tools
        return tools


async def close_mcp_tools() -> None:
    """Close the shared MCP connections of the running event loop."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _MCP if k[0] == loop_id]:
        await _MCP.pop(key).aclose()
        _MCP_LOCKS.pop(key, None)


ToolCall = Callable[[str | None, Any], Awaitable[str]]  # (name, arguments) -> result text, never raises


async def _builtin_call(name: str | None, arguments: Any) -> str:
    return call_tool(name, arguments)


async def _toolbox(
    mcp: str | None, mcp_timeout: float, only: str | None = None
) -> tuple[list[Any], ToolCall]:
    """The tools offered in an episode and how a call runs: the built-in calc, or an MCP server's tools."""
    if mcp is None or mcp == "":
        return TOOLS, _builtin_call
    if not isinstance(mcp, str):
        raise ValueError(f"mcp must be a command or URL string, got {type(mcp).__name__}")
    server = await mcp_tools(mcp, mcp_timeout)
    names = [n.strip() for n in (only or "").split(",") if n.strip()] or server.names
    if missing := sorted(set(names) - set(server.names)):
        raise ValueError(f"mcp_tools: the MCP server has no tool {missing}; it has {server.names}")
    return [t for t in server.tools if t["function"]["name"] in names], server.call


def _seed(seed: int | None, *parts: int) -> int | None:
    return None if seed is None else derive_seed(seed, *parts)


@dataclass(frozen=True)
class _Episodes:
    """The settings shared by the episodes of one call on one example."""

    model: ChatModel
    example: Mapping[str, Any]
    temperature: float
    max_tokens: int
    max_turns: int
    tool_cost: float
    verifier: Verifier
    tools: list[dict[str, Any]]
    call: ToolCall
    cost_per_turn: bool
    top_logprobs: int

    def __post_init__(self) -> None:
        turns = self.max_turns
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {turns!r}")

    def start(self, seed: int | None) -> Trajectory:
        """The trajectory of a new episode: the user turn and the episode's metadata."""
        messages, meta = single_turn_start(
            self.model, self.example, self.temperature, self.max_tokens, seed, None
        )
        family = self.example.get("family")
        meta.update(family=family if isinstance(family, str) else None, difficulty=difficulty_of(family))
        return Trajectory(messages_and_choices=messages, tools=self.tools, metadata=meta)

    async def ask(self, messages: list[dict[str, Any]], n: int, seed: int | None) -> list[Any]:
        options: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        options.update(tools=self.tools, top_logprobs=int(self.top_logprobs) or None)
        choices, _ = await request_choices(self.model, messages, n, seed=seed, **options)
        return choices

    async def play(self, traj: Trajectory, first: Any | None, seed: int | None) -> Trajectory:
        """Run the episode from its user turn (``first``: an already sampled first reply) and score it."""
        expected = str(self.example.get("expected_answer"))
        turn_costs: list[float] = []
        calls = errors = turns = 0
        tool_correct = False
        end_reason = "max_turns"
        while turns < self.max_turns:
            if turns == 0 and first is not None:
                choice = first
            else:
                try:
                    (choice,) = await self.ask(traj.messages(), 1, _seed(seed, turns))
                except Exception as exc:
                    error = (getattr(exc, "status_code", None), getattr(exc, "code", None))
                    if error != (400, "context_length_exceeded"):
                        raise
                    end_reason = "context"
                    traj.log(f"turn {turns + 1}: the conversation no longer fits the model's context")
                    break
            traj.messages_and_choices.append(choice)
            turns += 1
            tool_calls = choice.message.tool_calls or []
            turn_costs.append(-float(self.tool_cost) * len(tool_calls))
            if not tool_calls:
                end_reason = "answered"
                break
            for call in tool_calls:
                fn = getattr(call, "function", None)
                result = await self.call(getattr(fn, "name", None), getattr(fn, "arguments", None))
                calls += 1
                errors += result.startswith("error:")
                tool_correct = tool_correct or result == expected
                traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
        score = self.verifier.score(self.example, traj.last_assistant_text() or "")
        if self.cost_per_turn:
            traj.reward = float(score.reward)
            traj.turn_rewards = [c + 0.0 for c in turn_costs]  # + 0.0: no -0.0 in the records
        else:
            traj.reward = float(score.reward) - float(self.tool_cost) * calls
        counts = {"turns": turns, "tool_calls": calls, "tool_errors": errors, "used_tool": calls > 0}
        traj.metrics.update(correct=score.reward > 0.0, **counts, tool_correct=tool_correct)
        traj.metrics[f"outcome/{score.outcome}"] = 1
        traj.metadata.update(outcome=score.outcome, end_reason=end_reason, tool_cost=float(self.tool_cost))
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
    cost_per_turn: bool = False,
    mcp: str | None = None,
    mcp_timeout: float = 10.0,
    mcp_tools: str | None = None,
    top_logprobs: int = 0,
) -> Trajectory:
    """One episode (docs/environments.md). ``seed`` is the sampling seed; turn ``t`` uses a seed derived from
    ``(seed, t)``. ``max_tokens`` bounds each reply. ``verifier`` defaults to the strict arithmetic one."""
    box = await _toolbox(mcp, mcp_timeout, mcp_tools)
    settings = (temperature, max_tokens, max_turns, tool_cost, verifier or _STRICT, *box, cost_per_turn)
    ep = _Episodes(model, example, *settings, top_logprobs)
    return await ep.play(ep.start(seed), None, seed)


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
    cost_per_turn: bool = False,
    mcp: str | None = None,
    mcp_timeout: float = 10.0,
    mcp_tools: str | None = None,
    top_logprobs: int = 0,
) -> list[Trajectory]:
    """``n`` episodes on one example: their first replies come from ONE request with ``n`` choices, then
    each episode goes on by itself (episode ``i``, turn ``t`` seeded from ``(seed, i, t)``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    box = await _toolbox(mcp, mcp_timeout, mcp_tools)
    settings = (temperature, max_tokens, max_turns, tool_cost, verifier or _STRICT, *box, cost_per_turn)
    ep = _Episodes(model, example, *settings, top_logprobs)
    firsts = await ep.ask(ep.start(seed).messages(), n, seed)
    trajs = []
    for i, choice in enumerate(firsts):
        traj = ep.start(seed)
        traj.metadata["choice_index"] = i
        trajs.append(ep.play(traj, choice, _seed(seed, i)))
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
    mcp: str | None = None,
    mcp_timeout: float = 10.0,
    mcp_tools: str | None = None,
) -> dict[str, Any]:
    """Validation: one greedy (temperature 0) and/or one sampled (temperature 1, seeded) episode per example, at
    most ``max_concurrency`` at once; ``<kind>_accuracy`` etc. overall and by difficulty (docs/environments.md)."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(max_concurrency)
    options: dict[str, Any] = {"max_tokens": max_tokens, "max_turns": max_turns, "mcp": mcp}
    options.update(verifier=get_verifier(verifier), mcp_timeout=mcp_timeout, mcp_tools=mcp_tools)

    async def one(ex: Mapping[str, Any], temp: float, sd: int | None) -> Trajectory:
        async with sem:
            return await calculator_rollout(model, ex, temperature=temp, seed=sd, **options)

    out: dict[str, Any] = {"n": len(examples), "method": "rollout"}
    rows: list[dict[str, Any]] = [{"id": ex.get("id", i)} for i, ex in enumerate(examples)]
    n = max(len(examples), 1)
    for kind, on, temp in (("greedy", greedy, 0.0), ("sampled", sampled, 1.0)):
        if not on:
            continue
        seeds = [seed if kind == "greedy" else _seed(seed, 1, i) for i in range(len(examples))]
        trajs = await asyncio.gather(*(one(ex, temp, s) for ex, s in zip(examples, seeds)))
        for key, metric in _RATES.items():
            out[f"{kind}_{key}"] = sum(bool(t.metrics[metric]) for t in trajs) / n
            for level in ("easy", "hard"):
                if sel := [bool(t.metrics[metric]) for t in trajs if t.metadata.get("difficulty") == level]:
                    out[f"{kind}_{key}_{level}"] = sum(sel) / len(sel)
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
            for row, t in zip(rows, trajs):
                row["sampled_correct"] = int(bool(t.metrics["correct"]))
    step = getattr(model, "step", None)
    if isinstance(step, int):
        out["policy_step"] = step
    return out | {"seconds": time.perf_counter() - t0, "rows": rows}
