"""Trajectories -> token ids, trainable masks, sampling-time logprobs and turn indices, for every backend:
exactly the tokens the policy sampled and the prompts the server saw (docs/tools.md, "Exact tokens across turns").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from openai.types.chat.chat_completion import Choice

from palaestra.trajectories.types import Trajectory, choice_to_message

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
    """One training row (L,): ``mask`` True on tokens the policy sampled, ``old_logp`` their sampling-time
    logprobs (NaN where unknown), ``turn`` the index of their Choice (-1 on context; None when unknown)."""

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
    """Right-padded ``ids`` (B, T); ``mask``, ``old_logp``, ``turn`` (B, T-1) aligned with ``logp[b, t] = log
    p(ids[b, t+1] | ids[b, :t+1])``; ``lengths`` tokens kept per row; ``owner`` each row's trajectory index."""

    ids: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    lengths: np.ndarray
    turn: np.ndarray
    owner: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def _recorded_ids(choice: Choice, key: str, where: str) -> list[int] | None:
    value = (choice.model_extra or {}).get(key)
    if value is not None and (
        not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{where}choice.{key}: expected a list of token ids (ints)")
    return None if value is None else list(value)


def choice_token_ids(choice: Choice, where: str = "") -> list[int] | None:
    """The sampled token ids a server recorded on a Choice (``choice.token_ids``), or None."""
    return _recorded_ids(choice, "token_ids", where)


def choice_prompt_ids(choice: Choice, where: str = "") -> list[int] | None:
    """The prompt token ids a server recorded on a Choice (``choice.prompt_token_ids``), or None."""
    return _recorded_ids(choice, "prompt_token_ids", where)


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
    out = choice_token_ids(choice, f"{where}: ")
    if out is None:
        out = []
        for k, entry in enumerate(content):
            try:
                out.append(tokenizer.id_of(entry.token))
            except KeyError:
                raise ValueError(
                    f"{where}.logprobs.content[{k}].token {entry.token!r} is not in the model's vocabulary "
                    "(sampled by another model? a vLLM server needs --return-tokens-as-token-ids)"
                ) from None
    elif len(out) != len(content):
        raise ValueError(f"{where}: token_ids has {len(out)} ids but logprobs.content {len(content)} entries")
    lps = [float(e.logprob) if e.logprob is not None else float("nan") for e in content]
    mask = [True] * len(out)
    if not out or out[-1] not in getattr(tokenizer, "end_ids", (end,)):
        out.append(end)
        mask.append(False)
        lps.append(float("nan"))
    return out, mask, lps


def tokenize_rows(
    traj: Trajectory,
    tokenizer: ChatTokens,
    *,
    allow_missing_logprobs: bool = False,
    on_drift: OnDrift = "split",
) -> list[TokenizedTrajectory]:
    """Training rows of one trajectory (rules in docs/tools.md): a prompt that does not extend the tokens before
    it starts a new row (``on_drift="split"``) or raises :class:`TokenDriftError` (``"raise"``)."""
    if on_drift not in ("split", "raise"):
        raise ValueError(f"on_drift: expected 'split' or 'raise', got {on_drift!r}")
    rows: list[TokenizedTrajectory] = []
    row: list[tuple[int, bool, float, int]] = []  # (token id, trainable, old logprob, turn) of the open row
    history: list[dict[str, Any]] = []
    n_turn = 0

    def flush() -> None:
        if row:
            ids, mask, lps, turns = zip(*row)
            rows.append(
                TokenizedTrajectory(
                    trajectory_id=traj.id,
                    ids=np.asarray(ids, dtype=np.int64),
                    mask=np.asarray(mask, dtype=bool),
                    old_logp=np.asarray(lps, dtype=np.float64),
                    turn=np.asarray(turns, dtype=np.int64),
                )
            )
        row.clear()

    def render(gen_prompt: bool, where: str = "") -> list[int]:
        try:
            return list(tokenizer.render(history, add_generation_prompt=gen_prompt, tools=traj.tools).ids)
        except ValueError as exc:
            raise ValueError(f"trajectory {traj.id}: {where}{exc}") from None

    def extend_context(full: Sequence[int]) -> None:
        row.extend((t, False, float("nan"), -1) for t in full[len(row) :])

    items = traj.messages_and_choices
    for item, x in enumerate(items):
        if not isinstance(x, Choice):
            history.append(x)
            continue
        where = f"trajectory {traj.id}: messages_and_choices[{item}]"
        prompt = choice_prompt_ids(x, f"{where}: ")
        if prompt is None:
            prompt = render(True, f"messages before item {item}: ")
        ids = [t[0] for t in row]
        if prompt[: len(ids)] != ids:
            if on_drift == "raise":
                k = next(
                    (k for k, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids))
                )
                raise TokenDriftError(
                    f"{where}: the prompt this Choice was sampled from ({len(prompt)} tokens) does not extend "
                    f"the {len(ids)} tokens before it (first difference at token {k}: the chat template is "
                    "not append-only or a reply re-encodes differently); train it as its own row "
                    "(on_drift='split')"
                )
            flush()
        extend_context(prompt)
        c_ids, c_mask, c_lps = _choice_tokens(
            x, tokenizer, history, traj.tools, where, allow_missing_logprobs
        )
        row.extend((t, m, lp, n_turn if m else -1) for t, m, lp in zip(c_ids, c_mask, c_lps))
        n_turn += 1
        history.append(choice_to_message(x))
    if row and not isinstance(items[-1], Choice):  # messages after the last Choice: context, no loss
        full = render(False)
        if full[: len(row)] == [t[0] for t in row]:
            extend_context(full)
    if not rows and not row:  # no Choice: the context alone (nothing to train on)
        extend_context(render(False))
    flush()
    return rows


def tokenize_trajectory(
    traj: Trajectory, tokenizer: ChatTokens, *, allow_missing_logprobs: bool = False
) -> TokenizedTrajectory:
    """One row for the whole trajectory (:class:`TokenDriftError` where :func:`tokenize_rows` would split)."""
    return tokenize_rows(traj, tokenizer, allow_missing_logprobs=allow_missing_logprobs, on_drift="raise")[0]


def pack(
    items: Sequence[TokenizedTrajectory],
    pad_id: int,
    *,
    max_len: int | None = None,
    owner: Sequence[int] | np.ndarray | None = None,
) -> PackedBatch:
    """Right-pad rows into a :class:`PackedBatch` (``owner`` default ``0..B-1``), each kept up to its last
    trainable token (at least 2); a row over ``max_len`` tokens raises :class:`SequenceTooLongError`."""
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
    """:func:`tokenize_rows` on each trajectory, then :func:`pack`."""
    rows = [
        (i, row)
        for i, t in enumerate(trajectories)
        for row in tokenize_rows(
            t, tokenizer, allow_missing_logprobs=allow_missing_logprobs, on_drift=on_drift
        )
    ]
    return pack([r for _, r in rows], tokenizer.pad_id, max_len=max_len, owner=[i for i, _ in rows])
