"""EmbeddedBackend: one update on a fixed batch of a small random TinyGPT (no sampling involved)."""

from __future__ import annotations

import itertools
import re
import threading
import time
from typing import Any

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer
from palaestra.trainer.backend import Backend, TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.embedded import EmbeddedBackend
from palaestra.trainer.losses import dpo_loss, policy_loss
from palaestra.trainer.tokenize import MissingLogprobsError, SequenceTooLongError, tokenize_batch
from palaestra.trainer.update import dpo_grad
from palaestra.trajectories.types import Trajectory

TOK = Tokenizer.default()


def tiny_model(seed: int = 0, block_size: int = 40) -> EmbeddedModel:
    cfg = GPTConfig(
        vocab_size=TOK.vocab_size, block_size=block_size, d_model=32, n_layer=1, n_head=2, d_ff=64
    )
    return EmbeddedModel(TinyGPT(cfg, seed=seed), name="tiny")


def choice_of(tokens: list[str], logprobs: list[float] | None) -> Choice:
    body: dict[str, Any] = {
        "index": 0,
        "finish_reason": "stop" if tokens[-1] == "<|end|>" else "length",
        "message": {"role": "assistant", "content": "".join(t for t in tokens if not t.startswith("<|"))},
        "logprobs": None,
    }
    if logprobs is not None:
        body["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, logprobs)
            ]
        }
    return Choice.model_validate(body)


def on_policy(model: EmbeddedModel, prompt: str, tokens: list[str], reward: float = 0.0) -> Trajectory:
    """A trajectory whose Choice carries the model's current logprobs of ``tokens`` (as if it sampled them)."""
    user = {"role": "user", "content": prompt}
    draft = Trajectory(messages_and_choices=[user, choice_of(tokens, [0.0] * len(tokens))])
    pb = tokenize_batch([draft], TOK)
    lp = model.gpt.logprobs_of(pb.ids)[0][pb.mask[0]]
    return Trajectory(messages_and_choices=[user, choice_of(tokens, [float(x) for x in lp])], reward=reward)


def fixed_batch(model: EmbeddedModel) -> TrainBatch:
    good = ["Final: ", "4", "2", "<|end|>"]
    bad = ["4", "2", "<|end|>"]
    trajs, advs = [], []
    for k, prompt in enumerate(["What is 40+2?", "What is 50-8?", "What is 21+21?"]):
        trajs += [on_policy(model, prompt, good, 1.0), on_policy(model, prompt, bad, 0.0)]
        advs += [1.0, -1.0]
        if k == 2:
            trajs.append(on_policy(model, prompt, ["Final: ", "1", "<|end|>"], 0.0))
            advs.append(-0.5)
    return TrainBatch(trajs, np.asarray(advs))


def current_loss(model: EmbeddedModel, batch: TrainBatch, cfg: TrainConfig) -> float:
    pb = tokenize_batch(batch.trajectories, TOK)
    lp = model.gpt.logprobs_of(pb.ids).astype(np.float64)
    return policy_loss(
        lp, pb.old_logp, None, batch.advantages, pb.mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high
    ).loss


def seq_logp(model: EmbeddedModel, traj: Trajectory) -> float:
    pb = tokenize_batch([traj], TOK)
    return float(model.gpt.logprobs_of(pb.ids)[0][pb.mask[0]].sum())


def test_backend_step_lowers_loss_and_bumps_step() -> None:
    model = tiny_model()
    cfg = TrainConfig(lr=3e-3)
    backend = EmbeddedBackend(model, cfg)
    assert isinstance(backend, Backend)
    batch = fixed_batch(model)
    before = [seq_logp(model, t) for t in batch.trajectories]
    losses = [current_loss(model, batch, cfg)]
    for i in range(4):
        m = backend.train_step(batch, cfg)
        assert model.step == i + 1 and m["policy_step"] == i + 1
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert m["tokens"] == sum(len(t.choices()[0].logprobs.content) for t in batch.trajectories)
        if i == 0:
            assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # first update is on-policy
            assert m["loss"] == pytest.approx(losses[0], rel=1e-5)
        losses.append(current_loss(model, batch, cfg))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    after = [seq_logp(model, t) for t in batch.trajectories]
    for adv, b, a in zip(batch.advantages, before, after):
        assert (a > b) if adv > 0 else (a < b)


