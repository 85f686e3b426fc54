"""Batched KV-cache generation for :class:`~palaestra.models.tinygpt.TinyGPT`.

:func:`generate` samples completions for a batch of prompts (token ids) with per-row settings. Each row has
its own ``numpy.random.Generator`` (from its seed) and draws exactly one uniform number per sampled token, so
a row's output depends only on its prompt, settings and seed, never on the other rows of the batch (up to
float32 rounding of the batched GEMMs, which does not change tokens in practice).

* ``temperature == 0`` is greedy (argmax, lowest id on ties); otherwise softmax(logits / temperature), then
  nucleus filtering with ``top_p`` (the smallest set of most likely tokens whose mass reaches ``top_p``).
* ``logit_bias`` (per row, ``{token_id: bias}``) is added to the logits, and OpenAI's presence and frequency
  penalties are subtracted (``count * frequency + (count > 0) * presence``, counts over the row's generated
  tokens so far), before greedy choice or sampling.
* Reported ``logprobs`` and ``top_logprobs`` are those of the RAW model distribution (temperature 1, before
  ``top_p``, bias and penalties): that is what ``TinyGPT.logprobs_of`` recomputes for the trainer.
* A row stops on ``<|end|>`` (the token is kept in ``token_ids``/``logprobs`` and left out of ``text``;
  finish ``"stop"``), on a stop string (``text`` is cut before it; ``token_ids`` keep every sampled token
  up to the one completing it; finish ``"stop"``), or after ``max_new_tokens`` tokens or when prompt +
  completion reaches ``block_size`` tokens (finish ``"length"``; a prompt of ``block_size`` tokens or more
  yields no tokens).

Prompts of different lengths are left-padded in the cache; each row's positions start at 0 on its first real
token and padded keys are masked, so the computation per row is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from palaestra.models._kernels import NEG, ln_fwd
from palaestra.models._runtime import chunk_slices, parallel_map
from palaestra.models.tinygpt import TinyGPT, mlp, trunk_forward

FinishReason = Literal["stop", "length"]
GEN_TOKENS_PER_ROW = 16  # work estimate per row when deciding how to split a batch over the workers
_V = TypeVar("_V")


@dataclass
class Generation:
    """One sampled completion."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    text: str = ""


