"""Trajectories -> token ids, trainable masks, sampling-time logprobs and turn indices, for every backend.

Training uses exactly the tokens the policy sampled and the prompts the server saw, never a re-tokenisation
of the conversation. The tokenizer is the embedded one (:class:`~palaestra.models.tokenizer.Tokenizer`) or an
HF chat template (:class:`~palaestra.models.hf.tokenize.ChatTokenizer`): anything with ``render``,
``encode``, ``id_of``, ``end_id`` and ``pad_id`` (:class:`ChatTokens`). Rules (one trajectory, items of
``messages_and_choices`` in order):

* a **Choice** came from the policy. Its tokens are exactly the sampled ones: ``choice.token_ids`` when the
  server recorded them (the shared server does when ``logprobs`` is requested), else
  ``choice.logprobs.content[i].token`` mapped with ``tokenizer.id_of``; they are trainable, carry their
  sampling-time logprob as ``old_logp`` and their turn index (0 for the first Choice, 1 for the second, ...;
  -1 on context tokens). If the last sampled token is not an end token (cut by ``max_tokens`` or a stop
  string), the template's end token is appended as context;
* the **prompt** of each Choice is the one the server saw: ``choice.prompt_token_ids`` when recorded (the
  shared server records it), else the chat template applied to every earlier item (the trajectory's
  ``tools`` first, Choices as their assistant messages) with the generation prompt, tokenised once;
* consecutive turns share one row while the next prompt extends the row built so far token for token. When
  it does not (the template is not append-only: it drops earlier reasoning or assistant text; a sampled reply
  re-encodes to other tokens; a stop string cut a reply), the Choice starts a **new row** with its exact
  prompt, so every trainable token is scored in the context it was sampled in. :func:`tokenize_rows` returns
  every row; :func:`tokenize_trajectory` (one row) and ``on_drift="raise"`` raise :class:`TokenDriftError`,
  naming the trajectory, the item and the first differing position;
* message dicts (any role, assistant included) are context and never trained on; messages after the last
  Choice are appended as the template renders them when it extends the row (they cannot change the loss);
* a Choice without logprobs is refused (:class:`MissingLogprobsError`, naming the trajectory) unless
  ``allow_missing_logprobs``: then its assistant message (text and tool calls) is re-rendered with the
  template after its prompt, ``old_logp`` is NaN (the loss treats the token as on-policy, ratio 1), and the
  closing end token is trainable only when ``finish_reason`` is ``"stop"`` or ``"tool_calls"``.

:func:`pack` right-pads tokenized rows into arrays aligned with ``TinyGPT.forward_logprobs``:
``logp[b, t]`` scores ``ids[b, t + 1]``, so ``mask``, ``old_logp`` and ``turn`` are shifted by one. Tokens
after the last trainable one cannot change the loss (attention is causal) and are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from openai.types.chat.chat_completion import Choice

from palaestra.trajectories.types import Trajectory, choice_to_message

__all__ = [
    "ChatTokens",
    "MissingLogprobsError",
    "OnDrift",
    "PackedBatch",
    "SequenceTooLongError",
    "TokenDriftError",
    "TokenizedTrajectory",
    "choice_prompt_ids",
    "choice_token_ids",
    "pack",
    "tokenize_batch",
    "tokenize_rows",
    "tokenize_trajectory",
]

OnDrift = Literal["split", "raise"]


class ChatTokens(Protocol):
    """What tokenisation needs from a tokenizer (the embedded one and HF's ``ChatTokenizer`` have it)."""

    @property
    def end_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def id_of(self, token: str) -> int: ...

    def render(
        self, messages: Sequence[Any], *, add_generation_prompt: bool = ..., tools: Any = ...
    ) -> Any: ...


class MissingLogprobsError(ValueError):
    """A Choice carries no sampling-time logprobs and the config does not allow recomputing them."""


class SequenceTooLongError(ValueError):
    """A rendered trajectory does not fit the model's context."""


class TokenDriftError(ValueError):
    """The prompt a Choice was sampled from does not extend the tokens before it (template not append-only)."""


@dataclass(frozen=True)
class TokenizedTrajectory:
    """One training row: token ``ids`` (L,), ``mask`` (L,) True on tokens the policy sampled, ``old_logp``
    (L,) their sampling-time logprobs (NaN where unknown or not trainable), ``turn`` (L,) the index of the
    Choice each sampled token belongs to (-1 on context; None when unknown)."""

    trajectory_id: str
    ids: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    turn: np.ndarray | None = None

    @property
    def n_trainable(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded batch: ``ids`` (B, T) ints; ``mask``, ``old_logp`` and ``turn`` (B, T-1) aligned with the
    model's ``logp[b, t] = log p(ids[b, t+1] | ids[b, :t+1])``; ``lengths`` (B,) tokens kept per row;
    ``owner`` (B,) the index of the trajectory each row came from (rows of one trajectory are consecutive)."""

    ids: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    lengths: np.ndarray
    turn: np.ndarray
    owner: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def _int_list(value: Any, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{where}: expected a list of token ids (ints)")
    return list(value)


def choice_token_ids(choice: Choice) -> list[int] | None:
    """The sampled token ids a server recorded on a Choice (``choice.token_ids``), or None."""
    return _int_list((choice.model_extra or {}).get("token_ids"), "choice.token_ids")


def choice_prompt_ids(choice: Choice) -> list[int] | None:
    """The prompt token ids a server recorded on a Choice (``choice.prompt_token_ids``), or None."""
    return _int_list((choice.model_extra or {}).get("prompt_token_ids"), "choice.prompt_token_ids")


def _choice_tokens(
    choice: Choice,
    tokenizer: ChatTokens,
    history: list[dict[str, Any]],
    tools: Any,
    where: str,
    allow_missing: bool,
) -> tuple[list[int], list[bool], list[float]]:
    content = choice.logprobs.content if choice.logprobs is not None else None
    end = tokenizer.end_id
    if content is None:
        if not allow_missing:
            raise MissingLogprobsError(
                f"{where} is a Choice without logprobs; sample with logprobs=True or set "
                "TrainConfig.allow_missing_logprobs=True to recompute them"
            )
        prompt = tokenizer.render(history, add_generation_prompt=True, tools=tools).ids
        full = tokenizer.render(
            [*history, choice_to_message(choice)], add_generation_prompt=False, tools=tools
        )
        reply = list(full.ids[len(prompt) :])
        if full.ids[: len(prompt)] != prompt or end not in reply:
            raise MissingLogprobsError(
                f"{where}: a Choice without logprobs cannot be re-rendered; sample with logprobs=True"
            )
        k = reply.index(end)
        stopped = choice.finish_reason in ("stop", "tool_calls")
        return reply[: k + 1], [True] * k + [stopped], [float("nan")] * (k + 1)
    try:
        recorded = choice_token_ids(choice)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if recorded is not None and len(recorded) != len(content):
        raise ValueError(
            f"{where}: token_ids has {len(recorded)} ids but logprobs.content {len(content)} entries"
        )
    out: list[int] = []
    lps: list[float] = []
    for k, entry in enumerate(content):
        if recorded is not None:
            out.append(recorded[k])
        else:
            try:
                out.append(tokenizer.id_of(entry.token))
            except KeyError:
                raise ValueError(
                    f"{where}.logprobs.content[{k}].token {entry.token!r} is not in the model's vocabulary "
                    "(sampled by another model? a vLLM server needs --return-tokens-as-token-ids)"
                ) from None
        lp = entry.logprob
        lps.append(float(lp) if lp is not None else float("nan"))
    mask = [True] * len(out)
    if not out or out[-1] not in getattr(tokenizer, "end_ids", (end,)):
        out.append(end)
        mask.append(False)
        lps.append(float("nan"))
    return out, mask, lps


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def tokenize_rows(
    traj: Trajectory,
    tokenizer: ChatTokens,
    *,
    allow_missing_logprobs: bool = False,
    on_drift: OnDrift = "split",
) -> list[TokenizedTrajectory]:
    """Training rows of one trajectory (rules in the module docstring).

    One row while every prompt extends the tokens before it; a prompt that does not starts a new row
    (``on_drift="split"``) or raises :class:`TokenDriftError` (``on_drift="raise"``). A trajectory without
    any Choice gives one context-only row (nothing trainable)."""
    if on_drift not in ("split", "raise"):
        raise ValueError(f"on_drift: expected 'split' or 'raise', got {on_drift!r}")
    rows: list[TokenizedTrajectory] = []
    ids: list[int] = []
    mask: list[bool] = []
    lps: list[float] = []
    turns: list[int] = []
    history: list[dict[str, Any]] = []
    n_turn = 0

    def flush() -> None:
        nonlocal ids, mask, lps, turns
        if ids:
            rows.append(
                TokenizedTrajectory(
                    trajectory_id=traj.id,
                    ids=np.asarray(ids, dtype=np.int64),
                    mask=np.asarray(mask, dtype=bool),
                    old_logp=np.asarray(lps, dtype=np.float64),
                    turn=np.asarray(turns, dtype=np.int64),
                )
            )
        ids, mask, lps, turns = [], [], [], []

    def render(generation_prompt: bool, where: str = "") -> list[int]:
        try:
            return list(
                tokenizer.render(history, add_generation_prompt=generation_prompt, tools=traj.tools).ids
            )
        except ValueError as exc:
            raise ValueError(f"trajectory {traj.id}: {where}{exc}") from None

    def context(seg: Sequence[int]) -> None:
        ids.extend(seg)
        mask.extend([False] * len(seg))
        lps.extend([float("nan")] * len(seg))
        turns.extend([-1] * len(seg))

    trailing: list[dict[str, Any]] = []  # messages after the last Choice (context; cannot change the loss)
    for item, x in enumerate(traj.messages_and_choices):
        if not isinstance(x, Choice):
            history.append(x)
            trailing.append(x)
            continue
        trailing = []
        where = f"trajectory {traj.id}: messages_and_choices[{item}]"
        try:
            prompt = choice_prompt_ids(x)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if prompt is None:
            prompt = render(True, f"messages before item {item}: ")
        if ids and prompt[: len(ids)] != ids:
            if on_drift == "raise":
                k = _first_difference(prompt, ids)
                raise TokenDriftError(
                    f"{where}: the prompt this Choice was sampled from ({len(prompt)} tokens) does not extend "
                    f"the {len(ids)} tokens before it (first difference at token {k}: the chat template is "
                    "not append-only or a reply re-encodes differently); train it as its own row "
                    "(on_drift='split')"
                )
            flush()
        context(prompt[len(ids) :])
        c_ids, c_mask, c_lps = _choice_tokens(
            x, tokenizer, history, traj.tools, where, allow_missing_logprobs
        )
        ids.extend(c_ids)
        mask.extend(c_mask)
        lps.extend(c_lps)
        turns.extend([n_turn if m else -1 for m in c_mask])
        n_turn += 1
        history.append(choice_to_message(x))
    if ids and trailing:
        full = render(False)
        if full[: len(ids)] == ids:
            context(full[len(ids) :])
    if not rows and not ids:  # no Choice: the context alone (nothing to train on)
        context(render(False))
    flush()
    return rows


def tokenize_trajectory(
    traj: Trajectory, tokenizer: ChatTokens, *, allow_missing_logprobs: bool = False
) -> TokenizedTrajectory:
    """One row for the whole trajectory (rules in the module docstring); :class:`TokenDriftError` when a
    prompt does not extend the tokens before it (use :func:`tokenize_rows` to get one row per segment)."""
    return tokenize_rows(traj, tokenizer, allow_missing_logprobs=allow_missing_logprobs, on_drift="raise")[0]


def pack(
    items: Sequence[TokenizedTrajectory],
    pad_id: int,
    *,
    max_len: int | None = None,
    owner: Sequence[int] | np.ndarray | None = None,
) -> PackedBatch:
    """Right-pad tokenized rows into a :class:`PackedBatch` (``owner``: trajectory index per row, default
    ``0..B-1``).

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
    turn = np.full((B, T - 1), -1, dtype=np.int64)
    for b, (it, n) in enumerate(zip(items, lengths)):
        ids[b, :n] = it.ids[:n]
        mask[b, : n - 1] = it.mask[1:n]
        old[b, : n - 1] = it.old_logp[1:n]
        if it.turn is not None:
            turn[b, : n - 1] = it.turn[1:n]
    own = np.arange(B, dtype=np.int64) if owner is None else np.asarray(owner, dtype=np.int64).reshape(-1)
    if own.shape != (B,):
        raise ValueError(f"pack: owner has {own.size} entries for {B} rows")
    lens = np.asarray(lengths, dtype=np.int64)
    return PackedBatch(ids=ids, mask=mask, old_logp=old, lengths=lens, turn=turn, owner=own)


def tokenize_batch(
    trajectories: Sequence[Trajectory],
    tokenizer: ChatTokens,
    *,
    allow_missing_logprobs: bool = False,
    max_len: int | None = None,
    on_drift: OnDrift = "split",
) -> PackedBatch:
    """:func:`tokenize_rows` on each trajectory, then :func:`pack` (pad with ``tokenizer.pad_id``); the
    packed batch's ``owner`` maps each row back to its trajectory."""
    items: list[TokenizedTrajectory] = []
    owner: list[int] = []
    for i, t in enumerate(trajectories):
        for row in tokenize_rows(
            t, tokenizer, allow_missing_logprobs=allow_missing_logprobs, on_drift=on_drift
        ):
            items.append(row)
            owner.append(i)
    return pack(items, tokenizer.pad_id, max_len=max_len, owner=owner)
