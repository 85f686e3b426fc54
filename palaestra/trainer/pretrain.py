"""Pretraining recipes of the shipped embedded models (``arith-base``, ``calc-base``), of the HF arithmetic base
(:func:`build_hf_arith_base`, docs/scaling.md) and ``palaestra pretrain`` (SFT until a validation check passes);
docs/architecture.md, "The shipped base policies", describes them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from palaestra.envs import arithmetic_data, calculator_data
from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.calculator import CALC_TOOL
from palaestra.envs.splits import SplitFiles
from palaestra.models._runtime import single_thread
from palaestra.models.sampling import generate
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer, default_vocab
from palaestra.trainer.sft import Example, TinyGPTPolicy, sft
from palaestra.trainer.update import TrainablePolicy
from palaestra.trajectories.io import sha256_file
from palaestra.trajectories.runs import write_json

if TYPE_CHECKING:
    from palaestra.models.hf.tokenize import ChatTokenizer

Rows = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Recipe:
    """How one shipped base is pretrained (see the module docstring)."""

    name: str  # default model name: the file stem of <name>.npz / <name>.json
    files: SplitFiles  # the environment's shipped splits (train for demonstrations, val for checks)
    examples: Callable[[Rows, int], list[Example]]  # demonstrations of train rows, with the build seed
    metrics: Callable[..., dict[str, float]]  # (model, rows, temperature=, seed=) -> {"accuracy": ..., ...}
    skilled: Callable[[Mapping[str, float], float], bool]  # stop check: (metrics, target) -> done
    target: float  # stop threshold of the validation check
    vocab: tuple[str, ...] = tuple(default_vocab())  # the tokenizer's vocabulary
    block_size: int = 64  # context length of the model
    batch_size: int = 128  # demonstrations per SFT step
    lr: float = 2e-3  # peak learning rate (Adam)
    warmup: int = 100  # linear warmup steps
    eval_every: int = 25  # steps between validation checks
    max_steps: int = 3000  # step cap
    eval_rows: int | None = None  # validation rows checked during training (None: all)
    min_steps: int = 0  # no stop before this many steps
    tools: tuple[dict[str, Any], ...] = ()  # tool definitions rendered at the start of every example
    stop_rule: Callable[[float, int], dict[str, Any]] = lambda target, n: {}  # card "recipe": (target, rows)
    card_facts: Mapping[str, Any] = field(default_factory=dict)  # further facts written on the card


def pretrain(
    recipe: Recipe,
    policy: TrainablePolicy,
    model: Any,
    tok: Any,
    seed: int,
    *,
    max_steps: int,
    target: float,
    facts: Callable[[Sequence[Mapping[str, float]], Rows], dict[str, Any]],
    max_len: int | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """SFT ``policy`` on ``recipe``'s demonstrations until ``recipe.skilled`` holds (not before ``min_steps``)
    or for ``max_steps``; returns the base's card, with ``facts(history, val rows)``."""
    train, val = recipe.files.load("train"), recipe.files.load("val")
    probe = val[: recipe.eval_rows] if recipe.eval_rows is not None else val
    t0 = time.perf_counter()

    def probe_metrics() -> dict[str, float]:
        met = recipe.metrics(model, probe)
        if say is not None:
            say(
                f"sft: val greedy {met['accuracy']:.3f} on {len(probe)} rows ({time.perf_counter() - t0:.0f} s)"
            )
        return met

    history = sft(
        policy,
        tok,
        recipe.examples(train, seed),
        steps=max_steps,
        batch_size=recipe.batch_size,
        lr=recipe.lr,
        warmup=recipe.warmup,
        seed=seed,
        eval_fn=probe_metrics,
        eval_every=recipe.eval_every,
        stop_when=lambda row: row["step"] >= recipe.min_steps and recipe.skilled(row, target),
        tools=list(recipe.tools) or None,
        max_len=max_len,
    )
    seconds = time.perf_counter() - t0
    last = history[-1] if history else {}
    path = recipe.files.path("train")
    settings = {"batch_size": recipe.batch_size, "lr": recipe.lr, "warmup": recipe.warmup}
    return {
        "name": recipe.name,
        "seed": seed,
        "steps": int(last.get("step", 0)),
        "recipe": {**settings, "eval_every": recipe.eval_every, **recipe.stop_rule(target, len(probe))},
        **facts(history, val),
        "data": {"train": path.name, "train_rows": len(train), "val_rows": len(val)},
        "data_fingerprint": "sha256:" + sha256_file(path),
        "final_loss": last.get("loss"),
        "train_seconds": round(seconds, 1),
        "created": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
    }


