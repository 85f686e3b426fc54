"""gather_trajectory_groups / gather_trajectories: order, concurrency cap, exception budgets, after_each,
cancellation, timeouts and malformed rollouts."""

from __future__ import annotations

import asyncio

import pytest

from palaestra import GatherError, Trajectory, TrajectoryGroup, gather_trajectories, gather_trajectory_groups
from palaestra.trajectories.types import ExceptionRecord


class Tracker:
    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.started = 0
        self.finished = 0
        self.cancelled = 0

    async def rollout(self, reward: float, delay: float = 0.01, fail: bool = False) -> Trajectory:
        self.started += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(delay)
            if fail:
                raise RuntimeError(f"rollout {reward} failed")
            return Trajectory(reward=reward, metrics={"r2": reward * 2})
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self.finished += 1


async def test_group_from_coroutines_runs_them_concurrently() -> None:
    tr = Tracker()
    group = TrajectoryGroup(tr.rollout(float(i), delay=0.05) for i in range(8))
    assert group.num_pending == 8 and len(group) == 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    same = await group
    assert same is group
    assert loop.time() - t0 < 0.3  # 8 x 50 ms would be 400 ms sequentially
    assert sorted(group.rewards()) == [float(i) for i in range(8)]
    assert tr.peak == 8


async def test_results_keep_input_order_of_groups() -> None:
    tr = Tracker()
    # later groups finish first
    groups = [
        TrajectoryGroup([tr.rollout(float(i), delay=0.05 - 0.01 * i)], metadata={"i": i}) for i in range(5)
    ]
    out = await gather_trajectory_groups(groups, progress=False)
    assert [g.metadata["i"] for g in out] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cap", [1, 3, 7])
async def test_concurrency_cap_counts_rollouts_across_groups(cap: int) -> None:
    tr = Tracker()
    groups = [TrajectoryGroup(tr.rollout(1.0, delay=0.005) for _ in range(4)) for _ in range(6)]
    out = await gather_trajectory_groups(groups, max_concurrency=cap, progress=False)
    assert tr.peak == cap
    assert sum(len(g) for g in out) == 24


async def test_exceptions_within_count_budget_are_recorded() -> None:
    tr = Tracker()
    groups = [TrajectoryGroup([tr.rollout(1.0), tr.rollout(0.0, fail=True)]) for _ in range(3)]
    out = await gather_trajectory_groups(groups, max_exceptions=3, progress=False)
    assert [len(g) for g in out] == [1, 1, 1]
    assert all(len(g.exceptions) == 1 and g.exceptions[0].type == "RuntimeError" for g in out)


async def test_exceptions_past_count_budget_raise_and_cancel_the_rest() -> None:
    tr = Tracker()
    slow = [TrajectoryGroup(tr.rollout(1.0, delay=5.0) for _ in range(4))]
    bad = [TrajectoryGroup([tr.rollout(0.0, fail=True, delay=0.01)]) for _ in range(3)]
    with pytest.raises(GatherError) as info:
        await gather_trajectory_groups(slow + bad, max_exceptions=2, progress=False)
    assert info.value.failures == 3 and info.value.total == 7
    assert "3 of 7 rollouts failed" in str(info.value) and "RuntimeError" in str(info.value)
    assert tr.running == 0 and tr.cancelled == 4  # nothing left running


async def test_fraction_budget() -> None:
    tr = Tracker()

    # 10 rollouts, 2 fail: within 0.25 (floor(2.5) = 2), past 0.15 (floor(1.5) = 1)
    def make() -> list[TrajectoryGroup]:
        return [TrajectoryGroup([tr.rollout(1.0, fail=(i < 2))]) for i in range(10)]

    out = await gather_trajectory_groups(make(), max_exceptions=0.25, progress=False)
    assert sum(len(g.exceptions) for g in out) == 2
    with pytest.raises(GatherError):
        await gather_trajectory_groups(make(), max_exceptions=0.15, progress=False)


async def test_default_budget_is_zero() -> None:
    tr = Tracker()
    with pytest.raises(GatherError, match="1 of 2 rollouts failed"):
        await gather_trajectory_groups(
            [TrajectoryGroup([tr.rollout(1.0), tr.rollout(0, fail=True)])], progress=False
        )


