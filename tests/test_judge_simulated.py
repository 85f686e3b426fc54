"""SimulatedJudge: gold-based scores with controlled, seeded defects; same keys as RulerJudge; usable as the
script of a local server so the real RulerJudge runs against it."""

from __future__ import annotations

import re

import pytest

from palaestra.judges.faults import fault_script
from palaestra.judges.ruler import RulerJudge
from palaestra.judges.simulated import SimulatedJudge, completion_text, contains_number
from palaestra.testing import ScriptedServer
from palaestra.trajectories.protocols import RewardFunction
from palaestra.trajectories.types import Trajectory, TrajectoryGroup


def make_group(answers: list[str], reward: float = 0.25) -> TrajectoryGroup:
    prefix = [{"role": "user", "content": "What is 2+3? Reply with one line: Final: <int>"}]
    return TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[*prefix, {"role": "assistant", "content": a}], reward=reward)
            for a in answers
        ],
        metadata={"id": "p1"},
    )


def gold(traj: Trajectory, example: object) -> float:
    """Stands in for a verifier: 1 when the last line is exactly 'Final: 5'."""
    return 1.0 if completion_text(traj).strip().splitlines()[-1:] == ["Final: 5"] else 0.0


ANSWERS = ["Final: 5", "Final: 4", "The answer is five.\nFinal: 5", "no idea"]


async def test_unbiased_judge_reproduces_gold_with_the_same_keys_as_ruler() -> None:
    sim_group = make_group(ANSWERS)
    sim = SimulatedJudge(gold)
    assert isinstance(sim, RewardFunction)
    assert await sim.score_group(sim_group) is sim_group
    assert sim_group.rewards() == [1.0, 0.0, 1.0, 0.0]
    assert all(t.metrics["independent_reward"] == 0.25 for t in sim_group.trajectories)

    http_group = make_group(ANSWERS)
    with ScriptedServer(fault_script()) as server:
        await RulerJudge("m", base_url=server.base_url).score_group(http_group)
    assert set(sim_group.metrics) == set(http_group.metrics)
    assert set(sim_group.metadata) == set(http_group.metadata)
    assert set(sim_group.trajectories[0].metrics) == set(http_group.trajectories[0].metrics)
    assert set(sim_group.trajectories[0].metadata) == set(http_group.trajectories[0].metadata)
    assert sim_group.metadata["judge"] == "simulated:simulated" and sim_group.metrics["judge_calls"] == 1
    info = sim.info()
    assert info["kind"] == "simulated" and info["noise"] == 0.0 and info["gold"] == "gold"


async def test_position_bias_follows_the_presentation_slot() -> None:
    group = make_group([f"Final: {i}" for i in range(6, 12)])  # all gold 0
    await SimulatedJudge(gold, position_bias=0.5).score_group(group)
    n = len(group)
    for t in group.trajectories:
        slot = t.metadata["judge_slot"]
        assert t.reward == pytest.approx(0.5 * (1 - slot / (n - 1)))


async def test_length_and_format_bias() -> None:
    short, long = "Final: 5", "Let me think step by step about this sum very carefully.\nFinal: 5"
    group = make_group([short, long])
    await SimulatedJudge(lambda t, e: 0.5, length_bias=0.2).score_group(group)
    s, lo = group.rewards()
    assert lo == pytest.approx(0.7) and s == pytest.approx(0.5 + 0.2 * len(short) / len(long))

    group = make_group(["five", "5"])
    await SimulatedJudge(lambda t, e: 0.0, format_bias=0.3).score_group(group)
    assert group.rewards() == [
        0.0,
        pytest.approx(0.3),
    ]  # rewarded for containing a number, not for being right
    assert contains_number("x1") and not contains_number("none")


