"""Numeric kernels of TinyGPT, each a fast function beside a plain numpy ``*_reference`` twin (the textbook
formula written the obvious way) that ``tests/test_kernels.py`` checks it equals. The model and the KV-cache
decoder call the fast versions; their speed tricks stay in this file: row sums as a GEMV with a ones vector
(much faster than ``x.sum(-1)`` over a short last axis), the attention softmax shifted by the max of each
(batch, head) block instead of each row (with the exact per-row shift as a fallback when a row underflows),
the vocabulary softmax on transposed logits (V, N) so that its reductions run across rows, and the embedding
gradient as sort + ``reduceat`` instead of ``np.add.at``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

LN_EPS = 1e-5  # LayerNorm variance epsilon
NEG = -1e9  # additive attention mask: finite, so a fully masked row stays finite
Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


@lru_cache(maxsize=64)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    """A read-only ones vector (for GEMV row sums), cached per length and dtype."""
    ones = np.ones(n, dtype)
    ones.setflags(write=False)
    return ones


def ln_fwd(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> Triple:
    """LayerNorm of the rows of ``x`` (N, d): ``(out, xhat, rstd)`` with ``out = xhat * g + b``; ``xhat``
    (N, d) and ``rstd`` (N,) = 1 / std are what :func:`ln_bwd` needs."""
    inv_d = 1.0 / x.shape[1]
    xc = x - (x @ _ones(x.shape[1], x.dtype))[:, None] * inv_d  # (N, d) centred rows
    rstd = 1.0 / np.sqrt(np.vecdot(xc, xc) * inv_d + LN_EPS)  # (N,)
    xc *= rstd[:, None]  # now xhat
    out = xc * g
    out += b
    return out, xc, rstd


def ln_fwd_reference(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> Triple:
    """:func:`ln_fwd` written plainly."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    xhat = (x - mean) / np.sqrt(var + LN_EPS)
    return xhat * g + b, xhat, 1.0 / np.sqrt(var[:, 0] + LN_EPS)


def ln_bwd(dout: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, g: np.ndarray) -> Triple:
    """LayerNorm backward: ``(dx, dg, db)`` from ``dout`` (N, d) and the forward's ``xhat, rstd``."""
    ones_n, ones = _ones(dout.shape[0], dout.dtype), _ones(dout.shape[1], dout.dtype)
    dg = ones_n @ (dout * xhat)  # (d,)
    db = ones_n @ dout  # (d,)
    dxh = dout * g  # (N, d) gradient w.r.t. xhat
    inv_d = 1.0 / xhat.shape[1]
    m1 = (dxh @ ones) * inv_d  # (N,) row means of dxhat
    m2 = np.vecdot(dxh, xhat) * inv_d  # (N,) row means of dxhat * xhat
    dxh -= m1[:, None]
    dxh -= xhat * m2[:, None]
    dxh *= rstd[:, None]
    return dxh, dg, db


def ln_bwd_reference(dout: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, g: np.ndarray) -> Triple:
    """:func:`ln_bwd` written plainly."""
    dxhat = dout * g
    dx = rstd[:, None] * (
        dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    )
    return dx, (dout * xhat).sum(0), dout.sum(0)


def attention_probs(q: np.ndarray, k: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over keys of ``q @ k^T + mask``: (B, H, Tq, hd) x (B, H, Tk, hd) -> (B, H, Tq, Tk). ``q``
    carries the 1/sqrt(hd) score scale already; ``mask`` is additive (0 or :data:`NEG`), broadcastable."""
    s: np.ndarray = q @ k.transpose(0, 1, 3, 2)  # (B, H, Tq, Tk) scores
    B, H, Tq, Tk = s.shape
    ones_k = _ones(Tk, s.dtype)
    blocks = s.reshape(B * H, Tq * Tk)  # a view: one row per (batch, head)
    blocks -= blocks.max(1)[:, None]
    s += mask
    np.exp(s, out=s)
    rows = s.reshape(-1, Tk)  # (B*H*Tq, Tk) view
    sums = rows @ ones_k
    if not sums.min() > 1e-30:  # a row underflowed under the block shift: redo with the exact row shift
        s = q @ k.transpose(0, 1, 3, 2)
        s += mask
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        rows = s.reshape(-1, Tk)
        sums = rows @ ones_k
    rows *= (1.0 / sums)[:, None]
    return s


def attention_probs_reference(q: np.ndarray, k: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """:func:`attention_probs` written plainly."""
    s = q @ k.swapaxes(-1, -2) + mask
    e = np.exp(s - s.max(-1, keepdims=True))
    out: np.ndarray = e / e.sum(-1, keepdims=True)
    return out


def next_token_logprobs(hf: np.ndarray, w: np.ndarray, b: np.ndarray, targets: np.ndarray) -> Triple:
    """Log-probability of ``targets`` (N,) and entropy under ``softmax(hf @ w + b)``, ``hf`` (N, d), ``w``
    (d, V), ``b`` (V,): ``(logp (N,), entropy (N,), probs_t (V, N))``, the probabilities transposed."""
    zt = w.T @ hf.T  # (V, N) logits, transposed
    zt += b[:, None]
    zt -= zt.max(0)
    e = np.exp(zt)
    ones_v = _ones(zt.shape[0], zt.dtype)
    se = ones_v @ e  # (N,) partition functions (after the shift)
    lse = np.log(se)
    logp = zt[targets, np.arange(zt.shape[1])] - lse
    e *= 1.0 / se  # probabilities
    ent = lse - ones_v @ (e * zt)
    return logp, ent, e


def next_token_logprobs_reference(
    hf: np.ndarray, w: np.ndarray, b: np.ndarray, targets: np.ndarray
) -> Triple:
    """:func:`next_token_logprobs` written plainly."""
    z = hf @ w + b  # (N, V)
    logz = z - z.max(-1, keepdims=True)
    logz -= np.log(np.exp(logz).sum(-1, keepdims=True))
    p = np.exp(logz)
    return logz[np.arange(len(z)), targets], -(p * logz).sum(-1), p.T


def embedding_grad(idx: np.ndarray, dh: np.ndarray, vocab: int) -> np.ndarray:
    """Scatter-add the rows of ``dh`` (N, d) into a (vocab, d) table at ``idx`` (N,)."""
    order = np.argsort(idx, kind="stable")
    srt = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], srt[1:] != srt[:-1])))  # first row of each id
    out = np.zeros((vocab, dh.shape[1]), dh.dtype)
    out[srt[starts]] = np.add.reduceat(dh[order], starts, axis=0)
    return out


def embedding_grad_reference(idx: np.ndarray, dh: np.ndarray, vocab: int) -> np.ndarray:
    """:func:`embedding_grad` written plainly."""
    out = np.zeros((vocab, dh.shape[1]), dh.dtype)
    np.add.at(out, idx, dh)
    return out
