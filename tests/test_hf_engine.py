"""The HF model runs the one continuous-batching engine: a request arriving while another is generating joins
the running batch (one pass serves both), and a seeded row gets the same tokens whatever shares its batch.

A tiny random Llama built in code (no download), on CPU."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from palaestra.models.hf import HFModel  # noqa: E402
from palaestra.models.hf.sampling import HFRowCache, generate  # noqa: E402
from palaestra.models.sampling import DecodeBatch, Generation, Picking, pick_tokens  # noqa: E402

pytestmark = pytest.mark.hf

SHORT = [{"role": "user", "content": "What is 2+3?"}]
LONG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 41-7, and why?"}]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def test_a_request_joins_a_running_hf_batch_and_gets_its_seeded_tokens() -> None:
    ref = HFModel.tiny("tiny-random-llama", seed=0)  # the same weights, for the requests alone
    alone_a = await ref.generate(SHORT, n=2, max_tokens=30, seed=5)
    alone_b = await ref.generate(LONG, n=3, max_tokens=10, seed=9, temperature=0.8, top_p=0.9)
    assert min(len(s.token_ids) for s in alone_a) > 6  # the first request still runs when the second joins
    model = HFModel.tiny("tiny-random-llama", seed=0)
    rows: list[int] = []  # rows of each decoding step
    gate = threading.Event()

    class Gated(HFRowCache):  # holds the running batch at its third step until the second request is queued
        def step(self, tokens: np.ndarray) -> None:
            rows.append(len(tokens))
            if len(rows) == 3:
                assert gate.wait(10.0)
            super().step(tokens)

    model.row_cache = lambda: Gated(model.model, model.tokenizer, device="cpu", block_size=model.block_size)  # type: ignore[method-assign]
    first = asyncio.ensure_future(model.generate(SHORT, n=2, max_tokens=30, seed=5))
    while len(rows) < 3:
        await asyncio.sleep(0.001)
    second = asyncio.ensure_future(
        model.generate(LONG, n=3, max_tokens=10, seed=9, temperature=0.8, top_p=0.9)
    )
    await asyncio.sleep(0)  # the second request is queued
    gate.set()
    got_a, got_b = await first, await second
    assert rows[:3] == [2, 2, 2] and rows[3] == 5  # its rows joined the running ones at the next step
    for _ in range(1000):  # the pass records itself after resolving its last job
        if model.stats.snapshot()["generate_calls"]:
            break
        await asyncio.sleep(0.001)
    snap = model.stats.snapshot()
    assert snap["generate_calls"] == 1 and snap["batch_requests"] == [2] and snap["batch_rows"] == [5]
    for alone, got in ((alone_a, got_a), (alone_b, got_b)):
        assert [s.token_ids for s in got] == [s.token_ids for s in alone]
        assert [s.text for s in got] == [s.text for s in alone]
        for s, t in zip(got, alone):
            np.testing.assert_allclose(s.logprobs, t.logprobs, atol=1e-4)


def test_rows_joining_and_leaving_an_hf_cache_get_the_tokens_they_get_alone() -> None:
    """The cache merge (left padding), drop of finished rows and trim: each row as if generated alone."""
    model = HFModel.tiny("tiny-random-llama", seed=0)
    prompts = [model.render(SHORT), model.render(LONG), model.render(SHORT)[:5], model.render(LONG)[3:]]
    settings = [(12, 1.0, 1.0), (20, 0.0, 1.0), (6, 0.7, 0.9), (16, 1.3, 0.5)]

    def cache() -> HFRowCache:
        return HFRowCache(model.model, model.tokenizer, device="cpu", block_size=model.block_size)

    alone = [
        generate(model.model, model.tokenizer, [p], max_new_tokens=m, temperature=t, top_p=tp, seeds=[s])[0]
        for s, (p, (m, t, tp)) in enumerate(zip(prompts, settings))
    ]
    batch, got = DecodeBatch(cache()), dict[int, Generation]()
    for step in range(40):
        if step < len(prompts):  # one newcomer per step, while the others decode
            m, t, tp = settings[step]
            got.update(
                batch.add([step], [prompts[step]], max_new=[m], temperature=[t], top_p=[tp], seeds=[step])
            )
        got.update(batch.step())
    assert not batch.live_rows
    for r, g in enumerate(alone):
        assert got[r].token_ids == g.token_ids and got[r].text == g.text
        np.testing.assert_allclose(got[r].logprobs, g.logprobs, atol=1e-4)
    # every row has finished: a newcomer empties the cache first, then gets what it gets alone
    m, t, tp = settings[0]
    got.update(batch.add([9], [prompts[0]], max_new=[m], temperature=[t], top_p=[tp], seeds=[0]))
    while batch.live_rows:
        got.update(batch.step())
    assert got[9].token_ids == alone[0].token_ids
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        cache().add([prompts[0], []], np.array([0, 1]), 4)


@pytest.mark.parametrize(
    ("arch", "window"),
    [
        ("mistral", {"sliding_window": 4}),
        ("gemma2", {"sliding_window": 4, "head_dim": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ],
)
def test_a_sliding_window_model_is_refused_at_load_time(arch: str, window: dict[str, Any]) -> None:
    """Rows are merged and trimmed slot by slot, which only full-attention cache layers allow: a model with
    sliding-window layers (Mistral, Gemma 2, windowed Qwen2) is refused when it is built, naming the layer
    kinds and vLLM, so no server ever starts on it; the bare sampler refuses it too. With ``vllm=...`` the
    rollouts never run in-process, so it is accepted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from palaestra.models.hf.tiny import TINY_MODELS, build_char_tokenizer
    from palaestra.models.hf.tokenize import ChatTokenizer
    from palaestra.models.hf.vllm import VLLMLoRASync

    tok = build_char_tokenizer()
    spec = {k: v for k, v in TINY_MODELS["tiny-random-llama"].items() if k != "architecture"}
    cfg = AutoConfig.for_model(arch, vocab_size=len(tok), **{**spec, **window})
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    message = (
        "in-process generation does not support ['DynamicSlidingWindowLayer'] cache layers (rows are merged "
        "slot by slot: full attention only); serve this model on vLLM (HFModel(..., vllm=...))"
    )
    with pytest.raises(ValueError) as info:
        HFModel.from_config(cfg, tok, name="windowed")
    assert str(info.value) == message
    bare = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError) as info:
        generate(bare, ChatTokenizer(tok), [[5, 6]], max_new_tokens=2, temperature=0.0, seeds=[0])
    assert str(info.value) == message
    sync = VLLMLoRASync(base_url="http://vllm.invalid/v1", lora_dir="/nonexistent")
    assert HFModel.from_config(cfg, tok, name="windowed", vllm=sync).vllm is sync


