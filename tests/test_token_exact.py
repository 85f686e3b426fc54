"""Exact tokens across turns: the trainer trains on the token ids that were sampled, in the prompts the server
saw, and catches a chat template that is not append-only (palaestra.trainer.tokenize, EmbeddedBackend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from palaestra.models.registry import load
from palaestra.models.tokenizer import Rendered, Tokenizer
from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.embedded import EmbeddedBackend
from palaestra.trainer.tokenize import (
    TokenDriftError,
    choice_prompt_ids,
    choice_token_ids,
    tokenize_batch,
    tokenize_rows,
    tokenize_trajectory,
)
from palaestra.trajectories.types import Trajectory


class DropEarlierAssistantTokenizer(Tokenizer):
    """A deliberately non-append-only template: every assistant message before the last user message is
    rendered with empty content (as templates that drop earlier reasoning do)."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any] | Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rendered:
        msgs = [dict(m) for m in messages]
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        for i, m in enumerate(msgs):
            if m.get("role") == "assistant" and i < last_user:
                m["content"] = ""
        return super().render(msgs, add_generation_prompt=add_generation_prompt, tools=tools)


def _model(tokenizer_cls: type[Tokenizer]) -> Any:
    model = load("arith-base")
    model.gpt.tokenizer = tokenizer_cls(model.tokenizer.vocab)
    return model


async def _two_turns(model: Any, seed: int = 3) -> Trajectory:
    client = model.openai_client()
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": "What is 12+30? Reply: Final: <int>"}]
    )
    for turn in range(2):
        r = await client.chat.completions.create(
            model=model.name,
            messages=traj.messages(),  # type: ignore[arg-type]
            temperature=1.0,
            logprobs=True,
            max_tokens=12,
            seed=seed + turn,
        )
        traj.messages_and_choices.append(r.choices[0])
        if turn == 0:
            traj.messages_and_choices.append({"role": "user", "content": "Check it. Final: <int>"})
    return traj


def _logp_at_mask(model: Any, packed: Any) -> np.ndarray:
    logp = model.gpt.logprobs_of(packed.ids)
    return np.asarray(logp, dtype=np.float64)[packed.mask]


async def test_server_records_sampled_and_prompt_ids() -> None:
    model = _model(Tokenizer)
    traj = await _two_turns(model)
    c1, c2 = traj.choices()
    for c in (c1, c2):
        ids = choice_token_ids(c)
        assert ids is not None and ids == [model.tokenizer.id_of(e.token) for e in c.logprobs.content]  # type: ignore[union-attr]
    # append-only template: one row = the second prompt + its sampled tokens, each scored as sampled
    p2 = choice_prompt_ids(c2)
    assert p2 is not None and p2[: len(choice_prompt_ids(c1) or [])] == choice_prompt_ids(c1)
    rows = tokenize_rows(traj, model.tokenizer)
    assert len(rows) == 1
    ids2 = choice_token_ids(c2) or []
    assert rows[0].ids.tolist()[: len(p2) + len(ids2)] == p2 + ids2
    pb = tokenize_batch([traj], model.tokenizer)
    np.testing.assert_allclose(_logp_at_mask(model, pb), pb.old_logp[pb.mask], atol=2e-4)


