"""Tool calling in the embedded chat template and server, through the real ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.envs.calculator import CALC_TOOL, TOOLS
from palaestra.models.engine import EngineStats, Sample, SamplingParams
from palaestra.models.registry import load
from palaestra.models.remote import http_module
from palaestra.models.server import create_app
from palaestra.models.tokenizer import Tokenizer
from palaestra.models.toolcalls import parse_reply, tool_calls_text, tools_text
from palaestra.trainer.pretrain import calc_vocab
from palaestra.trainer.tokenize import tokenize_trajectory
from palaestra.trajectories.types import Trajectory

USER = {"role": "user", "content": "What is 81*92? Reply with one line: Final: <int>"}
CALL = '<call>calc {"expression":"81*92"}</call>'


# ---------------------------------------------------------------------------------------------- template
def test_tools_line_renders_names_and_parameters() -> None:
    two = [
        CALC_TOOL,
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"key": {"type": "string"}, "n": {"type": ["integer", "null"]}, "x": {}},
                    "required": ["key"],
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    assert (
        tools_text(two)
        == "Tools: calc(expression: string); lookup(key: string, n?: integer|null, x?: any); now()"
    )
    for bad, msg in [
        ([{"type": "function"}], r"tools\[0\]\.function must be an object"),
        ([{"type": "code_interpreter"}], r"tools\[0\]\.type 'code_interpreter' is not supported"),
        ([{"function": {"name": "bad name"}}], r"tools\[0\]\.function\.name must match"),
        ([3], r"tools\[0\] must be an object"),
        ([{"function": {"name": "f", "parameters": 3}}], r"tools\[0\]\.function\.parameters"),
        (
            [CALC_TOOL, {"function": {"name": "f", "parameters": {"properties": ["x"]}}}],
            r"tools\[1\]\.function\.parameters: 'properties' must be an object, 'required' a list",
        ),
        (
            [{"function": {"name": "f", "parameters": {"properties": {}, "required": "x"}}}],
            r"tools\[0\]\.function\.parameters: 'properties' must be an object, 'required' a list",
        ),
        (CALC_TOOL, r"tools must be a list of tool definitions, got dict"),
        ("calc", r"tools must be a list of tool definitions, got str"),
    ]:
        with pytest.raises(ValueError, match=msg):
            tools_text(bad)


def test_template_renders_tools_calls_and_results() -> None:
    tok = Tokenizer(calc_vocab())
    call = {
        "id": "x",
        "type": "function",
        "function": {"name": "calc", "arguments": '{"expression":"81*92"}'},
    }
    msgs = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "7452"},
    ]
    r = tok.render(msgs, tools=TOOLS)
    expected = [tok.system_id, *tok.encode("Tools: calc(expression: string)"), tok.end_id]
    expected += [tok.user_id, *tok.encode(USER["content"]), tok.end_id]
    expected += [tok.assistant_id, *tok.encode(CALL), tok.end_id]
    expected += [tok.tool_id, *tok.encode("7452"), tok.end_id, tok.assistant_id]
    assert r.ids == expected
    assert [tok.token_str(i) for i in tok.encode(CALL)] == [
        '<call>calc {"expression":"',
        *"81*92",
        '"}</call>',
    ]
    trained = [i for i, m in zip(r.ids, r.assistant_mask) if m]
    assert trained == [*tok.encode(CALL), tok.end_id]  # the call is assistant output; the result is not
    # text before the calls, two calls, dict arguments (compact JSON), the default vocabulary spells it out
    two = [dict(call), {"function": {"name": "calc", "arguments": {"expression": "1+2"}}}]
    text = tool_calls_text(two)
    assert text == CALL + '<call>calc {"expression":"1+2"}</call>'
    default = Tokenizer.default()
    r2 = default.render(
        [{"role": "assistant", "content": "Let me see.", "tool_calls": two}], add_generation_prompt=False
    )
    assert default.decode(r2.ids) == "Let me see." + text
    for bad in (
        [{"id": "x"}],
        [{"function": {"name": ""}}],
        "calc",
        [{"function": {"name": "f", "arguments": 3}}],
    ):
        with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls"):
            default.render([{"role": "assistant", "content": None, "tool_calls": bad}])
    # a call without arguments is a call with none; dict arguments must be JSON
    assert tool_calls_text([{"function": {"name": "now"}}]) == "<call>now {}</call>"
    for bad, msg in [
        ([3], r"tool_calls\[0\] must be an object with a 'function', got int"),
        (
            [{"function": {"name": "f", "arguments": {"when": {1, 2}}}}],
            r"tool_calls\[0\]\.function\.arguments is not JSON-serialisable \(.*set",
        ),
    ]:
        with pytest.raises(ValueError, match=msg):
            tool_calls_text(bad)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, None, [("calc", '{"expression":"81*92"}')]),
        ("Let me see." + CALL, "Let me see.", [("calc", '{"expression":"81*92"}')]),
        (
            CALL + '<call>calc {"expression": "1 + 2"}</call>',
            None,
            [("calc", '{"expression":"81*92"}'), ("calc", '{"expression": "1 + 2"}')],
        ),
        ('<call>calc {"s":"a}</call>b"}</call>', None, [("calc", '{"s":"a}</call>b"}')]),
    ],
)
def test_parse_reply_accepts_well_formed_calls(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    parsed = parse_reply(text, ["calc"])
    assert parsed is not None and parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        "Final: 7452",
        CALL + " done",  # text after the call
        CALL + "<call>",  # unfinished second call
        '<call>calc {"expression":"81*92"</call>',  # bad JSON
        '<call>calc ["81*92"]</call>',  # not an object
        '<call>calc{"expression":"1"}</call>',  # no space
        '<call>calc  {"expression":"1"}</call>',  # two spaces
        '<call>calc {"expression":"1"}',  # no closing tag
        '<call>sh {"cmd":"ls"}</call>',  # not an offered function
        '<call>9calc {"a":1}</call>',  # bad name
        "<call>calc {" + "[" * 5000 + "}</call>",  # pathological nesting: content, not a crash
    ],
)
def test_parse_reply_rejects_everything_else(text: str) -> None:
    assert parse_reply(text, ["calc"]) is None


PIECES = st.sampled_from(
    ["<call>", "</call>", "calc", " ", "{", "}", '"expression"', ":", '"1+2"', "x", "[1]", ","]
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(PIECES, max_size=14).map("".join)))
def test_parse_reply_is_total_and_round_trips(text: str) -> None:
    """Any text: parsing never raises, and a reply read as calls re-renders to exactly the same text."""
    parsed = parse_reply(text, ["calc"])
    if parsed is not None:
        calls = [{"function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        assert (parsed.content or "") + tool_calls_text(calls) == text


# ---------------------------------------------------------------------------------------------- server
class ScriptedPolicy:
    """A Servable whose replies are given texts (so the server's parsing can be driven exactly)."""

    def __init__(self, replies: Sequence[str], *, ended: bool = True) -> None:
        self.name, self.step, self.stats, self.block_size = "scripted", 0, EngineStats(), 512
        self.tokenizer = Tokenizer(calc_vocab())
        self.replies, self.ended = list(replies), ended
        self.prompts: list[list[int]] = []

    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Sample]:
        self.prompts.append(list(prompt_ids))
        out = []
        for seed in seeds:
            text = self.replies.pop(0)
            ids = self.tokenizer.encode(text) + ([self.tokenizer.end_id] if self.ended else [])
            out.append(
                Sample(
                    text,
                    ids,
                    [-0.25] * len(ids),
                    [],
                    "stop" if self.ended else "length",
                    list(prompt_ids),
                    seed,
                    0,
                )
            )
        return out


