"""The one sampler: rows decoded together with per-row settings, over any model's key/value cache.

Each row draws one uniform per sampled token from its own seed, so its output depends only on its prompt,
settings and seed, never on the other rows.

* ``temperature == 0`` is greedy (argmax, lowest id on ties); otherwise softmax(logits / temperature), then
  nucleus filtering with ``top_p``. ``logit_bias`` is added and OpenAI's presence/frequency penalties
  (``count * frequency + (count > 0) * presence``, over the row's generated tokens) subtracted first.
* Reported ``logprobs`` and ``top_logprobs`` are those of the RAW model distribution: what the trainer recomputes.
* A row stops on an end token (kept in ``token_ids``, left out of ``text``), on a stop string (``text`` is cut
  before it), or after ``max_new_tokens`` or at ``block_size`` tokens (finish ``"length"``).
* Stop strings are searched as the reply grows (other tokenizers' text by :func:`new_text`); a finished row's
  ``text`` is one full decode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import numpy as np

from palaestra.models._kernels import NEG, ln_fwd
from palaestra.models._runtime import chunk_slices, parallel_map
from palaestra.models.tinygpt import TinyGPT, mlp, scaled_qkv, trunk_forward
from palaestra.models.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]
GEN_TOKENS_PER_ROW = 16  # work estimate per row when deciding how to split a batch over the workers
DRAWS = 64  # uniforms drawn per row at a time (more as its completion grows)
_V = TypeVar("_V")


@dataclass
class Generation:
    """One sampled completion."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    text: str = ""


class RowCache(Protocol):
    """A backend's side of a :class:`DecodeBatch`: the key/value cache of its rows, in order. ``add`` prefills
    ``prompts`` and appends one row per entry of ``src`` (an index into ``prompts``); ``steps``: the most tokens
    any row will still sample. ``fits``: whether new rows can join without the finished rows leaving first.
    ``pick`` works as :func:`pick_tokens` on the backend's device (only the picks cross to the host)."""

    tokenizer: Any  # decode(ids)
    end_ids: frozenset[int]  # tokens that end a row's turn
    vocab_size: int
    block_size: int
    logits: Any  # (rows, V) next-token logits, in the backend's array type and place

    def fits(self, rows: int, width: int, steps: int) -> bool: ...
    def add(self, prompts: Sequence[Sequence[int]], src: np.ndarray, steps: int) -> None: ...
    def step(self, tokens: np.ndarray) -> None: ...
    def keep(self, rows: np.ndarray) -> None: ...
    def pick(self, rows: np.ndarray, how: Picking) -> Picks: ...


def key_mask(offset: np.ndarray, capacity: int) -> np.ndarray:
    """(rows, capacity) additive mask: 0 from each row's first token (``offset``) on, :data:`NEG` before it."""
    return np.where(np.arange(capacity)[None, :] >= offset[:, None], 0.0, NEG)


