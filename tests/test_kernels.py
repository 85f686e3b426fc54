"""Every fast kernel of TinyGPT equals its plain numpy reference (palaestra.models._kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from palaestra.models import _kernels as K


@pytest.fixture(params=["float32", "float64"])
def dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def tol(dtype: str) -> float:
    return 2e-5 if dtype == "float32" else 1e-12


def test_layer_norm_forward_and_backward(dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(37, 24)) * 3 + 1).astype(dtype)
    g, b = rng.normal(size=24).astype(dtype), rng.normal(size=24).astype(dtype)
    for fast, ref in zip(K.ln_fwd(x, g, b), K.ln_fwd_reference(x, g, b)):
        np.testing.assert_allclose(fast, ref, rtol=tol(dtype), atol=tol(dtype))
    _, xhat, rstd = K.ln_fwd_reference(x, g, b)
    dout = rng.normal(size=x.shape).astype(dtype)
    for fast, ref in zip(K.ln_bwd(dout, xhat, rstd, g), K.ln_bwd_reference(dout, xhat, rstd, g)):
        np.testing.assert_allclose(fast, ref, rtol=tol(dtype), atol=10 * tol(dtype))


def test_attention_probs_including_the_underflow_fallback(dtype: str) -> None:
    rng = np.random.default_rng(1)
    B, H, T, hd = 2, 3, 6, 4
    q, k = (rng.normal(size=(2, B, H, T, hd)) * 2).astype(dtype)
    causal = np.triu(np.full((T, T), K.NEG, dtype), 1)
    np.testing.assert_allclose(
        K.attention_probs(q, k, causal), K.attention_probs_reference(q, k, causal), atol=tol(dtype)
    )
    # scores spread so far apart that one row underflows under the per-block shift: the exact path is taken
    q[0, 0, 0] = 0.0
    q[0, 0, 5] = 200.0
    k[0, 0] = 1.0
    p = K.attention_probs(q, k, causal)
    np.testing.assert_allclose(p, K.attention_probs_reference(q, k, causal), atol=tol(dtype))
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=tol(dtype))


def test_next_token_logprobs(dtype: str) -> None:
    rng = np.random.default_rng(2)
    N, d, V = 19, 8, 30
    hf = rng.normal(size=(N, d)).astype(dtype)
    w, b = (rng.normal(size=(d, V)) * 2).astype(dtype), rng.normal(size=V).astype(dtype)
    targets = rng.integers(0, V, N)
    for fast, ref in zip(
        K.next_token_logprobs(hf, w, b, targets), K.next_token_logprobs_reference(hf, w, b, targets)
    ):
        np.testing.assert_allclose(fast, ref, atol=5 * tol(dtype))


def test_embedding_grad(dtype: str) -> None:
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 7, 50)  # repeated ids, and ids that never occur
    dh = rng.normal(size=(50, 5)).astype(dtype)
    np.testing.assert_allclose(
        K.embedding_grad(idx, dh, 9), K.embedding_grad_reference(idx, dh, 9), atol=tol(dtype)
    )
