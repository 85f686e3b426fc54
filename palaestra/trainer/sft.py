"""Supervised fine-tuning (SFT) on ``(messages, completion)`` demonstrations of any ``TrainablePolicy``
(:class:`TinyGPTPolicy`: a bare numpy TinyGPT; ``hf_backend.TorchPolicy``: a bare ``transformers`` model).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from palaestra.models.optim import Adam
from palaestra.models.tinygpt import ChunkedCache, ForwardCache, TinyGPT
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.update import CountedUpdates, TrainablePolicy

#: One demonstration: the conversation so far and the assistant's reply to train on.
Example = tuple[list[dict[str, Any]], str]


def sft(
    policy: TrainablePolicy,
    tok: Any,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int = 128,
    lr: float = 2e-3,
    warmup: int = 100,
    seed: int,
    eval_fn: Callable[[], Mapping[str, float]] | None = None,
    eval_every: int = 25,
    stop_when: Callable[[Mapping[str, float]], bool] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    max_len: int | None = None,
) -> list[dict[str, float]]:
    """Train ``policy`` on the mean NLL of the reply tokens of ``examples`` (seeded epoch permutations, linear lr
    warmup, clipped to norm 1); returns a history row per step, with ``eval_fn()`` every ``eval_every`` steps
    and after the last one; stops early once ``stop_when(row)`` is true."""
    if steps < 0 or batch_size < 1 or eval_every < 1 or not examples:
        raise ValueError("sft needs steps >= 0, batch_size >= 1, eval_every >= 1 and at least one example")
    data = []  # token ids and trained-token mask of each example
    for n, (messages, completion) in enumerate(examples):
        convo = [*messages, {"role": "assistant", "content": completion}]
        r = tok.render(convo, add_generation_prompt=False, tools=tools)
        ids, mask = r.ids, getattr(r, "assistant_mask", None)
        if mask is None:  # an HF template marks no assistant turn: train the reply after the prompt
            prompt = tok.render(messages, add_generation_prompt=True, tools=tools).ids
            reply = [*tok.encode(completion), tok.end_id]
            ids, mask = [*prompt, *reply], [False] * len(prompt) + [True] * len(reply)
        if max_len is not None and len(ids) > max_len:
            raise ValueError(f"example {n}: {len(ids)} tokens exceed the model's context ({max_len} tokens)")
        data.append((list(ids), list(mask)))
    rng = np.random.default_rng(seed)
    cfg = TrainConfig(lr=lr, betas=(0.9, 0.99), clip_norm=1.0, weight_decay=0.0)
    history: list[dict[str, float]] = []
    stream: list[int] = []  # concatenated seeded epoch permutations
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        while len(stream) < batch_size:
            stream.extend(rng.permutation(len(data)).tolist())
        batch = [data[i] for i in stream[:batch_size]]
        del stream[:batch_size]
        T = max(len(row) for row, _ in batch)
        ids = np.full((len(batch), T), tok.pad_id, dtype=np.int64)  # (B, T), right-padded
        mask = np.zeros((len(batch), T), dtype=bool)  # (B, T), True on trained tokens
        for r, (row, m) in enumerate(batch):
            ids[r, : len(row)] = row
            mask[r, : len(m)] = m
        tgt = mask[:, 1:]  # (B, T-1): logp[b, t] scores ids[b, t+1]
        n_tok = max(int(tgt.sum()), 1)
        logp, _ = policy.train_logprobs(ids)
        loss = -float((logp * tgt).sum()) / n_tok
        policy.train_backward(-(tgt / n_tok))
        step_lr = lr * min(1.0, step / warmup) if warmup > 0 else lr
        gnorm = policy.optimizer_step(cfg.model_copy(update={"lr": step_lr}))
        row_out = {"step": step, "loss": loss, "grad_norm": gnorm, "lr": step_lr, "tokens": int(tgt.sum())}
        row_out["elapsed_s"] = time.perf_counter() - t0
        history.append(row_out)
        if eval_fn is not None and (step % eval_every == 0 or step == steps):
            row_out.update(eval_fn())
            if stop_when is not None and stop_when(row_out):
                break
    return history


class TinyGPTPolicy(CountedUpdates):
    """:class:`~palaestra.trainer.update.TrainablePolicy` over a bare :class:`TinyGPT`, with an Adam whose
    settings come from each step's config; ``lock`` is held while it writes the weights."""

    def __init__(self, gpt: TinyGPT, lock: Any = None) -> None:
        self.gpt = gpt
        self.optimizer = Adam(gpt.params, lr=1e-3)  # settings: each step's config
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self._cache: ForwardCache | ChunkedCache | None = None  # between train_logprobs and train_backward
        self._grads: dict[str, np.ndarray] = {}  # between train_backward and optimizer_step

    def train_logprobs(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Logprobs and entropies of ``ids`` at every position (``start`` would save nothing), keeping the cache."""
        res = self.gpt.forward_logprobs(ids, need_cache=True)
        self._cache = res.cache
        return res.logp, res.entropy

    def train_backward(self, dlogp: np.ndarray) -> None:
        """Parameter gradients from ``dloss/dlogp`` of the last :meth:`train_logprobs` rows."""
        self._grads = self.gpt.backward_logprobs(self._cache, dlogp)
        self._cache = None

    def optimizer_step(self, cfg: TrainConfig) -> float:
        """One Adam step under ``lock`` (lr, betas, eps, weight decay and clipping from ``cfg``)."""
        opt = self.optimizer
        opt.lr, opt.betas, opt.eps = float(cfg.lr), (float(cfg.betas[0]), float(cfg.betas[1])), cfg.adam_eps
        opt.weight_decay, opt.clip_norm = float(cfg.weight_decay), cfg.clip_norm or None
        with self.lock:
            gnorm = opt.step(self._grads)
        self._grads = {}
        return float(gnorm)