def build_base(
    recipe: Recipe,
    out_dir: str | Path,
    seed: int = 0,
    *,
    max_steps: int | None = None,
    target: float | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Pretrain ``recipe``'s base on one BLAS thread, write ``<name>.npz`` and its card ``<name>.json``."""
    recipe = replace(recipe, name=name or recipe.name)
    tok = Tokenizer(list(recipe.vocab))
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=recipe.block_size, d_model=64, n_layer=2, n_head=4, d_ff=256
    )

    def facts(history: Any, val: Rows) -> dict[str, Any]:
        greedy = recipe.metrics(model, val)
        sampled = recipe.metrics(model, val, temperature=1.0, seed=seed)
        out = {
            "config": cfg.to_dict(),
            "val_accuracy_greedy": greedy["accuracy"],
            "val_accuracy_temp1": sampled["accuracy"],
            "val_temp1_seeds": f"seed + row index, from {seed}",
            "n_params": model.n_params,
            **recipe.card_facts,
        }
        if recipe.tools:
            out.update(tools=list(recipe.tools), word_tokens=list(recipe.vocab[len(default_vocab()) :]))
        if set(greedy) != {"accuracy"}:
            out.update(val_greedy=greedy, val_temp1=sampled)
        return out

    with single_thread():
        model = TinyGPT(cfg, tokenizer=tok, seed=seed)
        card = pretrain(
            recipe,
            TinyGPTPolicy(model),
            model,
            tok,
            seed,
            max_steps=recipe.max_steps if max_steps is None else max_steps,
            target=recipe.target if target is None else target,
            facts=facts,
            max_len=cfg.block_size + 1,
        )
    out, name = Path(out_dir), recipe.name
    model.save(out / f"{name}.npz", meta={"name": name, "step": 0, "sft_steps": card["steps"], "seed": seed})
    write_json(out / f"{name}.json", card)
    return card