@pytest.fixture
async def scripted() -> AsyncIterator[Any]:
    clients = []

    def make(replies: Sequence[str], *, ended: bool = True) -> tuple[ScriptedPolicy, openai.AsyncOpenAI]:
        policy = ScriptedPolicy(replies, ended=ended)
        httpx = http_module()
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(policy)), base_url="http://t/v1"
        )
        client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", http_client=http, max_retries=0)
        clients.append(client)
        return policy, client

    yield make
    for c in clients:
        await c.close()


async def test_server_returns_tool_calls_or_content(scripted: Any) -> None:
    replies = [
        CALL,
        "Let me see." + CALL + '<call>calc {"expression":"1+2"}</call>',
        CALL + " done",
        '<call>calc {"expression":"81*92"</call>',
        '<call>sh {"cmd":"ls"}</call>',
        "Final: 7452",
    ]
    policy, client = scripted(replies)
    out = []
    for _ in replies:
        r = await client.chat.completions.create(
            model="scripted",
            messages=[USER],
            tools=TOOLS,
            seed=7,
            logprobs=True,  # type: ignore[arg-type]
        )
        out.append(r.choices[0])
    first = out[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (tc,) = first.message.tool_calls or []
    assert tc.type == "function" and tc.function.name == "calc" and tc.id.startswith("call_")
    assert json.loads(tc.function.arguments) == {"expression": "81*92"}
    assert tc.function.arguments == '{"expression":"81*92"}'  # verbatim, as generated
    tokens = [e.token for e in first.logprobs.content]  # type: ignore[union-attr]
    assert "".join(tokens) == CALL + "<|end|>"  # logprobs cover the call's tokens
    second = out[1]
    assert second.finish_reason == "tool_calls" and second.message.content == "Let me see."
    calls = second.message.tool_calls or []
    assert [c.function.arguments for c in calls] == ['{"expression":"81*92"}', '{"expression":"1+2"}']
    assert len({c.id for c in calls}) == 2 and calls[0].id == tc.id  # same seed, choice and position
    for bad, text in zip(out[2:], replies[2:]):  # the model's mistakes stay content, never a server error
        assert bad.finish_reason == "stop" and bad.message.content == text and not bad.message.tool_calls
    tok = policy.tokenizer
    assert policy.prompts[0][:3] == [tok.system_id, tok.id_of("Tools: calc(expression: string)"), tok.end_id]


async def test_no_parsing_without_tools_or_with_tool_choice_none_or_when_cut(scripted: Any) -> None:
    _, client = scripted([CALL, CALL])
    plain = await client.chat.completions.create(model="scripted", messages=[USER])  # type: ignore[list-item]
    none = await client.chat.completions.create(
        model="scripted",
        messages=[USER],
        tools=TOOLS,
        tool_choice="none",  # type: ignore[arg-type]
    )
    assert plain.choices[0].message.content == CALL and plain.choices[0].finish_reason == "stop"
    # tool_choice="none": never tool-call markup in the reply (cut before it), never tool_calls
    assert none.choices[0].message.content == "" and none.choices[0].finish_reason == "stop"
    assert not none.choices[0].message.tool_calls
    _, client = scripted([CALL], ended=False)
    cut = await client.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)  # type: ignore[arg-type]
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == CALL
    _, client = scripted([])
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function"):
        await client.chat.completions.create(model="scripted", messages=[USER], tools=[{"type": "function"}])  # type: ignore[list-item]