def test_kl_reference_is_frozen_initial_policy() -> None:
    model = tiny_model()
    cfg = TrainConfig(lr=3e-3, kl_beta=0.1)
    backend = EmbeddedBackend(model, cfg)
    assert backend.reference is not None
    ref0 = {k: v.copy() for k, v in backend.reference.params.items()}
    batch = fixed_batch(model)
    m1 = backend.train_step(batch, cfg)
    assert m1["kl"] == pytest.approx(0.0, abs=1e-9)  # equal policies before the first update
    m2 = backend.train_step(batch, cfg)
    assert m2["kl"] > 0.0
    for k, v in backend.reference.params.items():
        np.testing.assert_array_equal(v, ref0[k])
    assert EmbeddedBackend(tiny_model(), TrainConfig()).reference is None  # no KL, no DPO: no copy kept


def test_dpo_objective_lowers_dpo_loss() -> None:
    model = tiny_model()
    cfg = TrainConfig(lr=3e-3, objective="dpo", dpo_beta=0.5)
    backend = EmbeddedBackend(model, cfg)
    batch = fixed_batch(model)
    batch.pairs = [(0, 1), (2, 3), (4, 5), (4, 6)]

    def loss_now() -> float:
        seq = np.asarray([seq_logp(model, t) for t in batch.trajectories])
        assert backend.reference is not None
        pb = tokenize_batch(batch.trajectories, TOK)
        ref = np.where(pb.mask, backend.reference.logprobs_of(pb.ids), 0.0).sum(1)
        c, r = np.asarray(batch.pairs).T
        return dpo_loss(seq[c], seq[r], ref[c], ref[r], beta=0.5).loss

    l0 = loss_now()
    assert l0 == pytest.approx(np.log(2.0), rel=1e-6)  # policy == reference
    m = backend.train_step(batch, cfg)
    assert m["pairs"] == 4 and m["loss"] == pytest.approx(l0, rel=1e-6)
    backend.train_step(batch, cfg)
    assert loss_now() < l0
    with pytest.raises(ValueError, match="pairs"):
        backend.train_step(TrainBatch(batch.trajectories, batch.advantages), cfg)


def test_missing_logprobs_refused_or_recomputed() -> None:
    model = tiny_model()
    user = {"role": "user", "content": "What is 1+1?"}
    trajs = [
        Trajectory(
            id="no-lp-here", messages_and_choices=[user, choice_of(["Final: ", "2", "<|end|>"], None)]
        ),
        Trajectory(messages_and_choices=[user, choice_of(["3", "<|end|>"], None)]),
    ]
    batch = TrainBatch(trajs, np.asarray([1.0, -1.0]))
    with pytest.raises(MissingLogprobsError, match="no-lp-here"):
        EmbeddedBackend(model).train_step(batch, TrainConfig())
    assert model.step == 0
    cfg = TrainConfig(allow_missing_logprobs=True)
    m = EmbeddedBackend(model, cfg).train_step(batch, cfg)
    assert m["ratio_mean"] == 1.0 and m["ratio_min"] == 1.0 and m["nonfinite_old"] == m["tokens"] == 5
    assert model.step == 1


def test_too_long_sequence_is_a_clear_error() -> None:
    model = tiny_model(block_size=16)
    user = {"role": "user", "content": "x" * 10}
    traj = Trajectory(
        id="too-long", messages_and_choices=[user, choice_of(["1"] * 8 + ["<|end|>"], [-1.0] * 9)]
    )
    with pytest.raises(SequenceTooLongError, match="too-long"):
        EmbeddedBackend(model).train_step(TrainBatch([traj], np.ones(1)), TrainConfig())