@pytest.mark.parametrize("bad", [-1, 1.5, 0.0, True, "3"])
async def test_invalid_budget_rejected(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        await gather_trajectory_groups([], max_exceptions=bad, progress=False)  # type: ignore[arg-type]


async def test_after_each_drop_replace_flatten_and_async() -> None:
    tr = Tracker()

    async def after_each(g: TrajectoryGroup) -> TrajectoryGroup | list[TrajectoryGroup] | None:
        i = g.metadata["i"]
        if i == 0:
            return None
        if i == 1:
            return TrajectoryGroup([Trajectory(reward=99.0)], metadata={"i": "replaced"})
        if i == 2:
            return [g, TrajectoryGroup([], metadata={"i": "extra"})]
        return g

    groups = [TrajectoryGroup([tr.rollout(float(i))], metadata={"i": i}) for i in range(4)]
    out = await gather_trajectory_groups(groups, after_each=after_each, progress=False)
    assert [g.metadata["i"] for g in out] == ["replaced", 2, "extra", 3]

    # a sync after_each works too
    out2 = await gather_trajectory_groups(
        [TrajectoryGroup([tr.rollout(1.0)])], after_each=lambda g: g, progress=False
    )
    assert len(out2) == 1


async def test_outer_cancellation_leaves_no_running_task() -> None:
    tr = Tracker()
    groups = [TrajectoryGroup(tr.rollout(1.0, delay=10) for _ in range(5)) for _ in range(2)]
    task = asyncio.ensure_future(gather_trajectory_groups(groups, max_concurrency=4, progress=False))
    await asyncio.sleep(0.05)
    assert tr.running == 4
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tr.running == 0
    assert tr.started == 4  # queued rollouts never started (and were closed, no warnings)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []


async def test_timeouts_and_malformed_rollouts_are_failures() -> None:
    tr = Tracker()

    async def not_a_trajectory() -> dict[str, float]:
        return {"reward": 1.0}

    group = TrajectoryGroup([tr.rollout(1.0, delay=5.0), not_a_trajectory(), tr.rollout(2.0)])  # type: ignore[list-item]
    out = await gather_trajectory_groups([group], max_exceptions=2, rollout_timeout=0.2, progress=False)
    types = sorted(e.type for e in out[0].exceptions)
    assert types == ["TimeoutError", "TypeError"]
    assert out[0].rewards() == [2.0]
    assert any("expected a Trajectory" in e.message for e in out[0].exceptions)


async def test_gather_trajectories_returns_failures_in_place() -> None:
    tr = Tracker()
    out = await gather_trajectories(
        [tr.rollout(1.0), tr.rollout(2.0, fail=True), tr.rollout(3.0)], max_exceptions=1, progress=False
    )
    assert (
        isinstance(out[0], Trajectory)
        and isinstance(out[1], ExceptionRecord)
        and isinstance(out[2], Trajectory)
    )
    assert out[2].reward == 3.0


async def test_awaitables_returning_groups_share_the_cap() -> None:
    tr = Tracker()

    async def make_group() -> TrajectoryGroup:
        return await TrajectoryGroup(tr.rollout(1.0, delay=0.01) for _ in range(5))

    out = await gather_trajectory_groups([make_group() for _ in range(4)], max_concurrency=2, progress=False)
    assert tr.peak == 2 and sum(len(g) for g in out) == 20


async def test_progress_means() -> None:
    from palaestra.trajectories.gather import Progress

    p = Progress(enabled=False)
    p.add_total(3)
    p.rollout_done(Trajectory(reward=1.0, metrics={"m": 2}))
    p.rollout_done(Trajectory(reward=0.0, metrics={"m": 4}))
    p.rollout_failed()
    assert p.means() == {"reward": 0.5, "m": 3.0, "exceptions": 1.0}


async def test_group_rollouts_returning_lists_are_flattened_and_counted_as_one_call() -> None:
    calls = []

    async def n_samples(n: int) -> list[Trajectory]:
        calls.append(n)
        await asyncio.sleep(0.01)
        return [Trajectory(reward=float(i)) for i in range(n)]

    async def failing() -> list[Trajectory]:
        raise RuntimeError("endpoint down")

    groups = [TrajectoryGroup([n_samples(4)]), TrajectoryGroup([n_samples(3), failing()])]
    out = await gather_trajectory_groups(groups, max_exceptions=1, progress=False)
    assert [len(g) for g in out] == [4, 3] and out[1].exceptions[0].type == "RuntimeError"
    assert calls == [4, 3]

    async def empty() -> list[Trajectory]:
        return []

    with pytest.raises(GatherError, match="expected a Trajectory"):
        await gather_trajectory_groups([TrajectoryGroup([empty()])], progress=False)


async def test_rollout_raising_cancelled_error_is_a_counted_failure_not_a_crash() -> None:
    """Issue 16.14: CancelledError from inside a rollout (nobody cancelled the gather) is a rollout failure."""
    tr = Tracker()

    async def cancels_itself() -> Trajectory:
        await asyncio.sleep(0.01)
        raise asyncio.CancelledError("upstream stream was cancelled")

    group = TrajectoryGroup([tr.rollout(1.0), cancels_itself(), tr.rollout(2.0)])
    out = await gather_trajectory_groups([group], max_exceptions=1, progress=False)
    assert sorted(out[0].rewards()) == [1.0, 2.0]
    assert len(out[0].exceptions) == 1 and "CancelledError" in out[0].exceptions[0].message
    # past the budget it is a GatherError like any failure, not a CancelledError
    with pytest.raises(GatherError, match="1 of 2 rollouts failed"):
        await gather_trajectory_groups(
            [TrajectoryGroup([cancels_itself(), tr.rollout(3.0, delay=5)])], progress=False
        )
    out2 = await gather_trajectories([cancels_itself(), tr.rollout(4.0)], max_exceptions=1, progress=False)
    assert isinstance(out2[0], ExceptionRecord) and isinstance(out2[1], Trajectory)


async def test_a_rollout_that_swallows_cancellation_cannot_overrun_the_timeout() -> None:
    """Issue 16.14: rollout_timeout is a deadline; a late result after swallowing the cancel is a timeout."""
    loop = asyncio.get_running_loop()
    late: list[str] = []

    async def stubborn() -> Trajectory:
        end = loop.time() + 1.5
        while loop.time() < end:
            try:
                await asyncio.sleep(end - loop.time())
            except asyncio.CancelledError:
                continue  # swallowed
        late.append("returned")
        return Trajectory(reward=99.0)

    async def fine() -> Trajectory:
        return Trajectory(reward=1.0)

    t0 = loop.time()
    out = await gather_trajectory_groups(
        [TrajectoryGroup([stubborn(), fine()])], max_exceptions=1, rollout_timeout=0.3, progress=False
    )
    elapsed = loop.time() - t0
    assert elapsed < 1.0, elapsed  # stopped waiting at the deadline, not when the rollout chose to end
    assert out[0].rewards() == [1.0]  # the late 99.0 is never a success
    assert [e.type for e in out[0].exceptions] == ["TimeoutError"]
    # the same stubborn rollout past the budget is a GatherError, also at the deadline
    t0 = loop.time()
    with pytest.raises(GatherError, match="rollout_timeout"):
        await gather_trajectories([stubborn()], rollout_timeout=0.3, progress=False)
    assert loop.time() - t0 < 1.0
    await asyncio.sleep(1.5)  # the abandoned rollouts end on their own; their results went nowhere
    assert late == ["returned", "returned"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_concurrency": 0}, "max_concurrency must be >= 1 or None"),
        ({"rollout_timeout": 0}, "rollout_timeout must be > 0 or None"),
        ({"rollout_timeout": -1.0}, "rollout_timeout must be > 0 or None"),
    ],
)
async def test_invalid_concurrency_and_timeout_rejected(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await gather_trajectory_groups([], progress=False, **options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        await gather_trajectories([], progress=False, **options)  # type: ignore[arg-type]


async def test_nothing_to_gather_gives_nothing() -> None:
    assert await gather_trajectory_groups([], progress=False) == []
    assert await gather_trajectories([], progress=False) == []


async def test_a_rollout_that_cancels_itself_under_a_deadline_is_a_counted_failure() -> None:
    async def cancels_itself() -> Trajectory:
        await asyncio.sleep(0.01)
        raise asyncio.CancelledError("upstream stream was cancelled")

    async def fine() -> Trajectory:
        return Trajectory(reward=1.0)

    group = TrajectoryGroup([cancels_itself(), fine()])
    out = await gather_trajectory_groups([group], max_exceptions=1, rollout_timeout=5.0, progress=False)
    assert out[0].rewards() == [1.0]
    assert [(e.type, e.message) for e in out[0].exceptions] == [
        ("RolloutCancelled", "the rollout raised CancelledError although the gather was not cancelled")
    ]


async def test_a_rollout_s_own_timeout_is_not_reported_as_rollout_timeout() -> None:
    async def own_timeout() -> Trajectory:
        await asyncio.wait_for(asyncio.sleep(5), 0.01)  # raises a bare TimeoutError() inside the rollout
        return Trajectory(reward=9.0)

    async def fine() -> Trajectory:
        return Trajectory(reward=1.0)

    for timeout in (None, 30.0):
        group = TrajectoryGroup([own_timeout(), fine()])
        out = await gather_trajectory_groups(
            [group], max_exceptions=1, rollout_timeout=timeout, progress=False
        )
        (record,) = out[0].exceptions
        assert record.type == "TimeoutError" and "rollout_timeout" not in record.message
        assert "own_timeout" in record.traceback  # where it came from


async def test_after_each_and_awaitables_must_give_groups() -> None:
    async def fine() -> Trajectory:
        return Trajectory(reward=1.0)

    with pytest.raises(TypeError, match="after_each returned a list holding dict, expected TrajectoryGroup"):
        await gather_trajectory_groups(
            [TrajectoryGroup([fine()])], after_each=lambda g: [g, {"not": "a group"}], progress=False
        )

    async def not_a_group() -> list[Trajectory]:
        return [await fine()]

    with pytest.raises(TypeError, match="a gathered awaitable returned list, expected TrajectoryGroup"):
        await gather_trajectory_groups([not_a_group()], progress=False)  # type: ignore[list-item]


async def test_progress_bar_counts_rollouts_and_shows_means(capsys: pytest.CaptureFixture[str]) -> None:
    from palaestra.trajectories.gather import Progress

    p = Progress(desc="rollouts", enabled=True)  # a tqdm bar on stderr
    p.add_total(3)
    p.rollout_done(Trajectory(reward=1.0, metrics={"m": 2}))
    p.rollout_done(Trajectory(reward=0.0, metrics={"m": 4}))
    p.rollout_failed()
    p.close()
    p.close()  # twice is fine
    err = capsys.readouterr().err
    assert "rollouts" in err and "3/3" in err
    assert "reward=0.5" in err and "m=3" in err and "exceptions=1" in err