class Decoder:
    """Incremental forward over a batch of prompts with a key/value cache.

    ``prefill()`` runs the left-padded prompts and returns the logits of the next token (rows, V); each
    ``step(tokens)`` appends one token per row and returns the next logits; ``keep(rows)`` drops the others.
    """

    def __init__(self, model: TinyGPT, prompts: Sequence[Sequence[int]], capacity: int) -> None:
        cfg = model.config
        lens = np.array([len(p) for p in prompts], dtype=np.intp)
        if lens.size == 0 or lens.min() < 1:
            raise ValueError("every prompt needs at least one token")
        self.model = model
        self.width = int(lens.max())
        if self.width > cfg.block_size:
            raise ValueError(f"prompt of {self.width} tokens exceeds block_size {cfg.block_size}")
        self.capacity = max(int(capacity), self.width)
        self.offset = self.width - lens
        self.prompts = [list(map(int, p)) for p in prompts]
        A, H, hd = len(prompts), cfg.n_head, cfg.d_model // cfg.n_head
        shape = (A, H, self.capacity, hd)
        self.k = [np.zeros(shape, model.dtype) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, model.dtype) for _ in range(cfg.n_layer)]
        slots = np.arange(self.capacity)
        self.key_mask = np.where(slots[None, :] >= self.offset[:, None], 0.0, NEG).astype(model.dtype)
        self.t = 0  # filled slots
        self.wq = [model.scaled_qkv(i) for i in range(cfg.n_layer)]

    @property
    def rows(self) -> int:
        return len(self.offset)

    def prefill(self) -> np.ndarray:
        m, L, A = self.model, self.width, self.rows
        x = np.full((A, L), m.tokenizer.pad_id, dtype=np.intp)
        for r, p in enumerate(self.prompts):
            x[r, L - len(p) :] = p
        slots = np.arange(L)
        pos = np.maximum(slots[None, :] - self.offset[:, None], 0)
        causal = np.triu(np.full((L, L), NEG, m.dtype), 1)
        # pad keys are hidden from real queries only, so that no row of scores is fully masked
        hide = (slots[None, None, :] < self.offset[:, None, None]) & (
            slots[None, :, None] >= self.offset[:, None, None]
        )
        mask = (causal[None] + np.where(hide, NEG, 0.0).astype(m.dtype))[:, None]
        kv: list[tuple[np.ndarray, np.ndarray]] = []
        hf = trunk_forward(m.weights, m.config.n_head, x, pos=pos, mask=mask, kv_out=kv)[0]  # (A*L, d)
        for i, (k, v) in enumerate(kv):
            self.k[i][:, :, :L] = k
            self.v[i][:, :, :L] = v
        self.t = L
        last = hf.reshape(A, L, -1)[:, -1]
        return self._head(last)

    def _head(self, hf: np.ndarray) -> np.ndarray:
        W = self.model.weights
        logits: np.ndarray = hf @ W.head_w  # (A, V)
        logits += W.head_b
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        W, cfg = self.model.weights, self.model.config
        s = self.t
        if s >= self.capacity:
            raise ValueError(f"KV cache is full ({self.capacity} slots)")
        A, d, H = self.rows, cfg.d_model, cfg.n_head
        hd = d // H
        pos = np.minimum(s - self.offset, cfg.block_size - 1)  # only finished rows are ever clamped
        h = W.wte[np.asarray(tokens, dtype=np.intp)] + W.wpe[pos]  # (A, d)
        kmask = self.key_mask[:, None, None, : s + 1]
        for i, blk in enumerate(W.blocks):
            a = ln_fwd(h, blk.ln1_g, blk.ln1_b)[0]
            wq, bq = self.wq[i]
            qkv = a @ wq  # (A, 3d)
            qkv += bq
            q, k, v = qkv.reshape(A, 3, H, hd).transpose(1, 0, 2, 3)  # each (A, H, hd)
            K, V = self.k[i], self.v[i]
            K[:, :, s] = k
            V[:, :, s] = v
            sc = q[:, :, None, :] @ K[:, :, : s + 1].transpose(0, 1, 3, 2)  # (A, H, 1, s+1)
            sc += kmask
            sc -= sc.max(-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(-1, keepdims=True)
            y = (sc @ V[:, :, : s + 1]).reshape(A, d)  # (A, H, 1, hd) -> (A, d)
            o = y @ blk.w_o
            o += blk.b_o
            h += o
            h += mlp(blk, ln_fwd(h, blk.ln2_g, blk.ln2_b)[0])[1]
        self.t = s + 1
        hf = ln_fwd(h, W.lnf_g, W.lnf_b)[0]
        return self._head(hf)

    def keep(self, rows: np.ndarray) -> None:
        """Keep only ``rows`` (indices into the current rows), in that order."""
        rows = np.asarray(rows, dtype=np.intp)
        self.offset = self.offset[rows]
        self.key_mask = self.key_mask[rows]
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]


def _per_row(value: _V | Sequence[_V], n: int, name: str) -> list[_V]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n  # type: ignore[list-item]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax over the last axis."""
    z: np.ndarray = logits - logits.max(-1, keepdims=True)
    z -= np.log(np.exp(z).sum(-1, keepdims=True))
    return z


