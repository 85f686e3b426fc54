"""TinyGPT: a small pre-LN GPT in numpy (learned positions, fused-QKV attention, ReLU MLP, untied head) with a
hand-written backward pass. Parameters live in ``model.params``, a flat dict (the checkpoint and optimiser
view); the maths reads the same arrays by name through ``model.weights``. :func:`trunk_forward` and
:func:`trunk_backward` are shared with the reward model.

Shapes in comments: B batch rows, T positions, N = B*T token rows, d = d_model, H heads, hd = d/H head
width, f = d_ff, V vocabulary.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from palaestra.models._kernels import (
    NEG,
    attention_probs,
    embedding_grad,
    ln_bwd,
    ln_fwd,
    next_token_logprobs,
)
from palaestra.models._runtime import chunk_slices, parallel_map, run_pinned, tune_malloc
from palaestra.models.tokenizer import Tokenizer
from palaestra.trajectories.io import atomic_write_bytes

FORMAT_VERSION = 1
CHECKPOINT_TAG = ("format_version", FORMAT_VERSION)  # the format key and value of a TinyGPT .npz


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a TinyGPT."""

    vocab_size: int  # number of token ids (the tokenizer's vocabulary size)
    block_size: int = 64  # longest context in tokens (rows of the learned position embedding)
    d_model: int = 64  # width of the residual stream
    n_layer: int = 2  # number of transformer blocks
    n_head: int = 4  # attention heads per block (must divide d_model)
    d_ff: int = 256  # hidden width of each block's ReLU MLP
    dtype: str = "float32"  # parameter and activation dtype: "float32", or "float64" for gradient checks

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "d_model", "n_layer", "n_head", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"GPTConfig.dtype must be 'float32' or 'float64', got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPTConfig:
        """The config of a dict written by :meth:`to_dict` (older checkpoints' ``activation: relu`` is read)."""
        d = dict(d)
        if d.pop("activation", "relu") != "relu":
            raise ValueError("GPTConfig: only the 'relu' activation exists")
        if unknown := sorted(set(d) - set(cls.__dataclass_fields__)):
            raise ValueError(f"GPTConfig: unknown fields {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class Block:
    """The parameters of one transformer block (the arrays of ``TinyGPT.params``, not copies)."""

    ln1_g: np.ndarray  # (d,)     LayerNorm gain before attention
    ln1_b: np.ndarray  # (d,)     ... and its bias
    w_qkv: np.ndarray  # (d, 3d)  fused query | key | value projection (heads side by side in each)
    b_qkv: np.ndarray  # (3d,)
    w_o: np.ndarray  # (d, d)     attention output projection
    b_o: np.ndarray  # (d,)
    ln2_g: np.ndarray  # (d,)     LayerNorm gain before the MLP
    ln2_b: np.ndarray  # (d,)
    w1: np.ndarray  # (d, f)      MLP up-projection (ReLU after it)
    b1: np.ndarray  # (f,)
    w2: np.ndarray  # (f, d)      MLP down-projection
    b2: np.ndarray  # (d,)

    # checkpoint name of each field, after the "h<layer>." prefix
    KEYS: ClassVar[dict[str, str]] = {
        "ln1_g": "ln1.g", "ln1_b": "ln1.b",
        "w_qkv": "attn.w_qkv", "b_qkv": "attn.b_qkv", "w_o": "attn.w_o", "b_o": "attn.b_o",
        "ln2_g": "ln2.g", "ln2_b": "ln2.b",
        "w1": "mlp.w1", "b1": "mlp.b1", "w2": "mlp.w2", "b2": "mlp.b2",
    }  # fmt: skip

    @classmethod
    def of(cls, params: Mapping[str, np.ndarray], layer: int) -> Block:
        """Block ``layer`` of a flat parameter dict."""
        return cls(**{name: params[f"h{layer}.{key}"] for name, key in cls.KEYS.items()})

    def named(self, layer: int) -> Iterator[tuple[str, np.ndarray]]:
        """``(checkpoint name, array)`` of every field."""
        for name, arr in vars(self).items():
            yield f"h{layer}.{self.KEYS[name]}", arr


@dataclass(frozen=True)
class Trunk:
    """The parameters below the head, by name (arrays of a flat parameter dict, not copies)."""

    wte: np.ndarray  # (V, d)     token embeddings
    wpe: np.ndarray  # (block_size, d)  position embeddings
    blocks: tuple[Block, ...]  # n_layer transformer blocks
    lnf_g: np.ndarray  # (d,)     final LayerNorm
    lnf_b: np.ndarray  # (d,)

    @classmethod
    def of(cls, params: Mapping[str, np.ndarray], n_layer: int) -> Trunk:
        """The trunk of a flat parameter dict (other entries, such as a head, are ignored)."""
        blocks = tuple(Block.of(params, i) for i in range(n_layer))
        return cls(params["wte"], params["wpe"], blocks, params["lnf.g"], params["lnf.b"])


@dataclass(frozen=True)
class Weights(Trunk):
    """Every parameter of a TinyGPT by name: the trunk and the language-model head."""

    head_w: np.ndarray  # (d, V)  language-model head (not tied to wte)
    head_b: np.ndarray  # (V,)

    @classmethod
    def of(cls, params: Mapping[str, np.ndarray], n_layer: int) -> Weights:
        """The named view of a TinyGPT's flat parameter dict."""
        return cls(**vars(Trunk.of(params, n_layer)), head_w=params["head.w"], head_b=params["head.b"])


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, in canonical order."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    block: dict[str, tuple[int, ...]] = {  # Block field -> shape
        "ln1_g": (d,), "ln1_b": (d,), "w_qkv": (d, 3 * d), "b_qkv": (3 * d,), "w_o": (d, d), "b_o": (d,),
        "ln2_g": (d,), "ln2_b": (d,), "w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,),
    }  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"wte": (v, d), "wpe": (cfg.block_size, d)}
    for i in range(cfg.n_layer):
        shapes.update({f"h{i}.{Block.KEYS[name]}": shape for name, shape in block.items()})
    shapes.update({"lnf.g": (d,), "lnf.b": (d,), "head.w": (d, v), "head.b": (v,)})
    return shapes


