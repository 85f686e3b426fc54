"""TinyGPT: a small pre-LN GPT in numpy with a hand-written backward pass.

Architecture: token + learned position embeddings, ``n_layer`` blocks of (LayerNorm -> causal multi-head
attention with fused QKV -> residual, LayerNorm -> ReLU MLP -> residual), final LayerNorm, untied linear head.
Parameters live in ``model.params`` (``dict[str, np.ndarray]``, float32 by default; float64 for gradient
checks). Every GEMM is 2-D except the per-head attention products (stacked ``matmul``).

Training API (used by the trainer): :meth:`TinyGPT.forward_logprobs` returns ``logp[b, t] =
log p(ids[b, t+1] | ids[b, :t+1])`` and the entropy of the predicting distribution;
:meth:`backward_logprobs` returns the gradients of ``sum(dlogp * logp)``. Batches of different lengths are
right-padded (causal attention makes the padding harmless; callers mask its logprobs). Checkpoints are
``.npz`` files (no pickle) holding the params, the config, the tokenizer vocabulary, a format version and
optionally the optimiser state.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.models._kernels import NEG, attention_probs, embedding_grad, ln_bwd, ln_fwd
from palaestra.models._runtime import chunk_slices, parallel_map, run_pinned, tune_malloc
from palaestra.models.tokenizer import Tokenizer
from palaestra.trajectories.io import atomic_write_bytes

FORMAT_VERSION = 1


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a TinyGPT."""

    vocab_size: int
    block_size: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_ff: int = 256
    activation: str = "relu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "d_model", "n_layer", "n_head", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.activation != "relu":
            raise ValueError(f"GPTConfig.activation {self.activation!r} is not supported (only 'relu')")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"GPTConfig.dtype must be 'float32' or 'float64', got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"GPTConfig: unknown fields {unknown}")
        return cls(**d)


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, in canonical order."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"wte": (v, d), "wpe": (cfg.block_size, d)}
    for i in range(cfg.n_layer):
        p = f"h{i}."
        shapes.update(
            {
                p + "ln1.g": (d,),
                p + "ln1.b": (d,),
                p + "attn.w_qkv": (d, 3 * d),
                p + "attn.b_qkv": (3 * d,),
                p + "attn.w_o": (d, d),
                p + "attn.b_o": (d,),
                p + "ln2.g": (d,),
                p + "ln2.b": (d,),
                p + "mlp.w1": (d, f),
                p + "mlp.b1": (f,),
                p + "mlp.w2": (f, d),
                p + "mlp.b2": (d,),
            }
        )
    shapes.update({"lnf.g": (d,), "lnf.b": (d,), "head.w": (d, v), "head.b": (v,)})
    return shapes


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
class LogprobResult:
    """Output of :meth:`TinyGPT.forward_logprobs`."""

    logp: np.ndarray  # (B, T-1)
    entropy: np.ndarray  # (B, T-1)
    cache: dict[str, Any] | None = field(default=None, repr=False)


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
        shapes = param_shapes(config)
        if params is None:
            params = init_params(config, seed)
        missing = sorted(set(shapes) - set(params))
        extra = sorted(set(params) - set(shapes))
        if missing or extra:
            raise ValueError(f"params do not match config: missing {missing}, unexpected {extra}")
        self.params: dict[str, np.ndarray] = {}  # given arrays are used as they are when already contiguous
        for name, shape in shapes.items():
            arr = np.ascontiguousarray(params[name], dtype=self.dtype)
            if arr.shape != shape:
                raise ValueError(f"param {name!r} has shape {arr.shape}, config expects {shape}")
            self.params[name] = arr
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

    # ------------------------------------------------------------------ validation
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

    # ------------------------------------------------------------------ forward
    def scaled_qkv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Fused QKV weight and bias of ``layer`` with the 1/sqrt(head_dim) score scale folded into Q."""
        d = self.config.d_model
        scale = 1.0 / math.sqrt(d // self.config.n_head)
        w = self.params[f"h{layer}.attn.w_qkv"].copy()
        b = self.params[f"h{layer}.attn.b_qkv"].copy()
        w[:, :d] *= scale
        b[:d] *= scale
        return w, b

    def _trunk(
        self,
        x: np.ndarray,
        cache: dict[str, Any] | None,
        *,
        pos: np.ndarray | None = None,
        mask: np.ndarray | None = None,
        kv_out: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> np.ndarray:
        """Embeddings + blocks + final LN for ids (B, T); returns (B*T, d).

        Defaults: positions 0..T-1 and a causal mask (right padding). The KV-cache prefill passes per-row
        ``pos`` (B, T), an additive ``mask`` broadcastable to (B, H, T, T) and ``kv_out`` to collect each
        layer's keys and values as (B, H, T, hd) views.
        """
        cfg, P = self.config, self.params
        B, T = x.shape
        N, d, H = B * T, cfg.d_model, cfg.n_head
        hd = d // H
        ones = np.ones(d, self.dtype)
        ones_t = np.ones(T, self.dtype)
        h = P["wte"][x.reshape(-1)]
        if pos is None:
            h3 = h.reshape(B, T, d)
            h3 += P["wpe"][:T]
        else:
            h += P["wpe"][pos.reshape(-1)]
        if mask is None:
            mask = np.triu(np.full((T, T), NEG, self.dtype), 1)
        layers = []
        for i in range(cfg.n_layer):
            p = f"h{i}."
            a, xh1, rs1 = ln_fwd(h, P[p + "ln1.g"], P[p + "ln1.b"], ones)
            wq, bq = self.scaled_qkv(i)
            qkv = a @ wq
            qkv += bq
            q, k, v = qkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)
            if kv_out is not None:
                kv_out.append((k, v))
            s = attention_probs(q, k, mask, ones_t)
            y = np.empty((N, d), self.dtype)
            np.matmul(s, v, out=y.reshape(B, T, H, hd).transpose(0, 2, 1, 3))
            o = y @ P[p + "attn.w_o"]
            o += P[p + "attn.b_o"]
            h += o
            a2, xh2, rs2 = ln_fwd(h, P[p + "ln2.g"], P[p + "ln2.b"], ones)
            f = a2 @ P[p + "mlp.w1"]
            f += P[p + "mlp.b1"]
            np.maximum(f, 0.0, out=f)
            m = f @ P[p + "mlp.w2"]
            m += P[p + "mlp.b2"]
            h += m
            if cache is not None:
                layers.append((a, xh1, rs1, wq, qkv, s, y, a2, xh2, rs2, f))
        hf, xhf, rsf = ln_fwd(h, P["lnf.g"], P["lnf.b"], ones)
        if cache is not None:
            cache.update(layers=layers, hf=hf, xhf=xhf, rsf=rsf, shape=(B, T))
        return hf

    def forward_logits(self, ids: Any) -> np.ndarray:
        """Full-forward logits (B, T, V) for every position (T <= block_size)."""
        x = self._check_ids(ids, max_len=self.config.block_size)

        def run() -> np.ndarray:
            logits: np.ndarray = self._trunk(x, None) @ self.params["head.w"]
            logits += self.params["head.b"]
            return logits.reshape(x.shape[0], x.shape[1], -1)

        return run_pinned(run)

    def forward_logprobs(self, ids: Any, *, need_cache: bool = True) -> LogprobResult:
        """Logprob of each next token and entropy of each predicting distribution, both (B, T-1).

        ``ids`` is (B, T) with ``2 <= T <= block_size + 1``; the last column is only a target. Large batches
        are split by rows over the worker threads (see ``palaestra.models._runtime``).
        """
        arr = self._check_ids(ids, max_len=self.config.block_size + 1)
        if arr.shape[1] < 2:
            raise ValueError("forward_logprobs needs at least 2 tokens per row")
        B, T = arr.shape[0], arr.shape[1] - 1
        slices = chunk_slices(B, T)
        parts = parallel_map(lambda sl: self._forward_chunk(arr[sl], need_cache), slices)
        if len(parts) == 1:
            return parts[0]
        cache = (
            {"chunks": [(sl, r.cache) for sl, r in zip(slices, parts)], "shape": (B, T)}
            if need_cache
            else None
        )
        return LogprobResult(
            np.concatenate([r.logp for r in parts]), np.concatenate([r.entropy for r in parts]), cache
        )

    def _forward_chunk(self, arr: np.ndarray, need_cache: bool) -> LogprobResult:
        x, tgt = arr[:, :-1], arr[:, 1:].reshape(-1)
        B, T = x.shape
        cache: dict[str, Any] | None = {} if need_cache else None
        hf = self._trunk(x, cache)
        # logits are kept transposed (V, N): reductions over the vocabulary then run across rows (fast)
        zt = self.params["head.w"].T @ hf.T
        zt += self.params["head.b"][:, None]
        zt -= zt.max(0)
        e = np.exp(zt)
        ones_v = np.ones(zt.shape[0], self.dtype)
        se = ones_v @ e
        lse = np.log(se)
        logp = zt[tgt, np.arange(B * T)] - lse
        e *= 1.0 / se  # probabilities
        ent = lse - ones_v @ (e * zt)
        if cache is not None:
            cache.update(probs_t=e, x=x, tgt=tgt)
        return LogprobResult(logp.reshape(B, T), ent.reshape(B, T), cache)

    def logprobs_of(self, ids: Any) -> np.ndarray:
        """``forward_logprobs(ids).logp`` without keeping activations."""
        return self.forward_logprobs(ids, need_cache=False).logp

    # ------------------------------------------------------------------ backward
    def backward_logprobs(self, cache: dict[str, Any] | None, dlogp: Any) -> dict[str, np.ndarray]:
        """Gradients of ``sum(dlogp * logp)`` w.r.t. every parameter, from a ``forward_logprobs`` cache."""
        if not cache or ("probs_t" not in cache and "chunks" not in cache):
            raise ValueError("backward_logprobs needs the cache of forward_logprobs(..., need_cache=True)")
        dl = np.asarray(dlogp, dtype=self.dtype)
        if dl.shape != tuple(cache["shape"]):
            raise ValueError(f"dlogp has shape {dl.shape}, expected {tuple(cache['shape'])}")
        if "chunks" not in cache:
            return self._backward_chunk(cache, dl)
        parts = parallel_map(lambda c: self._backward_chunk(c[1], dl[c[0]]), cache["chunks"])
        grads = parts[0]
        for other in parts[1:]:
            for name, g in grads.items():
                g += other[name]
        return grads

    def _backward_chunk(self, cache: dict[str, Any], dl: np.ndarray) -> dict[str, np.ndarray]:
        cfg, P = self.config, self.params
        B, T = cache["shape"]
        N, d, H = B * T, cfg.d_model, cfg.n_head
        hd = d // H
        scale = 1.0 / math.sqrt(hd)
        ones = np.ones(d, self.dtype)
        ones_n = np.ones(N, self.dtype)
        grads: dict[str, np.ndarray] = {}
        dl = dl.reshape(N)
        dzt = cache["probs_t"] * -dl
        dzt[cache["tgt"], np.arange(N)] += dl
        grads["head.w"] = cache["hf"].T @ dzt.T
        grads["head.b"] = dzt @ ones_n
        dh, grads["lnf.g"], grads["lnf.b"] = ln_bwd(
            dzt.T @ P["head.w"].T, cache["xhf"], cache["rsf"], P["lnf.g"], ones_n, ones
        )
        for i in reversed(range(cfg.n_layer)):
            p = f"h{i}."
            a, xh1, rs1, wq, qkv, s, y, a2, xh2, rs2, f = cache["layers"][i]
            # MLP
            grads[p + "mlp.w2"] = f.T @ dh
            grads[p + "mlp.b2"] = ones_n @ dh
            df = dh @ P[p + "mlp.w2"].T
            np.multiply(df, f > 0, out=df)
            grads[p + "mlp.w1"] = a2.T @ df
            grads[p + "mlp.b1"] = ones_n @ df
            da2, grads[p + "ln2.g"], grads[p + "ln2.b"] = ln_bwd(
                df @ P[p + "mlp.w1"].T, xh2, rs2, P[p + "ln2.g"], ones_n, ones
            )
            dh += da2
            # attention (gradients w.r.t. the scaled QKV, then mapped back to the raw weights)
            grads[p + "attn.w_o"] = y.T @ dh
            grads[p + "attn.b_o"] = ones_n @ dh
            dy = (dh @ P[p + "attn.w_o"].T).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
            q, k, v = qkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)
            dqkv = np.empty((N, 3 * d), self.dtype)
            dq, dk, dv = dqkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)
            np.matmul(s.transpose(0, 1, 3, 2), dy, out=dv)
            ds = dy @ v.transpose(0, 1, 3, 2)
            ds -= np.vecdot(ds, s)[..., None]
            ds *= s
            np.matmul(ds, k, out=dq)
            np.matmul(ds.transpose(0, 1, 3, 2), q, out=dk)
            gw = a.T @ dqkv
            gw[:, :d] *= scale
            gb = ones_n @ dqkv
            gb[:d] *= scale
            grads[p + "attn.w_qkv"], grads[p + "attn.b_qkv"] = gw, gb
            da, grads[p + "ln1.g"], grads[p + "ln1.b"] = ln_bwd(
                dqkv @ wq.T, xh1, rs1, P[p + "ln1.g"], ones_n, ones
            )
            dh += da
        dwpe = np.zeros_like(P["wpe"])
        dwpe[:T] = dh.reshape(B, T, d).sum(0)
        grads["wpe"] = dwpe
        grads["wte"] = embedding_grad(cache["x"].reshape(-1), dh, cfg.vocab_size)
        return {name: grads[name] for name in P}

    # ------------------------------------------------------------------ persistence
    def save(
        self, path: str | os.PathLike[str], *, optimizer: Any = None, meta: dict[str, Any] | None = None
    ) -> None:
        """Write an ``.npz`` checkpoint atomically (params, config, vocab, format version, optimiser)."""
        arrays: dict[str, np.ndarray] = {
            "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
            "config_json": np.array(json.dumps(self.config.to_dict(), sort_keys=True)),
            "vocab_json": np.array(json.dumps(self.tokenizer.vocab)),
            "meta_json": np.array(json.dumps(meta if meta is not None else self.meta, sort_keys=True)),
        }
        for name, arr in self.params.items():
            arrays["param/" + name] = arr
        if optimizer is not None:
            for key, val in optimizer.state_dict().items():
                arrays["optim/" + key] = np.asarray(val)
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=False, **arrays)  # type: ignore[arg-type]
        atomic_write_bytes(Path(path), buf.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TinyGPT:
        """Load a checkpoint written by :meth:`save` (optimiser state, if any: ``model.optimizer_state``)."""
        path = Path(path)
        try:
            npz = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable TinyGPT checkpoint ({exc})") from exc
        with npz:
            files = set(npz.files)
            if "format_version" not in files:
                raise ValueError(f"{path}: not a TinyGPT checkpoint (no format_version)")
            version = int(npz["format_version"])
            if version != FORMAT_VERSION:
                raise ValueError(
                    f"{path}: checkpoint format version {version} is not supported "
                    f"(this build reads version {FORMAT_VERSION})"
                )
            config = GPTConfig.from_dict(json.loads(str(npz["config_json"])))
            tokenizer = Tokenizer(json.loads(str(npz["vocab_json"])))
            params = {f[6:]: npz[f] for f in files if f.startswith("param/")}
            optim = {f[6:]: npz[f] for f in files if f.startswith("optim/")}
            meta = json.loads(str(npz["meta_json"])) if "meta_json" in files else {}
        try:
            model = cls(config, params=params, tokenizer=tokenizer)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        model.meta = meta
        model.optimizer_state = optim or None
        return model
