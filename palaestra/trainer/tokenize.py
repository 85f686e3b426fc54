"""Trajectories -> token ids, trainable masks and sampling-time logprobs, with the embedded chat template.

Rules (one trajectory, items of ``messages_and_choices`` in order):

* the trajectory's ``tools`` render first (the template's ``Tools:`` system turn), as the server rendered
  them for every request of the rollout;
* a message **dict** (any role, assistant included) is context: it is rendered alone with the chat template
  (``<|role|>`` + content + ``<|end|>``; an assistant dict's ``tool_calls`` as ``<call>...</call>``; a
  ``tool`` result as ``<|tool|>`` + result + ``<|end|>``) and never trained on;
* a **Choice** came from the policy: the generation prompt (``<|assistant|>``) is context, then come exactly
  the sampled tokens, recovered from ``choice.logprobs.content[i].token`` with ``tokenizer.id_of``; they are
  trainable and carry their sampling-time logprob as ``old_logp`` (a tool-call reply included: its
  ``<call>...</call>`` tokens are sampled tokens like any other). If the last sampled token is not
  ``<|end|>`` (the reply was cut by ``max_tokens`` or a stop string), the template's ``<|end|>`` is appended
  as context, so later turns see the same text as the server did;
* a Choice without logprobs is refused (:class:`MissingLogprobsError`, naming the trajectory) unless
  ``allow_missing_logprobs``: then its text is re-encoded, ``old_logp`` is NaN (the loss treats the token as
  on-policy, ratio 1), its tool calls are re-rendered after the text, and its ``<|end|>`` is trainable
  only when ``finish_reason`` is ``"stop"`` or ``"tool_calls"``.

:func:`pack` right-pads tokenized trajectories into arrays aligned with ``TinyGPT.forward_logprobs``:
``logp[b, t]`` scores ``ids[b, t + 1]``, so ``mask`` and ``old_logp`` are shifted by one. Tokens after the
last trainable one cannot change the loss (attention is causal) and are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from openai.types.chat.chat_completion import Choice

from palaestra.models.tokenizer import Tokenizer
from palaestra.models.toolcalls import tool_calls_text
from palaestra.trajectories.types import Trajectory

__all__ = [
    "MissingLogprobsError",
    "PackedBatch",
    "SequenceTooLongError",
    "TokenizedTrajectory",
    "pack",
    "tokenize_batch",
    "tokenize_trajectory",
]


class MissingLogprobsError(ValueError):
    """A Choice carries no sampling-time logprobs and the config does not allow recomputing them."""


class SequenceTooLongError(ValueError):
    """A rendered trajectory does not fit the model's context."""


