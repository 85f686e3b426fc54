"""A Bradley-Terry reward model: a linear head ``r = w . h_last + b`` on the TinyGPT trunk (initialised from a
policy), read at the last token of the conversation (causal attention makes right padding harmless). Loss over
pairs (chosen ``c``, rejected ``j``)::

    L = mean_i [ -log sigmoid(r(c_i) - r(j_i)) ] + center * mean_i [ r(c_i)^2 + r(j_i)^2 ] / 2

The small second term keeps scores near 0, so ``sigmoid(r)`` stays a readable absolute score.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.models._runtime import run_pinned
from palaestra.models.optim import Adam
from palaestra.models.registry import UnknownModelError, checkpoint
from palaestra.models.tinygpt import (
    BlockActivations,
    GPTConfig,
    TinyGPT,
    Trunk,
    checked_params,
    param_shapes,
    read_npz,
    trunk_backward,
    trunk_forward,
    write_npz,
)
from palaestra.models.tokenizer import Tokenizer
from palaestra.trajectories.io import DataError, iter_jsonl, json_object, write_jsonl_text

RM_FORMAT = "palaestra-rm-1"
Prompt = str | Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Pair:
    """One preference: ``chosen`` is preferred to ``rejected`` as a reply to ``prompt``."""

    prompt: str
    chosen: str
    rejected: str
    extra: Mapping[str, Any] | None = None  # other fields of its JSONL line, carried along


def read_pairs(path: str | os.PathLike[str]) -> list[Pair]:
    """Read a pairs JSONL file (``.jsonl.gz``: compressed); a bad line raises :class:`DataError` naming file,
    line and field."""
    out: list[Pair] = []
    for n, value in iter_jsonl(path):
        row = json_object(value, path, n)
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(key), str):
                raise DataError(f"field {key!r} must be a string", path=path, line=n)
        extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
        out.append(Pair(row["prompt"], row["chosen"], row["rejected"], extra or None))
    if not out:
        raise DataError("no pairs", path=path)
    return out


def write_pairs(path: str | os.PathLike[str], pairs: Sequence[Pair]) -> None:
    """Write pairs as JSONL (atomically); a ``.gz`` path is gzip-compressed (reproducibly: no timestamp)."""
    rows = [
        {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, **(p.extra or {})} for p in pairs
    ]
    write_jsonl_text(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


class RewardModel:
    """Scalar-head reward model on the TinyGPT trunk; ``score_texts`` is the scorer protocol of
    :class:`palaestra.judges.learned.LearnedJudge`."""

    def __init__(
        self,
        config: GPTConfig,
        params: Mapping[str, np.ndarray],
        tokenizer: Tokenizer,
        *,
        name: str = "reward-model",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = np.dtype(config.dtype)
        shapes = {k: v for k, v in param_shapes(config).items() if not k.startswith("head.")}  # the trunk
        shapes.update({"rm.w": (config.d_model,), "rm.b": (1,)})
        self.params = checked_params(shapes, params, self.dtype, "reward model params")
        self.name = name
        self.meta: dict[str, Any] = dict(meta or {})

    @classmethod
    def from_policy(cls, policy: TinyGPT, *, seed: int = 0, name: str = "reward-model") -> RewardModel:
        """A reward model whose trunk is a copy of ``policy``'s and whose head is a seeded small draw."""
        cfg = policy.config
        params = {k: v.copy() for k, v in policy.params.items() if not k.startswith("head.")}
        params["rm.w"] = np.random.default_rng(seed).normal(0.0, 0.02, cfg.d_model)
        params["rm.b"] = np.zeros(1)
        return cls(cfg, params, policy.tokenizer, name=name, meta={"init": policy.meta.get("name", "policy")})

    @cached_property
    def fingerprint(self) -> str:
        """``sha256:<16 hex>`` of the config and every parameter's bytes (changes whenever the weights do)."""
        h = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        for key in sorted(self.params):
            h.update(key.encode())
            h.update(np.ascontiguousarray(self.params[key], np.float32).tobytes())
        return "sha256:" + h.hexdigest()[:16]

    def weights_changed(self) -> None:
        """Call after updating ``params`` in place (the fingerprint is recomputed)."""
        self.__dict__.pop("fingerprint", None)

    def encode(self, prompt: Prompt, completion: str) -> list[int]:
        """Ids of the conversation ``prompt`` (a user text or a message list) + assistant ``completion``; the
        oldest tokens are dropped when too long for the context window (the reward is read at the end)."""
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        )
        messages.append({"role": "assistant", "content": completion})
        return self.tokenizer.render(messages, add_generation_prompt=False).ids[-self.config.block_size :]

    def forward(self, rows: Sequence[Sequence[int]], *, need_cache: bool = False) -> tuple[np.ndarray, Any]:
        """Scores (B,) of token-id rows (right-padded internally); with ``need_cache`` also the activations."""
        if not rows:
            return np.zeros(0, self.dtype), None
        lengths = np.array([len(r) for r in rows], dtype=np.intp)
        if lengths.min() < 1 or lengths.max() > self.config.block_size:
            raise ValueError(f"row lengths must be in [1, {self.config.block_size}]")
        B, T = len(rows), int(lengths.max())
        x = np.zeros((B, T), dtype=np.intp)
        for i, r in enumerate(rows):
            x[i, : len(r)] = r
        if x.max() >= self.config.vocab_size or x.min() < 0:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        acts: list[BlockActivations] | None = [] if need_cache else None

        def run() -> tuple[np.ndarray, Any]:
            trunk = Trunk.of(self.params, self.config.n_layer)
            hf, xhatf, rstdf = trunk_forward(trunk, self.config.n_head, x, acts=acts)
            last = np.arange(B) * T + lengths - 1  # (B,) row of each sequence's last token in hf (N, d)
            pooled = hf[last]  # (B, d)
            r = pooled @ self.params["rm.w"] + self.params["rm.b"][0]
            if not need_cache:
                return r, None
            return r, {"x": x, "acts": acts, "xhatf": xhatf, "rstdf": rstdf, "last": last, "pooled": pooled}

        return run_pinned(run)

    def backward(self, cache: Mapping[str, Any], dr: Any) -> dict[str, np.ndarray]:
        """Gradients of ``sum(dr * r)`` with respect to every parameter, from a ``forward(need_cache=True)``."""
        if not cache or "acts" not in cache:
            raise ValueError("backward needs the cache of forward(..., need_cache=True)")
        P, x = self.params, cache["x"]
        B, T = x.shape
        dr = np.asarray(dr, self.dtype).reshape(B)

        def run() -> dict[str, np.ndarray]:
            dhf = np.zeros((B * T, self.config.d_model), self.dtype)  # d loss / d hf: only at the last tokens
            dhf[cache["last"]] = dr[:, None] * P["rm.w"][None, :]
            trunk = Trunk.of(P, self.config.n_layer)
            g = trunk_backward(
                trunk, self.config.n_head, x, cache["acts"], dhf, cache["xhatf"], cache["rstdf"]
            )
            g["rm.w"] = cache["pooled"].T @ dr
            g["rm.b"] = np.array([dr.sum()], self.dtype)
            return {k: g[k] for k in P}

        return run_pinned(run)

    def score_ids(self, rows: Sequence[Sequence[int]], batch_size: int = 256) -> np.ndarray:
        """Scores of many rows, in batches."""
        out = [self.forward(rows[i : i + batch_size])[0] for i in range(0, len(rows), batch_size)]
        return np.concatenate(out) if out else np.zeros(0, self.dtype)

    def score_texts(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        """Scalar score of every completion as a reply to ``prompt`` (higher = preferred)."""
        return [float(s) for s in self.score_ids([self.encode(prompt, c) for c in completions])]

    def pair_accuracy(self, pairs: Sequence[Pair]) -> float:
        """Fraction of pairs where the chosen completion scores strictly higher than the rejected one."""
        if not pairs:
            return float("nan")
        rc = self.score_ids([self.encode(p.prompt, p.chosen) for p in pairs])
        rj = self.score_ids([self.encode(p.prompt, p.rejected) for p in pairs])
        return float(np.mean(rc > rj))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write an ``.npz`` (no pickle) atomically: params, config, vocabulary, format tag, name, metadata."""
        meta = {**self.meta, "name": self.name}
        write_npz(path, ("format", RM_FORMAT), self.config, self.tokenizer, meta, self.params)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RewardModel:
        """Read a file written by :meth:`save` (errors name the file)."""
        path = Path(path)
        try:
            config, tokenizer, meta, params, _ = read_npz(path, ("format", RM_FORMAT), what="reward model")
            return cls(config, params, tokenizer, name=str(meta.get("name", path.stem)), meta=meta)
        except ValueError as exc:  # read_npz's errors name the file already; the constructor's do not
            raise DataError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from exc


def load_reward_model(name_or_path: str | os.PathLike[str]) -> RewardModel:
    """A shipped reward model by name (``arith-rm``) or any reward model file by path (:class:`DataError`)."""
    try:
        path, _ = checkpoint(name_or_path, reward_models=True)
    except (UnknownModelError, FileNotFoundError) as exc:
        raise DataError(str(exc)) from None
    return RewardModel.load(path)


def bt_loss_and_grads(
    rm: RewardModel,
    chosen: Sequence[Sequence[int]],
    rejected: Sequence[Sequence[int]],
    *,
    center: float = 0.0,
) -> tuple[float, dict[str, np.ndarray], float]:
    """Bradley-Terry loss (see the module docstring), its gradients and the batch pair accuracy."""
    n = len(chosen)
    if n == 0 or len(rejected) != n:
        raise ValueError("chosen and rejected must be non-empty and of equal length")
    r, cache = rm.forward([*chosen, *rejected], need_cache=True)
    rc, rj = r[:n], r[n:]
    margin = rc - rj
    loss = float(np.mean(np.logaddexp(0.0, -margin)) + center * np.mean(rc**2 + rj**2) / 2)
    sig = 1.0 / (1.0 + np.exp(margin))  # sigmoid(-margin) = -dloss/dmargin per pair
    dr = np.concatenate([-sig, sig]) / n + center * r / n
    return loss, rm.backward(cache, dr), float(np.mean(margin > 0))


@dataclass
class TrainResult:
    """What :func:`train_reward_model` measured."""

    steps: int
    train_loss: float
    train_pair_accuracy: float
    heldout_pair_accuracy: float
    heldout_pairs: int
    train_pairs: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_reward_model(
    rm: RewardModel,
    pairs: Sequence[Pair],
    *,
    epochs: int = 2,
    batch_size: int = 64,
    lr: float = 1e-3,
    center: float = 1e-3,
    heldout_fraction: float = 0.1,
    seed: int = 0,
    log: Any = None,
) -> TrainResult:
    """Train ``rm`` in place with Adam on the Bradley-Terry loss; held-out pair accuracy at the end. The
    held-out split is seeded, and pairs of one prompt stay on one side."""
    t0 = time.perf_counter()
    prompts = sorted({p.prompt for p in pairs})
    order = np.random.default_rng(seed).permutation(len(prompts))
    held_prompts = {prompts[int(i)] for i in order[: round(len(prompts) * heldout_fraction)]}
    train = [p for p in pairs if p.prompt not in held_prompts]
    held = [p for p in pairs if p.prompt in held_prompts]
    if not train:
        raise DataError("no training pairs left after the held-out split")
    enc_c = [rm.encode(p.prompt, p.chosen) for p in train]
    enc_j = [rm.encode(p.prompt, p.rejected) for p in train]
    opt = Adam(rm.params, lr=lr, weight_decay=0.0, clip_norm=1.0)
    rng = np.random.default_rng(seed + 1)
    steps_per_epoch = max(1, math.ceil(len(train) / batch_size))
    total = epochs * steps_per_epoch
    losses, accs, step = [], [], 0
    for _ in range(epochs):
        order = rng.permutation(len(train))
        for b in range(steps_per_epoch):
            idx = order[b * batch_size : (b + 1) * batch_size]  # never empty: steps_per_epoch rounds up
            opt.lr = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            loss, grads, acc = bt_loss_and_grads(
                rm, [enc_c[i] for i in idx], [enc_j[i] for i in idx], center=center
            )
            opt.step(grads)
            losses.append(loss)
            accs.append(acc)
            step += 1
            if log is not None and (step % 50 == 0 or step == total):
                recent_loss, recent_acc = np.mean(losses[-50:]), np.mean(accs[-50:])
                log(f"rm step {step}/{total}: loss {recent_loss:.4f} pair acc {recent_acc:.3f}")
    rm.weights_changed()
    return TrainResult(
        steps=step,
        train_loss=float(np.mean(losses[-steps_per_epoch:])),
        train_pair_accuracy=float(np.mean(accs[-steps_per_epoch:])),
        heldout_pair_accuracy=rm.pair_accuracy(held) if held else float("nan"),
        heldout_pairs=len(held),
        train_pairs=len(train),
        seconds=time.perf_counter() - t0,
    )
