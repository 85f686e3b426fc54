"""Concurrent gathering of rollouts (awaitables returning a :class:`Trajectory` or a non-empty list of them) into
groups, with a concurrency cap and an exception budget. A rollout that raises, times out, cancels itself or
returns anything else is a failure, recorded in its group's ``exceptions`` within ``max_exceptions`` (a count, or
a fraction in (0, 1)); one more cancels the rest and raises :class:`GatherError`. A rollout that swallows its
cancellation at ``rollout_timeout`` is abandoned, its late result discarded (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar, Union

from palaestra.trajectories.runs import scrub_error
from palaestra.trajectories.types import ExceptionRecord, Trajectory, TrajectoryGroup

T = TypeVar("T")
AfterEachResult = Union[TrajectoryGroup, None, Sequence[TrajectoryGroup]]
AfterEach = Callable[[TrajectoryGroup], Union[AfterEachResult, Awaitable[AfterEachResult]]]
_MIN_INTERVAL = 0.2  # seconds between refreshes of the running means


class Progress:
    """Counts finished rollouts; a bar with done/total and running means when stderr is a terminal."""

    def __init__(self, desc: str = "gather", *, enabled: bool | None = None) -> None:
        self.total = self.done = self.exceptions = 0
        self.sums: dict[str, list[float]] = {}  # key -> [sum, count]
        self._bar: Any = None
        self._last = 0.0
        if sys.stderr.isatty() if enabled is None else enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=desc, dynamic_ncols=True)

    def add_total(self, n: int) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def means(self) -> dict[str, float]:
        """Running mean of reward and every numeric metric seen so far, plus the exception count."""
        return {**{k: s / n for k, (s, n) in self.sums.items()}, "exceptions": float(self.exceptions)}

    def rollout_done(self, trajectory: Trajectory) -> None:
        for key, value in [("reward", trajectory.reward), *trajectory.metrics.items()]:
            if isinstance(value, (int, float)):
                acc = self.sums.setdefault(key, [0.0, 0])
                acc[0] += float(value)
                acc[1] += 1
        self._tick()

    def rollout_failed(self) -> None:
        self.exceptions += 1
        self._tick()

    def _tick(self) -> None:
        self.done += 1
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.monotonic()
        if now - self._last >= _MIN_INTERVAL or self.done == self.total:
            self._last = now
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in self.means().items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class GatherError(RuntimeError):
    """More rollouts failed than the exception budget allows; names how many and shows the first traceback."""

    def __init__(self, failures: int, total: int, budget: float, first: ExceptionRecord) -> None:
        super().__init__(
            f"{failures} of {total} rollouts failed, more than max_exceptions={budget!r} allows; "
            f"the rest were cancelled. First failure ({first.type}: {first.message}):\n{first.traceback}"
        )
        self.failures = failures
        self.total = total
        self.first = first


@dataclass
class _Context:
    max_concurrency: int | None = None
    max_exceptions: float = 0
    rollout_timeout: float | None = None
    bar: InitVar[bool] = False
    desc: InitVar[str] = "gather"
    first: ExceptionRecord | None = None
    registered: set[int] = field(default_factory=set)
    abandoned: set[asyncio.Future[Any]] = field(default_factory=set)

    def __post_init__(self, bar: bool, desc: str) -> None:
        if isinstance(self.max_exceptions, bool) or not isinstance(self.max_exceptions, (int, float)):
            raise TypeError("max_exceptions must be an int count or a float fraction in (0, 1)")
        if isinstance(self.max_exceptions, int) and self.max_exceptions < 0:
            raise ValueError("max_exceptions must be >= 0")
        if isinstance(self.max_exceptions, float) and not 0.0 < self.max_exceptions < 1.0:
            raise ValueError("a float max_exceptions is a fraction of rollouts and must lie in (0, 1)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1 or None")
        if self.rollout_timeout is not None and self.rollout_timeout <= 0:
            raise ValueError("rollout_timeout must be > 0 or None")
        self.semaphore = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        self.progress = Progress(desc=desc, enabled=None if bar else False)

    def register(self, group: TrajectoryGroup) -> None:
        if id(group) not in self.registered:
            self.registered.add(id(group))
            self.progress.add_total(group.num_pending)

    async def run_all(self, aws: Sequence[Awaitable[T]]) -> list[T]:
        """Start ``aws`` as tasks that see this context, wait for all of them, close the bar."""
        token = _CONTEXT.set(self)
        try:
            tasks = [asyncio.ensure_future(a) for a in aws]
        finally:
            _CONTEXT.reset(token)
        try:
            return await wait_all(tasks)
        finally:
            self.progress.close()

    async def run_rollout(self, awaitable: Awaitable[Any]) -> Trajectory | list[Trajectory] | ExceptionRecord:
        started = False
        try:
            async with self.semaphore or contextlib.nullcontext():
                started = True
                result = await self._run_with_deadline(awaitable)
            is_list = isinstance(result, list) and result and all(isinstance(t, Trajectory) for t in result)
            if not isinstance(result, Trajectory) and not is_list:
                raise TypeError(f"rollout returned {type(result).__name__}, expected a Trajectory")
        except Exception as exc:  # a CancelledError (BaseException) propagates
            return self._failed(exc)
        finally:
            if not started and inspect.iscoroutine(awaitable):
                awaitable.close()  # never started: close it so no "never awaited" warning leaks
        for t in result if isinstance(result, list) else [result]:
            self.progress.rollout_done(t)
        return result  # type: ignore[no-any-return]

    async def _run_with_deadline(self, awaitable: Awaitable[Any]) -> Any:
        """Await the rollout under ``rollout_timeout`` (module docstring); cancelling the gather cancels it."""
        if self.rollout_timeout is None and _TASKS_COUNT_CANCELS:
            # no deadline: run the rollout in this task (no second task per rollout); whether a CancelledError
            # is the rollout's own or a cancellation of the gather is told by the task's cancel requests
            try:
                return await awaitable
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is None or current.cancelling():  # type: ignore[attr-defined]  # 3.11+, guarded
                    raise
                raise RolloutCancelled(_SELF_CANCELLED) from None
        task = asyncio.ensure_future(awaitable)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.rollout_timeout)
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(BaseException):  # give it its chance to clean up, within the deadline
                await asyncio.wait({task}, timeout=self.rollout_timeout)
            if not task.done():
                self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError(f"rollout exceeded rollout_timeout={self.rollout_timeout}s")
        if task.cancelled():
            raise RolloutCancelled(_SELF_CANCELLED)
        return task.result()

    def _abandon(self, task: asyncio.Future[Any]) -> None:
        """Cancel ``task`` and stop waiting; it stays referenced until it ends, its outcome dropped."""
        task.cancel()
        self.abandoned.add(task)

        def forget(t: asyncio.Future[Any]) -> None:
            self.abandoned.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: no "exception was never retrieved" warning

        task.add_done_callback(forget)

    def _failed(self, exc: Exception) -> ExceptionRecord:
        # kept as raised: the gather's own deadline raises a TimeoutError that says so, while a bare
        # TimeoutError() is the rollout's (an ``asyncio.wait_for`` inside it), not rollout_timeout
        record = ExceptionRecord.from_exception(exc)
        # an endpoint may quote the key it was sent: no known key reaches a group, a log or a GatherError
        record.message, record.traceback = scrub_error(record.message), scrub_error(record.traceback)
        self.first = self.first or record
        self.progress.rollout_failed()
        budget, failures, total = self.max_exceptions, self.progress.exceptions, self.progress.total
        if failures > (budget if isinstance(budget, int) else math.floor(budget * total)):
            raise GatherError(failures, total, budget, self.first) from None
        return record


_TASKS_COUNT_CANCELS = sys.version_info >= (3, 11)  # asyncio.Task.cancelling() exists from Python 3.11
_SELF_CANCELLED = "the rollout raised CancelledError although the gather was not cancelled"


class RolloutCancelled(Exception):
    """A rollout raised ``CancelledError`` while its gather was not being cancelled (counted as a failure)."""


_CONTEXT: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("palaestra_gather", default=None)


async def wait_all(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Run awaitables as tasks; on the first error (or on cancellation) cancel the rest, wait, and re-raise."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if failed := [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        errors = [t.exception() for t in failed]
        chosen = next((e for e in errors if isinstance(e, GatherError)), errors[0])
        assert chosen is not None
        raise chosen
    return [t.result() for t in tasks]


async def run_group(group: TrajectoryGroup) -> TrajectoryGroup:
    """Run a group's pending rollouts (what ``await group`` does) and return the group."""
    if not (pending := list(group._pending)):
        return group
    ctx = _CONTEXT.get() or _Context()
    ctx.register(group)
    group._pending = []
    if len(pending) == 1:  # one group rollout (n samples in one request): run it in this task
        results = [await ctx.run_rollout(pending[0])]
    else:
        results = await wait_all([ctx.run_rollout(a) for a in pending])
    for r in results:
        if isinstance(r, ExceptionRecord):
            group.exceptions.append(r)
        else:
            group.trajectories.extend(r if isinstance(r, list) else [r])
    return group


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    max_concurrency: int | None = None,
    max_exceptions: float = 0,
    rollout_timeout: float | None = None,
    after_each: AfterEach | None = None,
    progress: bool = True,
    desc: str = "gather",
) -> list[TrajectoryGroup]:
    """Run all groups' rollouts concurrently (limits: module docstring); return the groups in input order.
    ``after_each`` (sync or async) gets each finished group and returns it, a replacement, None (drop) or a list."""
    items = list(groups)
    ctx = _Context(max_concurrency, max_exceptions, rollout_timeout, progress, desc)
    for g in items:
        if isinstance(g, TrajectoryGroup):
            ctx.register(g)

    async def one(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
        group = await item
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"a gathered awaitable returned {type(group).__name__}, expected TrajectoryGroup")
        if after_each is None:
            return [group]
        result = after_each(group)
        if inspect.isawaitable(result):
            result = await result
        out = [] if result is None else [result] if isinstance(result, TrajectoryGroup) else list(result)
        if bad := [g for g in out if not isinstance(g, TrajectoryGroup)]:
            raise TypeError(
                f"after_each returned a list holding {type(bad[0]).__name__}, expected TrajectoryGroup"
            )
        return out

    nested = await ctx.run_all([one(g) for g in items])
    return [g for sub in nested for g in sub]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    max_concurrency: int | None = None,
    max_exceptions: float = 0,
    rollout_timeout: float | None = None,
    progress: bool = True,
) -> list[Trajectory | list[Trajectory] | ExceptionRecord]:
    """Run rollouts concurrently; failures within budget come back in place as :class:`ExceptionRecord`."""
    aws = list(trajectories)
    ctx = _Context(max_concurrency, max_exceptions, rollout_timeout, progress, "gather")
    ctx.progress.add_total(len(aws))
    return await ctx.run_all([ctx.run_rollout(a) for a in aws])