def checked_params(
    shapes: Mapping[str, tuple[int, ...]], params: Mapping[str, np.ndarray], dtype: Any, what: str = "params"
) -> dict[str, np.ndarray]:
    """``params`` as contiguous ``dtype`` arrays in ``shapes`` order; ValueError naming what does not match."""
    missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(f"{what} do not match config: missing {missing}, unexpected {extra}")
    out = {name: np.ascontiguousarray(params[name], dtype=dtype) for name in shapes}
    for name, shape in shapes.items():
        if out[name].shape != shape:
            raise ValueError(f"{what}: {name!r} has shape {out[name].shape}, config expects {shape}")
    return out


def init_params(cfg: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2 style init: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(cfg.dtype)
    out: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".g"):
            arr = np.ones(shape)
        elif len(shape) == 1:
            arr = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("w_o", "w2")) else 0.02
            arr = rng.normal(0.0, std, size=shape)
        out[name] = arr.astype(dt)
    return out


@dataclass
class BlockActivations:
    """What the backward pass of one block needs from its forward pass."""

    a1: np.ndarray  # (N, d)      LayerNorm-1 output, the input of the QKV projection
    xhat1: np.ndarray  # (N, d)   LayerNorm-1 normalised input
    rstd1: np.ndarray  # (N,)     LayerNorm-1 1/std
    w_qkv: np.ndarray  # (d, 3d)  QKV weight with the score scale folded into Q (see scaled_qkv)
    qkv: np.ndarray  # (N, 3d)    queries | keys | values
    probs: np.ndarray  # (B, H, T, T)  attention probabilities
    y: np.ndarray  # (N, d)       attention output, heads merged (input of the output projection)
    a2: np.ndarray  # (N, d)      LayerNorm-2 output, the input of the MLP
    xhat2: np.ndarray  # (N, d)
    rstd2: np.ndarray  # (N,)
    f: np.ndarray  # (N, f)       MLP hidden activations after the ReLU