async def test_the_hf_model_honours_logit_bias_and_penalties_like_the_embedded_one() -> None:
    model = HFModel.tiny("tiny-random-llama", seed=0)
    only = model.tokenizer.id_of("7")
    client = model.openai_client()
    kw: dict[str, Any] = {"model": model.name, "messages": SHORT, "n": 3, "max_tokens": 6, "seed": 2}
    r = await client.chat.completions.create(logit_bias={str(only): 100.0}, **kw)
    assert all(c.message.content == "7" * 6 for c in r.choices)
    bias = {"logit_bias": {str(only): 3.0}, "temperature": 0.0}
    free = await client.chat.completions.create(**bias, **kw)
    pen = await client.chat.completions.create(frequency_penalty=2.0, **bias, **kw)
    assert free.choices[0].message.content == "7" * 6  # the bias makes it the greedy choice...
    assert (pen.choices[0].message.content or "").count("7") <= 2  # ...until the penalty of its repeats


def test_the_hf_cache_picks_on_its_device_by_the_samplers_rule() -> None:
    """``HFRowCache.pick`` (torch, where the logits are) chooses what ``pick_tokens`` (numpy) chooses from the
    same logits: greedy and sampled rows, top_p 1/0.9/0.5, bias and penalties, top logprobs, a subset of rows;
    only per-row results come back to the host."""
    cache = HFModel.tiny("tiny-random-llama", seed=0).row_cache()
    rng = np.random.default_rng(0)
    rows, vocab = 12, cache.vocab_size
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    cache.logits = torch.from_numpy(logits)
    temps = np.array([0.0, 0.7, 1.0, 1.3] * 3)
    top_ps = np.repeat([1.0, 0.9, 0.5], 4)
    u = rng.random(rows)
    top_k = np.array([0, 3, 5, 0] * 3)
    bias = np.where(rng.random((rows, vocab)) < 0.05, 4.0, 0.0)
    penalty = rng.integers(0, 3, (rows, vocab)) * 0.6
    for which in (np.arange(rows), np.array([7, 2, 9])):
        for extra in ((), (bias[which], None), (None, penalty[which]), (bias[which], penalty[which])):
            how = Picking(temps[which], top_ps[which], u[which], top_k[which], *extra)
            want, got = pick_tokens(logits[which], how), cache.pick(which, how)
            assert isinstance(got[0], np.ndarray) and got[0].shape == (len(which),)
            assert got[0].tolist() == want[0].tolist()
            np.testing.assert_allclose(got[1], want[1], atol=1e-5)
            assert [[i for i, _ in t] for t in got[2]] == [[i for i, _ in t] for t in want[2]]
            for g, w in zip(got[2], want[2]):
                np.testing.assert_allclose([lp for _, lp in g], [lp for _, lp in w], atol=1e-5)
    assert (
        sum(map(len, want[2])) > 0 and len(set(want[0].tolist())) > 1
    )  # top lists and varied picks were seen


