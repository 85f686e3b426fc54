"""Batched KV-cache sampling for a ``transformers`` causal LM, with the embedded sampler's semantics.

Per-row seeds (one uniform draw per sampled token), greedy at temperature 0, nucleus sampling, raw-model
logprobs, stop tokens and strings, and the :class:`~palaestra.models.sampling.Generation` returned are those
of :mod:`palaestra.models.sampling`, so the shared server answers the same way for both backends. Here
logprobs are computed in float32, any of the tokenizer's ``end_ids`` ends a row, and stop strings are searched
in the decoded reply. Prompts are left-padded; ``attention_mask`` hides the pads and ``position_ids`` start at
0 on each row's first real token, so each row is computed as if alone. Finished rows leave the batch and cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from palaestra.models.sampling import FinishReason, Generation

__all__ = ["generate", "sample_tokens"]


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits`` (R, V) given per-row temperature, top_p and uniform ``u`` in [0, 1)."""
    logits = logits.float()
    greedy = torch.argmax(logits, dim=-1)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    kept = torch.where(before < top_p[:, None], sorted_p, torch.zeros_like(sorted_p))
    kept[:, 0] = sorted_p[:, 0]  # the most likely token always survives
    cdf = torch.cumsum(kept, dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)
    n_kept = (kept > 0).sum(dim=-1, keepdim=True)
    pos = torch.minimum(pos, n_kept - 1)
    sampled = order.gather(-1, pos).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


def _cache_kwarg(model: Any) -> str:
    """``cache`` (transformers >= 5) or ``past_key_values`` (older)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class _Row:
    __slots__ = ("done", "finish", "ids", "lps", "max_new", "rng", "stops", "text", "top")

    def __init__(self, seed: int | None, max_new: int, stops: Sequence[str]) -> None:
        self.rng = np.random.default_rng(seed)
        self.max_new = max_new
        self.stops = list(stops)
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.done = False
        self.finish: FinishReason = "length"
        self.text: str | None = None


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: Sequence[int],
    temperature: Sequence[float],
    top_p: Sequence[float],
    seeds: Sequence[int | None],
    stop: Sequence[Sequence[str]] | None = None,
    top_logprobs: int = 0,
    device: torch.device | str = "cpu",
) -> list[Generation]:
    """Sample one completion per prompt (module docstring). ``tokenizer`` is a
    :class:`~palaestra.models.hf.tokenize.ChatTokenizer` (end ids, pad id, decoding)."""
    n = len(prompts)
    if not n:
        return []
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stops = stop if stop is not None else [()] * n
    rows = [_Row(seeds[i], int(max_new_tokens[i]), stops[i]) for i in range(n)]
    ends = tokenizer.end_ids
    L = max(len(p) for p in prompts)
    ids = torch.full((n, L), tokenizer.pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, L - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp_(min=0)
    temps = torch.tensor([float(t) for t in temperature], dtype=torch.float32, device=device)
    tops = torch.tensor([float(t) for t in top_p], dtype=torch.float32, device=device)
    active = [i for i in range(n) if rows[i].max_new > 0]
    key = _cache_kwarg(model)
    cache: Any = None
    step_ids, step_pos = ids, pos
    sel = torch.arange(n, device=device)
    while active:
        kwargs = {key: cache} if cache is not None else {}
        out = model(  # logits of the last position only: the prefill's other positions would be thrown away
            input_ids=step_ids,
            attention_mask=attn,
            position_ids=step_pos,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        cache = _out_cache(out)
        logits = out.logits[:, -1, :].float()
        logp = torch.log_softmax(logits, dim=-1)
        u = torch.tensor([rows[i].rng.random() for i in active], dtype=torch.float32, device=device)
        tok = sample_tokens(logits, temps[sel], tops[sel], u)
        tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        if top_logprobs:
            tv, ti = torch.topk(logp, k=min(top_logprobs, logp.shape[-1]), dim=-1)
            tv_l, ti_l = tv.cpu().tolist(), ti.cpu().tolist()
        tok_l, lp_l = tok.cpu().tolist(), tok_lp.cpu().tolist()
        keep: list[int] = []
        for j, i in enumerate(active):
            r = rows[i]
            t = int(tok_l[j])
            r.ids.append(t)
            r.lps.append(float(lp_l[j]))
            if top_logprobs:
                r.top.append([(int(a), float(b)) for a, b in zip(ti_l[j], tv_l[j])])
            if t in ends:
                r.done, r.finish = True, "stop"
            elif r.stops:
                text = tokenizer.decode(r.ids)
                cut = min((text.find(s) for s in r.stops if s in text), default=-1)
                if cut >= 0:
                    r.done, r.finish, r.text = True, "stop", text[:cut]
            if not r.done and len(r.ids) >= r.max_new:
                r.done = True
            if not r.done:
                keep.append(j)
        if len(keep) < len(active):
            if not keep:
                break
            idx = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(idx)
            attn, sel, tok = attn[idx], sel[idx], tok[idx]
            step_pos = step_pos[idx]
            active = [active[j] for j in keep]
        attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype, device=device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
        step_ids = tok[:, None]
    out_rows = []
    for r in rows:
        if r.text is None:
            body = r.ids[:-1] if r.finish == "stop" and r.ids and r.ids[-1] in ends else r.ids
            r.text = tokenizer.decode(body)
        out_rows.append(Generation(r.ids, r.lps, r.top if top_logprobs else [], r.finish, r.text))
    return out_rows