def test_minibatches_and_epochs_count_optimizer_steps() -> None:
    model = tiny_model()
    cfg = TrainConfig(minibatch_size=3, update_epochs=2)
    batch = fixed_batch(model)  # 7 trajectories -> 3 minibatches per epoch
    m = EmbeddedBackend(model, cfg).train_step(batch, cfg)
    assert m["optimizer_steps"] == 6
    assert model.step == 1  # one policy version per train_step


def test_update_waits_for_model_lock() -> None:
    model = tiny_model()
    backend = EmbeddedBackend(model)
    batch = fixed_batch(model)
    w0 = model.gpt.params["head.w"].copy()
    with model.lock:
        th = threading.Thread(target=backend.train_step, args=(batch, TrainConfig()))
        th.start()
        time.sleep(0.3)
        assert th.is_alive() and model.step == 0
        np.testing.assert_array_equal(model.gpt.params["head.w"], w0)  # no half-applied update
    th.join(10)
    assert model.step == 1 and not np.array_equal(model.gpt.params["head.w"], w0)


def test_state_dict_resume_is_bit_identical() -> None:
    cfg = TrainConfig(lr=2e-3, minibatch_size=3, update_epochs=2, kl_beta=0.05, seed=7)
    straight = tiny_model()
    batch = fixed_batch(straight)  # built once: both runs see the same batch (same old logprobs)
    b1 = EmbeddedBackend(straight, cfg)
    for _ in range(4):
        b1.train_step(batch, cfg)

    first = tiny_model()
    b2 = EmbeddedBackend(first, cfg)
    for _ in range(2):
        b2.train_step(batch, cfg)
    state = b2.state_dict()
    b2.train_step(batch, cfg)  # moving on must not change the saved state
    fresh = tiny_model(seed=123)  # different initial weights: everything must come from the state
    b3 = EmbeddedBackend(fresh, cfg)
    b3.load_state_dict(state)
    assert fresh.step == 2 and b3.updates == 2
    for _ in range(2):
        b3.train_step(batch, cfg)
    assert fresh.step == straight.step == 4
    for k, v in straight.gpt.params.items():
        assert np.array_equal(v, fresh.gpt.params[k]), k
    s1, s3 = b1.state_dict(), b3.state_dict()
    assert s1.keys() == s3.keys()
    for k in s1:
        assert np.array_equal(s1[k], s3[k]), k


def test_load_state_dict_checks_shapes() -> None:
    state = EmbeddedBackend(tiny_model()).state_dict()
    other = GPTConfig(vocab_size=TOK.vocab_size, block_size=40, d_model=16, n_layer=1, n_head=2, d_ff=32)
    with pytest.raises(ValueError, match="shape"):
        EmbeddedBackend(EmbeddedModel(TinyGPT(other))).load_state_dict(state)


