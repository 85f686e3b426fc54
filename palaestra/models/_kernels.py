"""Numeric kernels of TinyGPT shared by training and KV-cache decoding (LayerNorm, attention softmax, ...).

Row reductions are written as GEMV products with a ones vector (much faster than numpy's reductions over a
short last axis).
"""

from __future__ import annotations

import numpy as np

LN_EPS = 1e-5
NEG = -1e9  # additive attention mask: finite, so a fully masked row stays finite


def ln_fwd(x: np.ndarray, g: np.ndarray, b: np.ndarray, ones: np.ndarray) -> tuple[np.ndarray, ...]:
    """LayerNorm of the rows of ``x`` (N, d); returns ``(out, xhat, rstd)`` (``ones``: d ones)."""
    inv_d = 1.0 / x.shape[1]
    xc = x - (x @ ones)[:, None] * inv_d
    rstd = 1.0 / np.sqrt(np.vecdot(xc, xc) * inv_d + LN_EPS)
    xc *= rstd[:, None]  # xhat
    out = xc * g
    out += b
    return out, xc, rstd


def ln_bwd(
    dout: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, g: np.ndarray, ones_n: np.ndarray, ones: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm backward: ``(dx, dg, db)`` from ``dout`` and the forward's ``xhat, rstd``."""
    dg = ones_n @ (dout * xhat)
    db = ones_n @ dout
    dxh = dout * g
    inv_d = 1.0 / xhat.shape[1]
    m1 = (dxh @ ones) * inv_d
    m2 = np.vecdot(dxh, xhat) * inv_d
    dxh -= m1[:, None]
    dxh -= xhat * m2[:, None]
    dxh *= rstd[:, None]
    return dxh, dg, db


def attention_probs(q: np.ndarray, k: np.ndarray, mask: np.ndarray, ones_k: np.ndarray) -> np.ndarray:
    """Softmax over keys of ``q @ k^T + mask`` for (B, H, Tq, hd) x (B, H, Tk, hd) -> (B, H, Tq, Tk).

    The stabilising shift is the max of each (batch, head) block (one fast reduction) instead of each row;
    if that underflows a row to zero the exact per-row shift is used instead.
    """
    s: np.ndarray = q @ k.transpose(0, 1, 3, 2)
    B, H, Tq, Tk = s.shape
    blocks = s.reshape(B * H, Tq * Tk)
    blocks -= blocks.max(1)[:, None]
    s += mask
    np.exp(s, out=s)
    rows = s.reshape(-1, Tk)
    sums = rows @ ones_k
    if not sums.min() > 1e-30:
        s = q @ k.transpose(0, 1, 3, 2)
        s += mask
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        rows = s.reshape(-1, Tk)
        sums = rows @ ones_k
    rows *= (1.0 / sums)[:, None]
    return s


def embedding_grad(idx: np.ndarray, dh: np.ndarray, vocab: int) -> np.ndarray:
    """Scatter-add rows of dh into a (vocab, d) table (sort + reduceat, faster than np.add.at)."""
    order = np.argsort(idx, kind="stable")
    srt = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], srt[1:] != srt[:-1])))
    out = np.zeros((vocab, dh.shape[1]), dh.dtype)
    out[srt[starts]] = np.add.reduceat(dh[order], starts, axis=0)
    return out