@dataclass(frozen=True)
class TokenizedTrajectory:
    """One rendered trajectory: token ``ids`` (L,), ``mask`` (L,) True on tokens the policy sampled,
    ``old_logp`` (L,) their sampling-time logprobs (NaN where unknown or not trainable)."""

    trajectory_id: str
    ids: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray

    @property
    def n_trainable(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded batch: ``ids`` (B, T) ints; ``mask`` and ``old_logp`` (B, T-1) aligned with the model's
    ``logp[b, t] = log p(ids[b, t+1] | ids[b, :t+1])``; ``lengths`` (B,) tokens kept per row."""

    ids: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    lengths: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def _choice_tokens(
    choice: Choice, tokenizer: Tokenizer, traj_id: str, item: int, allow_missing: bool
) -> tuple[list[int], list[bool], list[float]]:
    content = choice.logprobs.content if choice.logprobs is not None else None
    end = tokenizer.end_id
    if content is None:
        if not allow_missing:
            raise MissingLogprobsError(
                f"trajectory {traj_id}: messages_and_choices[{item}] is a Choice without logprobs; sample "
                "with logprobs=True or set TrainConfig.allow_missing_logprobs=True to recompute them"
            )
        text = (choice.message.content or "") + tool_calls_text(choice.message.tool_calls)
        ids = tokenizer.encode(text)
        stopped = choice.finish_reason in ("stop", "tool_calls")
        return [*ids, end], [True] * len(ids) + [stopped], [float("nan")] * (len(ids) + 1)
    out: list[int] = []
    lps: list[float] = []
    for k, entry in enumerate(content):
        try:
            out.append(tokenizer.id_of(entry.token))
        except KeyError:
            raise ValueError(
                f"trajectory {traj_id}: messages_and_choices[{item}].logprobs.content[{k}].token "
                f"{entry.token!r} is not in the model's vocabulary (sampled by another model?)"
            ) from None
        lp = entry.logprob
        lps.append(float(lp) if lp is not None else float("nan"))
    mask = [True] * len(out)
    if not out or out[-1] != end:
        out.append(end)
        mask.append(False)
        lps.append(float("nan"))
    return out, mask, lps


def tokenize_trajectory(
    traj: Trajectory, tokenizer: Tokenizer, *, allow_missing_logprobs: bool = False
) -> TokenizedTrajectory:
    """Render one trajectory with the chat template (rules in the module docstring)."""
    ids: list[int] = list(tokenizer.render([], add_generation_prompt=False, tools=traj.tools).ids)
    mask: list[bool] = [False] * len(ids)
    lps: list[float] = [float("nan")] * len(ids)
    gen_prompt = tokenizer.render([], add_generation_prompt=True).ids
    for item, x in enumerate(traj.messages_and_choices):
        if isinstance(x, Choice):
            ids.extend(gen_prompt)
            mask.extend([False] * len(gen_prompt))
            lps.extend([float("nan")] * len(gen_prompt))
            c_ids, c_mask, c_lps = _choice_tokens(x, tokenizer, traj.id, item, allow_missing_logprobs)
            ids.extend(c_ids)
            mask.extend(c_mask)
            lps.extend(c_lps)
        else:
            try:
                seg = tokenizer.render([x], add_generation_prompt=False).ids
            except ValueError as exc:
                raise ValueError(f"trajectory {traj.id}: messages_and_choices[{item}]: {exc}") from None
            ids.extend(seg)
            mask.extend([False] * len(seg))
            lps.extend([float("nan")] * len(seg))
    return TokenizedTrajectory(
        trajectory_id=traj.id,
        ids=np.asarray(ids, dtype=np.int64),
        mask=np.asarray(mask, dtype=bool),
        old_logp=np.asarray(lps, dtype=np.float64),
    )


def pack(items: Sequence[TokenizedTrajectory], pad_id: int, *, max_len: int | None = None) -> PackedBatch:
    """Right-pad tokenized trajectories into a :class:`PackedBatch`.

    Each row keeps its tokens up to the last trainable one (at least 2). ``max_len`` is the most tokens a row
    may have (for TinyGPT: ``block_size + 1``, the last token being only a target); a longer row raises
    :class:`SequenceTooLongError` naming the trajectory.
    """
    if not items:
        raise ValueError("pack: no trajectories to pack")
    lengths = []
    for it in items:
        where = np.flatnonzero(it.mask)
        n = int(where[-1]) + 1 if where.size else len(it.ids)
        n = min(max(n, 2), len(it.ids))
        if n < 2:
            raise ValueError(f"trajectory {it.trajectory_id}: fewer than 2 tokens after rendering")
        if max_len is not None and n > max_len:
            raise SequenceTooLongError(
                f"trajectory {it.trajectory_id}: {n} tokens up to its last trainable token, more than the "
                f"model context allows ({max_len - 1} positions + 1 target); shorten the conversation"
            )
        lengths.append(n)
    B, T = len(items), max(lengths)
    ids = np.full((B, T), pad_id, dtype=np.int64)
    mask = np.zeros((B, T - 1), dtype=bool)
    old = np.full((B, T - 1), np.nan, dtype=np.float64)
    for b, (it, n) in enumerate(zip(items, lengths)):
        ids[b, :n] = it.ids[:n]
        mask[b, : n - 1] = it.mask[1:n]
        old[b, : n - 1] = it.old_logp[1:n]
    return PackedBatch(ids=ids, mask=mask, old_logp=old, lengths=np.asarray(lengths, dtype=np.int64))


def tokenize_batch(
    trajectories: Sequence[Trajectory],
    tokenizer: Tokenizer,
    *,
    allow_missing_logprobs: bool = False,
    max_len: int | None = None,
) -> PackedBatch:
    """:func:`tokenize_trajectory` on each trajectory, then :func:`pack` (pad with ``tokenizer.pad_id``)."""
    items = [
        tokenize_trajectory(t, tokenizer, allow_missing_logprobs=allow_missing_logprobs) for t in trajectories
    ]
    return pack(items, tokenizer.pad_id, max_len=max_len)