def test_train_config_is_strict_documented_and_schedules() -> None:
    from pydantic import ValidationError

    for name, field in TrainConfig.model_fields.items():
        assert field.description, name
    with pytest.raises(ValidationError, match="lrr"):
        TrainConfig(lrr=1e-3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="decay_steps"):
        TrainConfig(lr_schedule="cosine", decay_steps=None)
    with pytest.raises(ValidationError, match="betas"):
        TrainConfig(betas=(0.9, 1.0))
    cfg = TrainConfig(lr=1e-3, lr_schedule="cosine", decay_steps=100, warmup_steps=10, lr_min_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(1e-4) and cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(10) == pytest.approx(1e-3)
    assert cfg.lr_at(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert cfg.lr_at(110) == cfg.lr_at(10_000) == pytest.approx(1e-4)
    lin = TrainConfig(lr=1e-3, lr_schedule="linear", decay_steps=4, lr_min_ratio=0.0)
    assert [lin.lr_at(s) for s in range(5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])
    assert TrainConfig(lr_schedule="constant").lr_at(123) == TrainConfig().lr


def test_train_batch_names_mismatched_inputs() -> None:
    model = tiny_model()
    trajs = fixed_batch(model).trajectories[:3]
    with pytest.raises(ValueError, match=r"advantages: expected 3 values \(one per trajectory\), got 2"):
        TrainBatch(trajs, np.zeros(2))
    with pytest.raises(ValueError, match=r"group_index: expected 3 values \(one per trajectory\), got 4"):
        TrainBatch(trajs, np.zeros(3), group_index=np.zeros(4, dtype=np.int64))
    for bad in [(0, 3), (1, 1), (-1, 0)]:
        with pytest.raises(
            ValueError, match=re.escape(f"pairs[1] = {bad} must name two different trajectories in 0..2")
        ):
            TrainBatch(trajs, np.zeros(3), pairs=[(0, 1), bad])
    with pytest.raises(ValueError, match="2 groups but 1 advantage arrays"):
        TrainBatch.from_groups([trajs[:2], trajs[2:]], [[1.0, -1.0]])
    with pytest.raises(ValueError, match="group 1: 1 trajectories but 2 advantages"):
        TrainBatch.from_groups([trajs[:2], trajs[2:]], [[1.0, -1.0], [0.5, 0.5]])
    ok = TrainBatch.from_groups([trajs[:2], trajs[2:]], [[1.0, -1.0], [0.5]])
    assert ok.group_index.tolist() == [0, 0, 1] and ok.advantages.tolist() == [1.0, -1.0, 0.5]


def test_empty_batch_is_refused() -> None:
    backend = EmbeddedBackend(tiny_model(), TrainConfig())
    with pytest.raises(ValueError, match="train_step: the batch has no trajectories"):
        backend.train_step(TrainBatch([], np.zeros(0)))
    assert backend.model.step == 0


def test_reference_is_taken_when_a_later_step_first_needs_it() -> None:
    # built without KL, then stepped with a config that has kl_beta > 0: the reference is the weights of
    # that moment (so the first KL is zero) and stays frozen afterwards
    model = tiny_model()
    backend = EmbeddedBackend(model, TrainConfig(lr=3e-3))
    batch = fixed_batch(model)
    backend.train_step(batch)
    assert backend.reference is None
    now = {k: v.copy() for k, v in model.gpt.params.items()}
    kl_cfg = TrainConfig(lr=3e-3, kl_beta=0.1)
    m1 = backend.train_step(batch, kl_cfg)
    assert m1["kl"] == pytest.approx(0.0, abs=1e-9)
    assert backend.reference is not None
    for k, v in backend.reference.params.items():
        np.testing.assert_array_equal(v, now[k])
    assert backend.train_step(batch, kl_cfg)["kl"] > 0.0


def test_dpo_grad_needs_reference_and_trained_pair_members() -> None:
    logp = np.full((2, 3), -1.0)
    mask = np.ones((2, 3), dtype=bool)
    cfg = TrainConfig(objective="dpo")
    with pytest.raises(ValueError, match="DPO needs the reference policy's logprobs"):
        dpo_grad(logp, None, mask, np.array([0, 1]), [(0, 1)], cfg)
    with pytest.raises(
        ValueError, match=r"DPO pair \(0, 2\): a trajectory of the pair has no trainable token"
    ):
        dpo_grad(logp, logp.copy(), mask, np.array([0, 1]), [(0, 2)], cfg)
    loss, dlogp, m = dpo_grad(logp, logp.copy(), mask, np.array([0, 1]), [(0, 1)], cfg)
    assert loss == pytest.approx(np.log(2.0)) and m["seqs"] == 2.0 and dlogp.shape == (2, 3)


def test_max_tokens_constant_needs_its_aggregation() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_tokens_constant: only used with agg='seq_sum_constant'"):
        TrainConfig(max_tokens_constant=64)
    assert TrainConfig(max_tokens_constant=64, agg="seq_sum_constant").max_tokens_constant == 64