@dataclass
class ForwardCache:
    """Activations of one :meth:`TinyGPT.forward_logprobs` pass (one chunk of rows)."""

    x: np.ndarray  # (B, T)       input ids
    targets: np.ndarray  # (N,)   next-token ids
    blocks: list[BlockActivations]
    hf: np.ndarray  # (N, d)      final LayerNorm output
    xhatf: np.ndarray  # (N, d)
    rstdf: np.ndarray  # (N,)
    probs_t: np.ndarray  # (V, N) next-token probabilities, transposed

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T) of ``x``."""
        return int(self.x.shape[0]), int(self.x.shape[1])


@dataclass
class ChunkedCache:
    """Activations of a pass split over worker threads: one :class:`ForwardCache` per chunk of rows."""

    chunks: list[tuple[slice, ForwardCache]]
    shape: tuple[int, int]  # (B, T) of the whole batch


@dataclass
class LogprobResult:
    """Output of :meth:`TinyGPT.forward_logprobs`."""

    logp: np.ndarray  # (B, T-1)
    entropy: np.ndarray  # (B, T-1)
    cache: ForwardCache | ChunkedCache | None = field(default=None, repr=False)


def split_heads(qkv: np.ndarray, B: int, T: int, H: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries, keys and values, each (B, H, T, hd), as views of ``qkv`` (N, 3d)."""
    q, k, v = qkv.reshape(B, T, 3, H, -1).transpose(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
    return q, k, v


def mlp(blk: Block, a2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block's MLP on LayerNorm output ``a2`` (N, d): ``(hidden f (N, f), output (N, d))``."""
    f = a2 @ blk.w1
    f += blk.b1
    np.maximum(f, 0.0, out=f)  # ReLU
    out = f @ blk.w2
    out += blk.b2
    return f, out


def scaled_qkv(blk: Block, n_head: int) -> tuple[np.ndarray, np.ndarray]:
    """The block's fused QKV weight (d, 3d) and bias (3d,) with the 1/sqrt(hd) score scale folded into Q."""
    d = blk.w_o.shape[0]
    scale = 1.0 / math.sqrt(d // n_head)
    w, b = blk.w_qkv.copy(), blk.b_qkv.copy()
    w[:, :d] *= scale
    b[:d] *= scale
    return w, b


def trunk_forward(
    W: Trunk,
    n_head: int,
    x: np.ndarray,
    *,
    acts: list[BlockActivations] | None = None,
    pos: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    kv_out: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embeddings + blocks + final LayerNorm of ids ``x`` (B, T): ``(hf, xhatf, rstdf)``, hf (N, d). The
    KV-cache prefill passes positions ``pos`` (B, T), an additive ``mask`` and ``kv_out`` (each layer's keys and
    values); ``acts`` collects what :func:`trunk_backward` needs."""
    B, T = x.shape
    h = W.wte[x.reshape(-1)]  # (N, d) residual stream
    if pos is None:
        h_btd = h.reshape(B, T, -1)  # (B, T, d) view of h
        h_btd += W.wpe[:T]  # same positions 0..T-1 for every row
    else:
        h += W.wpe[pos.reshape(-1)]
    if mask is None:
        mask = np.triu(np.full((T, T), NEG, h.dtype), 1)  # (T, T) causal
    for blk in W.blocks:
        a1, xhat1, rstd1 = ln_fwd(h, blk.ln1_g, blk.ln1_b)
        wq, bq = scaled_qkv(blk, n_head)
        qkv = a1 @ wq  # (N, 3d)
        qkv += bq
        q, k, v = split_heads(qkv, B, T, n_head)  # each (B, H, T, hd)
        if kv_out is not None:
            kv_out.append((k, v))
        probs = attention_probs(q, k, mask)  # (B, H, T, T)
        y = (probs @ v).transpose(0, 2, 1, 3).reshape(B * T, -1)  # (B, T, H, hd) -> (N, d), a copy
        o = y @ blk.w_o
        o += blk.b_o
        h += o
        a2, xhat2, rstd2 = ln_fwd(h, blk.ln2_g, blk.ln2_b)
        f, m = mlp(blk, a2)
        h += m
        if acts is not None:
            acts.append(BlockActivations(a1, xhat1, rstd1, wq, qkv, probs, y, a2, xhat2, rstd2, f))
    return ln_fwd(h, W.lnf_g, W.lnf_b)


def trunk_backward(
    W: Trunk,
    n_head: int,
    x: np.ndarray,
    acts: list[BlockActivations],
    dhf: np.ndarray,
    xhatf: np.ndarray,
    rstdf: np.ndarray,
) -> dict[str, np.ndarray]:
    """Gradients of the trunk parameters (checkpoint names) from ``dhf`` = d loss / d hf (N, d); ``x`` (B, T),
    ``acts``, ``xhatf`` and ``rstdf`` are what :func:`trunk_forward` returned or collected."""
    B, T = x.shape
    H, d = n_head, W.wte.shape[1]
    N, scale = B * T, 1.0 / math.sqrt(d // n_head)
    grads: dict[str, np.ndarray] = {}
    dh, grads["lnf.g"], grads["lnf.b"] = ln_bwd(dhf, xhatf, rstdf, W.lnf_g)  # dh: (N, d) d loss / d residual
    for i in reversed(range(len(W.blocks))):
        blk, act = W.blocks[i], acts[i]
        dw2 = act.f.T @ dh
        db2 = dh.sum(0)
        df = dh @ blk.w2.T  # (N, f)
        np.multiply(df, act.f > 0, out=df)  # through the ReLU
        dw1 = act.a2.T @ df
        db1 = df.sum(0)
        da2, dln2_g, dln2_b = ln_bwd(df @ blk.w1.T, act.xhat2, act.rstd2, blk.ln2_g)
        dh += da2
        # attention: gradients w.r.t. the scaled QKV first, mapped back to the raw weights at the end
        dw_o = act.y.T @ dh
        db_o = dh.sum(0)
        dy = (dh @ blk.w_o.T).reshape(B, T, H, d // H).transpose(0, 2, 1, 3)  # (B, H, T, hd)
        q, k, v = split_heads(act.qkv, B, T, H)
        dqkv = np.empty((N, 3 * d), dh.dtype)
        dq, dk, dv = split_heads(dqkv, B, T, H)  # views: writing them fills dqkv
        np.matmul(act.probs.transpose(0, 1, 3, 2), dy, out=dv)
        ds = dy @ v.transpose(0, 1, 3, 2)  # (B, H, T, T) d loss / d probs
        ds -= np.vecdot(ds, act.probs)[..., None]  # through the softmax
        ds *= act.probs
        np.matmul(ds, k, out=dq)
        np.matmul(ds.transpose(0, 1, 3, 2), q, out=dk)
        dw_qkv = act.a1.T @ dqkv
        dw_qkv[:, :d] *= scale
        db_qkv = dqkv.sum(0)
        db_qkv[:d] *= scale
        da1, dln1_g, dln1_b = ln_bwd(dqkv @ act.w_qkv.T, act.xhat1, act.rstd1, blk.ln1_g)
        dh += da1
        named = Block(dln1_g, dln1_b, dw_qkv, db_qkv, dw_o, db_o, dln2_g, dln2_b, dw1, db1, dw2, db2)
        grads.update(named.named(i))
    grads["wpe"] = dwpe = np.zeros_like(W.wpe)
    dwpe[:T] = dh.reshape(B, T, d).sum(0)
    grads["wte"] = embedding_grad(x.reshape(-1), dh, W.wte.shape[0])
    return grads


class TinyGPT:
    """Small trainable GPT (see module docstring)."""

    def __init__(
        self,
        config: GPTConfig,
        params: dict[str, np.ndarray] | None = None,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
    ) -> None:
        tune_malloc()
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.default()
        if self.tokenizer.vocab_size != config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but config.vocab_size={config.vocab_size}"
            )
        self.dtype = np.dtype(config.dtype)
        params = init_params(config, seed) if params is None else params
        self.params = checked_params(param_shapes(config), params, self.dtype)
        self.meta: dict[str, Any] = {}
        self.optimizer_state: dict[str, np.ndarray] | None = None

    def copy(self) -> TinyGPT:
        """An independent copy (parameters copied; config and tokenizer shared, both immutable)."""
        twin = TinyGPT(self.config, {k: v.copy() for k, v in self.params.items()}, self.tokenizer)
        twin.meta = dict(self.meta)
        return twin

    @property
    def n_params(self) -> int:
        return int(sum(p.size for p in self.params.values()))

    @property
    def weights(self) -> Weights:
        """The parameters by name (views of ``params``, built on each access so they always match it)."""
        return Weights.of(self.params, self.config.n_layer)

    def _check_ids(self, ids: Any, *, max_len: int) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 2 or arr.shape[0] == 0:
            raise ValueError(f"ids must be a non-empty 2-D int array (B, T), got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
        if arr.shape[1] > max_len:
            raise ValueError(f"sequence length {arr.shape[1]} exceeds the model limit {max_len}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}), got {arr.min()}..{arr.max()}"
            )
        return arr.astype(np.intp, copy=False)

    def forward_logits(self, ids: Any) -> np.ndarray:
        """Full-forward logits (B, T, V) for every position (T <= block_size)."""
        x = self._check_ids(ids, max_len=self.config.block_size)

        def run() -> np.ndarray:
            hf = trunk_forward(self.weights, self.config.n_head, x)[0]  # (N, d)
            return self.head(hf).reshape(x.shape[0], x.shape[1], -1)  # (B, T, V)

        return run_pinned(run)

    def head(self, hf: np.ndarray) -> np.ndarray:
        """Logits (N, V) of final-LayerNorm rows ``hf`` (N, d)."""
        W = self.weights
        logits: np.ndarray = hf @ W.head_w
        logits += W.head_b
        return logits

    def forward_logprobs(self, ids: Any, *, need_cache: bool = True) -> LogprobResult:
        """Logprob of each next token and entropy of each predicting distribution, both (B, T-1), of ``ids``
        (B, T) with ``2 <= T <= block_size + 1``."""
        arr = self._check_ids(ids, max_len=self.config.block_size + 1)
        if arr.shape[1] < 2:
            raise ValueError("forward_logprobs needs at least 2 tokens per row")
        B, T = arr.shape[0], arr.shape[1] - 1
        slices = chunk_slices(B, T)
        parts = parallel_map(lambda sl: self._forward_chunk(arr[sl], need_cache), slices)
        if len(parts) == 1:
            return parts[0]
        chunks = [(sl, r.cache) for sl, r in zip(slices, parts)]
        cache = ChunkedCache(chunks, (B, T)) if need_cache else None  # type: ignore[arg-type]
        return LogprobResult(
            np.concatenate([r.logp for r in parts]), np.concatenate([r.entropy for r in parts]), cache
        )

    def _forward_chunk(self, arr: np.ndarray, need_cache: bool) -> LogprobResult:
        x, targets = arr[:, :-1], arr[:, 1:].reshape(-1)  # (B, T) inputs, (N,) next tokens
        B, T = x.shape
        acts: list[BlockActivations] | None = [] if need_cache else None
        W = self.weights
        hf, xhatf, rstdf = trunk_forward(W, self.config.n_head, x, acts=acts)
        logp, ent, probs_t = next_token_logprobs(hf, W.head_w, W.head_b, targets)  # each (N,); probs_t (V, N)
        cache = ForwardCache(x, targets, acts, hf, xhatf, rstdf, probs_t) if acts is not None else None
        return LogprobResult(logp.reshape(B, T), ent.reshape(B, T), cache)

    def logprobs_of(self, ids: Any) -> np.ndarray:
        """``forward_logprobs(ids).logp`` without keeping activations."""
        return self.forward_logprobs(ids, need_cache=False).logp

    def backward_logprobs(
        self, cache: ForwardCache | ChunkedCache | None, dlogp: Any
    ) -> dict[str, np.ndarray]:
        """Gradients of ``sum(dlogp * logp)`` w.r.t. every parameter, from a ``forward_logprobs`` cache."""
        if not isinstance(cache, (ForwardCache, ChunkedCache)):
            raise ValueError("backward_logprobs needs the cache of forward_logprobs(..., need_cache=True)")
        dl = np.asarray(dlogp, dtype=self.dtype)
        if dl.shape != tuple(cache.shape):
            raise ValueError(f"dlogp has shape {dl.shape}, expected {tuple(cache.shape)}")
        if isinstance(cache, ForwardCache):
            return self._backward_chunk(cache, dl)
        parts = parallel_map(lambda c: self._backward_chunk(c[1], dl[c[0]]), cache.chunks)
        grads = parts[0]
        for other in parts[1:]:  # a fixed order: deterministic for a given chunking
            for name, g in grads.items():
                g += other[name]
        return grads

    def _backward_chunk(self, cache: ForwardCache, dl: np.ndarray) -> dict[str, np.ndarray]:
        W = self.weights
        N = dl.size
        dl = dl.reshape(N)
        # head: d logp[n] / d z[v, n] = 1{v = target} - p[v, n]
        dzt = cache.probs_t * -dl  # (V, N)
        dzt[cache.targets, np.arange(N)] += dl
        grads = trunk_backward(
            W, self.config.n_head, cache.x, cache.blocks, dzt.T @ W.head_w.T, cache.xhatf, cache.rstdf
        )
        grads["head.w"] = cache.hf.T @ dzt.T  # (d, V)
        grads["head.b"] = dzt.sum(1)
        return {name: grads[name] for name in self.params}

    def save(
        self, path: str | os.PathLike[str], *, optimizer: Any = None, meta: dict[str, Any] | None = None
    ) -> None:
        """Write an ``.npz`` checkpoint atomically (params, config, vocab, format version, optimiser)."""
        optim = optimizer.state_dict() if optimizer is not None else {}
        extra = {"optim/" + key: np.asarray(val) for key, val in optim.items()}
        meta = meta if meta is not None else self.meta
        write_npz(path, CHECKPOINT_TAG, self.config, self.tokenizer, meta, self.params, extra)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TinyGPT:
        """Load a checkpoint written by :meth:`save` (optimiser state, if any: ``model.optimizer_state``)."""
        config, tokenizer, meta, params, extra = read_npz(path, CHECKPOINT_TAG, what="TinyGPT checkpoint")
        try:
            model = cls(config, params=params, tokenizer=tokenizer)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        model.meta = meta
        model.optimizer_state = {k[6:]: v for k, v in extra.items() if k.startswith("optim/")} or None
        return model


def write_npz(
    path: str | os.PathLike[str],
    tag: tuple[str, Any],
    config: GPTConfig,
    tokenizer: Tokenizer,
    meta: Mapping[str, Any],
    params: Mapping[str, np.ndarray],
    extra: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write a model file atomically: format ``tag`` (key, value), config, vocabulary and metadata as JSON
    strings, ``param/<name>`` and ``extra`` arrays. No pickle."""
    arrays: dict[str, np.ndarray] = {
        tag[0]: np.array(tag[1]),
        "config_json": np.array(json.dumps(config.to_dict(), sort_keys=True)),
        "vocab_json": np.array(json.dumps(tokenizer.vocab)),
        "meta_json": np.array(json.dumps(dict(meta), sort_keys=True)),
    }
    arrays.update({"param/" + name: arr for name, arr in params.items()})
    arrays.update(extra or {})
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)  # type: ignore[arg-type]
    atomic_write_bytes(Path(path), buf.getvalue())


def read_npz(
    path: str | os.PathLike[str], tag: tuple[str, Any], *, what: str = "model file"
) -> tuple[GPTConfig, Tokenizer, dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(config, tokenizer, meta, params, extra)`` of a file written by :func:`write_npz` with the format
    ``tag`` (``params``: the ``param/`` arrays, prefix dropped; ``extra``: the others); ValueError naming the file."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable {what} ({exc})") from exc
    key, want = tag
    if key not in arrays:
        raise ValueError(f"{path}: not a {what} (no {key})")
    if (found := arrays.pop(key).item()) != want:
        raise ValueError(
            f"{path}: {what} {key.replace('_', ' ')} {found!r} is not supported (this build reads {want!r})"
        )
    try:
        config = GPTConfig.from_dict(json.loads(str(arrays.pop("config_json"))))
        tokenizer = Tokenizer(json.loads(str(arrays.pop("vocab_json"))))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable {what} ({exc})") from exc
    meta = json.loads(str(arrays.pop("meta_json"))) if "meta_json" in arrays else {}
    params = {k[6:]: v for k, v in arrays.items() if k.startswith("param/")}
    extra = {k: v for k, v in arrays.items() if not k.startswith("param/")}
    return config, tokenizer, meta, params, extra
