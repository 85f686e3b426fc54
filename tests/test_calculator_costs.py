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
        res = await evaluate_calculator(model, examples)
    for kind in ("greedy", "sampled"):  # the scripted agent ignores the temperature
        assert res[f"{kind}_tool_use_easy"] == 0.0 and res[f"{kind}_tool_use_hard"] == 1.0
        assert res[f"{kind}_accuracy_easy"] == 1.0 and res[f"{kind}_accuracy_hard"] == 1.0
    assert res["greedy_tool_use"] == pytest.approx(3 / 5)


async def test_per_turn_credit_sees_the_costly_step_the_final_reward_does_not() -> None:
    """On an easy problem, episodes that call the tool and episodes that answer in their head are all
    correct: the final reward cannot tell them apart (a zero-signal group), per-turn credit penalises the
    calling turn by its cost."""
    from palaestra.trainer.config import TrainConfig
    from palaestra.trainer.loop import GRPOTrainer

    count = {"n": 0}

    def alternating(request: dict[str, Any], n: int) -> Reply:
        msgs = request["messages"]
        if msgs[-1]["role"] == "tool":
            return Reply(f"Final: {msgs[-1]['content']}")
        count["n"] += 1
        if count["n"] % 2:
            return Reply("Final: 62")
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calc", "arguments": '{"expression": "55+7"}'},
        }
        return Reply(None, tool_calls=[call])

    with ScriptedServer(alternating, model="agent") as server:
        model = RemoteModel("agent", base_url=server.base_url, api_key="k")
        group = [
            await calculator_rollout(model, _ex("55+7", 62, "add"), tool_cost=0.1, cost_per_turn=True)
            for _ in range(4)
        ]
    assert [t.metrics["used_tool"] for t in group] == [False, True, False, True]
    assert all(t.reward == 1.0 for t in group)
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # build_batch needs only the config
    trainer.config = TrainConfig(advantage_mode="dr_grpo", negative_advantage_scale=1.0)
    batch, m = trainer.build_batch([group])
    assert len(batch) == 0 and m["frac_zero_std"] == 1.0  # final reward alone: nothing to learn
    trainer.config = TrainConfig(
        advantage_mode="dr_grpo", negative_advantage_scale=1.0, turn_credit="returns"
    )
    batch, m = trainer.build_batch([group])
    # episode returns [1, 0.9, 1, 0.9] (mean 0.95): in-head answers +0.05; the calling turn 0.9 - 0.95 = -0.05,
    # the answer after the tool 1 - 0.95 = +0.05
    assert batch.turn_advantages is not None
    got = [a.tolist() for a in batch.turn_advantages]
    want = [[0.05], [-0.05, 0.05], [0.05], [-0.05, 0.05]]
    for g, w in zip(got, want):
        assert g == pytest.approx(w)


async def _train_on_easy(model_name: str, tool_cost: float, steps: int) -> dict[str, Any]:
    """GRPO from ``model_name`` on easy (``add``) train problems, 4 groups of 8 episodes per step, seeded;
    returns the validation (greedy and sampled) on the easy val problems."""
    import asyncio

    import numpy as np

    from palaestra.envs.calculator import calculator_group_rollout
    from palaestra.models.registry import load
    from palaestra.trainer.config import TrainConfig
    from palaestra.trainer.loop import GRPOTrainer
    from palaestra.trajectories.types import TrajectoryGroup

    train = [r for r in load_split("train") if difficulty_of(r["family"]) == "easy"]
    val = [r for r in load_split("val") if difficulty_of(r["family"]) == "easy"]
    model = load(model_name)
    trainer = GRPOTrainer(model, TrainConfig(lr=5e-4, seed=0))
    rng = np.random.default_rng(0)
    for step in range(steps):
        examples = [train[int(i)] for i in rng.choice(len(train), size=4, replace=False)]
        groups = await asyncio.gather(
            *(
                calculator_group_rollout(model, ex, 8, seed=1000 * step + g, tool_cost=tool_cost)
                for g, ex in enumerate(examples)
            )
        )
        await trainer.step([TrajectoryGroup(list(g)) for g in groups])
    return await evaluate_calculator(model, val, seed=0)


async def test_a_tool_cost_teaches_calc_base_to_answer_easy_problems_without_the_tool() -> None:
    """calc-base answers easy sums both ways (with the tool, and directly, mostly right): trained with a cost
    per call it calls the tool on fewer easy problems than the same run without a cost, and stays about as
    accurate (same seed, same steps; benchmarks/tool_costs_calc.py shows the full task, hard problems too)."""
    free = await _train_on_easy("calc-base", 0.0, steps=16)
    costly = await _train_on_easy("calc-base", 0.1, steps=16)
    print("no cost", {k: v for k, v in free.items() if k != "rows"})
    print("cost 0.1", {k: v for k, v in costly.items() if k != "rows"})
    assert costly["sampled_tool_use"] <= free["sampled_tool_use"] - 0.2
    assert costly["greedy_tool_use"] <= free["greedy_tool_use"]
    assert costly["greedy_accuracy"] >= 0.9 and costly["sampled_accuracy"] >= free["sampled_accuracy"] - 0.1