def _sample_rows(logits: np.ndarray, temps: np.ndarray, top_ps: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Sample one token per row from softmax(logits/temp) restricted to its top_p nucleus (u: uniforms)."""
    z = logits / temps[:, None]
    z -= z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    out = np.empty(len(p), dtype=np.intp)
    nuc = top_ps < 1.0
    full = ~nuc
    if full.any():
        cdf = np.cumsum(p[full], axis=-1)
        idx = (cdf < (u[full] * cdf[:, -1])[:, None]).sum(-1)
        out[full] = np.minimum(idx, p.shape[1] - 1)
    if nuc.any():
        pn = p[nuc]
        order = np.argsort(-pn, axis=-1, kind="stable")
        ps = np.take_along_axis(pn, order, axis=-1)
        cum = np.cumsum(ps, axis=-1)
        ps[(cum - ps) >= top_ps[nuc][:, None]] = 0.0  # keep tokens until the mass reaches top_p
        cdf = np.cumsum(ps, axis=-1)
        idx = np.minimum((cdf < (u[nuc] * cdf[:, -1])[:, None]).sum(-1), p.shape[1] - 1)
        out[nuc] = order[np.arange(len(idx)), idx]
    return out


def generate(
    model: TinyGPT,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float],
    top_p: float | Sequence[float] = 1.0,
    seeds: Sequence[int | None],
    stop: Sequence[Sequence[str]] | None = None,
    top_logprobs: int = 0,
    logit_bias: Sequence[Mapping[int, float]] | None = None,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    cancelled: np.ndarray | None = None,
) -> list[Generation]:
    """Sample a completion for every prompt (see the module docstring for the exact semantics).

    Large batches are split by rows over the worker threads; rows are independent, so the split does not
    change any row's output. ``cancelled``: optional per-row flags that another thread may set while this
    runs; a flagged row stops at the next token (its generation is cut short: nobody wants it).
    """
    n = len(prompts)
    if len(seeds) != n:
        raise ValueError(f"seeds has {len(seeds)} entries for {n} prompts")
    max_new = [int(x) for x in _per_row(max_new_tokens, n, "max_new_tokens")]
    temps = np.array(_per_row(temperature, n, "temperature"), dtype=np.float64)
    top_ps = np.array(_per_row(top_p, n, "top_p"), dtype=np.float64)
    stops = [list(s) for s in stop] if stop is not None else [[] for _ in range(n)]
    if len(stops) != n:
        raise ValueError(f"stop has {len(stops)} entries for {n} prompts")
    if any(m < 0 for m in max_new) or (temps < 0).any() or not ((top_ps > 0) & (top_ps <= 1)).all():
        raise ValueError("max_new_tokens must be >= 0, temperature >= 0 and 0 < top_p <= 1")
    if any(not s for ss in stops for s in ss):
        raise ValueError("stop strings must be non-empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    k_top = int(top_logprobs)
    if not 0 <= k_top <= model.config.vocab_size:
        raise ValueError(f"top_logprobs must be in [0, {model.config.vocab_size}]")
    seed_list = list(seeds)
    vocab = model.config.vocab_size
    biases: list[Mapping[int, float]] = list(logit_bias) if logit_bias is not None else [{} for _ in range(n)]
    if len(biases) != n:
        raise ValueError(f"logit_bias has {len(biases)} entries for {n} prompts")
    if any(not 0 <= int(t) < vocab for b in biases for t in b):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    pres = np.array(_per_row(presence_penalty, n, "presence_penalty"), dtype=np.float64)
    freq = np.array(_per_row(frequency_penalty, n, "frequency_penalty"), dtype=np.float64)
    adjust = _Adjust(biases, pres, freq) if any(biases) or pres.any() or freq.any() else None

    def run(sl: slice) -> list[Generation]:
        adj = adjust.rows(sl) if adjust is not None else None
        dead = cancelled[sl] if cancelled is not None else None  # a view: later flags are seen
        return _generate(
            model, prompts[sl], max_new[sl], temps[sl], top_ps[sl], seed_list[sl], stops[sl], k_top, adj, dead
        )

    parts = parallel_map(run, chunk_slices(n, GEN_TOKENS_PER_ROW))
    return [g for part in parts for g in part]


@dataclass
class _Adjust:
    """Per-row logit bias and presence/frequency penalties (rows of one generate call)."""

    biases: list[Mapping[int, float]]
    presence: np.ndarray
    frequency: np.ndarray

    def rows(self, sl: slice) -> _Adjust:
        return _Adjust(self.biases[sl], self.presence[sl], self.frequency[sl])

    def dense_bias(self, vocab: int) -> np.ndarray | None:
        if not any(self.biases):
            return None
        out = np.zeros((len(self.biases), vocab))
        for r, b in enumerate(self.biases):
            for t, v in b.items():
                out[r, int(t)] = float(v)
        return out


def _adjusted(
    lg: np.ndarray, rr: np.ndarray, bias: np.ndarray | None, counts: np.ndarray | None, adj: _Adjust
) -> np.ndarray:
    """Logits of rows ``rr`` after logit bias and penalties (float64 copy)."""
    out = lg.astype(np.float64)
    if bias is not None:
        out += bias[rr]
    if counts is not None:
        c = counts[rr]
        out -= c * adj.frequency[rr, None] + (c > 0) * adj.presence[rr, None]
    return out


def _generate(
    model: TinyGPT,
    prompts: Sequence[Sequence[int]],
    max_new: list[int],
    temps: np.ndarray,
    top_ps: np.ndarray,
    seeds: list[int | None],
    stops: list[list[str]],
    k_top: int,
    adj: _Adjust | None = None,
    dead: np.ndarray | None = None,
) -> list[Generation]:
    n = len(prompts)
    block, tok = model.config.block_size, model.tokenizer
    limit = np.array([max(0, min(max_new[r], block - len(prompts[r]))) for r in range(n)], dtype=np.intp)
    active = np.flatnonzero(limit > 0)
    if active.size == 0:
        return [Generation([], [], [], "length", "") for _ in range(n)]
    # per-row buffers, indexed by request row and token index
    act = active.tolist()
    width, horizon = max(len(prompts[r]) for r in act), int(limit.max())
    tok_buf = np.zeros((n, horizon), dtype=np.intp)
    lp_buf = np.zeros((n, horizon))
    top_ids = np.zeros((n, horizon, k_top), dtype=np.intp)
    top_lps = np.zeros((n, horizon, k_top))
    count = np.zeros(n, dtype=np.intp)
    stopped = np.zeros(n, dtype=bool)
    uniforms = np.zeros((n, horizon))  # row r's t-th sampled token uses the t-th draw of its own generator
    for r in act:
        if temps[r] > 0:
            uniforms[r, : limit[r]] = np.random.default_rng(seeds[r]).random(int(limit[r]))
    has_stop = np.array([bool(s) for s in stops])
    texts = {r: "" for r in act if has_stop[r]}
    vocab, special, end_id = tok.vocab, tok.special_ids, tok.end_id
    # identical prompts (n choices, GRPO groups) are prefilled once and their cache rows copied
    uniq: dict[tuple[int, ...], int] = {}
    src = [uniq.setdefault(tuple(prompts[r]), len(uniq)) for r in act]
    dec = Decoder(model, [list(p) for p in uniq], capacity=width + horizon - 1)
    logits = dec.prefill()
    if len(uniq) < len(act):
        dec.keep(np.array(src))
        logits = logits[src]
    rows = active.astype(np.intp)  # request row of each decoder row
    live = np.ones(len(rows), dtype=bool)
    vsize = model.config.vocab_size
    bias = adj.dense_bias(vsize) if adj is not None else None
    pen = adj is not None and bool(adj.presence.any() or adj.frequency.any())
    counts = np.zeros((n, vsize)) if pen else None  # generated-token counts per row (penalties)
    while True:
        idx = np.flatnonzero(live)
        lg, rr = logits[idx], rows[idx]
        t_r = count[rr]
        lp = log_softmax(lg)
        pick = _adjusted(lg, rr, bias, counts, adj) if adj is not None else lg
        nxt = np.argmax(pick, axis=-1)
        samp = temps[rr] > 0
        if samp.any():
            rs = rr[samp]
            nxt[samp] = _sample_rows(
                pick[samp].astype(np.float64), temps[rs], top_ps[rs], uniforms[rs, t_r[samp]]
            )
        if counts is not None:
            counts[rr, nxt] += 1
        tok_buf[rr, t_r] = nxt
        lp_buf[rr, t_r] = lp[np.arange(len(rr)), nxt]
        if k_top:
            part = np.argpartition(-lp, k_top - 1, axis=-1)[:, :k_top]
            part.sort(axis=-1)  # ids ascending, so that the stable sort breaks ties by lower id
            pv = np.take_along_axis(lp, part, axis=-1)
            order = np.argsort(-pv, axis=-1, kind="stable")
            top_ids[rr, t_r] = np.take_along_axis(part, order, axis=-1)
            top_lps[rr, t_r] = np.take_along_axis(pv, order, axis=-1)
        count[rr] += 1
        done = nxt == end_id
        for j in np.flatnonzero(has_stop[rr] & ~done).tolist():  # text is only built for rows with stops
            row, t = int(rr[j]), int(nxt[j])
            if t in special:
                continue
            prev = texts[row]
            texts[row] = prev + vocab[t]
            hit = _find_stop(texts[row], stops[row], len(prev))
            if hit is not None:
                texts[row] = texts[row][:hit]
                done[j] = True
        stopped[rr[done]] = True
        ended = done | (count[rr] >= limit[rr])
        if dead is not None:
            ended |= dead[rr]
        live[idx[ended]] = False
        n_live = int(live.sum())
        if n_live == 0:
            break
        feed = np.full(len(rows), end_id, dtype=np.intp)
        feed[idx] = nxt
        if n_live <= 0.75 * len(rows):  # drop finished rows from the cache
            keep = np.flatnonzero(live)
            dec.keep(keep)
            rows, feed, live = rows[keep], feed[keep], live[keep]
        logits = dec.step(feed)
    out = []
    for r in range(n):
        c = int(count[r])
        ids = tok_buf[r, :c].tolist()
        top = [list(zip(top_ids[r, i].tolist(), top_lps[r, i].tolist())) for i in range(c)] if k_top else []
        text = texts[r] if r in texts else tok.decode(ids)
        out.append(Generation(ids, lp_buf[r, :c].tolist(), top, "stop" if stopped[r] else "length", text))
    return out


def _find_stop(text: str, stops: list[str], prev_len: int) -> int | None:
    """Earliest start of a stop string that ends in the newly added text, or None."""
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, prev_len - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
