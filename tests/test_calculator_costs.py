"""Tool costs in the calculator environment: the cost in the final reward or per turn, difficulty labels,
and validation's tool use by difficulty (against a scripted OpenAI-compatible agent)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from palaestra.envs.calculator import calculator_rollout, evaluate_calculator
from palaestra.envs.calculator_data import difficulty_of, load_split
from palaestra.models.remote import RemoteModel
from palaestra.testing import Reply, ScriptedServer


def agent(request: dict[str, Any], n: int) -> Reply:
    """Answers '+' problems in its head (correctly), calls calc for everything else, then copies the result."""
    msgs = request["messages"]
    question = msgs[0]["content"]
    expr = question.split("What is ", 1)[1].split("?", 1)[0]
    if msgs[-1]["role"] == "tool":
        return Reply(f"Final: {msgs[-1]['content']}")
    if "*" not in expr and "(" not in expr:
        a, b = expr.split("+")
        return Reply(f"Final: {int(a) + int(b)}")
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calc", "arguments": json.dumps({"expression": expr})},
    }
    return Reply(None, tool_calls=[call])


def _ex(expr: str, answer: int, family: str) -> dict[str, Any]:
    return {
        "id": expr,
        "prompt": f"What is {expr}? Reply with one line: Final: <int>",
        "expected_answer": str(answer),
        "family": family,
    }


def test_difficulty_labels() -> None:
    assert difficulty_of("add") == "easy"
    assert {difficulty_of(f) for f in ("mul", "muladd", "mulsub", "addmul")} == {"hard"}
    assert difficulty_of("nope") is None and difficulty_of(None) is None
    fams = {r["family"] for r in load_split("val")}
    assert {difficulty_of(f) for f in fams} == {"easy", "hard"}


async def test_cost_in_final_reward_or_per_turn() -> None:
    with ScriptedServer(agent, model="agent") as server:
        model = RemoteModel("agent", base_url=server.base_url, api_key="k")
        hard = _ex("81*92", 7452, "mul")
        easy = _ex("55+7", 62, "add")
        folded = await calculator_rollout(model, hard, tool_cost=0.1)
        per_turn = await calculator_rollout(model, hard, tool_cost=0.1, cost_per_turn=True)
        head = await calculator_rollout(model, easy, tool_cost=0.1, cost_per_turn=True)
    assert folded.reward == pytest.approx(0.9) and folded.turn_rewards is None
    # per turn: the final reward is the verifier's, the calling turn carries the cost
    assert per_turn.reward == 1.0 and per_turn.turn_rewards == pytest.approx([-0.1, 0.0])
    assert len(per_turn.turn_rewards or []) == len(per_turn.choices())
    assert head.reward == 1.0 and head.turn_rewards == [0.0] and not head.metrics["used_tool"]
    assert folded.metadata["difficulty"] == "hard" and head.metadata["difficulty"] == "easy"
    # the per-turn rewards survive the JSON round trip
    back = type(per_turn).model_validate_json(per_turn.model_dump_json())
    assert back.turn_rewards == per_turn.turn_rewards


async def test_validation_reports_tool_use_by_difficulty() -> None:
    examples = [
        _ex("12+5", 17, "add"),
        _ex("40+3", 43, "add"),
        _ex("12*13", 156, "mul"),
        _ex("(10+20)*3", 90, "addmul"),
        _ex("99*99", 9801, "mul"),
    ]
    with ScriptedServer(agent, model="agent") as server:
        model = RemoteModel("agent", base_url=server.base_url, api_key="k")
        res = await evaluate_calculator(model, examples, sampled=False)
    assert res["greedy_tool_use_easy"] == 0.0 and res["greedy_tool_use_hard"] == 1.0
    assert res["greedy_accuracy_easy"] == 1.0 and res["greedy_accuracy_hard"] == 1.0
    assert res["greedy_tool_use"] == pytest.approx(3 / 5)
