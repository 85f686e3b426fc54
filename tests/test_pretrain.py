"""SFT pretraining: loss goes down, seeded determinism, early stop, the build recipe and the shipped base."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest

from palaestra.envs.arithmetic_data import DATA_DIR as ARITH_DATA_DIR
from palaestra.envs.arithmetic_data import load_split
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer
from palaestra.trainer.pretrain import (
    ARITH,
    arith_accuracy,
    arith_examples,
    build_base,
    calc_metrics,
    pretrain,
    register,
)
from palaestra.trainer.sft import TinyGPTPolicy, sft
from palaestra.trajectories.io import sha256_file

WEIGHTS = Path(__file__).resolve().parents[1] / "palaestra" / "models" / "weights"


def small_model(seed: int = 0) -> TinyGPT:
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, d_model=32, n_layer=1, n_head=2, d_ff=64)
    return TinyGPT(cfg, tokenizer=tok, seed=seed)


def test_sft_reduces_loss_and_is_deterministic() -> None:
    examples = arith_examples(load_split("train")[:512])
    runs = []
    for _ in range(2):
        m = small_model()
        hist = sft(
            TinyGPTPolicy(m), m.tokenizer, examples, steps=40, batch_size=32, lr=3e-3, warmup=5, seed=3
        )
        runs.append((m, hist))
    (m1, h1), (m2, h2) = runs
    assert len(h1) == 40 and {"step", "loss", "grad_norm", "lr", "tokens", "elapsed_s"} <= set(h1[0])
    assert np.mean([r["loss"] for r in h1[-5:]]) < 0.6 * np.mean([r["loss"] for r in h1[:5]])
    assert h1[0]["lr"] == pytest.approx(3e-3 / 5) and h1[-1]["lr"] == pytest.approx(3e-3)
    assert [r["loss"] for r in h1] == [r["loss"] for r in h2]
    assert all(np.array_equal(m1.params[k], m2.params[k]) for k in m1.params)
    m3 = small_model()
    sft(TinyGPTPolicy(m3), m3.tokenizer, examples, steps=5, batch_size=32, seed=4)
    assert not all(np.array_equal(m1.params[k], m3.params[k]) for k in m1.params)


def test_sft_trains_only_assistant_tokens_and_stops_early() -> None:
    m = small_model()
    calls: list[int] = []

    def eval_fn() -> dict[str, float]:
        calls.append(1)
        return {"metric": float(len(calls))}

    hist = sft(
        TinyGPTPolicy(m),
        m.tokenizer,
        [([{"role": "user", "content": "hi"}], "ok")],
        steps=50,
        batch_size=4,
        seed=0,
        eval_fn=eval_fn,
        eval_every=5,
        stop_when=lambda met: met["metric"] >= 3,
    )
    assert len(hist) == 15 and hist[-1]["metric"] == 3.0 and "metric" not in hist[-2]
    assert all(r["tokens"] == 4 * 3 for r in hist)  # "o", "k", <|end|> per example
    with pytest.raises(ValueError, match=r"example 0: \d+ tokens exceed the model's context \(33 tokens\)"):
        sft(
            TinyGPTPolicy(m),
            m.tokenizer,
            [([{"role": "user", "content": "x" * 40}], "ok")],
            steps=1,
            seed=0,
            max_len=33,
        )


def test_build_recipe_writes_checkpoint_and_card(tmp_path: Path) -> None:
    card = build_base(ARITH, tmp_path, seed=1, max_steps=30, target=2.0, name="tiny-arith")
    assert card["steps"] == 30 and card["name"] == "tiny-arith" and card["seed"] == 1
    assert card["data_fingerprint"] == "sha256:" + sha256_file(ARITH_DATA_DIR / "train.jsonl")
    on_disk = json.loads((tmp_path / "tiny-arith.json").read_text())
    assert on_disk == card
    m = TinyGPT.load(tmp_path / "tiny-arith.npz")
    assert m.meta["name"] == "tiny-arith" and m.n_params == card["n_params"]
    val = load_split("val")
    assert arith_accuracy(m, val) == pytest.approx(card["val_accuracy_greedy"])


def test_cli_registration() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["pretrain", "--task", "arithmetic", "--out", "x", "--seed", "3"])
    assert args.seed == 3 and args.out == Path("x") and callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["pretrain", "--task", "chess", "--out", "x"])


def test_shipped_base_reproduces_its_card() -> None:
    card = json.loads((WEIGHTS / "arith-base.json").read_text())
    path = WEIGHTS / "arith-base.npz"
    assert path.stat().st_size < 2_000_000
    m = TinyGPT.load(path)
    assert m.n_params == card["n_params"] and m.config.to_dict() == card["config"]
    assert card["data_fingerprint"] == "sha256:" + sha256_file(ARITH_DATA_DIR / "train.jsonl")
    assert 0.35 <= card["val_accuracy_greedy"] <= 0.45
    val = load_split("val")
    assert len(val) == 1000
    greedy = arith_accuracy(m, val)
    assert abs(greedy - card["val_accuracy_greedy"]) <= 0.03
    sampled = arith_accuracy(m, val, temperature=1.0, seed=card["seed"])
    assert abs(sampled - card["val_accuracy_temp1"]) <= 0.03


@pytest.mark.parametrize(
    "bad",
    [{"steps": -1}, {"batch_size": 0}, {"eval_every": 0}, {"examples": []}],
    ids=lambda b: next(iter(b)),
)
def test_sft_refuses_bad_settings(bad: dict) -> None:
    m = small_model()
    before = {k: v.copy() for k, v in m.params.items()}
    kwargs: dict = {"examples": [([{"role": "user", "content": "hi"}], "ok")], "steps": 2, "batch_size": 1}
    kwargs.update(bad)
    with pytest.raises(
        ValueError, match="sft needs steps >= 0, batch_size >= 1, eval_every >= 1 and at least one"
    ):
        sft(TinyGPTPolicy(m), m.tokenizer, seed=0, **kwargs)
    assert all(np.array_equal(m.params[k], before[k]) for k in m.params)


def test_pretrain_says_each_validation_check() -> None:
    m = small_model()
    lines: list[str] = []
    card = pretrain(
        ARITH,
        TinyGPTPolicy(m),
        m,
        m.tokenizer,
        0,
        max_steps=2,
        target=2.0,
        facts=lambda h, v: {},
        say=lines.append,
    )
    assert card["steps"] == 2
    assert len(lines) == 1 and re.fullmatch(r"sft: val greedy 0\.\d{3} on 1000 rows \(\d+ s\)", lines[0]), (
        lines
    )


def test_calc_metrics_count_calls_and_direct_answers() -> None:
    from palaestra.envs import calculator_data
    from palaestra.models.registry import load

    rows = calculator_data.load_split("val")
    easy = [r for r in rows if r["family"] == "add"][:2]
    hard = [r for r in rows if r["family"] == "mul"][:2]
    met = calc_metrics(load("calc-base").gpt, easy + hard)
    # calc-base calls the tool on products and answers some easy sums directly: both kinds are in the rows
    assert met["call_rate"] > 0.0 and met["direct_correct"] > 0.0
    assert met["exact_among_calls"] == pytest.approx(met["exact_call"] / met["call_rate"])
    assert met["copy"] == 1.0  # every exact call's result is copied: correct = exact calls + direct answers
    assert met["accuracy"] == pytest.approx(met["exact_call"] + met["direct_correct"])
    assert met["easy_direct"] == 1.0 and 0.0 < met["easy_call_rate"] < 1.0
