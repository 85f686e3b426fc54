"""Calculator environment: data splits, the tool, multi-turn rollouts (scripted endpoint and calc-base), the
registry entry, and the shipped calc-base against its card."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from palaestra.envs import calculator_data as data
from palaestra.envs.calc_eval import evaluate
from palaestra.envs.calculator import (
    CALC_TOOL,
    TOOLS,
    calculator_group_rollout,
    calculator_rollout,
    call_tool,
    evaluate_calculator,
)
from palaestra.envs.registry import get_env, load_callable
from palaestra.models.registry import WEIGHTS_DIR, load
from palaestra.models.remote import RemoteModel
from palaestra.models.tokenizer import default_vocab
from palaestra.testing import Reply, ScriptedServer
from palaestra.trainer import pretrain as pretrain_calc
from palaestra.trajectories.io import sha256_file

EXAMPLE = {
    "id": "calc-mul-81x92",
    "prompt": "What is 81*92? Reply with one line: Final: <int>",
    "expected_answer": "7452",
    "expression": "81*92",
    "family": "mul",
}


# ---------------------------------------------------------------------------------------------- data
def test_shipped_splits_match_the_generator_and_are_disjoint() -> None:
    made = data.make_splits()
    for split in data.SPLITS:
        assert data.load_split(split) == made[split], split
    ids = {s: {r["id"] for r in made[s]} for s in ("train", "val", "test")}
    assert [len(ids[s]) for s in ("train", "val", "test")] == [12_000, 500, 500]
    assert not (ids["train"] & ids["val"] or ids["train"] & ids["test"] or ids["val"] & ids["test"])
    assert made["dev"] == made["val"][:100]
    counts = Counter(r["family"] for r in made["train"])
    assert {f: round(c / 12_000, 2) for f, c in counts.items()} == data.FAMILY_SHARE
    for row in made["val"]:
        assert row["prompt"] == f"What is {row['expression']}? Reply with one line: Final: <int>"
        assert row["expected_answer"] == str(evaluate(row["expression"]))
    assert any(r["expected_answer"].startswith("-") for r in made["train"])


def test_registry_entry() -> None:
    spec = get_env("calculator")
    assert spec.verifier == "arith-strict" and spec.load_split("dev")[0]["id"].startswith("calc-")
    assert load_callable(spec.rollout) is calculator_rollout
    assert load_callable(str(spec.group_rollout)) is calculator_group_rollout
    assert load_callable(str(spec.validate)) is evaluate_calculator
    # the shipped base was pretrained with the very tool definition the environment offers
    assert json.loads((WEIGHTS_DIR / "calc-base.json").read_text())["tools"] == [CALC_TOOL]


def test_an_unknown_family_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown family 'div'; families: add, mul, muladd, mulsub, addmul"):
        data.family_expressions("div")


def test_call_tool() -> None:
    assert call_tool("calc", '{"expression":"(57+22)*4"}') == "316"
    assert call_tool("calc", '{"expression":"1/0"}') == "error: division by zero"
    assert call_tool("shell", '{"cmd":"ls"}').startswith("error: no tool named 'shell'")
    assert call_tool("calc", 3).startswith("error: expected arguments")


# ---------------------------------------------------------------------------------------------- rollouts
def _call(expr: str, name: str = "calc", k: int = 0) -> dict[str, Any]:
    return {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"expression": expr})},
    }


def scripted_agent(request: dict[str, Any], n: int) -> Reply:
    """Question text decides the behaviour: 'right' calls then copies; 'zero' divides by zero; 'loop' keeps
    calling; 'other' calls an unknown tool; 'long' overflows the context."""
    messages = request["messages"]
    question = messages[0]["content"]
    expr = re.search(r"What is (.+)\?", question).group(1)  # type: ignore[union-attr]
    last = messages[-1]
    if "long" in question:
        body = {
            "error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
        return Reply(status=400, raw_body=json.dumps(body))
    if "loop" in question:
        return Reply(None, tool_calls=[_call(expr)])
    if last["role"] == "tool":
        return Reply(f"Final: {last['content']}")
    if "zero" in question:
        return Reply(None, tool_calls=[_call("1/0")])
    if "other" in question:
        return Reply("Checking.", tool_calls=[_call(expr, name="shell")])
    return Reply(None, tool_calls=[_call(expr)])


def _ex(question: str, answer: str) -> dict[str, Any]:
    return {
        "id": question,
        "prompt": f"What is {question}? Reply with one line: Final: <int>",
        "expected_answer": answer,
    }


async def test_rollout_against_an_openai_compatible_endpoint() -> None:
    with ScriptedServer(scripted_agent, model="agent") as server:
        model = RemoteModel("agent", base_url=server.base_url, api_key="k")
        right = await calculator_rollout(model, _ex("81*92", "7452"), seed=5)
        costly = await calculator_rollout(model, _ex("81*92", "7452"), seed=5, tool_cost=0.1)
        zero = await calculator_rollout(model, _ex("zero 1", "1"))
        other = await calculator_rollout(model, _ex("other 1", "1"))
        loop = await calculator_rollout(model, _ex("loop 2*3", "6"), max_turns=2)
        long = await calculator_rollout(model, _ex("long 1", "1"))
        requests = server.requests
    assert right.reward == 1.0 and costly.reward == pytest.approx(0.9)
    assert right.tools == TOOLS and all(r["tools"] == TOOLS for r in requests)
    assert right.metrics["tool_calls"] == 1 and right.metrics["turns"] == 2 and right.metrics["tool_correct"]
    msgs = right.messages()
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_0", "content": "7452"}
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "calc"
    assert right.metadata["end_reason"] == "answered" and right.metadata["outcome"] == "ok"
    # the second request carried the call and its result, as the OpenAI tools API expects
    second = requests[1]["messages"]
    assert second[1]["tool_calls"][0]["id"] == "call_0" and second[2]["role"] == "tool"
    assert zero.messages()[2]["content"] == "error: division by zero" and zero.metrics["tool_errors"] == 1
    assert zero.reward == 0.0 and not zero.metrics["tool_correct"]
    assert other.messages()[2]["content"].startswith("error: no tool named 'shell'")
    assert loop.metadata["end_reason"] == "max_turns" and loop.metrics["turns"] == 2
    assert loop.metrics["tool_calls"] == 2 and loop.reward == 0.0 and loop.metadata["outcome"] == "empty"
    assert long.metadata["end_reason"] == "context" and long.metrics["turns"] == 0 and long.reward == 0.0
    with ScriptedServer(lambda req, n: Reply(status=500)) as server:  # other API errors propagate
        with pytest.raises(Exception, match=r"500|scripted"):
            await calculator_rollout(
                RemoteModel("agent", base_url=server.base_url, api_key="k", max_retries=0), _ex("1+1", "2")
            )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_turns": 0}, r"max_turns must be an int >= 1, got 0"),
        ({"max_turns": True}, r"max_turns must be an int >= 1, got True"),
        ({"max_turns": 2.5}, r"max_turns must be an int >= 1, got 2\.5"),
        ({"mcp": 8765}, r"mcp must be a command or URL string, got int"),
        ({"mcp": ["python", "server.py"]}, r"mcp must be a command or URL string, got list"),
    ],
)
async def test_bad_env_options_are_refused_before_any_request(options: dict[str, Any], message: str) -> None:
    with ScriptedServer(scripted_agent, model="agent") as server:
        model = RemoteModel("agent", base_url=server.base_url, api_key="k")
        with pytest.raises(ValueError, match=message):
            await calculator_rollout(model, EXAMPLE, **options)
        with pytest.raises(ValueError, match=message):
            await calculator_group_rollout(model, EXAMPLE, 2, **options)
        with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
            await calculator_group_rollout(model, EXAMPLE, 0)
        assert server.requests == []


async def test_group_rollout_on_calc_base_is_seeded_and_trainable() -> None:
    model = load("calc-base")
    a = await calculator_group_rollout(model, EXAMPLE, 6, seed=11)
    b = await calculator_group_rollout(model, EXAMPLE, 6, seed=11)
    assert [t.messages() for t in a] == [t.messages() for t in b]
    assert len(a) == 6 and [t.metadata["choice_index"] for t in a] == list(range(6))
    assert any(t.metrics["used_tool"] for t in a)
    for t in a:
        assert t.reward == float(t.metrics["correct"])
        if t.metrics["tool_correct"]:
            assert t.messages()[2] == {
                "role": "tool",
                "tool_call_id": t.messages()[1]["tool_calls"][0]["id"],
                "content": "7452",
            }
        for c in t.choices():
            assert c.logprobs is not None and c.logprobs.content  # every turn can be trained on


# ---------------------------------------------------------------------------------------------- calc-base
def test_shipped_calc_base_card() -> None:
    card = json.loads((WEIGHTS_DIR / "calc-base.json").read_text())
    path = WEIGHTS_DIR / "calc-base.npz"
    assert path.stat().st_size < 2_000_000
    model = load("calc-base")
    vocab = model.tokenizer.vocab
    assert vocab[: len(default_vocab())] == default_vocab()  # arith-base's ids are unchanged
    assert vocab == pretrain_calc.calc_vocab() and model.gpt.n_params == card["n_params"]
    assert model.gpt.config.to_dict() == card["config"] and card["config"]["block_size"] == 128
    assert card["data_fingerprint"] == "sha256:" + sha256_file(data.DATA_DIR / "train.jsonl")
    assert card["val_accuracy_greedy"] < 0.5  # well below what the tool allows ...
    assert (
        card["val_greedy"]["copy"] >= 0.85 and card["val_greedy"]["exact_among_calls"] >= 0.9
    )  # ... which is


async def test_calc_base_reproduces_its_card_in_the_environment() -> None:
    """The environment's own evaluation (real tool, multi-turn) agrees with the card's exact-copy estimate."""
    card = json.loads((WEIGHTS_DIR / "calc-base.json").read_text())
    res = await evaluate_calculator(load("calc-base"), data.load_split("val"), seed=0, sampled=False)
    assert abs(res["greedy_accuracy"] - card["val_accuracy_greedy"]) <= 0.03
    assert abs(res["greedy_tool_use"] - card["val_greedy"]["call_rate"]) <= 0.03
    assert 0.15 <= res["greedy_tool_use"] <= 0.6  # it sometimes calls and sometimes guesses
    assert len(res["rows"]) == 500 and res["n"] == 500


def test_pretraining_recipe_mixes_tool_use_and_guesses(tmp_path: Path) -> None:
    rows = data.load_split("train")
    ex = pretrain_calc.calc_examples(rows, seed=0)
    assert ex == pretrain_calc.calc_examples(rows, seed=0) and ex != pretrain_calc.calc_examples(rows, seed=1)
    shown = pretrain_calc.calc_rows(rows)  # easy rows repeated, so the base learns direct sums
    assert len(ex) == len(shown)
    for fam, times in pretrain_calc.FAMILY_REPEAT.items():
        assert sum(r["family"] == fam for r in shown) == times * sum(r["family"] == fam for r in rows)
    used = Counter(r["family"] for r, (msgs, _) in zip(shown, ex) if len(msgs) == 3)
    total = Counter(r["family"] for r in shown)
    for fam, share in pretrain_calc.TOOL_SHARE.items():
        assert abs(used[fam] / total[fam] - share) < 0.05
    msgs, final = next(e for e in ex if len(e[0]) == 3)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == json.dumps(
        {"expression": msgs[0]["content"][8:].split("?")[0]}, separators=(",", ":")
    )
    assert final == "Final: " + msgs[2]["content"]
    card = pretrain_calc.build_base(pretrain_calc.CALC, tmp_path, seed=3, max_steps=5, name="tiny-calc")
    assert card["steps"] == 5 and (tmp_path / "tiny-calc.npz").is_file()
    assert json.loads((tmp_path / "tiny-calc.json").read_text()) == card