def _replies(
    model: TinyGPT,
    conversations: Sequence[list[dict[str, Any]]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[Any]:
    """One generated reply per conversation (conversation i sampled with seed + i)."""
    tok = model.tokenizer
    return generate(
        model,
        [tok.render(c, tools=tools).ids for c in conversations],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seeds=[seed + i for i in range(len(conversations))],
    )


def _user(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": row["prompt"]}


def _final(row: Mapping[str, Any]) -> str:
    return "Final: " + str(row["expected_answer"])


def arith_examples(rows: Rows, seed: int = 0) -> list[Example]:
    """``(messages, completion)`` pairs of arithmetic problems: the prompt as user turn, ``Final: <ans>``."""
    return [([_user(r)], _final(r)) for r in rows]


def arith_accuracy(model: TinyGPT, rows: Rows, *, temperature: float = 0.0, seed: int = 0) -> float:
    """Share of problems whose generated text is exactly ``Final: <ans>`` (row i sampled with seed+i)."""
    gens = _replies(model, [[_user(r)] for r in rows], max_new_tokens=8, temperature=temperature, seed=seed)
    return float(sum(g.text == _final(r) for g, r in zip(gens, rows))) / max(len(rows), 1)


ARITH = Recipe(  # the defaults of Recipe are arith-base's
    name="arith-base",
    files=arithmetic_data.FILES,
    examples=arith_examples,
    metrics=lambda model, rows, **kw: {"accuracy": arith_accuracy(model, rows, **kw)},
    skilled=lambda met, target: met["accuracy"] >= target,
    target=0.35,
    stop_rule=lambda target, n: {"stop_at_val_greedy": target},
)


CALC_WORD_TOKENS: tuple[str, ...] = (
    "Tools: calc(expression: string)",
    '<call>calc {"expression":"',
    '"}</call>',
    "<call>",
    "</call>",
    "error: ",
)
TOOL_SHARE: dict[str, float] = {"add": 0.5, "mul": 0.75, "muladd": 0.25, "mulsub": 0.25, "addmul": 0.25}
#: times each train row of a family is demonstrated (easy rows more often, so direct sums are learnt)
FAMILY_REPEAT: dict[str, int] = {"add": 8}


def calc_vocab() -> list[str]:
    """The default vocabulary followed by the calculator word tokens."""
    return [*default_vocab(), *CALC_WORD_TOKENS]


def call_arguments(expression: str) -> str:
    """The arguments JSON text of a demonstrated call (compact)."""
    return json.dumps({"expression": expression}, separators=(",", ":"))


def _after_exact_call(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation after the exact call and the true result: what the real tool would give."""
    fn = {"name": "calc", "arguments": call_arguments(str(row["expression"]))}
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": fn}]}
    return [_user(row), call, {"role": "tool", "content": str(row["expected_answer"])}]


def calc_rows(rows: Rows, repeat: Mapping[str, int] = FAMILY_REPEAT) -> list[Mapping[str, Any]]:
    """``rows`` with each row of a family in ``repeat`` repeated that many times (in place, order kept)."""
    return [row for row in rows for _ in range(repeat.get(str(row.get("family")), 1))]


def calc_examples(rows: Rows, seed: int) -> list[Example]:
    """One demonstration per row of :func:`calc_rows` (``rows`` with repeats): tool use with probability
    ``TOOL_SHARE[family]`` (one seeded draw per demonstration), else a direct answer."""
    expanded = calc_rows(rows)
    draws = np.random.default_rng(seed).random(len(expanded))
    return [
        (_after_exact_call(row), _final(row))
        if u < TOOL_SHARE.get(str(row.get("family")), 0.0)
        else ([_user(row)], _final(row))
        for u, row in zip(draws, expanded)
    ]


def calc_metrics(model: TinyGPT, rows: Rows, *, temperature: float = 0.0, seed: int = 0) -> dict[str, float]:
    """Tool-use and accuracy figures of ``model`` on ``rows`` (the exact-copy protocol of docs/architecture.md):
    ``call_rate`` / ``exact_call`` (first reply a calc call / the exact one), ``exact_among_calls``,
    ``direct_correct``, ``copy`` (right ``Final:`` line after the exact call and the true result), ``accuracy``,
    and on easy rows ``easy_call_rate`` and ``easy_direct`` (right direct answers among those not calling)."""
    tok, n = model.tokenizer, len(rows)
    kw: dict[str, Any] = {"temperature": temperature, "tools": [CALC_TOOL]}
    first = _replies(model, [[_user(r)] for r in rows], max_new_tokens=32, seed=seed, **kw)
    second = _replies(model, [_after_exact_call(r) for r in rows], max_new_tokens=12, seed=seed + n, **kw)
    calls = exact = direct = copied = correct = easy = easy_calls = easy_direct = 0
    for r, g1, g2 in zip(rows, first, second):
        ended = bool(g1.token_ids) and g1.token_ids[-1] == tok.end_id
        parsed = tok.parse_tool_calls(g1.text, ["calc"]) if ended else None
        good_copy = g2.text == _final(r)
        copied += good_copy
        if calculator_data.difficulty_of(r.get("family")) == "easy":
            easy += 1
            easy_calls += parsed is not None
            easy_direct += parsed is None and g1.text == _final(r)
        if parsed is not None:
            calls += 1
            is_exact = parsed.content is None and len(parsed.calls) == 1
            is_exact = is_exact and parsed.calls[0].arguments == call_arguments(str(r["expression"]))
            exact += is_exact
            correct += is_exact and good_copy
        elif g1.text == _final(r):
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
        "easy_call_rate": easy_calls / max(easy, 1),
        "easy_direct": easy_direct / max(easy - easy_calls, 1),
    }


CALC = Recipe(
    name="calc-base",
    files=calculator_data.FILES,
    examples=calc_examples,
    metrics=calc_metrics,
    skilled=lambda met, target: met["exact_among_calls"] >= target and met["copy"] >= target,
    target=0.9,
    vocab=tuple(calc_vocab()),
    block_size=128,
    batch_size=64,
    lr=3e-3,
    eval_every=100,
    max_steps=4000,
    min_steps=3000,
    tools=(CALC_TOOL,),
    stop_rule=lambda target, n: {
        "eval_rows": n,
        "stop_when": f"exact_among_calls and copy >= {target} on {n} val rows, after 3000 steps",
    },
    card_facts={
        "tool_share": dict(TOOL_SHARE),
        "family_repeat": dict(FAMILY_REPEAT),
        "val_protocol": "exact-copy estimate (palaestra.trainer.pretrain.calc_metrics)",
    },
)

RECIPES: dict[str, Recipe] = {"arithmetic": ARITH, "calculator": CALC}


ARCHITECTURE = "tiny-llama-64"  # the tiny.py spec the base is built from
CARD_FILE = "palaestra-card.json"
_MAX_NEW = 10  # "Final: -99" and the end token


def greedy_accuracy(model: Any, tok: ChatTokenizer, rows: Rows, *, batch: int = 250) -> float:
    """Share of ``rows`` whose greedy reply the strict verifier accepts (arith-strict)."""
    from palaestra.models.hf.sampling import generate as hf_generate

    verifier = StrictFinalVerifier()
    hits = 0
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        gens = hf_generate(  # greedy; the sampler runs under torch.no_grad
            model,
            tok,
            [tok.render([_user(r)]).ids for r in part],
            max_new_tokens=[_MAX_NEW] * len(part),
            temperature=[0.0] * len(part),
            top_p=[1.0] * len(part),
            seeds=[0] * len(part),
            device=next(model.parameters()).device,
        )
        hits += sum(verifier.score(r, g.text).reward == 1.0 for r, g in zip(part, gens))
    return hits / max(len(rows), 1)


def build_hf_arith_base(
    out_dir: str | Path,
    seed: int = 0,
    *,
    target: float = 0.3,
    max_steps: int = 2000,
    eval_every: int = 25,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """SFT all weights of ``tiny-llama-64`` until greedy val accuracy reaches ``target``; write it and its card."""
    import torch
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf.tiny import build_char_tokenizer, tiny_config
    from palaestra.models.hf.tokenize import ChatTokenizer
    from palaestra.trainer.hf_backend import TorchPolicy

    hf_tok = build_char_tokenizer()
    tok = ChatTokenizer(hf_tok)
    cfg = tiny_config(ARCHITECTURE, len(hf_tok))
    cfg.pad_token_id, cfg.eos_token_id = hf_tok.pad_token_id, hf_tok.eos_token_id
    recipe = replace(
        ARITH,
        name="hf-arith-base",
        metrics=lambda model, rows, **kw: {"accuracy": greedy_accuracy(model, tok, rows)},
        batch_size=64,
        lr=3e-3,
        warmup=50,
        eval_every=eval_every,
        eval_rows=200,
        stop_rule=lambda target, n: {
            "eval_rows": n,
            "stop_at_val_greedy": target,
            "max_steps": max_steps,
            "trained": "all weights (full fine-tuning)",
        },
    )

    def facts(history: Any, val: Rows) -> dict[str, Any]:
        return {
            "architecture": ARCHITECTURE,
            "probe_accuracy_greedy": history[-1].get("accuracy") if history else None,
            "val_accuracy_greedy": greedy_accuracy(model, tok, val),
            "n_params": sum(p.numel() for p in model.parameters()),
            "torch_threads": torch.get_num_threads(),
        }

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        policy = TorchPolicy(model)
        card = pretrain(
            recipe, policy, model, tok, seed, max_steps=max_steps, target=target, facts=facts, say=say
        )
    folder = Path(out_dir) / recipe.name
    model.save_pretrained(str(folder))
    hf_tok.save_pretrained(str(folder))
    write_json(folder / CARD_FILE, card)
    return card


def grpo_config(
    base: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 40,
    val_every: int = 20,
    val_rows: int = 200,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """The experiment config that trains the base folder ``base`` with GRPO and LoRA on arithmetic for all
    ``steps`` on ``device`` in ``dtype`` (``"auto"``: a GPU in bfloat16 when there is one)."""
    return {
        "run": {
            "name": "hf-learns",
            "seed": seed,
            "output_dir": str(out_dir),
            "groups_per_step": 16,
            "group_size": 8,
            "max_steps": steps,
            "progress": False,
            "samples_per_step": 2,
            "checkpoint_every": steps,
        },
        "model": {
            "backend": "hf",
            "name": str(base),
            "hf": {"lora": {"r": 16, "lora_alpha": 32}, "device": device, "dtype": dtype},
        },
        "env": {"name": "arithmetic", "max_tokens": _MAX_NEW, "temperature": 1.0},
        "reward": {"kind": "verifier", "verifier": "arith-strict"},
        "validation": {"every": val_every, "max_examples": val_rows, "sampled": False},
        "train": {"lr": 1e-3, "seed": seed},
        "stopping": {
            "patience": steps + 1,
            "hacking_window": None,
            "collapse_window": None,
            "restore_best": False,
        },
    }


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``palaestra pretrain``."""
    p = sub.add_parser(
        "pretrain",
        help="pretrain the embedded policy on a task (SFT) and write a checkpoint + card",
        description="Seeded SFT of the numpy policy. arithmetic: stops when greedy validation accuracy "
        "reaches --target (arith-base). calculator: tool-use demonstrations mixed with direct guesses; stops "
        "when calls and answer copies are exact at --target, after at least 3000 steps so that direct easy "
        "sums are learnt (calc-base, see palaestra.trainer.pretrain).",
    )
    p.add_argument("--task", required=True, choices=sorted(RECIPES), help="task to pretrain on")
    p.add_argument("--out", required=True, type=Path, help="output folder for <name>.npz and <name>.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=None, help="stop threshold (default: the task's)")
    p.add_argument("--max-steps", type=int, default=None, help="step cap (default: the task's)")
    p.add_argument("--name", default=None, help="model name, the file stem (default: the task's base name)")
    p.set_defaults(func=_pretrain_command)


def _pretrain_command(args: argparse.Namespace) -> int:
    card = build_base(
        RECIPES[args.task], args.out, args.seed, max_steps=args.max_steps, target=args.target, name=args.name
    )
    print(
        f"{card['name']}: {card['steps']} steps, val greedy {card['val_accuracy_greedy']:.3f}, "
        f"temp1 {card['val_accuracy_temp1']:.3f}, {card['n_params']} params "
        f"-> {Path(args.out) / card['name']}.npz"
    )
    return 0
