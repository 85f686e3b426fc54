"""Model registry (shipped weights, paths, independent copies) and the `palaestra tokens` command."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from palaestra.models import registry
from palaestra.models.commands import register, token_rows
from palaestra.models.embedded import EmbeddedModel
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer

SHIPPED = "arith-base" in registry.available()
needs_base = pytest.mark.skipif(not SHIPPED, reason="arith-base weights are not shipped in this checkout")


def tiny_checkpoint(tmp_path: Path, name: str = "tiny") -> Path:
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, d_model=16, n_layer=1, n_head=2, d_ff=32)
    path = tmp_path / f"{name}.npz"
    EmbeddedModel(TinyGPT(cfg, tokenizer=tok, seed=0), name=name).save(path)
    return path


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="palaestra")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_unknown_name_lists_available() -> None:
    with pytest.raises(registry.UnknownModelError) as info:
        registry.load("no-such-model")
    msg = str(info.value)
    assert "no-such-model" in msg and "available models" in msg
    for name in registry.available():
        assert name in msg


def test_load_from_path_gives_independent_copies(tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path)
    a = registry.load(path)
    b = registry.load(str(path), name="other")
    assert (a.name, b.name) == ("tiny", "other")
    a.gpt.params["wte"] += 1.0
    a.bump_step()
    assert not np.allclose(a.gpt.params["wte"], b.gpt.params["wte"]) and b.step == 0
    with pytest.raises(FileNotFoundError):
        registry.load(tmp_path / "missing.npz")


def test_card_beside_checkpoint_is_read(tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path)
    path.with_suffix(".json").write_text(json.dumps({"seed": 7}))
    assert registry.load(path).card == {"seed": 7}
    path.with_suffix(".json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tiny\.json"):
        registry.load(path)
    path.with_suffix(".json").write_text('["seed", 7]')
    with pytest.raises(ValueError, match=r"tiny\.json: a model card must be a JSON object, got list"):
        registry.load(path)


@needs_base
async def test_arith_base_answers_in_format() -> None:
    model = registry.load("arith-base")
    assert model.name == "arith-base" and model.step == 0
    assert model.card, "arith-base ships a JSON card"
    prompt = [{"role": "user", "content": "What is 12+30? Reply with one line: Final: <int>"}]
    r = await model.openai_client().chat.completions.create(
        model="arith-base", messages=prompt, temperature=0.0, max_tokens=12, logprobs=True
    )
    choice = r.choices[0]
    assert (choice.message.content or "").startswith("Final: ")
    assert choice.finish_reason == "stop" and choice.logprobs and choice.logprobs.content
    assert choice.logprobs.content[-1].token == "<|end|>"
    assert registry.load("arith-base").gpt is not model.gpt


def test_token_rows_without_model() -> None:
    rows = token_rows("Final: 323")
    tok = Tokenizer.default()
    assert [r["id"] for r in rows] == tok.encode("Final: 323")
    assert "".join(r["token"] for r in rows) == "Final: 323"
    assert all("logprob" not in r for r in rows)


def test_token_rows_logprobs_match_model(tmp_path: Path) -> None:
    model = registry.load(tiny_checkpoint(tmp_path))
    rows = token_rows("Final: 3", model, prompt="What is 1+2?", end=True)
    tok = model.tokenizer
    assert rows[-1]["token"] == "<|end|>"
    context = tok.render([{"role": "user", "content": "What is 1+2?"}]).ids
    ids = [r["id"] for r in rows]
    full = np.asarray([context + ids])
    logits = model.gpt.forward_logits(full)[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    for i, r in enumerate(rows):
        pos = len(context) + i - 1  # the token is predicted from everything before it
        assert math.isclose(r["logprob"], logp[pos, ids[i]], abs_tol=1e-4)
        assert math.isclose(r["prob"], math.exp(r["logprob"]))


def test_tokens_command_prints_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["tokens", "Final: 323"]) == 0
    out = capsys.readouterr().out
    assert "Final: " in out and "'3'" in out
    path = tiny_checkpoint(tmp_path)
    assert run_cli(["tokens", "Final: 323", "--model", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "tiny" and all(r["logprob"] <= 0 for r in data["tokens"])
    assert run_cli(["tokens", "x", "--model", "no-such-model"]) == 2
    assert "available models" in capsys.readouterr().err
    assert run_cli(["tokens", "x", "--prompt", "hi"]) == 2


def test_tokens_command_table_and_too_long_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_checkpoint(tmp_path)  # block_size 32
    assert run_cli(["tokens", "Final: 3", "--model", str(path), "--prompt", "What is 1+2?", "--end"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = token_rows("Final: 3", registry.load(path), prompt="What is 1+2?", end=True)
    total = sum(r["logprob"] for r in rows)
    assert out[0] == f"{len(rows)} tokens: " + " | ".join(repr(r["token"])[1:-1] for r in rows)
    assert out[1].split() == ["#", "id", "token", "logprob", "prob"]
    assert len(out) == len(rows) + 3 and out[2 + len(rows) - 1].split()[2] == "'<|end|>'"
    assert out[-1] == f"total logprob {total:.4f} under tiny (step 0); context: user prompt + <|assistant|>"
    assert run_cli(["tokens", "Final: 3", "--model", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("context: <|assistant|>")
    assert run_cli(["tokens", "1+1=" * 10, "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("palaestra tokens: error: prompt and text are ") and "scores at most 33" in err


def test_serve_rejects_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--model", "no-such-model", "--port", "1"]) == 2
    assert "available models" in capsys.readouterr().err


def test_serve_rejects_bad_names_and_batch_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tiny_checkpoint(tmp_path))
    nowhere = ["--host", "256.0.0.1"]  # were a check missed, the bind fails (exit 2) with another message
    cases = [
        (["--model", path, "--name", "a", "--name", "b"], "more --name than --model"),
        (["--model", path, "--model", path], "two models are named 'tiny'; use --name"),
        (["--model", path, "--name", "my model"], "model name must be a non-empty string without spaces"),
        (["--model", path, "--max-batch-rows", "0"], "max_batch_rows must be >= 1, got 0"),
    ]
    for argv, message in cases:
        assert run_cli(["serve", *argv, *nowhere]) == 2
        err = capsys.readouterr().err
        assert err.startswith("palaestra serve: error: ") and message in err, err
    assert run_cli(["serve", "--model", path, "--model", path, "--name", "a", *nowhere]) == 2
    assert "cannot listen on 256.0.0.1" in capsys.readouterr().err  # two names: past the checks


def test_available_lists_shipped_checkpoints() -> None:
    names = registry.available()
    assert names == sorted(names)
    assert all((registry.WEIGHTS_DIR / f"{n}.npz").is_file() for n in names)
