"""Supervised fine-tuning (SFT) of the embedded policy on ``(messages, completion)`` pairs.

Each pair is rendered with the chat template as ``messages`` + an assistant turn ``completion`` + ``<|end|>``;
the loss is the mean negative log-likelihood of the assistant tokens (every assistant turn of the example,
content and closing ``<|end|>``). The pretraining recipes of the shipped models
(:mod:`palaestra.trainer.pretrain`) are built on :func:`sft`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from palaestra.models.optim import Adam
from palaestra.models.tinygpt import TinyGPT

#: One demonstration: the conversation so far and the assistant's reply to train on.
Example = tuple[list[dict[str, Any]], str]


def encode_examples(
    model: TinyGPT, examples: Sequence[Example], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[tuple[list[int], list[bool]]]:
    """Token ids and assistant-token mask of every example (ValueError if one is longer than the model)."""
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
    elapsed_s`` and the metrics. ``tools`` (function definitions) are rendered at the start of every example.
    """
    if steps < 0 or batch_size < 1 or eval_every < 1 or not examples:
        raise ValueError("sft needs steps >= 0, batch_size >= 1, eval_every >= 1 and at least one example")
    data = encode_examples(model, examples, tools)
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
        ids = np.full((len(batch), T), pad, dtype=np.intp)  # (B, T), right-padded
        mask = np.zeros((len(batch), T), dtype=bool)  # (B, T), True on assistant tokens
        for r, (row, m) in enumerate(batch):
            ids[r, : len(row)] = row
            mask[r, : len(m)] = m
        tgt_mask = mask[:, 1:]  # (B, T-1): which predicted tokens count
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


__all__ = ["Example", "encode_examples", "sft"]