async def test_noise_is_seeded_and_repeats_differ() -> None:
    async def run(judge: SimulatedJudge) -> list[float]:
        g = make_group(ANSWERS)
        await judge.score_group(g)
        return g.rewards()

    a1, a2 = SimulatedJudge(gold, noise=0.1, seed=1), SimulatedJudge(gold, noise=0.1, seed=1)
    first = await run(a1)
    assert first == await run(a2)  # same seed, same scores
    assert first != await run(a1)  # a repeat on the same judge draws new noise
    assert first != await run(SimulatedJudge(gold, noise=0.1, seed=2))
    assert all(0.0 <= r <= 1.0 for r in first)


async def test_quantize_and_failing_gold() -> None:
    group = make_group(ANSWERS)
    await SimulatedJudge(lambda t, e: 0.33, quantize=3).score_group(group)
    assert set(group.rewards()) == {0.5}

    def broken(t: Trajectory, e: object) -> float:
        raise KeyError("expected_answer")

    group = make_group(ANSWERS)
    assert await SimulatedJudge(broken).score_group(group) is None
    assert group.metrics["judge_unscored"] == 1 and group.rewards() == [0.25] * 4
    with pytest.raises(ValueError):
        SimulatedJudge(gold, noise=-1)


async def test_simulated_server_drives_the_real_ruler_judge() -> None:
    sim = SimulatedJudge(gold, position_bias=0.3)
    group = make_group(ANSWERS)
    with ScriptedServer(sim.as_script()) as server:
        judge = RulerJudge("sim", base_url=server.base_url)
        await judge.score_group(group)
    request_text = server.requests[0]["messages"][1]["content"]
    ids_in_order = re.findall(r'<candidate id="([0-9a-f]{6})">', request_text)
    for t in group.trajectories:
        slot = ids_in_order.index(t.metadata["judge_id"])
        assert slot == t.metadata["judge_slot"]
        want = min(1.0, gold(t, None) + 0.3 * (1 - slot / 3))
        assert t.reward == pytest.approx(want)
    assert group.metrics["judge_calls"] == 1 and group.metrics["judge_unscored"] == 0


async def test_simulated_server_scores_do_not_depend_on_arrival_order() -> None:
    """The stand-in server's noise is seeded by each request's content: the same groups judged in reverse
    order give the same rewards (a counter-seeded script would hand the noise to other requests)."""
    sim = SimulatedJudge(gold, noise=0.3, seed=7)
    answers = [ANSWERS, ANSWERS[::-1], ["Final: 5", "Final: 6", "x", "Final: 5"], ["a", "b", "c", "Final: 5"]]

    async def judge_all(order: list[int]) -> dict[int, list[float]]:
        groups = {i: make_group(answers[i]) for i in order}
        for i, g in groups.items():
            g.metadata["id"] = f"p{i}"
        with ScriptedServer(sim.as_script()) as server:
            judge = RulerJudge("sim", base_url=server.base_url, seed=1)
            for i in order:
                await judge.score_group(groups[i])
        return {i: g.rewards() for i, g in groups.items()}

    forward, backward = await judge_all([0, 1, 2, 3]), await judge_all([3, 2, 1, 0])
    assert forward == backward
    assert len({tuple(r) for r in forward.values()}) > 1


async def test_non_finite_gold_leaves_the_group_unscored() -> None:
    from palaestra.judges.base import JudgeError

    group = make_group(ANSWERS)
    assert await SimulatedJudge(lambda t, e: float("nan")).score_group(group) is None
    assert group.metrics["judge_unscored"] == 1 and group.rewards() == [0.25] * 4
    with pytest.raises(JudgeError, match=r"gold function returned inf \(not finite\)"):
        await SimulatedJudge(lambda t, e: float("inf"), on_failure="raise").score_group(make_group(ANSWERS))


def test_longer_than_counts_stripped_characters_and_refuses_a_negative_length() -> None:
    from palaestra.judges.simulated import longer_than

    feature = longer_than(3)
    assert [feature(t) for t in ("abcd", "  abc  ", "")] == [True, False, False]
    assert longer_than(0)("x") and not longer_than(0)("   ")
    with pytest.raises(ValueError, match="min_chars must be >= 0, got -1"):
        longer_than(-1)
