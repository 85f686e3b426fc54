"""Trajectory / TrajectoryGroup types: messages(), finish(), exact JSON round trip with real Choice objects."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion import Choice

from palaestra import Trajectory, TrajectoryGroup
from palaestra.trajectories.types import ExceptionRecord


def real_choice() -> Choice:
    """A Choice parsed by the openai library from a full chat.completion payload with logprobs and a tool call."""
    payload = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "Final: 42",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "calc", "arguments": '{"x": "6*7"}'},
                        }
                    ],
                },
                "logprobs": {
                    "content": [
                        {
                            "token": "Final: ",
                            "logprob": -0.25,
                            "bytes": list(b"Final: "),
                            "top_logprobs": [
                                {"token": "Final: ", "logprob": -0.25, "bytes": list(b"Final: ")}
                            ],
                        },
                        {"token": "4", "logprob": -1.5, "bytes": [52], "top_logprobs": []},
                        {"token": "2", "logprob": -0.125, "bytes": [50], "top_logprobs": []},
                    ]
                },
            }
        ],
    }
    return ChatCompletion.model_validate(payload).choices[0]


def test_ids_are_unique_by_default() -> None:
    assert len({Trajectory().id for _ in range(100)}) == 100


def test_messages_turns_choices_into_assistant_dicts_with_tool_calls() -> None:
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "6*7?"}, real_choice()])
    msgs = t.messages()
    assert msgs[0] == {"role": "user", "content": "6*7?"}
    assert msgs[1]["role"] == "assistant" and msgs[1]["content"] == "Final: 42"
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"x": "6*7"}'}
    assert t.last_assistant_text() == "Final: 42"
    assert len(t.choices()) == 1


def test_choice_with_none_content_becomes_empty_string() -> None:
    c = real_choice()
    c.message.content = None
    assert Trajectory(messages_and_choices=[c]).messages()[0]["content"] == ""


def test_json_round_trip_is_exact_including_logprobs() -> None:
    t = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            real_choice(),
        ],
        tools=[{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
        reward=0.75,
        metrics={"correct": True, "turns": 2, "score": 0.5},
        metadata={"example_id": "x1", "seed": 3, "note": None},
        logs=["started"],
        policy_version=7,
    )
    text = t.model_dump_json()
    back = Trajectory.model_validate_json(text)
    assert back == t
    assert back.model_dump_json() == text
    choice = back.messages_and_choices[2]
    assert isinstance(choice, Choice)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [x.logprob for x in choice.logprobs.content] == [-0.25, -1.5, -0.125]
    assert choice.logprobs.content[0].top_logprobs[0].token == "Final: "
    assert isinstance(back.metrics["correct"], bool) and isinstance(back.metrics["turns"], int)


def test_group_round_trip_keeps_exceptions_and_metadata() -> None:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        err = exc
    g = TrajectoryGroup(
        [Trajectory(reward=1.0), err, Trajectory(reward=0.0)],
        metadata={"scenario": "s1"},
        metrics={"k": 1},
        logs=["x"],
    )
    assert len(g) == 2 and g.rewards() == [1.0, 0.0]
    assert g.exceptions[0].type == "ValueError" and "boom" in g.exceptions[0].traceback
    back = TrajectoryGroup.model_validate_json(g.model_dump_json())
    assert back == g


def test_finish_records_duration() -> None:
    t = Trajectory().finish()
    assert t.metrics["duration"] >= 0.0


def test_bad_items_are_rejected_with_position() -> None:
    with pytest.raises(ValueError, match="item 1"):
        Trajectory(messages_and_choices=[{"role": "user", "content": "a"}, {"content": "no role"}])
    with pytest.raises(ValueError, match="item 0"):
        Trajectory(messages_and_choices=[42])


def test_messages_and_choices_must_be_a_list() -> None:
    for value in ({"role": "user", "content": "a"}, "hello", None):
        with pytest.raises(ValueError, match="messages_and_choices must be a list"):
            Trajectory(messages_and_choices=value)


def test_an_openai_message_object_is_stored_as_a_plain_message() -> None:
    choice = real_choice()
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice.message])
    stored = t.messages_and_choices[1]
    assert type(stored) is dict and stored["role"] == "assistant" and stored["content"] == "Final: 42"
    assert stored["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"x": "6*7"}'}
    assert "refusal" not in stored  # None fields are left out, as in a hand-written message
    assert t.choices() == []  # a message, not a trainable choice (no logprobs)
    assert Trajectory.model_validate_json(t.model_dump_json()) == t


def test_exception_record_from_exception() -> None:
    rec = ExceptionRecord.from_exception(KeyError("k"))
    assert rec.type == "KeyError" and "k" in rec.message
