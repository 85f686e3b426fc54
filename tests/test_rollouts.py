"""request_choices: the shipped rollouts' route through the openai client (its ``post`` and a pydantic-validated
ChatCompletion) returns what ``chat.completions.create`` returns, keeps the client's retries, accepts the
replies ``create`` accepts, and names what it cannot use."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from palaestra.envs.rollouts import request_choices, single_turn_group_rollout
from palaestra.models.registry import load
from palaestra.testing import Reply, ScriptedServer

USER = [{"role": "user", "content": "What is 2 + 3?"}]


class Endpoint:
    def __init__(self, base_url: str, name: str, retries: int = 0) -> None:
        self.name = name
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=retries, timeout=10)

    def openai_client(self) -> openai.AsyncOpenAI:
        return self._client


def test_same_objects_as_create_from_the_embedded_server() -> None:
    model = load("arith-base")

    async def both() -> tuple[Any, Any]:
        got, response = await request_choices(model, USER, 4, temperature=1.0, max_tokens=8, seed=11)
        ref = await model.openai_client().chat.completions.create(
            model=model.name,
            messages=USER,  # type: ignore[arg-type]
            n=4,
            temperature=1.0,
            max_tokens=8,
            logprobs=True,
            seed=11,
        )
        return (got, response), ref

    (choices, response), ref = asyncio.run(both())
    assert type(response) is type(ref)
    assert choices == sorted(ref.choices, key=lambda c: c.index)
    assert choices[0].logprobs is not None and choices[0].logprobs.content  # token logprobs came through
    assert response.system_fingerprint == ref.system_fingerprint
    groups = asyncio.run(single_turn_group_rollout(model, {"id": "e", "prompt": "2 + 3"}, 3, seed=5))
    assert [t.metadata["choice_index"] for t in groups] == [0, 1, 2]
    assert all(t.metadata["policy"] == ref.system_fingerprint for t in groups)


def test_retries_a_429_and_accepts_a_lenient_reply() -> None:
    replies: list[Reply | str] = []

    def script(request: dict[str, Any], n: int) -> Reply | str:
        return replies.pop(0)

    lenient = {  # no "created", no "object", no "usage": not a strict ChatCompletion, but create takes it
        "id": "x",
        "model": "m",
        "choices": [
            {"index": 1, "message": {"role": "assistant", "content": "b"}, "finish_reason": "stop"},
            {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
        ],
    }

    async def calls(model: Endpoint, server: ScriptedServer) -> None:
        replies.extend([Reply(status=429, headers={"Retry-After": "0"}), Reply(raw_body=json.dumps(lenient))])
        choices, response = await request_choices(model, USER, 2, temperature=0.0, max_tokens=4)
        assert [c.message.content for c in choices] == ["a", "b"]  # sorted by index
        assert response.id == "x" and response.usage is None
        assert len(server.requests) == 2 and server.requests[-1]["logprobs"] is True
        assert "seed" not in server.requests[-1]  # None fields are not sent

        replies.append(Reply(raw_body=json.dumps({**lenient, "choices": lenient["choices"][:1]})))
        with pytest.raises(RuntimeError, match=r"'m' returned 1 choices, asked for 3"):
            await request_choices(model, USER, 3, temperature=0.0, max_tokens=4)

        replies.append(Reply(raw_body="[1, 2]"))
        with pytest.raises(RuntimeError, match=r"'m' replied with list, not a JSON object"):
            await request_choices(model, USER, temperature=0.0, max_tokens=4)

        replies.append(Reply(status=400, raw_body=json.dumps({"error": {"message": "bad n"}})))
        with pytest.raises(openai.BadRequestError, match="bad n"):
            await request_choices(model, USER, temperature=0.0, max_tokens=4)

    with ScriptedServer(script, model="m") as server:
        asyncio.run(calls(Endpoint(server.base_url, "m", retries=2), server))


@pytest.mark.parametrize("n", [0, -2])
def test_a_group_of_no_attempts_is_refused_before_any_request(n: int) -> None:
    with ScriptedServer(lambda request, k: "never sent", model="m") as server:
        with pytest.raises(ValueError, match=rf"n must be >= 1, got {n}"):
            asyncio.run(
                single_turn_group_rollout(Endpoint(server.base_url, "m"), {"id": "e", "prompt": "1+1"}, n)
            )
        assert server.requests == []
