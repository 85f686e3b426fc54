"""Trajectories -> token ids, trainable masks and old logprobs (palaestra.trainer.tokenize)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice

from palaestra.models.tokenizer import Tokenizer
from palaestra.trainer.tokenize import (
    MissingLogprobsError,
    SequenceTooLongError,
    TokenizedTrajectory,
    pack,
    tokenize_batch,
    tokenize_rows,
    tokenize_trajectory,
)
from palaestra.trajectories.types import Trajectory

TOK = Tokenizer.default()


def make_choice(
    tokens: list[str] | None, logprobs: list[float] | None = None, finish: str = "stop"
) -> Choice:
    """A Choice as the embedded server returns it (content = text without special tokens)."""
    text = "".join(t for t in (tokens or []) if not t.startswith("<|"))
    body: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
    }
    if tokens is not None:
        lps = logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(tokens))]
        body["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, lps)
            ],
            "refusal": None,
        }
    return Choice.model_validate(body)


USER = {"role": "user", "content": "What is 40+2? Reply with one line: Final: <int>"}


def test_single_turn_ids_mask_and_old_logprobs() -> None:
    sampled = ["Final: ", "4", "2", "<|end|>"]
    lps = [-0.5, -1.25, -0.75, -0.01]
    traj = Trajectory(messages_and_choices=[USER, make_choice(sampled, lps)])
    tt = tokenize_trajectory(traj, TOK)
    prompt = TOK.render([USER], add_generation_prompt=True).ids
    sampled_ids = [TOK.id_of(t) for t in sampled]
    assert tt.ids.tolist() == prompt + sampled_ids
    assert tt.mask.tolist() == [False] * len(prompt) + [True] * 4
    np.testing.assert_array_equal(tt.old_logp[tt.mask], lps)
    assert np.isnan(tt.old_logp[~tt.mask]).all()
    assert tt.trajectory_id == traj.id


def test_sampled_tokens_are_kept_even_when_text_would_encode_differently() -> None:
    # "Final: " sampled character by character must stay 7 tokens, not become the word token
    sampled = [*"Final: ", "7", "<|end|>"]
    traj = Trajectory(messages_and_choices=[USER, make_choice(sampled)])
    tt = tokenize_trajectory(traj, TOK)
    assert tt.n_trainable == 9
    assert tt.ids[tt.mask].tolist() == [TOK.id_of(t) for t in sampled]
    assert TOK.encode("Final: 7") != tt.ids[tt.mask][:-1].tolist()


def test_truncated_reply_gets_end_as_context() -> None:
    traj = Trajectory(messages_and_choices=[USER, make_choice(["Final: ", "1", "2"], finish="length")])
    tt = tokenize_trajectory(traj, TOK)
    assert tt.ids[-1] == TOK.end_id
    assert not tt.mask[-1]
    assert tt.mask[-4:-1].all()


def test_multi_turn_masks_only_policy_choices() -> None:
    system = {"role": "system", "content": "Be brief."}
    c1 = make_choice(["u", "p", "<|end|>"], [-1.0, -2.0, -3.0])
    user2 = {"role": "user", "content": "and now?"}
    asst_dict = {"role": "assistant", "content": "left"}  # written by hand, not by the policy: context
    user3 = {"role": "user", "content": "again"}
    c2 = make_choice(["d", "o"], [-4.0, -5.0], finish="length")
    traj = Trajectory(messages_and_choices=[system, USER, c1, user2, asst_dict, user3, c2])
    tt = tokenize_trajectory(traj, TOK)
    a = TOK.assistant_id
    expected: list[int] = []
    mask: list[bool] = []
    for seg, trainable in (
        (TOK.render([system, USER], add_generation_prompt=True).ids, False),
        ([TOK.id_of("u"), TOK.id_of("p"), TOK.end_id], True),
        (TOK.render([user2, asst_dict, user3], add_generation_prompt=True).ids, False),
        ([TOK.id_of("d"), TOK.id_of("o")], True),
        ([TOK.end_id], False),
    ):
        expected += seg
        mask += [trainable] * len(seg)
    assert tt.ids.tolist() == expected
    assert tt.mask.tolist() == mask
    np.testing.assert_array_equal(tt.old_logp[tt.mask], [-1.0, -2.0, -3.0, -4.0, -5.0])
    # the hand-written assistant message is rendered like the template renders it, and is not trainable
    assert a in tt.ids.tolist()
    # what the policy saw before its second turn equals the server's rendering of traj.messages()
    before_c2 = TOK.render(traj.messages()[:-1], add_generation_prompt=True).ids
    assert tt.ids[: len(before_c2)].tolist() == before_c2


def test_missing_logprobs_refused_with_trajectory_id() -> None:
    traj = Trajectory(id="traj-without-lp", messages_and_choices=[USER, make_choice(None)])
    with pytest.raises(MissingLogprobsError, match=r"traj-without-lp.*messages_and_choices\[1\]"):
        tokenize_trajectory(traj, TOK)
    with pytest.raises(MissingLogprobsError, match="traj-without-lp"):
        tokenize_batch([traj], TOK)


def test_missing_logprobs_allowed_recomputes() -> None:
    choice = make_choice(None)
    choice.message.content = "Final: 42"
    traj = Trajectory(messages_and_choices=[USER, choice])
    tt = tokenize_trajectory(traj, TOK, allow_missing_logprobs=True)
    body = TOK.encode("Final: 42")
    assert tt.ids[tt.mask].tolist() == [*body, TOK.end_id]  # finish_reason "stop": <|end|> was sampled
    assert np.isnan(tt.old_logp).all()
    cut = make_choice(None, finish="length")
    cut.message.content = "Final: 4"
    tt2 = tokenize_trajectory(Trajectory(messages_and_choices=[USER, cut]), TOK, allow_missing_logprobs=True)
    assert tt2.ids[-1] == TOK.end_id and not tt2.mask[-1]


def test_unknown_token_names_position() -> None:
    traj = Trajectory(id="tx", messages_and_choices=[USER, make_choice(["Final: ", "<|nope|>"])])
    with pytest.raises(ValueError, match=r"tx.*content\[1\].*vocabulary"):
        tokenize_trajectory(traj, TOK)


def test_pack_aligns_with_next_token_logprobs_and_trims() -> None:
    t1 = Trajectory(
        messages_and_choices=[USER, make_choice(["Final: ", "4", "2", "<|end|>"], [-1, -2, -3, -4])]
    )
    t2 = Trajectory(
        messages_and_choices=[
            USER,
            make_choice(["9"], [-7.0], finish="length"),
            {"role": "user", "content": "x"},
        ]
    )
    items = [tokenize_trajectory(t, TOK) for t in (t1, t2)]
    pb = pack(items, TOK.pad_id)
    n1, n2 = len(items[0].ids), int(np.flatnonzero(items[1].mask)[-1]) + 1
    assert pb.lengths.tolist() == [n1, n2]  # row 2 keeps nothing after its last sampled token
    assert pb.ids.shape == (2, max(n1, n2))
    assert pb.mask.shape == pb.old_logp.shape == (2, max(n1, n2) - 1)
    for b, it in enumerate(items):
        n = pb.lengths[b]
        assert pb.ids[b, :n].tolist() == it.ids[:n].tolist()
        assert (pb.ids[b, n:] == TOK.pad_id).all()
        # logp[b, t] scores ids[b, t+1]: the mask is the token mask shifted by one
        assert pb.mask[b, : n - 1].tolist() == it.mask[1:n].tolist()
        assert not pb.mask[b, n - 1 :].any()
    np.testing.assert_array_equal(pb.old_logp[0][pb.mask[0]], [-1, -2, -3, -4])
    np.testing.assert_array_equal(pb.old_logp[1][pb.mask[1]], [-7.0])
    assert pb.tokens == 5


def test_pack_rejects_too_long() -> None:
    traj = Trajectory(id="long-one", messages_and_choices=[USER, make_choice(["1"] * 30 + ["<|end|>"])])
    tt = tokenize_trajectory(traj, TOK)
    pack([tt], TOK.pad_id, max_len=len(tt.ids))
    with pytest.raises(SequenceTooLongError, match="long-one"):
        pack([tt], TOK.pad_id, max_len=len(tt.ids) - 1)


def test_logprob_values_survive_exactly() -> None:
    lps = [-math.pi, -1e-7, -23.5]
    traj = Trajectory(messages_and_choices=[USER, make_choice(["1", "2", "<|end|>"], lps)])
    pb = tokenize_batch([traj], TOK)
    assert pb.old_logp[pb.mask].tolist() == lps


def with_token_ids(choice: Choice, token_ids: Any) -> Choice:
    """``choice`` with the ``token_ids`` a vLLM server records next to the logprobs."""
    return Choice.model_validate({**choice.model_dump(), "token_ids": token_ids})


def test_recorded_token_ids_are_used_or_refused_with_the_position() -> None:
    sampled = make_choice(["Final: ", "4", "<|end|>"])
    ids = [TOK.id_of("Final: "), TOK.id_of("4"), TOK.end_id]
    traj = Trajectory(messages_and_choices=[USER, with_token_ids(sampled, ids)])
    assert tokenize_trajectory(traj, TOK).ids[-3:].tolist() == ids
    for bad in (["4", 2], [1, True], "12"):
        t = Trajectory(messages_and_choices=[USER, with_token_ids(sampled, bad)])
        with pytest.raises(
            ValueError,
            match=rf"trajectory {t.id}: messages_and_choices\[1\]: choice.token_ids: expected a list of token ids",
        ):
            tokenize_trajectory(t, TOK)
    t = Trajectory(messages_and_choices=[USER, with_token_ids(sampled, ids[:2])])
    with pytest.raises(ValueError, match=r"token_ids has 2 ids but logprobs\.content 3 entries"):
        tokenize_trajectory(t, TOK)


def test_bad_role_and_bad_drift_option_are_named() -> None:
    traj = Trajectory(
        messages_and_choices=[{"role": "robot", "content": "hi"}, make_choice(["4", "<|end|>"])]
    )
    with pytest.raises(
        ValueError, match=rf"trajectory {traj.id}: .*messages\[0\].role 'robot' is not one of"
    ):
        tokenize_rows(traj, TOK)
    with pytest.raises(ValueError, match="on_drift: expected 'split' or 'raise', got 'merge'"):
        tokenize_rows(traj, TOK, on_drift="merge")  # type: ignore[arg-type]


def test_trajectory_without_choices_is_one_context_row() -> None:
    traj = Trajectory(messages_and_choices=[USER])
    rows = tokenize_rows(traj, TOK)
    assert len(rows) == 1
    assert rows[0].ids.tolist() == TOK.render([USER], add_generation_prompt=False).ids
    assert not rows[0].mask.any() and rows[0].turn is not None and (rows[0].turn == -1).all()


def test_pack_refuses_empty_short_and_misowned_input() -> None:
    with pytest.raises(ValueError, match="pack: no trajectories to pack"):
        pack([], TOK.pad_id)
    one = TokenizedTrajectory("lonely", np.array([5]), np.array([False]), np.array([np.nan]))
    with pytest.raises(ValueError, match="trajectory lonely: fewer than 2 tokens after rendering"):
        pack([one], TOK.pad_id)
    two = TokenizedTrajectory("pair", np.array([5, 6]), np.array([False, True]), np.array([np.nan, -1.0]))
    with pytest.raises(ValueError, match="pack: owner has 1 entries for 2 rows"):
        pack([two, two], TOK.pad_id, owner=[0])
    assert pack([two, two], TOK.pad_id, owner=[0, 0]).owner.tolist() == [0, 0]
