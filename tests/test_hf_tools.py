"""Tool calls through the HF path: a chat template that takes ``tools`` renders them, and a reply written as
``<tool_call>{...}</tool_call>`` comes back from the shared server as OpenAI ``tool_calls``.

The model is a tiny Llama (built from a config, nothing downloaded) with the character tokenizer and a small
Hermes-style template set in this file; a few seconds of SFT on one tool-call demonstration make its greedy
reply that call, so the server path is exercised with text the model really generated. The client is the
real ``openai.AsyncOpenAI`` bound to the in-process app."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

import openai  # noqa: E402

from palaestra.models.hf import HFModel  # noqa: E402
from palaestra.models.hf.tokenize import ChatTokenizer  # noqa: E402

pytestmark = pytest.mark.hf

# Tools listed one JSON per line in a system block; calls as <tool_call>\n{json}\n</tool_call> (Hermes-like).
TEMPLATE = (
    "{%- if tools %}<|system|># Tools{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}<|end|>{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{%- if m.content is string %}{{ m.content }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{%- endfor %}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
NO_TOOLS_TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
ADD: Any = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
MUL: Any = {
    "type": "function",
    "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}},
}
ASK: Any = [{"role": "user", "content": "2 plus 3?"}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _tokenizer(template: str) -> Any:
    from palaestra.models.hf.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def caller(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    """A tiny Llama whose greedy reply to ASK (tools offered) is CALL_TEXT, loaded from its saved folder."""
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf.tiny import tiny_config
    from palaestra.trainer.hf_backend import TorchPolicy
    from palaestra.trainer.sft import sft

    tok = _tokenizer(TEMPLATE)
    cfg = tiny_config("tiny-random-llama", len(tok))
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg).eval()
    examples = [(ASK, CALL_TEXT), ([{"role": "user", "content": "hi"}], "hello")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and no spinning on a busy machine
    try:
        sft(
            TorchPolicy(base),
            ChatTokenizer(tok),
            examples,
            steps=150,
            batch_size=2,
            lr=1e-2,
            warmup=0,
            seed=0,
            tools=[ADD],
        )
    finally:
        torch.set_num_threads(threads)
    folder = Path(tmp_path_factory.mktemp("caller"))
    base.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return HFModel.from_pretrained(folder, device="cpu", dtype="float32", name="caller")


def test_parse_tool_calls_hermes_blocks() -> None:
    tok = ChatTokenizer(_tokenizer(TEMPLATE))
    assert tok.takes_tools and tok.call_open == "<tool_call>"
    two = CALL_TEXT + '\n<tool_call>{"name": "mul", "parameters": {"x": [1, 2]}}</tool_call>\n'
    parsed = tok.parse_tool_calls("thinking first " + two, ["add", "mul"])
    assert parsed is not None and parsed.content == "thinking first"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("add", {"a": 2, "b": 3}),
        ("mul", {"x": [1, 2]}),
    ]
    assert tok.parse_tool_calls(CALL_TEXT, ["mul"]) is None  # not an offered function
    assert tok.parse_tool_calls("no call here", ["add"]) is None
    for bad in (
        CALL_TEXT + " trailing words",
        '<tool_call>{"name": "add", "arguments": {"a": 2}',  # never closed
        '<tool_call>{"name": "add", "arguments": "a=2"}</tool_call>',  # arguments not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        "<tool_call>[1, 2]</tool_call>",
    ):
        assert tok.parse_tool_calls(bad, ["add"]) is None, bad
    plain = ChatTokenizer(_tokenizer(NO_TOOLS_TEMPLATE))
    assert not plain.takes_tools and plain.call_open is None and plain.parse_tool_calls(CALL_TEXT) is None
    with pytest.raises(ValueError, match="does not take tools"):
        plain.render(ASK, tools=[ADD])


def test_template_renders_tools_and_calls_round_trip() -> None:
    tok = ChatTokenizer(_tokenizer(TEMPLATE))
    text = tok.render(ASK, tools=[ADD]).text
    assert text.startswith("<|system|># Tools\n") and '"name": "add"' in text
    assert text.endswith("<|user|>2 plus 3?<|end|><|assistant|>")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
    convo = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    again = tok.render(convo, tools=[ADD], add_generation_prompt=False).text
    assert again.endswith("<|assistant|>" + CALL_TEXT + "<|end|>")  # the call renders as the model wrote it


async def test_server_returns_openai_tool_calls(caller: HFModel) -> None:
    client = caller.openai_client()
    assert isinstance(client, openai.AsyncOpenAI)
    resp = await client.chat.completions.create(
        model=caller.name, messages=ASK, tools=[ADD], temperature=0, max_tokens=80, logprobs=True
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (tc,) = choice.message.tool_calls or []
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert choice.logprobs is not None and len(choice.logprobs.content or []) > len(CALL_TEXT) // 2

    # the call sent back with its result renders and the conversation goes on
    result = {"role": "tool", "tool_call_id": tc.id, "content": "5"}
    follow: Any = [*ASK, choice.message.model_dump(exclude_none=True), result]
    nxt = await client.chat.completions.create(model=caller.name, messages=follow, tools=[ADD], max_tokens=4)
    assert nxt.choices[0].finish_reason in ("stop", "length", "tool_calls")

    # tool_choice="none": the reply is cut before any call markup, never parsed
    none = await client.chat.completions.create(
        model=caller.name, messages=ASK, tools=[ADD], tool_choice="none", temperature=0, max_tokens=80
    )
    assert not none.choices[0].message.tool_calls
    assert "<tool_call>" not in (none.choices[0].message.content or "")


async def test_streamed_tool_call_deltas(caller: HFModel) -> None:
    client = caller.openai_client()
    stream = await client.chat.completions.create(
        model=caller.name, messages=ASK, tools=[ADD], temperature=0, max_tokens=80, stream=True
    )
    name, args, finish = "", "", None
    async for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                name += (d.function.name or "") if d.function else ""
                args += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and name == "add" and json.loads(args) == {"a": 2, "b": 3}


async def test_tools_refused_for_a_template_without_them(tmp_path: Path) -> None:
    from palaestra.models.hf.tiny import tiny_config

    tok = _tokenizer(NO_TOOLS_TEMPLATE)
    model = HFModel.from_config(tiny_config("tiny-random-llama", len(tok)), tok, name="plain")
    with pytest.raises(openai.BadRequestError, match="does not take tools"):
        await model.openai_client().chat.completions.create(
            model="plain", messages=ASK, tools=[ADD], max_tokens=2
        )
