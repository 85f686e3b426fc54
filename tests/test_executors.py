"""Rollout executors without Ray: the in-process executor runs sync and async calls, and a Ray executor's bad
settings are refused when it is made (before Ray is imported or started). Ray itself: tests/test_ray_executor.py."""

from __future__ import annotations

import asyncio

import pytest

from palaestra.trajectories.executors import Executor, InProcessExecutor, RayExecutor


async def test_in_process_executor_runs_sync_and_async_calls() -> None:
    executor: Executor = InProcessExecutor()

    def add(a: int, b: int = 0) -> int:
        return a + b

    async def later(a: int, *, b: int) -> int:
        await asyncio.sleep(0)
        return a * b

    assert await executor.submit(add, 2, b=3) == 5
    assert await executor.submit(later, 4, b=5) == 20
    with pytest.raises(ZeroDivisionError):
        await executor.submit(lambda: 1 / 0)
    executor.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 0}, "num_workers must be >= 1 or None, got 0"),
        ({"resources": {"num_cpus": -1}}, "rollout resource 'num_cpus' must be a number >= 0, got -1"),
        ({"resources": {"num_gpus": "one"}}, "rollout resource 'num_gpus' must be a number >= 0, got 'one'"),
        (
            {"resources": {"accelerator": True}},
            "rollout resource 'accelerator' must be a number >= 0, got True",
        ),
    ],
)
def test_bad_ray_settings_are_refused_at_once(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RayExecutor(**kwargs)
