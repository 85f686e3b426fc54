"""Reward model: finite-difference gradient check of the Bradley-Terry loss, learning a toy preference,
pair files, save/load and the fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from palaestra.models.reward_model import (
    Pair,
    RewardModel,
    bt_loss_and_grads,
    load_reward_model,
    read_pairs,
    train_reward_model,
    write_pairs,
)
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import SPECIAL_TOKENS, Tokenizer
from palaestra.trajectories.io import DataError

SMALL_VOCAB = [*SPECIAL_TOKENS, *"0123456789+-ab", "Final: "]


def tiny_rm(dtype: str = "float64", seed: int = 1, jitter: float = 0.2) -> RewardModel:
    tok = Tokenizer(SMALL_VOCAB)
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=8, d_model=16, n_layer=2, n_head=2, d_ff=24, dtype=dtype
    )
    rm = RewardModel.from_policy(TinyGPT(cfg, tokenizer=tok, seed=seed), seed=seed)
    rng = np.random.default_rng(seed)
    for p in rm.params.values():  # move away from the init so every path matters
        p += rng.normal(0.0, jitter, p.shape).astype(p.dtype)
    return rm


def test_gradient_check_float64() -> None:
    rm = tiny_rm()
    rng = np.random.default_rng(0)
    v = rm.config.vocab_size
    chosen = [list(rng.integers(0, v, size=n)) for n in (8, 5, 3)]
    rejected = [list(rng.integers(0, v, size=n)) for n in (6, 8, 1)]
    _, grads, _ = bt_loss_and_grads(rm, chosen, rejected, center=0.1)
    assert set(grads) == set(rm.params)

    def objective() -> float:
        return bt_loss_and_grads(rm, chosen, rejected, center=0.1)[0]

    eps = 1e-6
    pick = np.random.default_rng(1)
    for name, p in rm.params.items():
        flat, num = p.reshape(-1), np.zeros(p.size)
        # every entry of small params, a seeded sample of 40 of larger ones (the rest stay 0 on both sides)
        idx = np.arange(p.size) if p.size <= 40 else pick.choice(p.size, 40, replace=False)
        for i in idx:
            old = flat[i]
            flat[i] = old + eps
            up = objective()
            flat[i] = old - eps
            down = objective()
            flat[i] = old
            num[i] = (up - down) / (2 * eps)
        ana = np.zeros(p.size)
        ana[idx] = grads[name].reshape(-1)[idx]
        assert grads[name].dtype == np.float64
        scale = max(1e-8, np.abs(num).max())
        assert np.abs(ana - num).max() / scale < 1e-5, name


def test_padding_does_not_change_a_score() -> None:
    rm = tiny_rm()
    rows = [[7, 8, 9], [7, 8, 9, 10, 11, 12]]
    together = rm.forward(rows)[0]
    alone = rm.forward(rows[:1])[0]
    assert together[0] == pytest.approx(alone[0], abs=1e-12)


def test_learns_a_toy_preference() -> None:
    """Prefer completions ending in one letter to the same completions ending in the other; the opposite
    preference is learnt from the swapped pairs, so the result is not the initial model's bias."""
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(300):
        prompt = "".join(rng.choice(list("0123456789+-"), size=3))
        body = "".join(rng.choice(list("0123"), size=2))
        rows.append((prompt, body))
    tok = Tokenizer(SMALL_VOCAB)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, d_model=16, n_layer=1, n_head=2, d_ff=32)
    for good, bad in (("a", "b"), ("b", "a")):
        pairs = [Pair(prompt, body + good, body + bad) for prompt, body in rows]
        rm = RewardModel.from_policy(TinyGPT(cfg, tokenizer=tok, seed=0), seed=0)
        result = train_reward_model(rm, pairs, epochs=3, batch_size=32, lr=3e-3, seed=0, heldout_fraction=0.2)
        assert result.heldout_pairs > 0
        assert result.heldout_pair_accuracy >= 0.95, good
        scores = rm.score_texts("1+2", ["3" + good, "3" + bad])
        assert scores[0] > scores[1]


def test_save_load_roundtrip_and_fingerprint(tmp_path: Path) -> None:
    rm = tiny_rm(dtype="float32")
    rm.save(tmp_path / "rm.npz")
    back = RewardModel.load(tmp_path / "rm.npz")
    assert back.fingerprint == rm.fingerprint
    assert back.score_texts("1+2", ["3", "4"]) == rm.score_texts("1+2", ["3", "4"])
    back.params["rm.b"] += 1.0
    back.weights_changed()
    assert back.fingerprint != rm.fingerprint
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(DataError, match=r"bad\.npz"):
        RewardModel.load(tmp_path / "bad.npz")


def test_pairs_file_roundtrip_and_errors(tmp_path: Path) -> None:
    pairs = [Pair("p", "c", "r", {"source": "test"})]
    write_pairs(tmp_path / "pairs.jsonl", pairs)
    assert read_pairs(tmp_path / "pairs.jsonl") == pairs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n" + '{"prompt": "p"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: field 'chosen'"):
        read_pairs(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no pairs"):
        read_pairs(empty)


def test_load_reward_model_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no-such-rm.*available"):
        load_reward_model("no-such-rm")
    with pytest.raises(DataError, match=r"missing\.npz"):
        load_reward_model(tmp_path / "missing.npz")
    rm = tiny_rm(dtype="float32")
    rm.save(tmp_path / "rm.npz")
    assert load_reward_model(tmp_path / "rm.npz").fingerprint == rm.fingerprint


def test_scoring_and_training_refuse_bad_rows_and_empty_sets() -> None:
    rm = tiny_rm()
    assert rm.score_texts("1+2", []) == [] and rm.score_ids([]).shape == (0,)
    scores, cache = rm.forward([])
    assert scores.shape == (0,) and cache is None
    assert np.isnan(rm.pair_accuracy([]))
    V, T = rm.config.vocab_size, rm.config.block_size
    for rows in ([[1] * (T + 1)], [[1, 2], []]):
        with pytest.raises(ValueError, match=rf"row lengths must be in \[1, {T}\]"):
            rm.forward(rows)
    for rows in ([[1, V]], [[-1, 2]]):
        with pytest.raises(ValueError, match=rf"token ids must be in \[0, {V}\)"):
            rm.forward(rows)
    for cache in (None, {}, {"x": np.zeros((1, 2), int)}):
        with pytest.raises(
            ValueError, match=r"backward needs the cache of forward\(\.\.\., need_cache=True\)"
        ):
            rm.backward(cache, np.ones(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chosen and rejected must be non-empty and of equal length"):
        bt_loss_and_grads(rm, [], [])
    with pytest.raises(ValueError, match="chosen and rejected must be non-empty and of equal length"):
        bt_loss_and_grads(rm, [[1, 2]], [[1, 2], [3, 4]])
    pairs = [Pair("1+2", "3", "4"), Pair("1+3", "4", "5")]
    with pytest.raises(DataError, match="no training pairs left after the held-out split"):
        train_reward_model(rm, pairs, heldout_fraction=1.0)
