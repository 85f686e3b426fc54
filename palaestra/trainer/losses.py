"""Policy-gradient and preference losses with analytic gradients (pure numpy, no I/O).

Shapes: ``B`` sequences (rows) by ``T`` token positions; ``mask[i, t]`` is True for trainable tokens (policy
tokens of assistant turns). Values at masked-out positions are ignored entirely (they may be NaN or padding).

Per-token clipped surrogate (PPO / GRPO / DAPO clip-higher), with ``rho = exp(logp - old_logp)``::

    l_pg(i,t) = -min(rho * A_i, clip(rho, 1 - clip_low, 1 + clip_high) * A_i)
    dl_pg/dlogp = -A_i * rho  where the unclipped term is the minimum;
                  0           where the clipped term is strictly smaller
                              (A > 0 and rho > 1 + clip_high, or A < 0 and rho < 1 - clip_low)

k3 KL to a frozen reference (Schulman 2020), with ``d = ref_logp - logp``::

    k3 = exp(d) - d - 1  >= 0  (0 iff logp == ref_logp)        dk3/dlogp = 1 - exp(d)

Per-token loss ``l = l_pg + kl_beta * k3``, aggregated with weights ``w(i,t)`` on masked tokens
(``loss = sum w * l``, ``dloss/dlogp = w * dl/dlogp``); ``N`` = masked tokens, ``n_i`` = those of row i:

- ``token_mean``           ``w = 1 / N``                       (DAPO / TRL ``bnpo``; verl ``token-mean``)
- ``seq_mean_token_mean``  ``w = 1 / (B * max(n_i, 1))``       (DeepSeekMath GRPO; TRL ``grpo``)
- ``seq_sum_constant``     ``w = 1 / (B * L)``, ``L = max_tokens_constant or T``   (Dr. GRPO; TRL ``dr_grpo``)

Rows with no trainable token contribute nothing but still count in ``B``. With no trainable token at all the
loss and gradient are 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
from numpy.typing import ArrayLike

from palaestra.trainer.advantages import check_nonneg, float_array

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)
NonFiniteOld = Literal["ratio_one", "raise"]

__all__ = [
    "AGG_MODES",
    "AggMode",
    "DPOResult",
    "LossResult",
    "NonFiniteOld",
    "dpo_loss",
    "kl_k3",
    "kl_k3_grad",
    "policy_loss",
]


def kl_k3(logp: ArrayLike, ref_logp: ArrayLike) -> np.ndarray:
    """Per-token k3 estimate of KL(policy || ref): ``exp(ref - logp) - (ref - logp) - 1``.

    Always >= 0 and exactly 0 where ``logp == ref_logp``; computed as ``expm1(d) - d`` for accuracy near 0.
    """
    d = np.asarray(ref_logp, dtype=np.float64) - np.asarray(logp, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.maximum(np.expm1(d) - d, 0.0)


def kl_k3_grad(logp: ArrayLike, ref_logp: ArrayLike) -> np.ndarray:
    """Gradient of :func:`kl_k3` with respect to ``logp``: ``1 - exp(ref - logp)``."""
    d = np.asarray(ref_logp, dtype=np.float64) - np.asarray(logp, dtype=np.float64)
    with np.errstate(over="ignore"):
        return -np.expm1(d)


@dataclass(frozen=True)
class LossResult:
    """Scalar loss, its gradient with respect to the per-token ``logp`` (shape ``(B, T)``, 0 where masked
    out) and float metrics."""

    loss: float
    dlogp: np.ndarray
    metrics: dict[str, float] = field(default_factory=dict)


def _matrix(name: str, x: ArrayLike, shape: tuple[int, int] | None = None) -> np.ndarray:
    a = float_array(x, name, 2, "a numeric (B, T) array")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name}: shape {a.shape} does not match logp's {shape}")
    return a


def _bool_mask(mask: ArrayLike, shape: tuple[int, int]) -> np.ndarray:
    m = np.asarray(mask)
    if m.shape != shape:
        raise ValueError(f"mask: shape {m.shape} does not match logp's {shape}")
    if m.dtype == np.bool_:
        return m
    if not np.issubdtype(m.dtype, np.number) or not np.all((m == 0) | (m == 1)):
        raise ValueError("mask: expected booleans or 0/1 values")
    return m.astype(bool)


def _check_finite_masked(name: str, a: np.ndarray, m: np.ndarray) -> None:
    bad = np.argwhere(m & ~np.isfinite(a))
    if bad.size:
        i, t = (int(v) for v in bad[0])
        raise ValueError(f"{name}[{i}, {t}] is {a[i, t]!r} at a trainable token; expected a finite value")


def _agg_weights(m: np.ndarray, agg: str, max_tokens_constant: int | None) -> np.ndarray:
    b, t = m.shape
    if agg == "token_mean":
        w = np.full(m.shape, 1.0 / max(int(m.sum()), 1))
    elif agg == "seq_mean_token_mean":
        lengths = np.maximum(m.sum(axis=1), 1).astype(np.float64)
        w = np.broadcast_to(1.0 / (max(b, 1) * lengths)[:, None], m.shape)
    else:
        const = max_tokens_constant if max_tokens_constant is not None else t
        w = np.full(m.shape, 1.0 / (max(b, 1) * max(const, 1)))
    return np.where(m, w, 0.0)


def policy_loss(
    logp: ArrayLike,
    old_logp: ArrayLike,
    ref_logp: ArrayLike | None,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kl_beta: float = 0.0,
    agg: AggMode = "token_mean",
    max_tokens_constant: int | None = None,
    nonfinite_old: NonFiniteOld = "ratio_one",
) -> LossResult:
    """Clipped-surrogate policy loss plus ``kl_beta * k3`` (formulas in the module docstring).

    ``logp``: current per-token log-probs ``(B, T)``; ``old_logp``: sampling-time log-probs; ``ref_logp``:
    reference-policy log-probs or ``None`` (required when ``kl_beta > 0``; with ``kl_beta == 0`` it is only
    used for the ``kl`` metric); ``advantages``: one per sequence ``(B,)`` (or per token ``(B, T)``);
    ``mask``: trainable tokens ``(B, T)``.

    Non-finite ``old_logp`` at a trainable token (a sampler that returned no or ``-inf`` logprob): with
    ``nonfinite_old="ratio_one"`` (default) the token is treated as on-policy (``old = logp`` held constant,
    ratio 1, plain policy gradient ``-A``) and counted in ``metrics["nonfinite_old"]``; ``"raise"`` raises
    ``ValueError`` naming the position. Non-finite ``logp``/``ref_logp``/advantages at a trainable token
    always raise. A huge ratio is not capped: with ``A < 0`` the loss can become ``inf``.

    Metrics: ``loss``, ``pg_loss`` and ``kl_loss`` (the aggregated parts, ``kl_loss`` before ``kl_beta``),
    ``kl`` (token-mean k3, if ``ref_logp`` given), ``clip_frac`` = ``clip_low_frac + clip_high_frac``
    (fractions of trainable tokens whose gradient the clip removed), ``ratio_mean/min/max``, ``tokens``,
    ``seqs`` (rows with a trainable token), ``nonfinite_old``.
    """
    lp = _matrix("logp", logp)
    shape = (lp.shape[0], lp.shape[1])
    old = _matrix("old_logp", old_logp, shape)
    m = _bool_mask(mask, shape)
    if not (0.0 <= clip_low < 1.0):
        raise ValueError(f"clip_low: must be in [0, 1), got {clip_low!r}")
    check_nonneg("clip_high", clip_high)
    check_nonneg("kl_beta", kl_beta)
    if agg not in AGG_MODES:
        raise ValueError(f"agg: unknown aggregation {agg!r}; expected one of {AGG_MODES}")
    if max_tokens_constant is not None:
        if agg != "seq_sum_constant":
            raise ValueError("max_tokens_constant: only used with agg='seq_sum_constant'")
        if type(max_tokens_constant) is not int or max_tokens_constant < 1:  # bool is not an int here
            raise ValueError(f"max_tokens_constant: expected an int >= 1, got {max_tokens_constant!r}")
    if nonfinite_old not in get_args(NonFiniteOld):
        raise ValueError(f"nonfinite_old: expected 'ratio_one' or 'raise', got {nonfinite_old!r}")
    if kl_beta > 0.0 and ref_logp is None:
        raise ValueError("ref_logp: required when kl_beta > 0")

    adv = np.asarray(advantages, dtype=np.float64)
    if adv.shape == (shape[0],):
        adv = np.broadcast_to(adv[:, None], shape)
    elif adv.shape != shape:
        raise ValueError(f"advantages: expected shape ({shape[0]},) or {shape}, got {adv.shape}")
    _check_finite_masked("logp", lp, m)
    _check_finite_masked("advantages", adv, m)
    old_bad = m & ~np.isfinite(old)
    if nonfinite_old == "raise":
        _check_finite_masked("old_logp", old, m)

    lp = np.where(m, lp, 0.0)
    adv = np.where(m, adv, 0.0)
    old = np.where(m & np.isfinite(old), old, lp)  # ratio exactly 1 at bad or masked-out positions
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(lp - old)
        unclipped = np.where(adv == 0.0, 0.0, ratio * adv)
        clipped = np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
        pg_tok = -np.minimum(unclipped, clipped)
        is_clipped = clipped < unclipped
        dpg = np.where(is_clipped | (adv == 0.0), 0.0, -adv * ratio)

    w = _agg_weights(m, agg, max_tokens_constant)
    n_tok = int(m.sum())
    pg_loss = float(np.sum(np.where(m, w * pg_tok, 0.0)))
    metrics: dict[str, float] = {}
    loss, dtok = pg_loss, dpg
    if ref_logp is not None:
        ref = _matrix("ref_logp", ref_logp, shape)
        _check_finite_masked("ref_logp", ref, m)
        ref = np.where(m, ref, 0.0)
        kl_tok = np.where(m, kl_k3(lp, ref), 0.0)
        kl_loss = float(np.sum(w * kl_tok))
        metrics["kl"] = float(kl_tok.sum() / max(n_tok, 1))
        metrics["kl_loss"] = kl_loss
        if kl_beta > 0.0:
            loss = pg_loss + kl_beta * kl_loss
            dtok = dpg + kl_beta * np.where(m, kl_k3_grad(lp, ref), 0.0)
    dlogp = np.where(m, w * dtok, 0.0)

    denom = max(n_tok, 1)
    clip_low_n = int(np.sum(m & is_clipped & (adv < 0.0)))
    clip_high_n = int(np.sum(m & is_clipped & (adv > 0.0)))
    r_masked = ratio[m] if n_tok else np.ones(1)
    metrics.update(
        loss=loss,
        pg_loss=pg_loss,
        clip_frac=(clip_low_n + clip_high_n) / denom,
        clip_low_frac=clip_low_n / denom,
        clip_high_frac=clip_high_n / denom,
        ratio_mean=float(r_masked.mean()),
        ratio_min=float(r_masked.min()),
        ratio_max=float(r_masked.max()),
        tokens=float(n_tok),
        seqs=float(np.sum(m.any(axis=1))),
        nonfinite_old=float(old_bad.sum()),
    )
    return LossResult(loss=loss, dlogp=dlogp, metrics=metrics)


@dataclass(frozen=True)
class DPOResult:
    """Mean DPO loss over pairs and its gradients with respect to the policy's chosen and rejected sequence
    log-probs (same shape as the inputs)."""

    loss: float
    dchosen: np.ndarray
    drejected: np.ndarray
    metrics: dict[str, float] = field(default_factory=dict)


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    """``log(1 / (1 + exp(-z)))`` without overflow for large ``|z|``."""
    return np.asarray(-np.logaddexp(0.0, -z))


def dpo_loss(
    policy_chosen_logp: ArrayLike,
    policy_rejected_logp: ArrayLike,
    ref_chosen_logp: ArrayLike,
    ref_rejected_logp: ArrayLike,
    beta: float = 0.1,
) -> DPOResult:
    """Sigmoid DPO loss (Rafailov et al. 2023), averaged over pairs.

    With ``h_w = pi_chosen - ref_chosen``, ``h_l = pi_rejected - ref_rejected`` and
    ``z = beta * (h_w - h_l)``::

        loss = mean_k -log sigmoid(z_k)
        dloss/dpi_chosen_k = -beta * sigmoid(-z_k) / K       dloss/dpi_rejected_k = +beta * sigmoid(-z_k) / K

    Inputs are sequence log-probs (scalars or 1-D arrays of equal shape). No pairs -> loss 0.
    Metrics: ``loss``, ``pairs``, ``reward_accuracy`` (fraction with ``z > 0``), ``margin`` (mean ``z``),
    ``chosen_reward`` / ``rejected_reward`` (mean ``beta * h``).
    """
    if not (np.isfinite(beta) and beta > 0.0):
        raise ValueError(f"beta: must be a finite number > 0, got {beta!r}")
    names = ("policy_chosen_logp", "policy_rejected_logp", "ref_chosen_logp", "ref_rejected_logp")
    arrays = [
        np.asarray(x, dtype=np.float64)
        for x in (policy_chosen_logp, policy_rejected_logp, ref_chosen_logp, ref_rejected_logp)
    ]
    shape = arrays[0].shape
    for name, a in zip(names, arrays):
        if a.ndim > 1:
            raise ValueError(f"{name}: expected a scalar or 1-D array, got shape {a.shape}")
        bad = np.flatnonzero(~np.isfinite(a.reshape(-1)))
        if bad.size:
            raise ValueError(f"{name}[{int(bad[0])}] is not finite")
        if a.shape != shape:
            raise ValueError(f"{name}: shape {a.shape} does not match policy_chosen_logp's {shape}")
    pc, pr, rc, rr = arrays
    k = int(pc.size)
    if k == 0:
        keys = ("loss", "pairs", "reward_accuracy", "margin", "chosen_reward", "rejected_reward")
        return DPOResult(
            loss=0.0, dchosen=np.zeros(shape), drejected=np.zeros(shape), metrics=dict.fromkeys(keys, 0.0)
        )
    chosen_reward = beta * (pc - rc)
    rejected_reward = beta * (pr - rr)
    z = chosen_reward - rejected_reward
    loss = float(np.mean(-_log_sigmoid(z)))
    sig_neg = np.exp(_log_sigmoid(-z))  # sigmoid(-z), stable
    dchosen = -beta * sig_neg / k
    metrics = {
        "loss": loss,
        "pairs": float(k),
        "reward_accuracy": float(np.mean(z > 0.0)),
        "margin": float(np.mean(z)),
        "chosen_reward": float(np.mean(chosen_reward)),
        "rejected_reward": float(np.mean(rejected_reward)),
    }
    return DPOResult(loss=loss, dchosen=dchosen, drejected=-dchosen, metrics=metrics)
