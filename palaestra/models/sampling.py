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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

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


def key_mask(offset: np.ndarray, capacity: int) -> np.ndarray:
    """(rows, capacity) additive attention mask over cache slots: 0 from each row's first token (``offset``)
    on, :data:`NEG` on the left padding before it."""
    return np.where(np.arange(capacity)[None, :] >= offset[:, None], 0.0, NEG)


class Decoder:
    """Incremental forward over a batch of prompts with a key/value cache.

    ``prefill()`` runs the left-padded prompts and returns the logits of the next token (rows, V); each
    ``step(tokens)`` appends one token per row and returns the next logits; ``keep(rows)`` drops the others.
    """

    def __init__(
        self,
        model: TinyGPT,
        prompts: Sequence[Sequence[int]],
        capacity: int,
        wq: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
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
        self.key_mask = key_mask(self.offset, self.capacity).astype(model.dtype)
        self.t = 0  # filled slots
        self.wq = wq if wq is not None else [model.scaled_qkv(i) for i in range(cfg.n_layer)]

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
        kmask = self.key_mask[:A, None, None, : s + 1]  # the cache may hold spare rows after the first A
        for i, blk in enumerate(W.blocks):
            a = ln_fwd(h, blk.ln1_g, blk.ln1_b)[0]
            wq, bq = self.wq[i]
            qkv = a @ wq  # (A, 3d)
            qkv += bq
            q, k, v = qkv.reshape(A, 3, H, hd).transpose(1, 0, 2, 3)  # each (A, H, hd)
            K, V = self.k[i][:A], self.v[i][:A]
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
        n = len(rows)
        if n > len(self.key_mask):
            self.key_mask = self.key_mask[rows]
            self.k = [k[rows] for k in self.k]
            self.v = [v[rows] for v in self.v]
            return
        self.key_mask[:n] = self.key_mask[rows]  # in place: spare rows stay allocated
        for buf in (*self.k, *self.v):
            buf[:n, :, : self.t] = buf[rows, :, : self.t]  # slots from t on are written before they are read


def _n_rows(values: Sequence[_V], n: int, name: str) -> list[_V]:
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return list(values)


def _per_row(value: _V | Sequence[_V], n: int, name: str) -> list[_V]:
    """One entry per prompt: a list or tuple must have ``n`` entries; any other value is repeated."""
    if isinstance(value, (list, tuple)):
        return _n_rows(value, n, name)
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
) -> list[Generation]:
    """Sample a completion for every prompt (see the module docstring for the exact semantics).

    Large batches are split by rows over the worker threads; rows are independent, so the split does not
    change any row's output. Each part is decoded as one :class:`DecodeBatch`.
    """
    n = len(prompts)
    seed_list = _n_rows(seeds, n, "seeds")
    max_new = [int(x) for x in _per_row(max_new_tokens, n, "max_new_tokens")]
    temps = np.array(_per_row(temperature, n, "temperature"), dtype=np.float64)
    top_ps = np.array(_per_row(top_p, n, "top_p"), dtype=np.float64)
    stops = [list(s) for s in _n_rows(stop, n, "stop")] if stop is not None else [[] for _ in range(n)]
    if any(m < 0 for m in max_new) or (temps < 0).any() or not ((top_ps > 0) & (top_ps <= 1)).all():
        raise ValueError("max_new_tokens must be >= 0, temperature >= 0 and 0 < top_p <= 1")
    if any(not s for ss in stops for s in ss):
        raise ValueError("stop strings must be non-empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    k_top = int(top_logprobs)
    if not 0 <= k_top <= model.config.vocab_size:
        raise ValueError(f"top_logprobs must be in [0, {model.config.vocab_size}]")
    vocab = model.config.vocab_size
    biases = _n_rows(logit_bias, n, "logit_bias") if logit_bias is not None else [{} for _ in range(n)]
    if any(not 0 <= int(t) < vocab for b in biases for t in b):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    pres = [float(x) for x in _per_row(presence_penalty, n, "presence_penalty")]
    freq = [float(x) for x in _per_row(frequency_penalty, n, "frequency_penalty")]
    adjusted = any(biases) or any(pres) or any(freq)

    def run(sl: slice) -> list[Generation]:
        batch = DecodeBatch(model)
        done = batch.add(
            list(range(sl.stop - sl.start)),  # a row's key: its index in this part
            prompts[sl],
            max_new=max_new[sl],
            temperature=temps[sl].tolist(),
            top_p=top_ps[sl].tolist(),
            seeds=seed_list[sl],
            stop=stops[sl],
            top_logprobs=[k_top] * (sl.stop - sl.start),
            logit_bias=biases[sl] if adjusted else None,
            presence_penalty=pres[sl] if adjusted else None,
            frequency_penalty=freq[sl] if adjusted else None,
        )
        while batch.live_rows:
            done += batch.step()
        return [g for _, g in sorted(done, key=lambda kg: int(kg[0]))]

    parts = parallel_map(run, chunk_slices(n, GEN_TOKENS_PER_ROW))
    return [g for part in parts for g in part]


class DecodeBatch:
    """Rows decoded together that may join and leave between decoding steps (continuous batching).

    :meth:`add` prefills new rows (identical prompts once) and merges their key/value cache into the running
    batch; :meth:`step` samples one token for every live row, hands back the rows that finished (with the
    caller's key), and runs the model one step for the others; :meth:`drop` ends rows at once (their partial
    completion is handed back). Each row keeps its own seed, settings and token counter, so what a row gets
    does not depend on which rows share its batch or when they joined (module docstring).
    """

    # per-row state, first axis the rows (_keep keeps them in step): settings and counters (rows,), and one
    # entry per generated position (rows, block_size)
    _ARRAYS: tuple[str, ...] = ("temps", "top_ps", "limit", "count", "ktop", "stopped", "has_stop", "pres")
    _ARRAYS += ("freq", "uniforms", "tok", "lp")

    def __init__(self, model: TinyGPT, *, spare_rows: int = 0, spare_slots: int = 0) -> None:
        """``spare_rows``/``spare_slots``: room the cache keeps beyond what the rows need, so that rows
        joining later are written in place (no copy of the running rows' cache)."""
        self.model = model
        self.spare_rows, self.spare_slots = int(spare_rows), int(spare_slots)
        self.horizon = model.config.block_size
        self.dec: Decoder | None = None
        self.logits = np.zeros((0, model.config.vocab_size), model.dtype)  # next-token logits per row
        self.keys: list[Any] = []
        self.live = np.zeros(0, dtype=bool)
        self.temps = np.zeros(0)
        self.top_ps = np.zeros(0)
        self.limit = np.zeros(0, dtype=np.intp)
        self.count = np.zeros(0, dtype=np.intp)
        self.ktop = np.zeros(0, dtype=np.intp)
        self.stopped = np.zeros(0, dtype=bool)
        self.has_stop = np.zeros(0, dtype=bool)
        self.uniforms = np.zeros(
            (0, self.horizon)
        )  # row r's t-th sampled token uses the t-th draw of its seed
        self.tok = np.zeros((0, self.horizon), dtype=np.intp)
        self.lp = np.zeros((0, self.horizon))
        self.pres = np.zeros(0)
        self.freq = np.zeros(0)
        self.bias: np.ndarray | None = None  # (rows, V) logit bias, when some row has one
        self.counts: np.ndarray | None = None  # (rows, V) generated-token counts, when some row has penalties
        self.stops: list[list[str]] = []
        self.texts: list[str] = []
        self.tops: list[list[list[tuple[int, float]]]] = []

    @property
    def live_rows(self) -> int:
        """Rows still generating."""
        return int(self.live.sum())

    @property
    def steps_left(self) -> int:
        """Decoding steps until every live row has reached its token limit (0 when none is live)."""
        left = (self.limit - self.count)[self.live]
        return int(left.max()) if left.size else 0

    def add(
        self,
        keys: Sequence[Any],
        prompts: Sequence[Sequence[int]],
        *,
        max_new: Sequence[int],
        temperature: Sequence[float],
        top_p: Sequence[float],
        seeds: Sequence[int | None],
        stop: Sequence[Sequence[str]] | None = None,
        top_logprobs: Sequence[int] | None = None,
        logit_bias: Sequence[Mapping[int, float]] | None = None,
        presence_penalty: Sequence[float] | None = None,
        frequency_penalty: Sequence[float] | None = None,
    ) -> list[tuple[Any, Generation]]:
        """Prefill new rows and merge them into the batch; rows with no room to generate are handed back
        at once (empty, ``"length"``). Settings are per row and assumed checked (see :func:`generate`)."""
        n = len(prompts)
        block = self.model.config.block_size
        limit = [max(0, min(int(max_new[r]), block - len(prompts[r]))) for r in range(n)]
        done = [(keys[r], Generation([], [], [], "length", "")) for r in range(n) if limit[r] <= 0]
        act = [r for r in range(n) if limit[r] > 0]
        if not act:
            return done
        uniq: dict[tuple[int, ...], int] = {}
        src = np.array([uniq.setdefault(tuple(prompts[r]), len(uniq)) for r in act], dtype=np.intp)
        lim = np.array([limit[r] for r in act], dtype=np.intp)
        new = Decoder(self.model, [list(p) for p in uniq], capacity=0, wq=self.dec.wq if self.dec else None)
        logits = new.prefill()
        self._merge(new, src, lim)
        self.logits = np.concatenate([self.logits, logits[src]]) if len(self.logits) else logits[src]
        m = len(act)
        uni = np.zeros((m, self.horizon))
        for j, r in enumerate(act):
            if temperature[r] > 0:
                uni[j, : lim[j]] = np.random.Generator(np.random.PCG64(seeds[r])).random(int(lim[j]))
        stops = [list(stop[r]) for r in act] if stop is not None else [[] for _ in act]
        pres = np.array([presence_penalty[r] for r in act] if presence_penalty is not None else [0.0] * m)
        freq = np.array([frequency_penalty[r] for r in act] if frequency_penalty is not None else [0.0] * m)
        bias = [logit_bias[r] for r in act] if logit_bias is not None else None
        rows: dict[str, Any] = {  # the new rows of _ARRAYS; the others (counters, tokens) start at zero
            "temps": [temperature[r] for r in act],
            "top_ps": [top_p[r] for r in act],
            "limit": lim,
            "ktop": [top_logprobs[r] for r in act] if top_logprobs is not None else np.zeros(m),
            "has_stop": [bool(x) for x in stops],
            "pres": pres,
            "freq": freq,
            "uniforms": uni,
        }
        for name in self._ARRAYS:
            mine = getattr(self, name)
            new_rows = rows.get(name, np.zeros((m, *mine.shape[1:])))
            setattr(self, name, np.concatenate([mine, np.asarray(new_rows, dtype=mine.dtype)]))
        self.keys += [keys[r] for r in act]
        self.live = np.concatenate([self.live, np.ones(m, dtype=bool)])
        vsize, old = self.model.config.vocab_size, len(self.keys) - m
        if bias is not None and any(bias):
            dense = np.zeros((m, vsize))
            for j, b in enumerate(bias):
                for t, v in b.items():
                    dense[j, int(t)] = float(v)
            self.bias = np.concatenate(
                [self.bias if self.bias is not None else np.zeros((old, vsize)), dense]
            )
        elif self.bias is not None:
            self.bias = np.concatenate([self.bias, np.zeros((m, vsize))])
        if self.counts is not None or pres.any() or freq.any():
            prev = self.counts if self.counts is not None else np.zeros((old, vsize))
            self.counts = np.concatenate([prev, np.zeros((m, vsize))])
        self.stops += stops
        self.texts += [""] * m
        self.tops += [[] for _ in range(m)]
        return done

    def _merge(self, new: Decoder, src: np.ndarray, lim: np.ndarray) -> None:
        """Cache of the rows so far followed by the new rows ``src`` of ``new`` (prefilled). In place when
        the cache has room (spare rows, slots before the current one for the prompts, slots after it for
        the completions); else a new cache of the live rows, trimmed of slots before every row's first
        token, with the spare room."""
        old, b, width = self.dec, len(src), new.t
        dtype = self.model.dtype
        if old is not None and self.live.any():
            s, room = old.t, len(old.key_mask)
            fits = s >= width and s + int(lim.max()) - 1 <= old.capacity
            if fits and old.rows + b > room and self.live_rows + b <= room:
                self._keep(np.flatnonzero(self.live))  # finished rows leave (in place) to make room
            a = old.rows
            if fits and a + b <= room:
                offset = new.offset[src] + (s - width)
                for mine, theirs in zip((*old.k, *old.v), (*new.k, *new.v)):
                    mine[a : a + b, :, : s - width] = 0.0  # masked, but read: finite
                    mine[a : a + b, :, s - width : s] = theirs[src, :, :width]
                old.key_mask[a : a + b] = key_mask(offset, old.capacity)
                old.offset = np.concatenate([old.offset, offset])
                return
            if not self.live.all():
                self._keep(np.flatnonzero(self.live))
            a, s, trim = old.rows, old.t, int(old.offset.min())
        else:
            if old is not None:
                self._keep(np.zeros(0, dtype=np.intp))
            a, s, trim = 0, 0, 0
        span = s - trim
        t = max(span, width)
        kept = old.offset - trim + (t - span) if old is not None and a else np.zeros(0, np.intp)
        offset = np.concatenate([kept, new.offset[src] + (t - width)])
        left = np.concatenate([self.limit - self.count, lim])  # tokens each row has still to sample
        capacity = max(t, t + int(left.max()) - 1) + self.spare_slots
        rows = a + b + self.spare_rows
        bufs = []
        for i, theirs in enumerate((*new.k, *new.v)):
            buf = np.empty((rows, theirs.shape[1], capacity, theirs.shape[3]), dtype)
            buf[:, :, :t] = 0.0  # slots before a row's first token are masked, but read: finite
            if a:
                assert old is not None
                mine = (*old.k, *old.v)[i]
                buf[:a, :, t - span : t] = mine[:a, :, trim:s]
            buf[a : a + b, :, t - width : t] = theirs[src, :, :width]
            bufs.append(buf)
        n_layer = len(new.k)
        new.k, new.v = bufs[:n_layer], bufs[n_layer:]
        new.offset = offset
        new.capacity = capacity
        new.t = t
        new.key_mask = np.full((rows, capacity), NEG, dtype)
        new.key_mask[: a + b] = key_mask(offset, capacity)
        self.dec = new

    def _keep(self, rows: np.ndarray) -> None:
        """Keep only decoder rows ``rows`` (in that order) in the cache and the per-row state."""
        if self.dec is not None:
            self.dec.keep(rows)
        self.logits = self.logits[rows]
        rl = rows.tolist()
        self.keys = [self.keys[r] for r in rl]
        self.live = self.live[rows]
        for name in self._ARRAYS:
            setattr(self, name, getattr(self, name)[rows])
        if self.bias is not None:
            self.bias = self.bias[rows]
        if self.counts is not None:
            self.counts = self.counts[rows]
        self.stops = [self.stops[r] for r in rl]
        self.texts = [self.texts[r] for r in rl]
        self.tops = [self.tops[r] for r in rl]

    def _finish(self, r: int, decode: bool = True) -> Generation:
        c = int(self.count[r])
        ids = self.tok[r, :c].tolist()
        text = self.texts[r] if self.stops[r] or not decode else self.model.tokenizer.decode(ids)
        reason: FinishReason = "stop" if self.stopped[r] else "length"
        return Generation(ids, self.lp[r, :c].tolist(), self.tops[r], reason, text)

    def drop(self, which: Callable[[Any], bool]) -> list[tuple[Any, Generation]]:
        """End the live rows whose key satisfies ``which`` now; their partial completions are handed back
        (tokens and logprobs; no ``text``, as nobody reads it)."""
        out = []
        for r in np.flatnonzero(self.live).tolist():
            if which(self.keys[r]):
                self.live[r] = False
                out.append((self.keys[r], self._finish(r, decode=False)))
        return out

    def step(self) -> list[tuple[Any, Generation]]:
        """Sample one token for every live row, hand back the rows that finished, and compute the next
        logits of the others."""
        idx = np.flatnonzero(self.live)
        if idx.size == 0:
            return []
        tok = self.model.tokenizer
        lg, t_r = self.logits[idx], self.count[idx]
        lp = log_softmax(lg)
        adjusted = self.bias is not None or self.counts is not None
        pick = lg.astype(np.float64) if adjusted else lg
        if self.bias is not None:
            pick += self.bias[idx]
        if self.counts is not None:
            c = self.counts[idx]
            pick -= c * self.freq[idx, None] + (c > 0) * self.pres[idx, None]
        nxt = np.argmax(pick, axis=-1)
        samp = self.temps[idx] > 0
        if samp.any():
            rs = idx[samp]
            nxt[samp] = _sample_rows(
                pick[samp].astype(np.float64), self.temps[rs], self.top_ps[rs], self.uniforms[rs, t_r[samp]]
            )
        if self.counts is not None:
            self.counts[idx, nxt] += 1
        self.tok[idx, t_r] = nxt
        self.lp[idx, t_r] = lp[np.arange(len(idx)), nxt]
        ks = self.ktop[idx]
        k_top = int(ks.max())
        if k_top:
            sel = np.flatnonzero(ks > 0)
            lps = lp[sel]
            part = np.argpartition(-lps, k_top - 1, axis=-1)[:, :k_top]
            part.sort(axis=-1)  # ids ascending, so that the stable sort breaks ties by lower id
            pv = np.take_along_axis(lps, part, axis=-1)
            order = np.argsort(-pv, axis=-1, kind="stable")
            top_ids = np.take_along_axis(part, order, axis=-1).tolist()
            top_lps = np.take_along_axis(pv, order, axis=-1).tolist()
            for j, i in enumerate(sel.tolist()):
                k = int(ks[i])
                self.tops[int(idx[i])].append(list(zip(top_ids[j][:k], top_lps[j][:k])))
        self.count[idx] += 1
        done = nxt == tok.end_id
        vocab, special = tok.vocab, tok.special_ids
        for j in np.flatnonzero(
            self.has_stop[idx] & ~done
        ).tolist():  # text is only built for rows with stops
            r, stops = int(idx[j]), self.stops[int(idx[j])]
            t = int(nxt[j])
            if t in special:
                continue
            prev = self.texts[r]
            text = prev + vocab[t]
            hit = _find_stop(text, stops, len(prev))
            if hit is not None:
                text = text[:hit]
                done[j] = True
            self.texts[r] = text
        self.stopped[idx[done]] = True
        ended = done | (self.count[idx] >= self.limit[idx])
        gone = idx[ended]
        self.live[gone] = False
        out = [(self.keys[r], self._finish(r)) for r in gone.tolist()]
        n_live = int(self.live.sum())
        if n_live == 0:
            return out
        feed = np.full(len(self.live), tok.end_id, dtype=np.intp)
        feed[idx] = nxt
        if n_live <= 0.75 * len(self.live):  # drop finished rows from the cache
            keep = np.flatnonzero(self.live)
            self._keep(keep)
            feed = feed[keep]
        assert self.dec is not None
        self.logits = self.dec.step(feed)
        return out


def _find_stop(text: str, stops: list[str], prev_len: int) -> int | None:
    """Earliest start of a stop string that ends in the newly added text, or None."""
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, prev_len - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