class TinyGPTCache:
    """The numpy TinyGPT's :class:`RowCache`: per layer (rows, heads, slots, hd) keys and values, row ``r``
    from slot ``offset[r]`` on (left padding masked); slot ``t`` is written next. Spare rows and slots let rows
    joining later be written in place."""

    def __init__(self, model: TinyGPT, *, spare_rows: int = 0, spare_slots: int = 0) -> None:
        cfg = model.config
        self.model, self.tokenizer = model, model.tokenizer
        self.vocab_size, self.block_size = cfg.vocab_size, cfg.block_size
        self.end_ids = frozenset({model.tokenizer.end_id})
        self.spare_rows, self.spare_slots = int(spare_rows), int(spare_slots)
        self.wq = [scaled_qkv(blk, cfg.n_head) for blk in model.weights.blocks]
        empty = np.zeros((0, cfg.n_head, 0, cfg.d_model // cfg.n_head), model.dtype)
        self.k, self.v = [empty] * cfg.n_layer, [empty] * cfg.n_layer
        self.offset = np.zeros(0, dtype=np.intp)
        self.key_mask = np.zeros((0, 0), model.dtype)
        self.t = 0  # filled slots
        self.logits = np.zeros((0, cfg.vocab_size), model.dtype)  # each row's next-token logits

    @property
    def rows(self) -> int:
        return len(self.offset)

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2])

    def fits(self, rows: int, width: int, steps: int) -> bool:
        """Spare rows, slots before the current one for the prompts and after it for the completions."""
        return (
            self.rows > 0
            and self.t >= width
            and self.t + steps - 1 <= self.capacity
            and self.rows + rows <= len(self.key_mask)
        )

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Keys then values of each layer (P, H, L, hd), left padding and logits (P, V) of the prompts."""
        m = self.model
        lens = np.array([len(p) for p in prompts], dtype=np.intp)
        if lens.size == 0 or lens.min() < 1:
            raise ValueError("every prompt needs at least one token")
        L, P = int(lens.max()), len(prompts)
        if self.block_size < L:
            raise ValueError(f"prompt of {L} tokens exceeds block_size {self.block_size}")
        offset = L - lens
        x = np.full((P, L), m.tokenizer.pad_id, dtype=np.intp)
        for r, p in enumerate(prompts):
            x[r, L - len(p) :] = p
        slots = np.arange(L)
        pos = np.maximum(slots[None, :] - offset[:, None], 0)
        causal = np.triu(np.full((L, L), NEG, m.dtype), 1)
        # pad keys are hidden from real queries only, so that no row of scores is fully masked
        hide = (slots < offset[:, None, None]) & (slots[:, None] >= offset[:, None, None])  # (P, L, L)
        mask = (causal[None] + np.where(hide, NEG, 0.0).astype(m.dtype))[:, None]
        kv: list[tuple[np.ndarray, np.ndarray]] = []
        hf = trunk_forward(m.weights, m.config.n_head, x, pos=pos, mask=mask, kv_out=kv)[0]  # (P*L, d)
        return [k for k, _ in kv] + [v for _, v in kv], offset, m.head(hf.reshape(P, L, -1)[:, -1])

    def add(self, prompts: Sequence[Sequence[int]], src: np.ndarray, steps: int) -> None:
        """Prefill; write the new rows in place when it :meth:`fits`, else into a new cache (the rows so far
        trimmed of slots before every row's first token, the new rows, the spare room)."""
        theirs, new_off, logits = self._prefill(prompts)
        self.logits = np.concatenate([self.logits, logits[src]]) if len(self.logits) else logits[src]
        a, b, s, width = self.rows, len(src), self.t, int(theirs[0].shape[2])
        if self.fits(b, width, steps):
            offset = new_off[src] + (s - width)
            for mine, kv in zip((*self.k, *self.v), theirs):
                mine[a : a + b, :, : s - width] = 0.0  # masked, but read: finite
                mine[a : a + b, :, s - width : s] = kv[src]
            self.key_mask[a : a + b] = key_mask(offset, self.capacity)
            self.offset = np.concatenate([self.offset, offset])
            return
        trim = int(self.offset.min()) if a else s
        span = s - trim
        t = max(span, width)
        offset = np.concatenate([self.offset - trim + (t - span), new_off[src] + (t - width)])
        capacity = max(t, t + steps - 1) + self.spare_slots
        rows = a + b + self.spare_rows
        bufs = []
        for mine, kv in zip((*self.k, *self.v), theirs):
            buf = np.empty((rows, kv.shape[1], capacity, kv.shape[3]), self.model.dtype)
            buf[:, :, :t] = 0.0  # slots before a row's first token are masked, but read: finite
            buf[:a, :, t - span : t] = mine[:a, :, trim:s]
            buf[a : a + b, :, t - width : t] = kv[src]
            bufs.append(buf)
        self.k, self.v = bufs[: len(self.k)], bufs[len(self.k) :]
        self.offset, self.t = offset, t
        self.key_mask = np.full((rows, capacity), NEG, self.model.dtype)
        self.key_mask[: a + b] = key_mask(offset, capacity)

    def step(self, tokens: np.ndarray) -> None:
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
        self.logits = self.model.head(ln_fwd(h, W.lnf_g, W.lnf_b)[0])

    def keep(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.intp)
        self.offset = self.offset[rows]
        self.logits = self.logits[rows]
        self.key_mask[: len(rows)] = self.key_mask[rows]  # in place: spare rows stay allocated
        for buf in (*self.k, *self.v):
            buf[: len(rows), :, : self.t] = buf[rows, :, : self.t]  # slots from t on are written before read

    def pick(self, rows: np.ndarray, how: Picking) -> Picks:
        return pick_tokens(self.logits[rows], how)


def _n_rows(values: Sequence[_V], n: int, name: str) -> list[_V]:
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return list(values)


def _per_row(value: Any, n: int, name: str, cast: Callable[[Any], _V]) -> list[_V]:
    """One ``cast`` entry per prompt: a list or tuple must have ``n`` entries; any other value is repeated."""
    return [cast(x) for x in (_n_rows(value, n, name) if isinstance(value, (list, tuple)) else [value] * n)]


def _sample_rows(logits: np.ndarray, temps: np.ndarray, top_ps: np.ndarray, u: np.ndarray) -> np.ndarray:
    """One token per row from softmax(logits/temp) restricted to its top_p nucleus (u: uniforms)."""
    with np.errstate(over="ignore", invalid="ignore"):  # a temperature so small that logits / temp overflow
        z = logits / temps[:, None]
        top = z.max(-1, keepdims=True)
        z -= top
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    out = np.empty(len(p), dtype=np.intp)
    hot = np.flatnonzero(np.isinf(top[:, 0]))  # rows at the temperature-0 limit: the argmax (their p is NaN)
    if hot.size:
        p[hot] = 0.0
        p[hot, np.argmax(logits[hot], axis=-1)] = 1.0
    nuc = top_ps < 1.0
    full = ~nuc
    if full.any():
        cdf = np.cumsum(p[full], axis=-1)
        out[full] = np.minimum((cdf < (u[full] * cdf[:, -1])[:, None]).sum(-1), p.shape[1] - 1)
    if nuc.any():
        pn = p[nuc]
        order = np.argsort(-pn, axis=-1, kind="stable")
        ps = np.take_along_axis(pn, order, axis=-1)
        ps[(np.cumsum(ps, axis=-1) - ps) >= top_ps[nuc][:, None]] = 0.0  # keep until the mass reaches top_p
        cdf = np.cumsum(ps, axis=-1)
        idx = np.minimum((cdf < (u[nuc] * cdf[:, -1])[:, None]).sum(-1), p.shape[1] - 1)
        out[nuc] = order[np.arange(len(idx)), idx]
    return out


@dataclass(frozen=True)
class Picking:
    """How to choose the next token of each of some rows (module docstring); arrays over those rows."""

    temps: np.ndarray  # temperature; 0 is greedy
    top_ps: np.ndarray  # nucleus mass
    u: np.ndarray  # the row's uniform draw for this token
    top_k: np.ndarray  # most likely tokens to report with their logprobs (0: none)
    bias: np.ndarray | None = None  # (rows, V) added to the logits, or None
    penalty: np.ndarray | None = None  # (rows, V) subtracted from the logits, or None


#: the tokens, their raw log-probabilities, and each row's ``top_k`` most likely ``(id, logprob)``
Picks = tuple[np.ndarray, np.ndarray, list[list[tuple[int, float]]]]


def pick_tokens(logits: np.ndarray, how: Picking) -> Picks:
    """The next token of each row of ``logits`` (rows, V), as the module docstring says."""
    lp = logits - logits.max(-1, keepdims=True)  # log-softmax
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    pick = logits.astype(np.float64) if how.bias is not None or how.penalty is not None else logits
    if how.bias is not None:
        pick += how.bias
    if how.penalty is not None:
        pick -= how.penalty
    nxt = np.argmax(pick, axis=-1)
    samp = how.temps > 0
    if samp.any():
        nxt[samp] = _sample_rows(
            pick[samp].astype(np.float64, copy=False), how.temps[samp], how.top_ps[samp], how.u[samp]
        )
    tops: list[list[tuple[int, float]]] = [[] for _ in range(len(nxt))]
    k_top = int(how.top_k.max()) if len(how.top_k) else 0
    if k_top:
        sel = np.flatnonzero(how.top_k > 0)
        part = np.argpartition(-lp[sel], k_top - 1, axis=-1)[:, :k_top]
        top_lists(tops, sel, how.top_k, part, np.take_along_axis(lp[sel], part, axis=-1))
    return nxt, lp[np.arange(len(nxt)), nxt], tops


def top_lists(
    tops: list[list[tuple[int, float]]], sel: np.ndarray, top_k: np.ndarray, ids: np.ndarray, lps: np.ndarray
) -> None:
    """``tops[i]`` for the rows ``sel``: the ``top_k[i]`` most likely of candidates ``ids`` (rows, k) with
    logprobs ``lps``, lower id first on ties."""
    by_id = np.argsort(ids, axis=-1)
    ids, lps = np.take_along_axis(ids, by_id, axis=-1), np.take_along_axis(lps, by_id, axis=-1)
    order = np.argsort(-lps, axis=-1, kind="stable")
    top_ids = np.take_along_axis(ids, order, axis=-1).tolist()
    top_lps = np.take_along_axis(lps, order, axis=-1).tolist()
    for j, i in enumerate(sel.tolist()):
        tops[i] = list(zip(top_ids[j][: top_k[i]], top_lps[j][: top_k[i]]))


def generate(
    model: TinyGPT | Callable[[], RowCache],
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
    """A completion for every prompt. ``model``: a TinyGPT (large batches split over the worker threads) or a
    function returning a fresh :class:`RowCache`."""
    new_cache = (lambda: TinyGPTCache(model)) if isinstance(model, TinyGPT) else model
    n = len(prompts)
    seed_list = _n_rows(seeds, n, "seeds")
    max_new = _per_row(max_new_tokens, n, "max_new_tokens", int)
    temps = _per_row(temperature, n, "temperature", float)
    top_ps = _per_row(top_p, n, "top_p", float)
    stops = [list(s) for s in _n_rows(stop, n, "stop")] if stop is not None else [[] for _ in range(n)]
    if any(m < 0 for m in max_new) or min(temps, default=0) < 0 or any(not 0 < x <= 1 for x in top_ps):
        raise ValueError("max_new_tokens must be >= 0, temperature >= 0 and 0 < top_p <= 1")
    if any(not s for ss in stops for s in ss):
        raise ValueError("stop strings must be non-empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not n:
        return []
    first = new_cache()
    vocab, k_top = first.vocab_size, int(top_logprobs)
    if not 0 <= k_top <= vocab:
        raise ValueError(f"top_logprobs must be in [0, {vocab}]")
    biases = _n_rows(logit_bias, n, "logit_bias") if logit_bias is not None else [{} for _ in range(n)]
    if any(not 0 <= int(t) < vocab for b in biases for t in b):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    pres = _per_row(presence_penalty, n, "presence_penalty", float)
    freq = _per_row(frequency_penalty, n, "frequency_penalty", float)

    def run(sl: slice) -> list[Generation]:
        batch = DecodeBatch(first if sl.start == 0 else new_cache())
        done = batch.add(
            list(range(sl.stop - sl.start)),  # a row's key: its index in this part
            prompts[sl],
            max_new=max_new[sl],
            temperature=temps[sl],
            top_p=top_ps[sl],
            seeds=seed_list[sl],
            stop=stops[sl],
            top_logprobs=[k_top] * (sl.stop - sl.start),
            logit_bias=biases[sl],  # all empty or zero: no (rows, V) bias or counts (DecodeBatch.add)
            presence_penalty=pres[sl],
            frequency_penalty=freq[sl],
        )
        while batch.live_rows:
            done += batch.step()
        return [g for _, g in sorted(done, key=lambda kg: int(kg[0]))]

    if not isinstance(model, TinyGPT):  # another backend (torch) runs its own threads: no numpy worker hop
        return run(slice(0, n))
    return [g for part in parallel_map(run, chunk_slices(n, GEN_TOKENS_PER_ROW)) for g in part]


class DecodeBatch:
    """Rows decoded together over a backend's :class:`RowCache`, joining (:meth:`add`) and leaving
    (:meth:`step` hands back finished rows with the caller's key; :meth:`drop` ends rows at once)."""

    # per-row state, first axis the rows (_keep keeps them in step): settings and counters (rows,), and one
    # entry per generated position (rows, width), width growing with the longest completion
    _ARRAYS: tuple[str, ...] = ("live", "temps", "top_ps", "limit", "count", "ktop", "stopped", "has_stop")
    _ARRAYS += ("pres", "freq", "prefix", "read", "uniforms", "tok", "lp")
    _LISTS = ("keys", "rngs", "stops", "texts", "tops")  # per-row lists, kept in step too

    def __init__(self, cache: RowCache) -> None:
        self.cache = cache
        self.tokenizer = cache.tokenizer
        self.exact_pieces = isinstance(self.tokenizer, Tokenizer)  # its tokens are exact text pieces
        self.end_ids = np.array(sorted(cache.end_ids), dtype=np.intp)
        self.keys: list[Any] = []
        self.rngs: list[np.random.Generator | None] = []  # per row: its seed's stream (None: greedy)
        # the _ARRAYS; prefix and read: new_text's offsets into each row's tokens (its text so far)
        self.live, self.stopped, self.has_stop = (np.zeros(0, dtype=bool) for _ in range(3))
        self.limit, self.count, self.ktop, self.prefix, self.read = (np.zeros(0, np.intp) for _ in range(5))
        self.temps, self.top_ps, self.pres, self.freq = (np.zeros(0) for _ in range(4))
        self.uniforms = np.zeros((0, DRAWS))  # row r's t-th sampled token uses the t-th draw of its seed
        self.tok, self.lp = np.zeros((0, DRAWS), dtype=np.intp), np.zeros((0, DRAWS))
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
        """Prefill new rows and merge them in; rows with no room to generate are handed back at once.
        Settings are per row and assumed checked (see :func:`generate`)."""
        n = len(prompts)
        limit = [max(0, min(int(max_new[r]), self.cache.block_size - len(prompts[r]))) for r in range(n)]
        done = [(keys[r], Generation([], [], [], "length", "")) for r in range(n) if limit[r] <= 0]
        act = [r for r in range(n) if limit[r] > 0]
        if not act:
            return done
        uniq: dict[tuple[int, ...], int] = {}
        src = np.array([uniq.setdefault(tuple(prompts[r]), len(uniq)) for r in act], dtype=np.intp)
        lim = np.array([limit[r] for r in act], dtype=np.intp)
        steps = max(int(lim.max()), self.steps_left)
        width = max(len(p) for p in uniq)
        if not self.live.all() and not (self.live.any() and self.cache.fits(len(act), width, steps)):
            self._keep(np.flatnonzero(self.live))  # finished rows leave (to make room)
        self.cache.add([list(p) for p in uniq], src, steps)
        m = len(act)
        rngs = [np.random.default_rng(seeds[r]) if temperature[r] > 0 else None for r in act]
        w = self.tok.shape[1]
        uni = np.array([rng.random(w) if rng is not None else np.zeros(w) for rng in rngs])
        stops = [list(stop[r]) for r in act] if stop is not None else [[] for _ in act]
        pres = np.array([presence_penalty[r] for r in act] if presence_penalty is not None else [0.0] * m)
        freq = np.array([frequency_penalty[r] for r in act] if frequency_penalty is not None else [0.0] * m)
        bias = [logit_bias[r] for r in act] if logit_bias is not None else []
        rows: dict[str, Any] = {  # the new rows of _ARRAYS; the others (counters, tokens) start at zero
            "live": np.ones(m),
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
        self.rngs += rngs
        vsize, old = self.cache.vocab_size, len(self.keys) - m
        if self.bias is not None or any(bias):
            prev = self.bias if self.bias is not None else np.zeros((old, vsize))
            self.bias = np.concatenate([prev, np.zeros((m, vsize))])
            for j, b in enumerate(bias):
                for t, v in b.items():
                    self.bias[old + j, int(t)] = float(v)
        if self.counts is not None or pres.any() or freq.any():
            prev = self.counts if self.counts is not None else np.zeros((old, vsize))
            self.counts = np.concatenate([prev, np.zeros((m, vsize))])
        self.stops += stops
        self.texts += [""] * m
        self.tops += [[] for _ in range(m)]
        return done

    def _keep(self, rows: np.ndarray) -> None:
        """Keep only cache rows ``rows`` (in that order) in the cache and the per-row state."""
        self.cache.keep(rows)
        for name in (*self._ARRAYS, "bias", "counts"):
            if (arr := getattr(self, name)) is not None:
                setattr(self, name, arr[rows])
        rl = rows.tolist()
        for name in self._LISTS:
            setattr(self, name, [getattr(self, name)[r] for r in rl])

    def _finish(self, r: int, decode: bool = True) -> Generation:
        c = int(self.count[r])
        ids = self.tok[r, :c].tolist()
        reason: FinishReason = "stop" if self.stopped[r] else "length"
        text = self.texts[r]  # with stops: the reply so far, cut before a stop that ended it
        if decode and not (self.exact_pieces and self.stops[r]):  # exact pieces: texts[r] is the full decode
            ended = reason == "stop" and ids and ids[-1] in self.cache.end_ids
            full = self.tokenizer.decode(ids[:-1] if ended else ids)
            hit = _find_stop(full, self.stops[r])
            by_stop = reason == "stop" and not ended  # the grown text met a stop string
            if hit is not None or not by_stop:  # (else the full decode lacks that stop: the grown cut stands)
                text = full[:hit]
        return Generation(ids, self.lp[r, :c].tolist(), self.tops[r], reason, text)

    def drop(self, which: Callable[[Any], bool]) -> list[tuple[Any, Generation]]:
        """End the live rows whose key satisfies ``which`` now; their partial completions (no ``text``)."""
        rows = [r for r in np.flatnonzero(self.live).tolist() if which(self.keys[r])]
        self.live[rows] = False
        return [(self.keys[r], self._finish(r, decode=False)) for r in rows]

    def step(self) -> list[tuple[Any, Generation]]:
        """Sample one token for every live row; hand back the rows that finished."""
        idx = np.flatnonzero(self.live)
        if idx.size == 0:
            return []
        t_r, w = self.count[idx], self.tok.shape[1]
        if int(t_r.max()) >= w:  # room for twice as many tokens per row, more uniforms from each row's stream
            self.tok = np.pad(self.tok, ((0, 0), (0, w)))
            self.lp = np.pad(self.lp, ((0, 0), (0, w)))
            more = np.zeros((len(self.rngs), w))
            for r, rng in enumerate(self.rngs):
                if rng is not None and self.live[r]:
                    more[r] = rng.random(w)
            self.uniforms = np.concatenate([self.uniforms, more], axis=1)
        penalty = None
        if self.counts is not None:
            c = self.counts[idx]
            penalty = c * self.freq[idx, None] + (c > 0) * self.pres[idx, None]
        ks = self.ktop[idx]
        bias = None if self.bias is None else self.bias[idx]
        how = Picking(self.temps[idx], self.top_ps[idx], self.uniforms[idx, t_r], ks, bias, penalty)
        nxt, lp, tops = self.cache.pick(idx, how)
        if self.counts is not None:
            self.counts[idx, nxt] += 1
        self.tok[idx, t_r] = nxt
        self.lp[idx, t_r] = lp
        for i in np.flatnonzero(ks > 0).tolist():
            self.tops[int(idx[i])].append(tops[i])
        self.count[idx] += 1
        done = np.isin(nxt, self.end_ids)
        for j in np.flatnonzero(self.has_stop[idx] & ~done).tolist():
            r = int(idx[j])
            old = self.texts[r]
            if self.exact_pieces:
                new, complete = self.tokenizer.decode([int(nxt[j])]), True
            else:  # other tokenizers may write a token differently beside its neighbours
                new, complete = new_text(
                    self.tokenizer.decode, self.tok[r, : self.count[r]], self.prefix[r], self.read[r]
                )
            # no stop is in the old text, so search only its tail (and the new text, even incomplete)
            text = old + new
            hit = _find_stop(text, self.stops[r], max(0, len(old) + 1 - max(map(len, self.stops[r]))))
            if hit is not None:
                self.texts[r] = text[:hit]
                done[j] = True
            elif complete:
                self.texts[r] = text
                self.prefix[r], self.read[r] = self.read[r], self.count[r]
        self.stopped[idx[done]] = True
        gone = idx[done | (self.count[idx] >= self.limit[idx])]
        self.live[gone] = False
        out = [(self.keys[r], self._finish(r)) for r in gone.tolist()]
        n_live = int(self.live.sum())
        if n_live == 0:
            return out
        feed = np.full(len(self.live), self.end_ids[0], dtype=np.intp)
        feed[idx] = nxt
        if n_live <= 0.75 * len(self.live):  # drop finished rows from the cache
            keep = np.flatnonzero(self.live)
            self._keep(keep)
            feed = feed[keep]
        self.cache.step(feed)
        return out


def new_text(decode: Callable[[list[int]], str], ids: np.ndarray, prefix: int, read: int) -> tuple[str, bool]:
    """The text that ``ids[read:]`` add to the reply (what ``decode(ids[prefix:])`` has beyond
    ``decode(ids[prefix:read])``) and whether it is complete (not empty, not ending in U+FFFD); when complete,
    the caller moves on (``prefix, read = read, len(ids)``)."""
    shorter = decode(ids[prefix:read].tolist())
    longer = decode(ids[prefix:].tolist())
    new = longer[len(shorter) :] if len(longer) > len(shorter) else ""
    return new, bool(new) and not new.endswith("\ufffd")


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Earliest start (at ``start`` or later) of a stop string in ``text``, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
