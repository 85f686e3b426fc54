"""Tokenizer: vocabulary, greedy word tokens, decoding, chat template and assistant mask."""

from __future__ import annotations

import re

import pytest

from palaestra.models.tokenizer import SPECIAL_TOKENS, WORD_TOKENS, Tokenizer, default_vocab

PROMPT = "What is 12+7? Reply with one line: Final: <int>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


def test_default_vocab_layout(tok: Tokenizer) -> None:
    assert tok.vocab[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert tok.vocab_size == len(SPECIAL_TOKENS) + 1 + 95 + len(WORD_TOKENS)
    assert tok.pad_id == 0 and tok.vocab[tok.end_id] == "<|end|>"
    assert {tok.token_str(i) for i in tok.special_ids} == set(SPECIAL_TOKENS)
    for c in "\n" + "".join(chr(i) for i in range(32, 127)):
        assert tok.id_of(c) == tok.encode(c)[0]


def test_word_tokens_greedy_longest_first(tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    assert [tok.token_str(i) for i in ids] == ["What is ", "1", "2", "+", "7", WORD_TOKENS[1]]
    # "Final: " inside the longer word token is not split out; alone it is one token
    assert [tok.token_str(i) for i in tok.encode("Final: -42")] == ["Final: ", "-", "4", "2"]
    # a prefix of a word token falls back to characters
    assert [tok.token_str(i) for i in tok.encode("What i")] == list("What i")


def test_round_trip_and_unknown_chars(tok: Tokenizer) -> None:
    text = "Final: 323\n  {x} ~`|<|end|>"
    assert tok.decode(tok.encode(text)) == text  # text never produces special tokens
    ids = tok.encode("a\u00e9b\tc")
    assert ids[1] == tok.unk_id and ids[3] == tok.unk_id
    assert tok.decode(ids) == "abc"
    assert tok.decode(ids, skip_special=False) == "a<|unk|>b<|unk|>c"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_id_of_is_exact_lookup(tok: Tokenizer) -> None:
    for i, s in enumerate(tok.vocab):
        assert tok.id_of(s) == i and tok.token_str(i) == s
    with pytest.raises(KeyError, match="not in the tokenizer vocabulary"):
        tok.id_of("Final:")


def test_chat_template_and_mask(tok: Tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "Final: 19"},
        {"role": "user", "content": [{"type": "text", "text": "Sure"}, {"type": "text", "text": "?"}]},
    ]
    r = tok.render(msgs)
    expected = [
        tok.system_id,
        *tok.encode("Be brief."),
        tok.end_id,
        tok.user_id,
        *tok.encode(PROMPT),
        tok.end_id,
    ]
    expected += [tok.assistant_id, *tok.encode("Final: 19"), tok.end_id]
    expected += [tok.user_id, *tok.encode("Sure?"), tok.end_id, tok.assistant_id]
    assert r.ids == expected
    assert len(r.assistant_mask) == len(r.ids)
    masked = [i for i, m in zip(r.ids, r.assistant_mask) if m]
    assert masked == [*tok.encode("Final: 19"), tok.end_id]  # content + closing <|end|>, not the role token
    no_prompt = tok.render(msgs, add_generation_prompt=False)
    assert no_prompt.ids == expected[:-1]


def test_render_content_variants_and_errors(tok: Tokenizer) -> None:
    r = tok.render([{"role": "assistant", "content": None, "tool_calls": []}], tools=[])
    assert r.ids == [tok.assistant_id, tok.end_id, tok.assistant_id]
    assert r.assistant_mask == [False, True, False]
    # tools and tool calls are rendered since issue 11 (docs/tools.md): malformed ones are errors
    with pytest.raises(ValueError, match=r"tools\[0\]\.function must be an object"):
        tok.render([{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]"):
        tok.render([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}])
    assert tok.render([{"role": "developer", "content": "x"}]).ids[0] == tok.system_id
    assert tok.render([{"role": "tool", "content": "4"}]).ids[:2] == [tok.tool_id, tok.id_of("4")]
    with pytest.raises(ValueError, match=r"messages\[0\]\.role 'robot'"):
        tok.render([{"role": "robot", "content": "hi"}])
    for role in (None, 3, ["user"]):
        with pytest.raises(
            ValueError, match=rf"messages\[1\]\.role must be a string, got {re.escape(repr(role))}"
        ):
            tok.render([{"role": "user", "content": "a"}, {"role": role, "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.role must be a string, got None"):
        tok.render([{"content": "no role"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\]: only text"):
        tok.render([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="must be a string"):
        tok.render([{"role": "user", "content": 3}])


def test_vocab_is_data_and_extensible() -> None:
    vocab = [*default_vocab(), "<|tool_call|>", "Final answer: "]
    tok = Tokenizer(vocab)
    assert tok.encode("Final answer: 3")[0] == tok.id_of("Final answer: ")
    assert tok.id_of("<|tool_call|>") in tok.special_ids
    assert tok.decode([tok.id_of("<|tool_call|>"), tok.id_of("x")]) == "x"
    with pytest.raises(ValueError, match="duplicate"):
        Tokenizer([*default_vocab(), "a"])
    with pytest.raises(ValueError, match="lacks required special"):
        Tokenizer(["a", "b"])
    for bad in ("", 5, None):
        with pytest.raises(
            ValueError, match=rf"vocab entries must be non-empty strings, got {re.escape(repr(bad))}"
        ):
            Tokenizer([*default_vocab(), bad])  # type: ignore[list-item]
