"""A ``transformers`` causal LM's :class:`~palaestra.models.sampling.RowCache`, for the shared sampler and engine.

The rows share one left-padded ``DynamicCache`` (``attention_mask`` hides the pads, ``position_ids`` count each
row's own tokens); merging rows and trimming shared padding needs full-attention layers (others: serve on vLLM).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.functional import pad

from palaestra.models.sampling import Generation, Picking, Picks, top_lists
from palaestra.models.sampling import generate as sample

__all__ = ["HFRowCache", "check_cache_layers", "context_length", "generate"]


class HFRowCache:
    """The rows of one generation pass of ``model`` (module docstring) with a ``ChatTokenizer``."""

    def __init__(self, model: Any, tokenizer: Any, *, device: torch.device | str, block_size: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.end_ids: frozenset[int] = tokenizer.end_ids
        self.vocab_size, self.block_size = int(tokenizer.vocab_size), int(block_size)
        self.device = torch.device(device)
        base = check_cache_layers(model)
        # the cache's keyword: ``cache`` (transformers >= 5) or ``past_key_values`` (older)
        self.key = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.cache: Any = None  # DynamicCache of the rows (batch, heads, slots, head dim per layer)
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # 1 on each row's real slots
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's next position
        self.logits = torch.zeros((0, self.vocab_size), device=self.device)  # each row's next-token logits

    def fits(self, rows: int, width: int, steps: int) -> bool:
        """Never: joining rows always rebuild the cache, so finished rows leave first."""
        return False

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        kwargs = {self.key: cache} if cache is not None else {}
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        self.cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[:, -1].float()  # type: ignore[no-any-return]

    @torch.no_grad()
    def add(self, prompts: Sequence[Sequence[int]], src: np.ndarray, steps: int) -> None:
        width = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) < 1:
            raise ValueError("every prompt needs at least one token")
        ids = torch.full((len(prompts), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        old, old_mask = self.cache, self.mask
        self.mask = mask
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        logits = self._forward(ids, pos, None)
        rows = torch.as_tensor(src, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(rows)  # one row per choice (identical prompts were prefilled once)
        new_mask = self.mask = mask[rows]
        if old is not None and len(old_mask):  # the rows so far, then the new ones, padded on the left
            span = max(old_mask.shape[1], width)
            for mine, new in zip(old.layers, self.cache.layers):
                for name in ("keys", "values"):
                    a, b = getattr(mine, name), getattr(new, name)
                    both = (pad(a, (0, 0, span - a.shape[2], 0)), pad(b, (0, 0, span - b.shape[2], 0)))
                    setattr(mine, name, torch.cat(both))
            both = (pad(old_mask, (span - old_mask.shape[1], 0)), pad(self.mask, (span - width, 0)))
            self.cache, self.mask = old, torch.cat(both)
        self.pos = torch.cat([self.pos, new_mask.sum(-1)])
        self.logits = torch.cat([self.logits, logits[rows]])

    @torch.no_grad()
    def step(self, tokens: np.ndarray) -> None:
        self.mask = pad(self.mask, (0, 1), value=1)
        ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long, device=self.device)[:, None]
        self.logits = self._forward(ids, self.pos[:, None], self.cache)
        self.pos += 1

    def keep(self, rows: np.ndarray) -> None:
        idx = torch.as_tensor(np.asarray(rows), dtype=torch.long, device=self.device)
        self.mask, self.pos, self.logits = self.mask[idx], self.pos[idx], self.logits[idx]
        if not len(idx):
            self.cache, self.mask = None, self.mask[:, :0]
            return
        self.cache.batch_select_indices(idx)
        lead = int(self.mask.any(0).int().argmax())  # slots that are padding in every row
        if lead:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    @torch.no_grad()
    def pick(self, rows: np.ndarray, how: Picking) -> Picks:
        """:func:`palaestra.models.sampling.pick_tokens` on the logits of ``rows``, on the model's device."""
        dev = self.device
        logits = self.logits[torch.as_tensor(rows, dtype=torch.long, device=dev)]
        lp = torch.log_softmax(logits, -1)
        pick = logits.double() if how.bias is not None or how.penalty is not None else logits
        if how.bias is not None:
            pick += torch.as_tensor(how.bias, device=dev)
        if how.penalty is not None:
            pick -= torch.as_tensor(how.penalty, device=dev)
        nxt = pick.argmax(-1)
        samp = np.flatnonzero(how.temps > 0)
        if len(samp):
            on = torch.as_tensor(samp, device=dev)
            nxt[on] = _sample_rows(pick[on].double(), how.temps[samp], how.top_ps[samp], how.u[samp])
        tops: list[list[tuple[int, float]]] = [[] for _ in range(len(rows))]
        k_top = int(how.top_k.max()) if len(how.top_k) else 0
        if k_top:
            sel = np.flatnonzero(how.top_k > 0)
            vals, ids = lp[torch.as_tensor(sel, device=dev)].topk(k_top, dim=-1)
            top_lists(tops, sel, how.top_k, ids.cpu().numpy(), vals.cpu().numpy())
        return nxt.cpu().numpy(), lp.gather(1, nxt[:, None])[:, 0].cpu().numpy(), tops


