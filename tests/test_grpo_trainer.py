"""GRPOTrainer on the shipped arith-base with the strict verifier: learning, a shuffled-reward control,
bit-identical resume, batch building (filtering, DPO pairs) and the public validation helper."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split
from palaestra.envs.rollouts import single_turn_rollout
from palaestra.envs.verifier import VerifierReward
from palaestra.models.embedded import EmbeddedModel
from palaestra.models.registry import load
from palaestra.trainer.checkpoints import load_checkpoint
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.loop import GRPOTrainer
from palaestra.trainer.validation import evaluate_accuracy, sample_group
from palaestra.trajectories.gather import gather_trajectory_groups
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

BASE = os.environ.get("PALAESTRA_ARITH_BASE", "arith-base")  # a checkpoint path may stand in for the base
GROUPS, GROUP_SIZE = 32, 8
VAL_N = 300
REWARD = VerifierReward(StrictFinalVerifier())
TRAIN = load_split("train")
VAL = load_split("val")[:VAL_N]


async def rollout_step(
    model: EmbeddedModel,
    step: int,
    seed: int,
    *,
    method: str = "generate",
    shuffle: bool = False,
    concurrent: bool = True,
) -> list[TrajectoryGroup]:
    """One seeded batch: GROUPS prompts x GROUP_SIZE samples, scored by the strict verifier.

    ``concurrent=False`` sends the requests one at a time, so no two share a forward pass: sampled tokens are
    batch-invariant, but logprobs move by float32 rounding with the batch composition, and a bit-identity test
    must not depend on request timing."""
    rng = np.random.default_rng([seed, step])
    examples = [TRAIN[i] for i in rng.choice(len(TRAIN), size=GROUPS, replace=False)]
    calls = [
        sample_group(model, ex, GROUP_SIZE, max_tokens=8, seed=seed * 100_000 + step * 100 + g, method=method)
        for g, ex in enumerate(examples)
    ]
    if concurrent:
        groups = await asyncio.gather(*calls)
    else:
        groups = [await c for c in calls]
    for g, ex in zip(groups, examples):
        await REWARD.score_group(g, ex)
    if shuffle:  # control: rewards permuted across the whole batch, so they carry no information
        flat = [t for g in groups for t in g.trajectories]
        for t, r in zip(flat, rng.permutation([t.reward for t in flat])):
            t.reward = float(r)
    return list(groups)


async def greedy_acc(model: EmbeddedModel) -> float:
    res = await evaluate_accuracy(model, VAL, samples=0, seed=0)
    assert res.greedy is not None and res.n == VAL_N
    return res.greedy


STEPS = 120  # 120 steps of 32 x 8 samples: about 8 s of training on 2 cores


async def train(shuffle: bool) -> tuple[float, float]:
    """STEPS GRPO steps from the base (cosine lr decay over the run); greedy val accuracy before and after."""
    model = load(BASE)
    trainer = GRPOTrainer(model, TrainConfig(lr=3e-4, decay_steps=STEPS, seed=1))
    base = await greedy_acc(model)
    for step in range(1, STEPS + 1):
        result = await trainer.step(await rollout_step(model, step, seed=11, shuffle=shuffle))
        assert np.isfinite(result.metrics["reward_mean"])
        if result.updated:
            assert np.isfinite(result.metrics["loss"]) and np.isfinite(result.metrics["grad_norm"])
    return base, await greedy_acc(model)


async def test_grpo_raises_greedy_val_accuracy_and_shuffled_control_does_not() -> None:
    base, final = await train(shuffle=False)
    assert final - base >= 0.15, (base, final)
    c_base, c_final = await train(shuffle=True)
    assert c_base == base
    assert c_final - c_base < 0.05, (c_base, c_final)
    print(
        f"GRPO: {base:.3f} -> {final:.3f} in {STEPS} steps; shuffled control: {c_base:.3f} -> {c_final:.3f}"
    )


async def test_save_load_continue_is_bit_identical(tmp_path: Path) -> None:
    cfg = TrainConfig(seed=3, kl_beta=0.02, minibatch_size=96)
    straight = load(BASE)
    t1 = GRPOTrainer(straight, cfg)
    for step in (1, 2, 3):
        await t1.step(await rollout_step(straight, step, seed=5, method="openai", concurrent=False))

    first = load(BASE)
    t2 = GRPOTrainer(first, cfg)
    for step in (1, 2):
        await t2.step(await rollout_step(first, step, seed=5, method="openai", concurrent=False))
    ckpt = tmp_path / "trainer.npz"
    t2.save(ckpt)
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves no temporary file
    resumed = load(BASE)
    t3 = GRPOTrainer(resumed, cfg)
    t3.load(ckpt)
    assert t3.global_step == 2 and resumed.step == first.step == 2
    await t3.step(await rollout_step(resumed, 3, seed=5, method="openai", concurrent=False))
    for name, p in straight.gpt.params.items():
        assert np.array_equal(p, resumed.gpt.params[name]), name
    s1, s3 = t1.state_dict(), t3.state_dict()
    assert s1.keys() == s3.keys()
    assert all(np.array_equal(s1[k], s3[k]) for k in s1)
    assert (
        TrainConfig.model_validate_json(str(load_checkpoint(ckpt)["trainer"]["trainer/config_json"])) == cfg
    )
    with pytest.raises(ValueError, match="not-a-ckpt"):
        bad = tmp_path / "not-a-ckpt.npz"
        bad.write_bytes(b"junk")
        t3.load(bad)


async def test_env_rollouts_through_gather_and_event_loop_stays_free() -> None:
    model = load(BASE)
    trainer = GRPOTrainer(model)
    examples = TRAIN[:8]
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(
                (single_turn_rollout(model, ex, max_tokens=8, seed=100 * i + j) for j in range(4))
            )
            for i, ex in enumerate(examples)
        ),
        progress=False,
    )
    for g, ex in zip(groups, examples):
        await REWARD.score_group(g, ex)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    result = await trainer.step(groups)
    task.cancel()
    assert ticks > 0  # the numpy update ran in a worker thread
    assert result.step == 1 and result.metrics["groups"] == 8 and result.metrics["trajectories"] == 32
    for key in ("reward_mean", "reward_std", "frac_zero_std", "groups_kept", "seconds"):
        assert key in result.metrics
    if result.updated:
        assert model.step == result.policy_step == 1
        for key in ("loss", "clip_frac", "clip_low_frac", "clip_high_frac", "entropy", "tokens", "grad_norm"):
            assert key in result.metrics


def traj(reward: float) -> Trajectory:
    return Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward)


async def test_zero_std_groups_are_filtered_and_all_filtered_means_no_update() -> None:
    model = load(BASE)
    trainer = GRPOTrainer(model)
    groups = [[traj(1.0), traj(1.0)], [traj(0.0), traj(0.0), traj(0.0)], [traj(1.0), traj(0.0)]]
    batch, metrics = trainer.build_batch(groups)
    assert len(batch) == 2 and batch.group_index.tolist() == [2, 2]
    assert metrics["frac_zero_std"] == pytest.approx(2 / 3) and metrics["groups_kept"] == 1
    # rewards [1, 0]: mean 0.5, sample std sqrt(0.5) -> advantages +-0.5 / (sqrt(0.5) + eps)
    a = 0.5 / (np.sqrt(0.5) + 1e-4)
    np.testing.assert_allclose(batch.advantages, [a, -0.25 * a])  # failures weighted by 0.25 by default
    plain = GRPOTrainer(model, TrainConfig(negative_advantage_scale=1.0)).build_batch(groups)[0]
    np.testing.assert_allclose(plain.advantages, [a, -a])
    keep_all = GRPOTrainer(model, TrainConfig(drop_zero_std=False)).build_batch(groups)[0]
    assert len(keep_all) == 7
    w0 = model.gpt.params["wte"].copy()
    result = await trainer.step(groups[:2])
    assert not result.updated and model.step == 0 and result.step == 1
    assert np.array_equal(model.gpt.params["wte"], w0)


def test_dpo_batch_pairs_follow_rankings() -> None:
    model = load(BASE)
    trainer = GRPOTrainer(model, TrainConfig(objective="dpo", dpo_pairs="best_vs_rest"))
    g0 = [traj(0.0), traj(1.0), traj(0.5)]
    g1 = [traj(0.2), traj(0.2)]
    g2 = [traj(0.0), traj(1.0)]
    batch, metrics = trainer.build_batch([g0, g1, g2])
    assert metrics["pairs"] == 3
    chosen = [batch.trajectories[c].reward for c, _ in batch.pairs]
    rejected = [batch.trajectories[r].reward for _, r in batch.pairs]
    assert chosen == [1.0, 1.0, 1.0] and rejected == [0.0, 0.5, 0.0]
    assert batch.trajectories[batch.pairs[0][0]] is g0[1]


async def test_validation_paths_agree_on_greedy() -> None:
    model = load(BASE)
    fast = await evaluate_accuracy(model, VAL[:40], samples=2, seed=4)
    http = await evaluate_accuracy(model, VAL[:40], samples=2, seed=4, method="openai")
    assert fast.method == "generate" and http.method == "openai"
    assert fast.greedy == http.greedy and fast.greedy_outcomes == http.greedy_outcomes
    assert [r["greedy_completion"] for r in fast.rows] == [r["greedy_completion"] for r in http.rows]
    assert fast.sampled is not None and 0.0 <= fast.sampled <= 1.0
    a = await sample_group(model, VAL[0], 6, seed=9, method="openai")
    b = await sample_group(model, VAL[0], 6, seed=9, method="generate")
    for x, y in zip(a.trajectories, b.trajectories):
        assert x.messages_and_choices[-1].model_dump() == y.messages_and_choices[-1].model_dump()


async def test_evaluate_accuracy_refuses_bad_arguments() -> None:
    from palaestra.models.remote import RemoteModel

    model = load(BASE)
    remote = RemoteModel("arith-base", "http://127.0.0.1:9/v1", api_key="unused")
    with pytest.raises(TypeError, match="method='generate' needs an EmbeddedModel, got RemoteModel"):
        await evaluate_accuracy(remote, VAL[:2], method="generate")
    with pytest.raises(ValueError, match="method must be 'auto', 'generate' or 'openai', got 'beam'"):
        await evaluate_accuracy(model, VAL[:2], method="beam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="samples must be >= 0, got -1"):
        await evaluate_accuracy(model, VAL[:2], samples=-1)
    bad = [VAL[0], {**VAL[1], "prompt": ["What is 1+1?"]}]
    with pytest.raises(ValueError, match="examples\\[1\\]: field 'prompt' must be a string, got list"):
        await evaluate_accuracy(model, bad)
    empty = await evaluate_accuracy(model, [], samples=2)
    assert (empty.n, empty.greedy, empty.sampled, empty.rows) == (0, 0.0, 0.0, [])


def _scored(reward: float, turn_rewards: list[float] | None = None) -> Trajectory:
    user = {"role": "user", "content": "What is 1+1?"}
    reply = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Final: 2"}}
    )
    return Trajectory(messages_and_choices=[user, reply], reward=reward, turn_rewards=turn_rewards)


async def test_build_batch_names_unusable_groups() -> None:
    trainer = GRPOTrainer(load(BASE), TrainConfig())
    waiting = asyncio.get_running_loop().create_future()
    try:
        with pytest.raises(ValueError, match=r"groups\[1\] still has 1 pending rollouts; await it first"):
            trainer.build_batch([[_scored(1.0), _scored(0.0)], TrajectoryGroup([_scored(1.0), waiting])])
    finally:
        waiting.cancel()
    with pytest.raises(TypeError, match=r"groups\[0\]\[1\] is dict, not a Trajectory"):
        trainer.build_batch([[_scored(1.0), {"reward": 0.0}]])  # type: ignore[list-item]
    # per-turn credit: a trajectory with turn rewards for another number of turns is named by group
    trainer.config = TrainConfig(turn_credit="turn_group")
    with pytest.raises(
        ValueError, match=r"groups\[0\]: trajectory 1: turn_rewards: 2 values for 1 assistant"
    ):
        trainer.build_batch([[_scored(1.0, [0.5]), _scored(0.0, [0.5, 0.0])]])
    batch, _ = trainer.build_batch([[_scored(1.0, [0.5]), _scored(0.0, [0.0])]])
    assert batch.turn_advantages is not None and len(batch) == 2


def test_trainer_needs_a_backend_for_other_models_and_a_trainer_checkpoint(tmp_path: Path) -> None:
    from palaestra.trainer.checkpoints import save_checkpoint

    with pytest.raises(TypeError, match="GRPOTrainer: no default backend for str; pass backend=<Backend>"):
        GRPOTrainer("gpt-4o")
    trainer = GRPOTrainer(load(BASE), TrainConfig())
    other = tmp_path / "other.npz"
    save_checkpoint(other, {"trainer": {"trainer/format": np.array("someone-else/1")}})
    with pytest.raises(
        ValueError, match=r"other.npz: not a trainer checkpoint \(trainer state: format 'someone-else/1'"
    ):
        trainer.load(other)
    trainer.save(tmp_path / "mine.npz")
    trainer.load(tmp_path / "mine.npz")
