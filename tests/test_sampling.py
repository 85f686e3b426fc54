"""KV-cache generation: exactness vs the full forward, batch invariance, seeds, stops, limits, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from palaestra.models.sampling import DecodeBatch, TinyGPTCache, generate
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer


def make_model(dtype: str = "float32", block: int = 32, seed: int = 0, jitter: float = 0.3) -> TinyGPT:
    tok = Tokenizer.default()
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=block, d_model=32, n_layer=2, n_head=4, d_ff=64, dtype=dtype
    )
    m = TinyGPT(cfg, tokenizer=tok, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for p in m.params.values():  # a random, fairly peaked model: varied outputs
        p += rng.normal(0.0, jitter, p.shape).astype(p.dtype)
    return m


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return make_model()


def prompts_of(m: TinyGPT, texts: list[str]) -> list[list[int]]:
    return [m.tokenizer.render([{"role": "user", "content": t}]).ids for t in texts]


def test_kv_cache_logits_equal_full_forward() -> None:
    m = make_model(dtype="float64", block=16)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(7, m.config.vocab_size, n)) for n in (3, 9, 1, 6)]
    conts = rng.integers(7, m.config.vocab_size, size=(4, 7))
    dec = TinyGPTCache(m)
    dec.add(prompts, np.arange(4), steps=8)
    steps = [dec.logits]
    for t in range(6):
        dec.step(conts[:, t])
        steps.append(dec.logits)
    worst = 0.0
    for r, p in enumerate(prompts):
        full = m.forward_logits(np.array([p + conts[r].tolist()]))[0]
        for t, logits in enumerate(steps):
            worst = max(worst, float(np.abs(full[len(p) - 1 + t] - logits[r]).max()))
    assert worst < 1e-10
    dec.keep(np.array([2, 0]))  # dropping rows keeps the others exact
    dec.step(np.array([5, 6]))
    nxt = dec.logits
    full0 = m.forward_logits(np.array([prompts[0] + conts[0, :6].tolist() + [6]]))[0, -1]
    np.testing.assert_allclose(nxt[1], full0, atol=1e-10)


def test_batch_composition_invariance(model: TinyGPT) -> None:
    target = prompts_of(model, ["What is 3+4? Reply with one line: Final: <int>"])[0]
    others = prompts_of(model, ["a much longer prompt with many characters in it", "x", "Final: 12"])
    alone = generate(model, [target], max_new_tokens=12, temperature=1.0, seeds=[42])[0]
    cases = [  # (batch, index of the target, max_new_tokens, seeds)
        ([*others, target], 3, [20, 9, 5, 12], [7, 8, 9, 42]),
        ([target, *others], 0, 12, [42, 1, 2, 3]),
        ([others[0], target, others[0]], 1, [3, 12, 30], [5, 42, 6]),
    ]
    for batch, pos, max_new, seeds in cases:
        gens = generate(model, batch, max_new_tokens=max_new, temperature=1.0, seeds=seeds)
        got = gens[pos]
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert got.finish_reason == alone.finish_reason
        np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-4)


def test_seed_determinism_and_variety(model: TinyGPT) -> None:
    p = prompts_of(model, ["What is 1+1? Reply with one line: Final: <int>"]) * 8
    a = generate(model, p, max_new_tokens=10, temperature=1.0, seeds=list(range(8)))
    b = generate(model, p, max_new_tokens=10, temperature=1.0, seeds=list(range(8)))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert len({tuple(g.token_ids) for g in a}) > 1  # different seeds, different samples
    solo = generate(model, p[:1], max_new_tokens=10, temperature=1.0, seeds=[5])[0]
    assert solo.token_ids == a[5].token_ids  # identical prompts share one prefill; rows stay independent
    greedy = generate(model, p[:2], max_new_tokens=10, temperature=0.0, seeds=[None, 123])
    assert greedy[0].token_ids == greedy[1].token_ids


def test_greedy_follows_full_forward_and_logprobs_are_raw(model: TinyGPT) -> None:
    prompt = prompts_of(model, ["hello"])[0]
    g = generate(model, [prompt], max_new_tokens=6, temperature=0.0, seeds=[0], top_logprobs=3)[0]
    seq = prompt + g.token_ids
    logits = model.forward_logits(np.array([seq]))[0]
    for t, tok_id in enumerate(g.token_ids):
        assert tok_id == int(np.argmax(logits[len(prompt) - 1 + t]))
    want = model.logprobs_of(np.array([seq]))[0, len(prompt) - 1 :]
    np.testing.assert_allclose(g.logprobs, want, atol=1e-4)
    # sampled at a low temperature and top_p, the reported logprobs are still the raw (temperature 1) ones
    s = generate(model, [prompt], max_new_tokens=6, temperature=0.3, top_p=0.5, seeds=[3], top_logprobs=3)[0]
    raw = model.logprobs_of(np.array([prompt + s.token_ids]))[0, len(prompt) - 1 :]
    np.testing.assert_allclose(s.logprobs, raw, atol=1e-4)
    for lp, top in zip(g.logprobs, g.top_logprobs):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][1] == pytest.approx(lp)  # greedy picks the most likely token


def test_end_token_stops_and_is_kept(model: TinyGPT) -> None:
    gens = generate(
        model, prompts_of(model, ["q"] * 64), max_new_tokens=30, temperature=1.0, seeds=list(range(64))
    )
    ended = [g for g in gens if g.finish_reason == "stop"]
    assert ended, "some samples should end their turn"
    end_id = model.tokenizer.end_id
    for g in ended:
        assert g.token_ids[-1] == end_id and end_id not in g.token_ids[:-1]
        assert len(g.logprobs) == len(g.token_ids)
        assert g.text == model.tokenizer.decode(g.token_ids)


def test_stop_strings_truncate_text(model: TinyGPT) -> None:
    p = prompts_of(model, ["stop test"])
    free = generate(model, p, max_new_tokens=20, temperature=1.0, seeds=[11])[0]
    assert len(free.text) >= 4, free
    stop = free.text[2:4]
    cut = free.text.find(stop)
    g = generate(model, p, max_new_tokens=20, temperature=1.0, seeds=[11], stop=[[stop, "\u2603"]])[0]
    assert g.finish_reason == "stop" and g.text == free.text[:cut]
    n = len(g.token_ids)
    assert g.token_ids == free.token_ids[:n]  # kept up to the token completing the stop string
    assert stop in model.tokenizer.decode(g.token_ids) and stop not in model.tokenizer.decode(
        g.token_ids[:-1]
    )


def test_stop_strings_match_a_full_decode_reference(model: TinyGPT) -> None:
    """The reply is searched as it grows (only its new tail): for 48 seeded rows and stop strings of 1-3
    characters taken from free samples (so that they straddle token pieces), each row ends exactly where a
    search of the full decode after every token says, with the text cut at the earliest stop."""
    tok = model.tokenizer
    p = prompts_of(model, ["q"] * 48)
    free = generate(model, p, max_new_tokens=24, temperature=1.0, seeds=list(range(48)))
    stops = [
        [g.text[i % 5 : i % 5 + 1 + i % 3] or "\u2603", g.text[-2:] or "\u2603"] for i, g in enumerate(free)
    ]
    got = generate(model, p, max_new_tokens=24, temperature=1.0, seeds=list(range(48)), stop=stops)
    hits = 0
    for g, f, ss in zip(got, free, stops):
        for n in range(1, len(f.token_ids) + 1):  # the reference: a full decode after each token
            text = tok.decode(f.token_ids[:n])
            found = [i for i in (text.find(s) for s in ss) if i >= 0]
            if found and f.token_ids[n - 1] != tok.end_id:
                assert (g.token_ids, g.text, g.finish_reason) == (f.token_ids[:n], text[: min(found)], "stop")
                hits += 1
                break
        else:
            assert (g.token_ids, g.text, g.finish_reason) == (f.token_ids, f.text, f.finish_reason)
    assert hits >= 24  # most rows met one of their stops


def test_max_tokens_and_block_size_give_length(model: TinyGPT) -> None:
    block = model.config.block_size
    short = prompts_of(model, ["x"])[0]
    long = list(np.random.default_rng(0).integers(7, 100, block - 3))
    too_long = list(range(7, 7 + block))
    gens = generate(
        model,
        [short, long, too_long, short],
        max_new_tokens=[3, 50, 5, 0],
        temperature=0.0,
        seeds=[None] * 4,
        stop=[["\u2603"]] * 4,
    )
    assert len(gens[0].token_ids) <= 3 and (gens[0].finish_reason == "length") == (
        len(gens[0].token_ids) == 3
    )
    assert len(long) + len(gens[1].token_ids) <= block
    if gens[1].finish_reason == "length":
        assert len(long) + len(gens[1].token_ids) == block
    assert gens[2].token_ids == [] and gens[2].finish_reason == "length"
    assert gens[3].token_ids == [] and gens[3].finish_reason == "length"


def test_short_prompt_long_answer_beside_long_prompt(model: TinyGPT) -> None:
    long = list(range(7, 27))
    short = [model.tokenizer.user_id, 8]
    stop = [["\u2603"], ["\u2603"]]
    alone = generate(model, [short], max_new_tokens=25, temperature=0.0, seeds=[None], stop=stop[:1])[0]
    gens = generate(
        model, [long, short], max_new_tokens=[1, 25], temperature=0.0, seeds=[None, None], stop=stop
    )
    assert len(gens[0].token_ids) == 1 and gens[1].token_ids == alone.token_ids


def test_tiny_top_p_is_greedy(model: TinyGPT) -> None:
    p = prompts_of(model, ["nucleus"]) * 4
    greedy = generate(model, p[:1], max_new_tokens=8, temperature=0.0, seeds=[None])[0]
    nucleus = generate(model, p, max_new_tokens=8, temperature=1.0, top_p=1e-6, seeds=[1, 2, 3, 4])
    assert all(g.token_ids == greedy.token_ids for g in nucleus)


def test_sampling_frequencies_follow_the_distribution() -> None:
    m = make_model(jitter=0.05)
    prompt = prompts_of(m, ["freq"])[0]
    gens = generate(m, [prompt] * 2000, max_new_tokens=1, temperature=1.0, seeds=list(range(2000)))
    logp = np.log(np.exp(m.forward_logits(np.array([prompt]))[0, -1]).astype(np.float64))
    probs = np.exp(logp - np.logaddexp.reduce(logp))
    counts = np.bincount([g.token_ids[0] for g in gens], minlength=m.config.vocab_size)
    top = np.argsort(-probs)[:5]
    np.testing.assert_allclose(counts[top] / 2000, probs[top], atol=0.03)


def test_argument_errors(model: TinyGPT) -> None:
    p = prompts_of(model, ["x"])
    assert generate(model, [], max_new_tokens=2, temperature=1.0, seeds=[]) == []
    full = generate(
        model, p, max_new_tokens=2, temperature=1.0, seeds=[1], top_logprobs=model.config.vocab_size
    )
    assert sorted(i for i, _ in full[0].top_logprobs[0]) == list(range(model.config.vocab_size))
    with pytest.raises(ValueError, match="seeds has 2 entries for 1 prompts"):
        generate(model, p, max_new_tokens=2, temperature=1.0, seeds=[1, 2])
    with pytest.raises(ValueError, match="temperature >= 0"):
        generate(model, p, max_new_tokens=2, temperature=-1.0, seeds=[1])
    with pytest.raises(ValueError, match="top_p"):
        generate(model, p, max_new_tokens=2, temperature=1.0, top_p=0.0, seeds=[1])
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], max_new_tokens=2, temperature=1.0, seeds=[1])
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, p, max_new_tokens=2, temperature=1.0, seeds=[1], stop=[[""]])


@pytest.mark.parametrize("spare", [0, 8])  # 0: every join copies the cache; 8: joins are written in place
def test_rows_joining_a_running_batch_get_the_tokens_they_get_alone(model: TinyGPT, spare: int) -> None:
    """Continuous batching: rows that join between decoding steps (and rows that leave) change no row's
    tokens; each row gets what it gets generated alone with its seed."""
    texts = ["What is 3+4?", "a longer prompt: 12+30", "x", "Final: 12"]
    prompts = prompts_of(model, texts)
    settings = [(12, 1.0, 1.0), (20, 0.0, 1.0), (9, 0.7, 0.9), (16, 1.3, 0.5)]
    alone = [
        generate(model, [p], max_new_tokens=m, temperature=t, top_p=tp, seeds=[s], top_logprobs=2)[0]
        for s, (p, (m, t, tp)) in enumerate(zip(prompts, settings))
    ]
    batch = DecodeBatch(TinyGPTCache(model, spare_rows=spare, spare_slots=4 * spare))
    got: dict[object, object] = {}
    for step in range(60):
        if step < len(prompts):  # one newcomer per step, while the others decode
            m, t, tp = settings[step]
            got.update(
                batch.add(
                    [step],
                    [prompts[step]],
                    max_new=[m],
                    temperature=[t],
                    top_p=[tp],
                    seeds=[step],
                    top_logprobs=[2],
                )
            )
        got.update(batch.step())
    assert not batch.live_rows
    for r, g in enumerate(alone):
        assert got[r].token_ids == g.token_ids  # type: ignore[attr-defined]
        np.testing.assert_allclose(got[r].logprobs, g.logprobs, atol=1e-4)  # type: ignore[attr-defined]
        assert [[i for i, _ in t] for t in got[r].top_logprobs] == [[i for i, _ in t] for t in g.top_logprobs]  # type: ignore[attr-defined]


def test_more_bad_arguments_and_rows_without_room(model: TinyGPT) -> None:
    p = prompts_of(model, ["x"])
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"top_logprobs must be in \[0, {V}\]"):
        generate(model, p, max_new_tokens=2, temperature=1.0, seeds=[1], top_logprobs=V + 1)
    with pytest.raises(ValueError, match=rf"top_logprobs must be in \[0, {V}\]"):
        generate(model, p, max_new_tokens=2, temperature=1.0, seeds=[1], top_logprobs=-1)
    for bad in ({V: 1.0}, {-1: 1.0}):
        with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {V}\)"):
            generate(model, p, max_new_tokens=2, temperature=1.0, seeds=[1], logit_bias=[bad])
    # no row has room to generate: every one is handed back at once, empty, "length"
    block = model.config.block_size
    gens = generate(
        model, [p[0], list(range(7, 7 + block))], max_new_tokens=[0, 5], temperature=1.0, seeds=[1, 2]
    )
    assert [(g.token_ids, g.logprobs, g.finish_reason, g.text) for g in gens] == [([], [], "length", "")] * 2


def test_row_cache_refuses_prompts_it_cannot_hold(model: TinyGPT) -> None:
    block = model.config.block_size
    for prompts, message in [
        ([[5, 6], []], "every prompt needs at least one token"),
        ([], "every prompt needs at least one token"),
        ([list(range(7, 8 + block))], f"prompt of {block + 1} tokens exceeds block_size {block}"),
    ]:
        with pytest.raises(ValueError, match=message):
            TinyGPTCache(model).add(prompts, np.zeros(len(prompts), dtype=np.intp), steps=2)
    cache = TinyGPTCache(model)  # no spare slots: room for the prompt and one more token
    cache.add([[5, 6, 7]], np.array([0]), steps=2)
    cache.step(np.array([8]))
    with pytest.raises(ValueError, match=r"KV cache is full \(4 slots\)"):
        cache.step(np.array([9]))


def test_long_sampled_rows_keep_using_their_seed_stream() -> None:
    """Past the first DRAWS tokens a sampled row draws more uniforms from its own seed: its t-th token is still
    the inverse-CDF pick of the t-th draw of its seed (checked against the full forward)."""
    from palaestra.models.sampling import DRAWS

    m = make_model(dtype="float64", block=DRAWS + 24)
    tok = m.tokenizer
    prompt = prompts_of(m, ["long"])[0]
    n_new, seed, temp = DRAWS + 12, 7, 1.5
    no_end = {tok.end_id: -100.0}
    g = generate(m, [prompt], max_new_tokens=n_new, temperature=temp, seeds=[seed], logit_bias=[no_end])[0]
    assert len(g.token_ids) == n_new
    logits = m.forward_logits(np.array([prompt + g.token_ids[:-1]]))[0, len(prompt) - 1 :]  # (n_new, V)
    logits[:, tok.end_id] -= 100.0
    z = logits / temp
    p = np.exp(z - z.max(-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = np.random.default_rng(seed).random(n_new)
    expected = (cdf < (u * cdf[:, -1])[:, None]).sum(-1)
    assert g.token_ids == expected.tolist()


def test_rows_with_penalties_joining_a_running_batch_get_the_tokens_they_get_alone(model: TinyGPT) -> None:
    """Finished rows leave the batch (with their penalty counters) to make room for newcomers; every row still
    gets what it gets generated alone."""
    prompts = prompts_of(model, ["What is 3+4?", "x", "Final: 12"])
    settings = [(3, 0.8, 1.5), (14, 0.0, 0.7), (10, 1.1, 2.0)]  # max tokens, temperature, frequency penalty
    alone = [
        generate(model, [p], max_new_tokens=n, temperature=t, seeds=[s], frequency_penalty=f)[0]
        for s, (p, (n, t, f)) in enumerate(zip(prompts, settings))
    ]
    batch = DecodeBatch(TinyGPTCache(model))  # no spare room: every join rebuilds the cache
    got: dict[object, object] = {}
    for step in range(40):
        if step in (0, 1, 5):  # the third joins after the first has finished
            r = (0, 1, 5).index(step)
            n, t, f = settings[r]
            got.update(
                batch.add(
                    [r],
                    [prompts[r]],
                    max_new=[n],
                    temperature=[t],
                    top_p=[1.0],
                    seeds=[r],
                    presence_penalty=[0.0],
                    frequency_penalty=[f],
                )
            )
        got.update(batch.step())
    assert not batch.live_rows and len(got) == 3
    for r, g in enumerate(alone):
        assert got[r].token_ids == g.token_ids  # type: ignore[attr-defined]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_vanishing_temperature_is_the_greedy_limit(model: TinyGPT, top_p: float) -> None:
    """A temperature so small that logits / temperature overflow (5e-324, the smallest float) samples the
    argmax, as temperature 0 does; a row beside it at temperature 1 draws what it draws alone."""
    p = prompts_of(model, ["What is 3+4? Reply with one line: Final: <int>", "x"])
    greedy = generate(model, p[:1], max_new_tokens=10, temperature=0.0, seeds=[3])[0]
    warm = generate(model, p[1:], max_new_tokens=10, temperature=1.0, top_p=top_p, seeds=[4])[0]
    with np.errstate(all="raise"):  # no overflow or NaN warning escapes the sampler
        cold, mixed = generate(
            model, p, max_new_tokens=10, temperature=[5e-324, 1.0], top_p=top_p, seeds=[3, 4]
        )
    assert cold.token_ids == greedy.token_ids
    assert mixed.token_ids == warm.token_ids
