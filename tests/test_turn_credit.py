"""Turn-level rewards and credit: per-turn returns and advantages against hand-computed values, per-token
advantages in the trainer, and the two-step lab where per-turn credit learns the step the final reward
alone does not."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice

from palaestra.labs.two_step import TwoStepConfig, train_two_step
from palaestra.models.tokenizer import Tokenizer
from palaestra.trainer.advantages import turn_advantages, turn_returns
from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.loop import GRPOTrainer
from palaestra.trainer.tokenize import tokenize_batch
from palaestra.trajectories.types import Trajectory

TOK = Tokenizer.default()

# one group: a = R 1 with a per-turn reward 0.5 on its first turn (2 turns); b = R 0 (2 turns); c = R 1 (1 turn)
FINAL = [1.0, 0.0, 1.0]
TURNS: list[Any] = [[0.5, 0.0], [0.0, 0.0], None]
N = [2, 2, 1]


def _close(got: list[np.ndarray], want: list[list[float]]) -> None:
    assert [g.size for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-9)


def test_turn_returns_by_hand() -> None:
    # u = [0.5, 1.0]; G1 = 1.0; G0 = 0.5 + 0.5 * 1.0
    np.testing.assert_allclose(turn_returns([0.5, 0.0], 1.0, 2, discount=0.5), [1.0, 1.0])
    # u = [0, 0, 2]; G = [0.81 * 2, 0.9 * 2, 2]
    np.testing.assert_allclose(turn_returns(None, 2.0, 3, discount=0.9), [1.62, 1.8, 2.0])
    assert turn_returns(None, 1.0, 0).size == 0
    # default discount 1: G_0 = R + sum r_k; discount 0 (allowed) leaves each turn its own step reward
    np.testing.assert_allclose(turn_returns([0.5, 0.25], 1.0, 2), [1.75, 1.25])
    np.testing.assert_allclose(turn_returns([0.5, 0.25], 1.0, 2, discount=0.0), [0.5, 1.25])
    with pytest.raises(ValueError, match="turn_rewards: 1 values for 2"):
        turn_returns([1.0], 0.0, 2)
    with pytest.raises(ValueError, match="discount"):
        turn_returns(None, 0.0, 1, discount=1.5)


def test_final_broadcasts_the_final_reward_advantage() -> None:
    # dr_grpo on R = [1, 0, 1]: mean 2/3
    got = turn_advantages(FINAL, TURNS, N, credit="final", mode="dr_grpo")
    _close(got, [[1 / 3, 1 / 3], [-2 / 3, -2 / 3], [1 / 3]])


def test_final_with_batch_std_uses_the_groups_std() -> None:
    # one group is the whole batch: R = [1, 0, 0, 0], sample std 0.5, A = (R - 0.25) / 0.5
    got = turn_advantages([1.0, 0.0, 0.0, 0.0], [None] * 4, [1, 2, 1, 1], mode="batch_std", eps=0.0)
    _close(got, [[1.5], [-0.5, -0.5], [-0.5], [-0.5]])


def test_returns_by_hand() -> None:
    # G_a = [1.5, 1.0], G_b = [0, 0], G_c = [1]; episode returns E = [1.5, 0, 1], mean 5/6
    got = turn_advantages(FINAL, TURNS, N, credit="returns", mode="dr_grpo")
    m = 2.5 / 3
    _close(got, [[1.5 - m, 1.0 - m], [-m, -m], [1.0 - m]])
    # rloo: baselines (2.5 - E_i) / 2 = [0.5, 1.25, 0.75]
    got = turn_advantages(FINAL, TURNS, N, credit="returns", mode="rloo")
    _close(got, [[1.0, 0.5], [-1.25, -1.25], [0.25]])
    # grpo: sample std of E = sqrt(((2/3)^2 + (5/6)^2 + (1/6)^2) / 2)
    s = math.sqrt(((2 / 3) ** 2 + (5 / 6) ** 2 + (1 / 6) ** 2) / 2) + 1e-4
    got = turn_advantages(FINAL, TURNS, N, credit="returns", mode="grpo")
    _close(got, [[(1.5 - m) / s, (1.0 - m) / s], [-m / s, -m / s], [(1.0 - m) / s]])


def test_turn_group_by_hand() -> None:
    # turn 0 among a, b, c: [1.5, 0, 1] (mean 5/6); turn 1 among a, b only: [1, 0] (mean 1/2)
    got = turn_advantages(FINAL, TURNS, N, credit="turn_group", mode="dr_grpo")
    m = 2.5 / 3
    _close(got, [[1.5 - m, 0.5], [-m, -0.5], [1.0 - m]])
    # with discount 0.5: G_a = [0.5 + 0.5, 1], G_b = [0, 0], G_c = [1]
    got = turn_advantages(FINAL, TURNS, N, credit="turn_group", mode="dr_grpo", discount=0.5)
    _close(got, [[1 - 2 / 3, 0.5], [-2 / 3, -0.5], [1 - 2 / 3]])


def test_returns_without_turn_rewards_equals_final() -> None:
    r = [0.3, 1.0, -0.2, 0.7]
    n = [1, 3, 2, 2]
    for mode in ("grpo", "dr_grpo", "rloo"):
        a = turn_advantages(r, [None] * 4, n, credit="final", mode=mode)  # type: ignore[arg-type]
        b = turn_advantages(r, [None] * 4, n, credit="returns", mode=mode)  # type: ignore[arg-type]
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-12)


def test_equal_returns_give_zero_and_bad_input_is_named() -> None:
    got = turn_advantages([1.0, 1.0], [None, None], [2, 1], credit="returns")
    assert all(not g.any() for g in got)
    # equal episode returns (1.5 each) give 0 on every turn, though the later turns' returns differ
    for mode in ("grpo", "dr_grpo", "rloo"):
        got = turn_advantages(
            [1.0, 1.0],
            [[0.5, 0.0], [0.0, 0.5]],
            [2, 2],
            credit="returns",
            mode=mode,  # type: ignore[arg-type]
        )
        _close(got, [[0.0, 0.0], [0.0, 0.0]])
    # a group of one trajectory has nothing to compare with
    _close(turn_advantages([1.0], [[0.5, 0.0]], [2], credit="returns", mode="rloo"), [[0.0, 0.0]])
    with pytest.raises(ValueError, match="batch_std"):
        turn_advantages(FINAL, TURNS, N, credit="returns", mode="batch_std")
    with pytest.raises(ValueError, match=r"trajectory 0: turn_rewards: 2 values for 3"):
        turn_advantages(FINAL, TURNS, [3, 2, 1], credit="turn_group")
    with pytest.raises(ValueError, match="unknown turn credit"):
        turn_advantages(FINAL, TURNS, N, credit="nope")  # type: ignore[arg-type]


def _choice(tokens: list[str]) -> Choice:
    text = "".join(t for t in tokens if not t.startswith("<|"))
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "logprobs": {
                "content": [
                    {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
                    for t in tokens
                ],
                "refusal": None,
            },
        }
    )


def _two_turn(final: float, turn: list[float] | None, first: str) -> Trajectory:
    return Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "go"},
            _choice([first, "<|end|>"]),
            {"role": "user", "content": "again"},
            _choice(["Final: ", "1", "<|end|>"]),
        ],
        reward=final,
        turn_rewards=turn,
    )


def test_trainer_applies_each_turns_advantage_to_its_tokens() -> None:
    group = [_two_turn(1.0, [0.5, 0.0], "a"), _two_turn(0.0, [0.0, 0.0], "b")]
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # build_batch needs only the config
    trainer.config = TrainConfig(
        turn_credit="turn_group", advantage_mode="dr_grpo", negative_advantage_scale=1
    )
    batch, metrics = trainer.build_batch([group])
    assert batch.turn_advantages is not None
    # turn 0: returns [1.5, 0] -> [0.75, -0.75]; turn 1: [1, 0] -> [0.5, -0.5]
    _close(batch.turn_advantages, [[0.75, 0.5], [-0.75, -0.5]])
    assert batch.advantages.tolist() == [0.75, -0.75]
    assert metrics["groups_kept"] == 1.0
    packed = tokenize_batch(batch.trajectories, TOK)
    assert packed.turn is not None and packed.owner is not None
    tok_adv = batch.token_advantages(packed.turn, packed.owner)
    # row 0: "a", <|end|> at 0.75 then "Final: ", "1", <|end|> at 0.5; row 1 the same with minus signs
    np.testing.assert_allclose(tok_adv[0][packed.mask[0]], [0.75, 0.75, 0.5, 0.5, 0.5])
    np.testing.assert_allclose(tok_adv[1][packed.mask[1]], [-0.75, -0.75, -0.5, -0.5, -0.5])
    # a group whose per-turn advantages are all zero is dropped (DAPO filtering)
    same = [_two_turn(1.0, [0.5, 0.0], "a"), _two_turn(1.0, [0.5, 0.0], "b")]
    batch2, m2 = trainer.build_batch([same])
    assert len(batch2) == 0 and m2["frac_zero_std"] == 1.0
    # final credit ignores the per-turn rewards: the same advantage on every token (as before)
    trainer.config = TrainConfig(advantage_mode="dr_grpo", negative_advantage_scale=1)
    batch3, _ = trainer.build_batch([group])
    assert batch3.turn_advantages is None and batch3.advantages.tolist() == [0.5, -0.5]


def test_train_batch_checks_turn_advantages() -> None:
    t = _two_turn(1.0, None, "a")
    with pytest.raises(ValueError, match="turn_advantages: expected 1"):
        TrainBatch([t], np.zeros(1), turn_advantages=[])
    with pytest.raises(ValueError, match="not finite"):
        TrainBatch([t], np.zeros(1), turn_advantages=[np.asarray([np.nan, 0.0])])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_step_lab_per_turn_credit_learns_step_one(seed: int) -> None:
    # the end reward does not depend on the first choice; only a per-turn reward of step 1 prefers A
    base = TwoStepConfig(rewards=(1.0, 0.0, 1.0, 0.0), step1_rewards=(0.5, 0.0), steps=200, seed=seed)
    final = train_two_step(base)
    for credit in ("returns", "turn_group"):
        run = train_two_step(TwoStepConfig(**{**base.__dict__, "turn_credit": credit}))
        assert run.p_first_a[-1] > 0.95  # learned the first step from its per-turn reward
        assert run.pi2[-1, 0, 0] > 0.95  # and the second step from the end reward
    assert final.p_first_a[-1] < 0.8  # the final reward alone carries nothing about step 1
    assert final.pi2[-1, 0, 0] > 0.9


def test_turn_returns_and_advantages_refuse_bad_counts() -> None:
    with pytest.raises(ValueError, match="n_turns: must be >= 0, got -1"):
        turn_returns(None, 1.0, -1)
    with pytest.raises(ValueError, match="final_reward is nan; rewards must be finite"):
        turn_returns([0.0, 0.0], float("nan"), 2)
    assert turn_returns(None, 1.0, 0).size == 0  # no turns: no returns, not an error
    with pytest.raises(ValueError, match="3 final rewards, 2 turn reward lists, 3 turn counts"):
        turn_advantages(FINAL, TURNS[:2], N, credit="returns")
    with pytest.raises(ValueError, match="3 final rewards, 3 turn reward lists, 2 turn counts"):
        turn_advantages(FINAL, TURNS, N[:2])


def test_token_advantages_name_a_turn_without_advantage() -> None:
    # a hand-built batch giving a two-turn trajectory one advantage: the second turn's tokens have none
    t = _two_turn(1.0, None, "a")
    batch = TrainBatch([t], np.zeros(1), turn_advantages=[np.asarray([0.5])])
    packed = tokenize_batch([t], TOK)
    assert packed.turn is not None and packed.owner is not None
    with pytest.raises(
        ValueError, match=rf"trajectory {t.id}: turn 1 has no advantage \(turn_advantages has 1\)"
    ):
        batch.token_advantages(packed.turn, packed.owner)
    ok = TrainBatch([t], np.zeros(1), turn_advantages=[np.asarray([0.5, -0.25])])
    row = ok.token_advantages(packed.turn, packed.owner)[0]
    np.testing.assert_allclose(row[packed.mask[0]], [0.5, 0.5, -0.25, -0.25, -0.25])
