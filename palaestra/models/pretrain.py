"""Supervised pretraining (SFT) of the embedded policy and the build of the shipped ``arith-base`` model.

:func:`sft` trains a :class:`~palaestra.models.tinygpt.TinyGPT` on ``(messages, completion)`` pairs: each
pair is rendered with the chat template as ``messages`` + an assistant turn ``completion`` + ``<|end|>``, and
the loss is the mean negative log-likelihood of the assistant tokens (content and closing ``<|end|>``).

:func:`build_arith_base` is the recipe of the shipped base: d64 L2 H4 ReLU, batch 128, lr 2e-3 with 100
warmup steps, stopping as soon as greedy validation accuracy reaches 0.35 (checked every 25 steps). It reads
the arithmetic task's shipped JSONL splits (train/val) by path, so that this layer-2 module does not import
``palaestra.envs``; the completion of an example is ``"Final: " + expected_answer``. It runs with one worker
and one BLAS thread, so the same seed gives the same weights on the same machine and BLAS build (other CPUs
may round differently). ``palaestra pretrain --task arithmetic --out DIR --seed N`` runs it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.models.tinygpt import TinyGPT

Example = tuple[list[dict[str, Any]], str]
ARITH_DATA_DIR = Path(__file__).resolve().parents[1] / "envs" / "data" / "arithmetic"
ARITH_TARGET = 0.35
MODEL_NAME = "arith-base"


def _encode_examples(
    model: TinyGPT, examples: Sequence[Example], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[tuple[list[int], list[bool]]]:
    tok, block = model.tokenizer, model.config.block_size
    out = []
    for n, (messages, completion) in enumerate(examples):
        convo = [*messages, {"role": "assistant", "content": completion}]
        r = tok.render(convo, add_generation_prompt=False, tools=tools)
        if len(r.ids) > block + 1:
            raise ValueError(f"example {n}: {len(r.ids)} tokens exceed block_size + 1 = {block + 1}")
        out.append((r.ids, r.assistant_mask))
    return out


def sft(
    model: TinyGPT,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int = 128,
    lr: float = 2e-3,
    warmup: int = 100,
    seed: int,
    eval_fn: Callable[[TinyGPT], Mapping[str, float]] | None = None,
    eval_every: int = 25,
    stop_when: Callable[[Mapping[str, float]], bool] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, float]]:
    """Train ``model`` in place on the assistant tokens of ``examples``; returns one history row per step.

    Batches are consecutive slices of a stream of seeded epoch permutations. The learning rate warms up
    linearly over ``warmup`` steps, then stays at ``lr`` (Adam, betas (0.9, 0.99), clip 1.0). Every
    ``eval_every`` steps (and after the last one) ``eval_fn(model)`` is merged into that step's row; training
    stops early once ``stop_when(metrics)`` is true. Rows hold ``step, loss, grad_norm, lr, tokens,
    elapsed_s`` and the metrics. ``tools`` (function definitions) are rendered at the start of every example;
    every assistant turn of an example (earlier ones in ``messages`` included) is trained on.
    """
    import numpy as np

    from palaestra.models.optim import Adam

    if steps < 0 or batch_size < 1 or eval_every < 1 or not examples:
        raise ValueError("sft needs steps >= 0, batch_size >= 1, eval_every >= 1 and at least one example")
    data = _encode_examples(model, examples, tools)
    rng = np.random.default_rng(seed)
    opt = Adam(model.params, lr=lr)
    pad = model.tokenizer.pad_id
    history: list[dict[str, float]] = []
    stream: list[int] = []  # concatenated seeded epoch permutations
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        while len(stream) < batch_size:
            stream.extend(rng.permutation(len(data)).tolist())
        batch = [data[i] for i in stream[:batch_size]]
        del stream[:batch_size]
        T = max(len(ids) for ids, _ in batch)
        ids = np.full((len(batch), T), pad, dtype=np.intp)
        mask = np.zeros((len(batch), T), dtype=bool)
        for r, (row, m) in enumerate(batch):
            ids[r, : len(row)] = row
            mask[r, : len(m)] = m
        tgt_mask = mask[:, 1:]
        n_tok = int(tgt_mask.sum())
        res = model.forward_logprobs(ids)
        loss = -float((res.logp * tgt_mask).sum()) / max(n_tok, 1)
        grads = model.backward_logprobs(res.cache, -tgt_mask.astype(model.dtype) / max(n_tok, 1))
        opt.lr = lr * min(1.0, step / warmup) if warmup > 0 else lr
        gnorm = opt.step(grads)
        row_out = {
            "step": step,
            "loss": loss,
            "grad_norm": gnorm,
            "lr": opt.lr,
            "tokens": n_tok,
            "elapsed_s": time.perf_counter() - t0,
        }
        history.append(row_out)
        if eval_fn is not None and (step % eval_every == 0 or step == steps):
            metrics = dict(eval_fn(model))
            row_out.update(metrics)
            if stop_when is not None and stop_when(metrics):
                break
    return history


# ---------------------------------------------------------------------------------------------- arithmetic
def arith_examples(rows: Sequence[Mapping[str, Any]]) -> list[Example]:
    """``(messages, completion)`` pairs of arithmetic problems: the prompt as user turn, ``Final: <ans>``."""
    return [([{"role": "user", "content": r["prompt"]}], "Final: " + str(r["expected_answer"])) for r in rows]


def arith_accuracy(
    model: TinyGPT, rows: Sequence[Mapping[str, Any]], *, temperature: float = 0.0, seed: int = 0
) -> float:
    """Share of problems whose generated text is exactly ``Final: <ans>`` (row i sampled with seed+i)."""
    from palaestra.models.sampling import generate

    tok = model.tokenizer
    prompts = [tok.render([{"role": "user", "content": r["prompt"]}]).ids for r in rows]
    gens = generate(
        model,
        prompts,
        max_new_tokens=8,
        temperature=temperature,
        seeds=[seed + i for i in range(len(rows))],
    )
    hits = sum(g.text == "Final: " + str(r["expected_answer"]) for g, r in zip(gens, rows))
    return hits / max(len(rows), 1)


def build_arith_base(
    out_dir: str | Path,
    seed: int = 0,
    *,
    data_dir: str | Path | None = None,
    max_steps: int = 3000,
    target: float = ARITH_TARGET,
    name: str = MODEL_NAME,
) -> dict[str, Any]:
    """Pretrain the arithmetic base, write ``<name>.npz`` and its card ``<name>.json``; returns the card."""
    from palaestra.models._runtime import single_thread
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer
    from palaestra.trajectories.io import read_jsonl, sha256_file
    from palaestra.trajectories.runs import write_json

    data = Path(data_dir) if data_dir is not None else ARITH_DATA_DIR
    train_path, val_path = data / "train.jsonl", data / "val.jsonl"
    train, val = read_jsonl(train_path), read_jsonl(val_path)
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, d_model=64, n_layer=2, n_head=4, d_ff=256)
    t0 = time.perf_counter()
    with single_thread():
        model = TinyGPT(cfg, tokenizer=tok, seed=seed)
        history = sft(
            model,
            arith_examples(train),
            steps=max_steps,
            batch_size=128,
            lr=2e-3,
            warmup=100,
            seed=seed,
            eval_fn=lambda m: {"val_greedy": arith_accuracy(m, val)},
            eval_every=25,
            stop_when=lambda met: met["val_greedy"] >= target,
        )
        greedy = arith_accuracy(model, val)
        sampled = arith_accuracy(model, val, temperature=1.0, seed=seed)
    steps = int(history[-1]["step"]) if history else 0
    card = {
        "name": name,
        "seed": seed,
        "steps": steps,
        "recipe": {
            "batch_size": 128,
            "lr": 2e-3,
            "warmup": 100,
            "eval_every": 25,
            "stop_at_val_greedy": target,
        },
        "config": cfg.to_dict(),
        "data": {"train": train_path.name, "train_rows": len(train), "val_rows": len(val)},
        "data_fingerprint": "sha256:" + sha256_file(train_path),
        "val_accuracy_greedy": greedy,
        "val_accuracy_temp1": sampled,
        "val_temp1_seeds": f"seed + row index, from {seed}",
        "n_params": model.n_params,
        "final_loss": float(history[-1]["loss"]) if history else None,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "created": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
    }
    out = Path(out_dir)
    model.save(out / f"{name}.npz", meta={"name": name, "step": 0, "sft_steps": steps, "seed": seed})
    write_json(out / f"{name}.json", card)
    return card


# ---------------------------------------------------------------------------------------------- CLI
def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``palaestra pretrain``."""
    p = sub.add_parser(
        "pretrain",
        help="pretrain the embedded policy on a task (SFT) and write a checkpoint + card",
        description="Seeded SFT of the numpy policy. arithmetic: stops when greedy validation accuracy "
        "reaches --target (arith-base). calculator: tool-use demonstrations mixed with direct guesses; stops "
        "when calls and answer copies are exact at --target (calc-base, see palaestra.models.pretrain_calc).",
    )
    p.add_argument("--task", required=True, choices=["arithmetic", "calculator"], help="task to pretrain on")
    p.add_argument("--out", required=True, type=Path, help="output folder for <name>.npz and <name>.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=None, help="stop threshold (default: the task's)")
    p.add_argument("--max-steps", type=int, default=None, help="step cap (default: the task's)")
    p.add_argument("--name", default=None, help="model name, the file stem (default: the task's base name)")
    p.set_defaults(func=_pretrain_command)


def _pretrain_command(args: argparse.Namespace) -> int:
    if args.task == "calculator":
        from palaestra.models import pretrain_calc as pc

        card = pc.build_calc_base(
            args.out,
            args.seed,
            max_steps=args.max_steps or 4000,
            target=pc.CALC_TARGET if args.target is None else args.target,
            name=args.name or pc.MODEL_NAME,
        )
    else:
        card = build_arith_base(
            args.out,
            args.seed,
            max_steps=args.max_steps or 3000,
            target=ARITH_TARGET if args.target is None else args.target,
            name=args.name or MODEL_NAME,
        )
    print(
        f"{card['name']}: {card['steps']} steps, val greedy {card['val_accuracy_greedy']:.3f}, "
        f"temp1 {card['val_accuracy_temp1']:.3f}, {card['n_params']} params "
        f"-> {Path(args.out) / card['name']}.npz"
    )
    return 0