# ---------------------------------------------------------------------------------------------- calc-base
async def test_calc_base_multi_turn_exchange_retokenises_to_the_sampled_tokens() -> None:
    model = load("calc-base")
    tok, client = model.tokenizer, model.openai_client()
    traj = Trajectory(messages_and_choices=[USER], tools=TOOLS)
    r1 = await client.chat.completions.create(
        model=model.name,
        messages=traj.messages(),
        tools=TOOLS,
        temperature=0,
        logprobs=True,
        max_tokens=24,  # type: ignore[arg-type]
    )
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and c1.message.tool_calls
    call = c1.message.tool_calls[0]
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "81*92"}
    sampled1 = [tok.id_of(e.token) for e in c1.logprobs.content]  # type: ignore[union-attr]
    assert r1.usage is not None and r1.usage.completion_tokens == len(sampled1)
    traj.messages_and_choices += [c1, {"role": "tool", "tool_call_id": call.id, "content": "7452"}]
    # what the server renders for turn 2 = turn 1's prompt + exactly the sampled tokens + the tool turn
    prompt1 = tok.render([USER], tools=TOOLS).ids
    prompt2 = tok.render(traj.messages(), tools=TOOLS).ids
    tool_turn = [tok.tool_id, *tok.encode("7452"), tok.end_id, tok.assistant_id]
    assert prompt2 == prompt1 + sampled1 + tool_turn
    r2 = await client.chat.completions.create(
        model=model.name,
        messages=traj.messages(),
        tools=TOOLS,
        temperature=0,
        logprobs=True,
        max_tokens=24,  # type: ignore[arg-type]
    )
    assert r2.usage is not None and r2.usage.prompt_tokens == len(prompt2)
    c2 = r2.choices[0]
    assert c2.finish_reason == "stop" and (c2.message.content or "").startswith("Final: ")
    sampled2 = [tok.id_of(e.token) for e in c2.logprobs.content]  # type: ignore[union-attr]
    traj.messages_and_choices.append(c2)
    # the trainer's view: the same ids, trainable exactly on the two sampled replies, old logprobs as returned
    tt = tokenize_trajectory(traj, tok)
    assert tt.ids.tolist() == prompt2 + sampled2
    assert tt.mask.tolist() == [False] * len(prompt1) + [True] * len(sampled1) + [False] * len(tool_turn) + [
        True
    ] * len(sampled2)
    lps = [e.logprob for e in [*c1.logprobs.content, *c2.logprobs.content]]  # type: ignore[union-attr]
    assert tt.old_logp[tt.mask].tolist() == pytest.approx(lps)
    # and the whole conversation as plain dicts renders to the same ids
    final = tok.render(traj.messages(), tools=TOOLS, add_generation_prompt=False).ids
    assert final == prompt2 + sampled2
    logp = model.gpt.logprobs_of([tt.ids.tolist()])[
        0
    ]  # the model scores the sampled tokens as it sampled them
    assert logp[tt.mask[1:]].tolist() == pytest.approx(lps, abs=1e-4)


# ---------------------------------------------------------------------------------------------- real HTTP
async def test_calculator_rollout_over_http_against_palaestra_serve() -> None:
    """`palaestra serve --model calc-base` on 127.0.0.1: the env's rollout (RemoteModel, real openai client)
    gets tool calls back over the wire, exactly as in-process."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    from palaestra.envs.calculator import calculator_rollout
    from palaestra.models.remote import RemoteModel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "palaestra", "serve", "--model", "calc-base", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=root,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "palaestra serve exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "palaestra serve did not start"
            time.sleep(0.1)
        remote = RemoteModel("calc-base", base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        example = {"id": "x", "prompt": USER["content"], "expected_answer": "7452"}
        traj = await calculator_rollout(remote, example, temperature=0.0, seed=1)
        local = await calculator_rollout(load("calc-base"), example, temperature=0.0, seed=1)
    finally:
        proc.terminate()
        proc.wait(10)
    msgs = traj.messages()
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expression":"81*92"}'}
    assert msgs[2]["content"] == "7452" and traj.metrics["tool_correct"]
    assert msgs == local.messages()  # same ids (seeded), same replies as in-process
