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