def _sample_rows(logits: torch.Tensor, temps: np.ndarray, top_ps: np.ndarray, u: np.ndarray) -> torch.Tensor:
    """:func:`palaestra.models.sampling._sample_rows` in torch on the logits' device, step for step (float64);
    the per-row settings stay on the host, so no branch waits for the device."""
    dev = logits.device
    t, cut, draw = (torch.as_tensor(x, device=dev) for x in (temps, top_ps, u))
    z = logits / t[:, None]
    hot = torch.isinf(z.amax(-1, keepdim=True))  # a temperature so small that logits / temp overflow: argmax
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    p = torch.where(hot, greedy, torch.softmax(z, -1))  # (no host sync: the check stays on the device)
    out = torch.empty(len(p), dtype=torch.long, device=dev)
    full, nuc = np.flatnonzero(top_ps >= 1.0), np.flatnonzero(top_ps < 1.0)
    if len(full):
        rows = torch.as_tensor(full, device=dev)
        out[rows] = _first_reaching(p[rows].cumsum(-1), draw[rows])
    if len(nuc):
        rows = torch.as_tensor(nuc, device=dev)
        ps, order = p[rows].sort(dim=-1, descending=True, stable=True)
        ps[(ps.cumsum(-1) - ps) >= cut[rows][:, None]] = 0.0  # keep tokens until the mass reaches top_p
        out[rows] = order.gather(1, _first_reaching(ps.cumsum(-1), draw[rows])[:, None])[:, 0]
    return out


def _first_reaching(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, how many running sums ``cdf`` are below ``u`` times the row's total (at most the last index)."""
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp_(max=cdf.shape[1] - 1)


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    **settings: Any,
) -> list[Generation]:
    """:func:`palaestra.models.sampling.generate` (same settings) for a bare ``transformers`` model."""
    size = context_length(model, block_size)
    return sample(lambda: HFRowCache(model, tokenizer, device=device, block_size=size), prompts, **settings)


def check_cache_layers(model: Any) -> Any:
    """The base model of ``model``; ValueError unless each of its cache layers is full attention."""
    from transformers import DynamicCache

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kinds = {type(layer).__name__ for layer in DynamicCache(config=base.config).layers} - {"DynamicLayer"}
    if kinds:
        raise ValueError(
            f"in-process generation does not support {sorted(kinds)} cache layers (rows are merged slot by "
            "slot: full attention only); serve this model on vLLM (HFModel(..., vllm=...))"
        )
    return base


def context_length(model: Any, block_size: int | None = None) -> int:
    """``block_size`` when given, else the config's ``max_position_embeddings`` (2048 when it has none)."""
    return int(block_size or getattr(model.config, "max_position_embeddings", 2048))