def test_the_hf_cache_takes_the_argmax_at_a_vanishing_temperature() -> None:
    """A temperature so small that logits / temperature overflow (5e-324) picks the argmax on the device, as the
    numpy sampler does, at top_p 1 and 0.9; rows at temperature 1 beside it pick what numpy picks."""
    cache = HFModel.tiny("tiny-random-llama", seed=0).row_cache()
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((4, cache.vocab_size))).astype(np.float32)
    cache.logits = torch.from_numpy(logits)
    how = Picking(
        np.array([5e-324, 1.0, 5e-324, 1.0]), np.array([1.0, 1.0, 0.9, 0.9]), rng.random(4), np.zeros(4, int)
    )
    rows = np.arange(4)
    got, want = cache.pick(rows, how)[0], pick_tokens(logits, how)[0]
    assert got.tolist() == want.tolist()
    assert got[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


# Stop strings with HF tokenizers: the reply's text grows by the offsets method (``new_text``), not by a full
# decode per token; these tests hold it to the full decode, with a character tokenizer, a byte-level BPE whose
# tokens split multi-byte characters, and a SentencePiece-style BPE whose tokens' text depends on the one before.

BPE_TEXTS = [
    "héllo wörld, café crème",
    "日本語のテキスト。日本と日本語",
    "emoji 🙂🎉 party 🙂🙂 done",
    "naïve résumé über",
]


def _char_tokenizer() -> Any:
    from palaestra.models.hf.tiny import build_char_tokenizer
    from palaestra.models.hf.tokenize import ChatTokenizer

    return ChatTokenizer(build_char_tokenizer())


def _bpe_tokenizer() -> Any:
    """A byte-level BPE trained here on a few strings (no download): many of its tokens hold part of a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from palaestra.models.hf.tokenize import ChatTokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=340, initial_alphabet=alphabet, special_tokens=["<|end|>"], show_progress=False
    )
    raw.train_from_iterator(BPE_TEXTS * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>")
    return ChatTokenizer(hf, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")


def _metaspace_tokenizer() -> Any:
    """A SentencePiece-style BPE ("▁" for spaces; a decode drops its first leading space): a token's text
    depends on the tokens before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from palaestra.models.hf.tokenize import ChatTokenizer

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<|end|>", "<unk>"], show_progress=False)
    raw.train_from_iterator(BPE_TEXTS * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>", unk_token="<unk>")
    return ChatTokenizer(hf, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")


TOKENIZERS = {"char": _char_tokenizer, "bpe": _bpe_tokenizer, "metaspace": _metaspace_tokenizer}


def _random_replies(tok: Any, rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    """Random token ids (the end token rare), half of them runs of the tokens of the training texts (so that
    characters complete) and half any ids (so that some never do)."""
    texts = [tok.hf.encode(t, add_special_tokens=False) for t in BPE_TEXTS]
    out = []
    for i in range(n):
        if i % 2:
            ids = rng.integers(0, tok.vocab_size, length)
        else:
            ids = np.array(texts[i % len(texts)] * 20)[rng.integers(0, 2) :][:length]
            ids[rng.random(len(ids)) < 0.1] = rng.integers(0, tok.vocab_size)
        out.append([int(x) for x in ids])
    return out


@pytest.mark.parametrize("name", TOKENIZERS)
def test_incremental_text_is_the_full_decode_at_every_step(name: str) -> None:
    """``new_text`` after each token: the committed text is the full decode of the tokens up to ``read``, the
    committed plus the new text the full decode of all tokens so far, and an incomplete text ends in U+FFFD."""
    from palaestra.models.sampling import new_text

    tok = TOKENIZERS[name]()
    rng = np.random.default_rng(0)
    waited = 0
    for reply in _random_replies(tok, rng, 40, 48):
        ids, text, prefix, read = np.array(reply), "", 0, 0
        for t in range(1, len(ids) + 1):
            new, complete = new_text(tok.decode, ids[:t], prefix, read)
            assert text + new == tok.decode(reply[:t])
            if complete:
                text, prefix, read = text + new, read, t
            else:
                assert new == "" or new.endswith("\ufffd")
                waited += bool(new)
            assert text == tok.decode(reply[:read])
    assert (waited > 0) == (name == "bpe")  # only the byte-level BPE splits characters over tokens


class _Scripted:
    """A RowCache whose row for prompt ``[k]`` picks the tokens ``scripts[k]`` in order (no model)."""

    def __init__(self, tokenizer: Any, scripts: list[list[int]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts
        self.end_ids, self.vocab_size, self.block_size = tokenizer.end_ids, tokenizer.vocab_size, 10_000
        self.rows: list[list[int]] = []
        self.at: list[int] = []  # tokens fed to each row so far

    def fits(self, rows: int, width: int, steps: int) -> bool:
        return True

    def add(self, prompts: Any, src: np.ndarray, steps: int) -> None:
        self.rows += [self.scripts[prompts[s][0]] for s in src.tolist()]
        self.at += [0] * len(src)

    def step(self, tokens: np.ndarray) -> None:
        self.at = [a + 1 for a in self.at]

    def keep(self, rows: np.ndarray) -> None:
        self.rows, self.at = [self.rows[r] for r in rows.tolist()], [self.at[r] for r in rows.tolist()]

    def pick(self, rows: np.ndarray, how: Picking) -> Any:
        nxt = np.array([self.rows[r][self.at[r]] for r in rows.tolist()], dtype=np.intp)
        return nxt, np.zeros(len(rows)), [[] for _ in rows]


def _full_decode_rule(
    tok: Any, reply: list[int], stops: list[str], max_new: int
) -> tuple[list[int], str, str]:
    """The reference: the reply decoded in full after every token, ending at the first token completing a stop
    (its text cut before the earliest stop), at an end token (left out of the text) or after ``max_new``."""
    for n in range(1, max_new + 1):
        if reply[n - 1] in tok.end_ids:
            return reply[:n], tok.decode(reply[: n - 1]), "stop"
        text = tok.decode(reply[:n])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return reply[:n], text[: min(found)], "stop"
    return reply[:max_new], tok.decode(reply[:max_new]), "length"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_strings_end_rows_where_a_full_decode_after_every_token_says(name: str) -> None:
    """Scripted replies through a DecodeBatch with stop strings: taken from the replies' full decodes at random
    places and lengths (so that they straddle tokens, and hold whole or split multi-byte characters), plus
    multi-byte ones ("本", "🙂", "é", "日本"), one never met, and (BPE) stops completed by a token that also starts
    an unfinished character. Token ids, finish reasons and texts are those of the full-decode rule; after each
    step the grown text is the full decode up to ``read``, and a few tokens are decoded per row."""
    tok = TOKENIZERS[name]()
    rng = np.random.default_rng(1)
    replies = _random_replies(tok, rng, 64, 40)
    end = min(tok.end_ids)
    for reply in replies[::6]:
        reply[int(rng.integers(2, 12))] = end
    stops = []
    for r, reply in enumerate(replies):
        full = tok.decode(reply)
        i, k = int(rng.integers(0, max(1, len(full) - 3))), int(rng.integers(1, 4))
        multi = ["本", "🙂", "é", "日本"][r % 4] if r % 3 == 0 else ""
        stops.append([s for s in (full[i : i + k].replace("\ufffd", ""), multi, "\u2603") if s])
    # a stop completed by a token that also starts an unfinished character ("日本" + a first byte of "語")
    ok, filler = tok.hf.encode("ok ", add_special_tokens=False), replies[1]
    for t in range(tok.vocab_size):
        piece = tok.decode([t])
        if piece.endswith("\ufffd") and piece[0] != "\ufffd" and "\ufffd" not in piece.rstrip("\ufffd"):
            replies.append([*ok, t, *filler][:40])
            stops.append([piece.rstrip("\ufffd")[-1]])
    assert (len(replies) > 64) == (name == "bpe")
    max_new = [int(m) for m in rng.integers(10, 41, len(replies))]
    batch = DecodeBatch(_Scripted(tok, replies))
    n = len(replies)
    got = dict(
        batch.add(list(range(n)), [[k] for k in range(n)], max_new=max_new, temperature=[0.0] * n,
                  top_p=[1.0] * n, seeds=[None] * n, stop=stops)
    )  # fmt: skip
    windows = []  # tokens decoded per row and step
    while batch.live_rows:
        got.update(batch.step())
        for r in np.flatnonzero(batch.live).tolist():  # the grown text: a full decode up to ``read``
            ids = batch.tok[r, : batch.count[r]].tolist()
            assert batch.texts[r] == tok.decode(ids[: batch.read[r]])
            windows.append(len(ids) - int(batch.prefix[r]))
    assert np.mean(windows) < 3  # a few tokens decoded per step, not the whole reply
    reasons = {"stop": 0, "length": 0, "end": 0}
    for k, (reply, ss, m) in enumerate(zip(replies, stops, max_new)):
        want = _full_decode_rule(tok, reply, ss, m)
        assert (got[k].token_ids, got[k].text, got[k].finish_reason) == want, k
        reasons["end" if want[0][-1] == end else want[2]] += 1
    assert min(reasons.values()) >= 3  # each way of ending was seen


def test_hf_generation_with_stop_strings_follows_the_full_decode_rule() -> None:
    """The tiny HF model's seeded samples with stop strings taken from their free samples (1-3 characters, so
    that they straddle tokens) end as the full-decode rule says."""
    model = HFModel.tiny("tiny-random-llama", seed=0)
    tok = model.tokenizer
    prompts = [model.render(SHORT)] * 12
    kw: dict[str, Any] = {"max_new_tokens": 20, "temperature": 1.0, "seeds": list(range(12))}
    free = generate(model.model, tok, prompts, **kw)
    stops = [[g.text[i % 4 : i % 4 + 1 + i % 3] or "\u2603", "\u2603"] for i, g in enumerate(free)]
    got = generate(model.model, tok, prompts, stop=stops, **kw)
    for g, f, ss in zip(got, free, stops):
        assert (g.token_ids, g.text, g.finish_reason) == _full_decode_rule(tok, f.token_ids, ss, 20)
    assert sum(g.finish_reason == "stop" and g.token_ids[-1] not in tok.end_ids for g in got) >= 6