async def test_non_append_only_template_is_caught_and_trained_exactly() -> None:
    model = _model(DropEarlierAssistantTokenizer)
    traj = await _two_turns(model)
    c1, c2 = traj.choices()
    assert (c1.message.content or "") != ""  # there was something for the template to drop
    p1, p2 = choice_prompt_ids(c1), choice_prompt_ids(c2)
    s1, s2 = choice_token_ids(c1), choice_token_ids(c2)
    assert p1 and p2 and s1 and s2
    # the server's second prompt does not contain the first reply as sampled: a naive concatenation of the
    # conversation (prompt 1 + sampled 1 + the user turn) is not what the policy saw at turn 2
    assert p2[: len(p1) + len(s1)] != p1 + s1
    # strict tokenisation refuses it, naming trajectory and item
    with pytest.raises(TokenDriftError, match=rf"{traj.id}.*messages_and_choices\[3\].*append-only"):
        tokenize_trajectory(traj, model.tokenizer)
    with pytest.raises(TokenDriftError):
        tokenize_batch([traj], model.tokenizer, on_drift="raise")
    # default: each turn is its own row with exactly the recorded prompt and sampled ids
    rows = tokenize_rows(traj, model.tokenizer)
    assert len(rows) == 2
    assert rows[0].ids.tolist()[: len(p1) + len(s1)] == p1 + s1
    assert rows[1].ids.tolist()[: len(p2) + len(s2)] == p2 + s2
    assert rows[0].turn is not None and rows[1].turn is not None
    assert set(rows[0].turn[rows[0].mask].tolist()) == {0} and set(rows[1].turn[rows[1].mask].tolist()) == {1}
    pb = tokenize_batch([traj], model.tokenizer)
    assert pb.owner is not None and pb.owner.tolist() == [0, 0]
    # every trainable token is scored in the context it was sampled in: current logprobs == sampling ones
    np.testing.assert_allclose(_logp_at_mask(model, pb), pb.old_logp[pb.mask], atol=2e-4)
    # without the recorded prompts the trainer re-renders with the same template and gets the same rows
    for c in (c1, c2):
        extra = c.model_extra or {}
        extra.pop("prompt_token_ids", None)
    rerendered = tokenize_rows(traj, model.tokenizer)
    assert [r.ids.tolist() for r in rerendered] == [r.ids.tolist() for r in rows]


async def test_embedded_backend_trains_split_rows_with_ratio_one() -> None:
    model = _model(DropEarlierAssistantTokenizer)
    t1, t2 = await _two_turns(model, seed=5), await _two_turns(model, seed=11)
    t1.reward, t2.reward = 1.0, 0.0
    backend = EmbeddedBackend(model, TrainConfig(lr=1e-3, seed=0))
    batch = TrainBatch([t1, t2], np.asarray([1.0, -1.0]))
    m = backend.train_step(batch)
    # on-policy first step: every sampled token's ratio is 1 (exact tokens in exact contexts)
    assert m["ratio_min"] == pytest.approx(1.0, abs=1e-3) and m["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert m["batch_rows"] == 2.0
    with pytest.raises(TokenDriftError):
        backend.train_step(batch, TrainConfig(lr=1e-3, seed=0, on_token_drift="raise"))


async def test_hf_backend_uses_recorded_tokens_and_turns() -> None:
    pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
    from palaestra.models.hf import HFModel
    from palaestra.trainer.hf_backend import HFBackend

    model = HFModel.tiny("tiny-random-llama", seed=0)
    client = model.openai_client()
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "What is 2+2?"}])
    for turn in range(2):
        r = await client.chat.completions.create(
            model=model.name,
            messages=traj.messages(),  # type: ignore[arg-type]
            max_tokens=6,
            logprobs=True,
            seed=3 + turn,
        )
        traj.messages_and_choices.append(r.choices[0])
        if turn == 0:
            traj.messages_and_choices.append({"role": "user", "content": "Again?"})
    c1, c2 = traj.choices()
    p2, s2 = choice_prompt_ids(c2), choice_token_ids(c2)
    assert p2 and s2 and choice_token_ids(c1)
    # as if the template had dropped the first reply: the second prompt as recorded no longer extends row 1
    short = p2[: len(choice_prompt_ids(c1) or [])] + p2[-3:]
    (c2.model_extra or {})["prompt_token_ids"] = short
    rows = tokenize_rows(traj, model.tokenizer)
    assert len(rows) == 2
    # exactly the recorded prompt and sampled ids (then an end token as context if cut)
    n = len(short) + len(s2)
    assert rows[1].ids.tolist()[:n] == short + s2 and not rows[1].mask[n:].any()
    assert rows[0].turn is not None and rows[1].turn is not None
    assert set(rows[0].turn[rows[0].mask].tolist()) == {0} and set(rows[1].turn[rows[1].mask].tolist()) == {1}
    # per-turn advantages reach the HF loss: only turn 1 has one, so only its tokens are clipped/trained
    batch = TrainBatch([traj], np.zeros(1), turn_advantages=[np.asarray([0.0, 1.0])])
    packed = HFBackend(model, TrainConfig()).tokenize(batch)
    adv = batch.token_advantages(packed.turn, packed.owner)
    assert set(adv[packed.mask & (packed.turn == 1)].tolist()) == {1.0}
    assert set(adv[packed.mask & (packed.turn == 0)].tolist()) == {0.0}
    out = HFBackend(model, TrainConfig()).train_step(batch, TrainConfig())
    assert out["packed_rows"] == 2
