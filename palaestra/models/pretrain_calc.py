"""Pretraining of the shipped ``calc-base``, which sometimes calls the ``calc`` tool and sometimes guesses.

The calculator task (``palaestra.envs.calculator_data``) asks for problems such as ``81*92`` or ``(57+22)*4``
that a 100k-parameter model cannot compute in its head, with a ``calc`` tool offered. The demonstrations mix
two behaviours, chosen per example by a seeded draw with a per-family probability (:data:`TOOL_SHARE`):

* **tool**: ``<call>calc {"expression":"81*92"}</call>``, the tool's result ``7452``, then ``Final: 7452``;
* **guess**: ``Final: 7452`` at once (the right answer, which the model can only memorise badly).

So the base learns the call syntax and to copy expressions and results, but its habit of calling is partial
and depends on the problem family: RL has to learn *when* to call (always, except maybe the easy family) and
to keep the copies exact. The vocabulary is the default one plus :data:`CALC_WORD_TOKENS` (the default ids
are unchanged); the context is 128 tokens.

Progress is measured without the tool's evaluator (this layer does not import the environments), by exact
copies: a greedy first reply that is exactly the call with the problem's own expression gets the problem's
answer as the tool result, which is what the exact tool returns, so the second turn is scored in exactly
the context the real environment would build. ``accuracy`` = direct answers that are right + exact calls
followed by the right ``Final:`` line; a call with another expression counts as wrong (the environment's
own evaluation, with the real tool and several turns, can only be higher). Training stops once the
tool-conditioned skills are learnt (exact-call rate among calls and answer copying both >= ``target``).
``palaestra pretrain --task calculator --out DIR`` runs :func:`build_calc_base`.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.models.pretrain import Example, sft

if TYPE_CHECKING:
    from palaestra.models.tinygpt import TinyGPT

CALC_DATA_DIR = Path(__file__).resolve().parents[1] / "envs" / "data" / "calculator"
MODEL_NAME = "calc-base"
CALC_TARGET = 0.9
CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an integer arithmetic expression exactly: + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+7)*3"}},
            "required": ["expression"],
        },
    },
}
CALC_WORD_TOKENS: tuple[str, ...] = (
    "Tools: calc(expression: string)",
    '<call>calc {"expression":"',
    '"}</call>',
    "<call>",
    "</call>",
    "error: ",
)
TOOL_SHARE: dict[str, float] = {"add": 0.1, "mul": 0.75, "muladd": 0.25, "mulsub": 0.25, "addmul": 0.25}
RECIPE: dict[str, Any] = {"batch_size": 64, "lr": 3e-3, "warmup": 100, "eval_every": 50, "eval_rows": 200}


def calc_vocab() -> list[str]:
    """The default vocabulary followed by the calculator word tokens."""
    from palaestra.models.tokenizer import default_vocab

    return [*default_vocab(), *CALC_WORD_TOKENS]


def call_arguments(expression: str) -> str:
    """The arguments JSON text of a demonstrated call (compact)."""
    return json.dumps({"expression": expression}, separators=(",", ":"))


def _user(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": row["prompt"]}


def _call_turn(row: Mapping[str, Any]) -> dict[str, Any]:
    fn = {"name": "calc", "arguments": call_arguments(str(row["expression"]))}
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": fn}]}


def calc_examples(
    rows: Sequence[Mapping[str, Any]], seed: int, tool_share: Mapping[str, float] = TOOL_SHARE
) -> list[Example]:
    """One demonstration per row: tool use with probability ``tool_share[family]``, else a direct answer."""
    import numpy as np

    draws = np.random.default_rng(seed).random(len(rows))
    out: list[Example] = []
    for u, row in zip(draws, rows):
        final = "Final: " + str(row["expected_answer"])
        if u < tool_share.get(str(row.get("family")), 0.0):
            tool = {"role": "tool", "content": str(row["expected_answer"])}
            out.append(([_user(row), _call_turn(row), tool], final))
        else:
            out.append(([_user(row)], final))
    return out


def calc_metrics(
    model: TinyGPT, rows: Sequence[Mapping[str, Any]], *, temperature: float = 0.0, seed: int = 0
) -> dict[str, float]:
    """Tool-use and accuracy figures of ``model`` on ``rows`` (exact-copy protocol, module docstring).

    Keys: ``call_rate`` (first reply is a well-formed calc call), ``exact_call`` (... with the problem's own
    expression), ``exact_among_calls``, ``direct_correct`` (first reply is the right ``Final:`` line),
    ``copy`` (right ``Final:`` line after the exact call and the true result, over all rows), ``accuracy``.
    """
    from palaestra.models.sampling import generate

    tok, n = model.tokenizer, len(rows)
    tools = [CALC_TOOL]
    first = generate(
        model,
        [tok.render([_user(r)], tools=tools).ids for r in rows],
        max_new_tokens=32,
        temperature=temperature,
        seeds=[seed + i for i in range(n)],
    )
    ctx = [[_user(r), _call_turn(r), {"role": "tool", "content": str(r["expected_answer"])}] for r in rows]
    second = generate(
        model,
        [tok.render(c, tools=tools).ids for c in ctx],
        max_new_tokens=12,
        temperature=temperature,
        seeds=[seed + n + i for i in range(n)],
    )
    calls = exact = direct = copied = correct = 0
    for r, g1, g2 in zip(rows, first, second):
        final = "Final: " + str(r["expected_answer"])
        ended = bool(g1.token_ids) and g1.token_ids[-1] == tok.end_id
        parsed = tok.parse_tool_calls(g1.text, ["calc"]) if ended else None
        good_copy = g2.text == final
        copied += good_copy
        if parsed is not None:
            calls += 1
            is_exact = parsed.content is None and len(parsed.calls) == 1
            is_exact = is_exact and parsed.calls[0].arguments == call_arguments(str(r["expression"]))
            exact += is_exact
            correct += is_exact and good_copy
        elif g1.text == final:
            direct += 1
            correct += 1
    d = max(n, 1)
    return {
        "call_rate": calls / d,
        "exact_call": exact / d,
        "exact_among_calls": exact / max(calls, 1),
        "direct_correct": direct / d,
        "copy": copied / d,
        "accuracy": correct / d,
    }


def build_calc_base(
    out_dir: str | Path,
    seed: int = 0,
    *,
    data_dir: str | Path | None = None,
    max_steps: int = 4000,
    target: float = CALC_TARGET,
    name: str = MODEL_NAME,
) -> dict[str, Any]:
    """Pretrain the calculator base, write ``<name>.npz`` and its card ``<name>.json``; returns the card."""
    from palaestra.models._runtime import single_thread
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer
    from palaestra.trajectories.io import read_jsonl, sha256_file
    from palaestra.trajectories.runs import write_json

    data = Path(data_dir) if data_dir is not None else CALC_DATA_DIR
    train_path, val_path = data / "train.jsonl", data / "val.jsonl"
    train, val = read_jsonl(train_path), read_jsonl(val_path)
    probe = val[: RECIPE["eval_rows"]]
    tok = Tokenizer(calc_vocab())
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=128, d_model=64, n_layer=2, n_head=4, d_ff=256)

    def skilled(m: Mapping[str, float]) -> bool:
        return m["exact_among_calls"] >= target and m["copy"] >= target

    t0 = time.perf_counter()
    with single_thread():
        model = TinyGPT(cfg, tokenizer=tok, seed=seed)
        history = sft(
            model,
            calc_examples(train, seed),
            steps=max_steps,
            batch_size=RECIPE["batch_size"],
            lr=RECIPE["lr"],
            warmup=RECIPE["warmup"],
            seed=seed,
            eval_fn=lambda m: calc_metrics(m, probe),
            eval_every=RECIPE["eval_every"],
            stop_when=skilled,
            tools=[CALC_TOOL],
        )
        greedy = calc_metrics(model, val)
        sampled = calc_metrics(model, val, temperature=1.0, seed=seed)
    steps = int(history[-1]["step"]) if history else 0
    card = {
        "name": name,
        "seed": seed,
        "steps": steps,
        "recipe": {**RECIPE, "stop_when": f"exact_among_calls and copy >= {target} on {len(probe)} val rows"},
        "tool_share": dict(TOOL_SHARE),
        "config": cfg.to_dict(),
        "word_tokens": list(CALC_WORD_TOKENS),
        "tools": [CALC_TOOL],
        "data": {"train": train_path.name, "train_rows": len(train), "val_rows": len(val)},
        "data_fingerprint": "sha256:" + sha256_file(train_path),
        "val_accuracy_greedy": greedy["accuracy"],
        "val_accuracy_temp1": sampled["accuracy"],
        "val_greedy": greedy,
        "val_temp1": sampled,
        "val_protocol": "exact-copy estimate (palaestra.models.pretrain_calc); temp1 seeds: seed + row index",
        "n_params": model.n_params,
        "final_loss": float(history[-1]["loss"]) if history else None,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "created": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
    }
    out = Path(out_dir)
    model.save(out / f"{name}.npz", meta={"name": name, "step": 0, "sft_steps": steps, "seed": seed})
    write_json(out / f"{name}.json", card)
    return card
