"""Where and when an experiment's rollouts run: now or ahead of time (``[run] max_staleness``), in this
process or in local worker processes (``[run] rollout_processes``); the schedule and placements are described
in docs/scaling.md. Before step ``k`` the loop calls :meth:`RolloutPipeline.begin`, which starts the rollouts of
steps up to ``k + s`` with the calls the loop itself would make (same order, arguments and seeds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from palaestra.trainer.endpoints import endpoint_of, remote_rollout
from palaestra.trainer.rollout_worker import RolloutProcess, drain, picklable, serve_copy, stamped
from palaestra.trajectories.executors import Executor, InProcessExecutor, RayExecutor

__all__ = ["RolloutPipeline", "sampling_version"]


def sampling_version(step: int, max_staleness: int) -> int:
    """The policy version (updates done) that samples step ``step``'s rollouts (1-based steps)."""
    return max(0, step - 1 - max_staleness)


@dataclass
class _Snapshot:
    """The weights and version of the live policy at one moment: what a step's rollouts sample from."""

    step: int
    params: dict[str, np.ndarray]

    @classmethod
    def of(cls, model: Any, copy: bool = True) -> _Snapshot:
        """``copy=False``: the live arrays themselves (sent at once, before the update can change them)."""
        with model.lock:
            return cls(int(model.step), {n: a.copy() if copy else a for n, a in model.gpt.params.items()})


def _not_sendable(model: Any, rollout: Any) -> str | None:
    """Why the rollouts cannot run in worker processes (without ``rollout``: why the policy cannot be copied)."""
    from palaestra.models.embedded import EmbeddedModel

    if not isinstance(model, EmbeddedModel):
        return f"{type(model).__name__} is not the embedded policy"
    if rollout is not None and not picklable(rollout):
        return f"rollout {getattr(rollout, '__qualname__', rollout)!r} is not a module-level function"
    return None


class RolloutPipeline:
    """Runs an experiment's rollouts with its executor, staleness and rollout processes (module docstring)."""

    def __init__(self, experiment: Any, model: Any, rollout: Callable[..., Any]) -> None:
        self.exp, self.run, self.model = experiment, experiment.config.run, model
        run = self.run
        self.max_staleness = s = int(run.max_staleness)
        if s > 0 and _not_sendable(model, None):  # before any work, not at the first step
            raise NotImplementedError(
                f"max_staleness > 0 needs a policy that can be copied in process (the embedded policy); "
                f"{type(model).__name__} is not supported yet (set [run] max_staleness = 0)"
            )
        ray = run.executor == "ray"
        self.executor: Executor = (
            RayExecutor(run.workers, resources=run.rollout_resources or None, address=run.ray_address)
            if ray
            else InProcessExecutor()
        )
        self._raw = self.rollout = rollout
        self._stops: dict[int, Callable[[], None]] = {}  # step -> stops its copy's endpoint (Ray; 0: live)
        if ray:  # the live policy served over HTTP: the workers get its endpoint (stopped by aclose)
            endpoint, self._stops[0] = endpoint_of(model)
            self.rollout = remote_rollout(rollout, self.executor, endpoint)
        self._frozen: dict[int, _Snapshot] = {}  # step -> the frozen weights its rollouts use
        self._copies: dict[int, Any] = {}  # step -> the frozen weights served in this process (no workers)
        self._tasks: dict[int, list[asyncio.Future[Any]]] = {}  # step -> its started rollouts, in call order
        self._versions: dict[int, int] = {}  # step -> the policy version that samples it
        self._trained: dict[int, int] = {}  # step -> the version its update starts from
        self._proc: RolloutProcess | None = None
        self._ahead: set[int] = set()  # steps launched in the workers whose weights are not sent yet
        #: where rollouts run: "process", "ray", "thread" (prefetched in process) or "inline" (s = 0 in process)
        self.worker = "ray" if ray else "thread" if s > 0 else "inline"
        n = 0 if ray else run.processes
        why = _not_sendable(model, rollout) if n > 0 else None
        if n > 0 and why is None:  # starts now: the workers warm up during the base validation
            self._proc, self.worker = RolloutProcess(model, rollout, n), "process"
        elif n > 0:
            where = "on a thread" if s > 0 else "in this process"
            experiment.say(f"rollout_processes = {n}: {why}, so the rollouts run {where} instead")
        self.ahead = s > 0 or self._proc is not None  # rollouts started by begin(), not called by rollouts()

    def _launch(self, step: int) -> None:
        """Freeze the live policy for ``step`` (even past max_steps: a resume with a larger budget needs it)
        and start its rollouts on it (launched ahead in the workers: send its weights)."""
        snap = self._frozen.get(step)
        if snap is None:  # at max_staleness 0 the live weights, uncopied: sent before the update changes them
            snap = self._frozen[step] = _Snapshot.of(self.model, copy=self.max_staleness > 0)
        if step > self.run.max_steps or (step in self._tasks and step not in self._ahead):
            return
        self._versions[step] = snap.step
        if step in self._ahead and self._proc is not None:  # its requests are built: now its weights
            self._ahead.discard(step)
            self._proc.publish(step, snap.step, snap.params)
        else:
            self._start(step, snap)

    def _start(self, step: int, snap: _Snapshot | None) -> None:
        """Start the rollout calls the loop will make for ``step`` on ``snap``'s weights, in the worker processes
        (``None``: launched ahead, the weights follow) or on a copy served in this process."""
        calls = [call for group in self.exp.rollout_calls(step, self._raw) for call in group]
        concurrency = self.run.max_concurrency or 1 << 30
        if self._proc is not None:
            version, params = (snap.step, snap.params) if snap is not None else (None, None)
            record = self.max_staleness > 0
            self._tasks[step] = self._proc.launch(step, version, params, calls, concurrency, record=record)
            return
        assert snap is not None
        version = snap.step
        frozen = self._copies[step] = serve_copy(self.model, version, snap.params)
        sem = asyncio.Semaphore(concurrency)
        fn = self._raw
        if self.worker == "ray":  # workers reach the frozen copy over HTTP, until end(step)
            endpoint, self._stops[step] = endpoint_of(frozen)
            fn = remote_rollout(self._raw, self.executor, endpoint)

        async def one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            async with sem:
                return stamped(await fn(frozen, *args, **kwargs), version)

        self._tasks[step] = [asyncio.ensure_future(one(args, kwargs)) for args, kwargs in calls]
        for task in self._tasks[step]:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning

    def begin(self, step: int) -> None:
        """Step ``step`` starts: make sure the rollouts of steps ``step .. step + s`` run (with worker processes
        at ``s = 0``, also launch step ``step + 1`` ahead). Called again when the step starts: a no-op."""
        if not self.ahead or step in self._trained:  # begun already (end() forgets it)
            return
        self._trained[step] = int(self.model.step)  # the version step's update starts from
        for k in range(step, step + self.max_staleness + 1):
            self._launch(k)  # a new launch freezes the live policy: by the schedule, the version k needs
        nxt = step + 1
        if self._proc is not None and self.max_staleness == 0 and nxt <= self.run.max_steps:
            # the workers start step + 1's calls once they finish this step's, so the openai client builds
            # its requests during this step's update; generation waits for the weights begin(step + 1) sends
            self._start(nxt, None)
            self._ahead.add(nxt)

    def rollouts(
        self, step: int, calls: list[list[tuple[tuple[Any, ...], dict[str, Any]]]]
    ) -> list[list[Any]]:
        """The awaitables of step ``step``'s rollout ``calls`` (per group): started by :meth:`begin`, or (``s = 0``
        in this process) called now on the live policy through the executor."""
        if not self.ahead:
            return [[self.rollout(self.model, *args, **kwargs) for args, kwargs in group] for group in calls]
        started = iter(self._tasks[step])
        out = [[next(started) for _ in group] for group in calls]
        if next(started, None) is not None:
            raise RuntimeError(f"pipeline: step {step} started other rollout calls than the loop makes")
        return out

    def end(self, step: int) -> dict[str, Any]:
        """Step ``step`` finished its update: staleness figures for its history row; frees its copy."""
        if not self.ahead:
            return {}
        for per_step in (self._tasks, self._frozen, self._copies):
            per_step.pop(step, None)
        self._stops.pop(step, lambda: None)()
        if self._proc is not None:
            self._proc.end(step)
        sampled, trained = self._versions.pop(step, None), self._trained.pop(step, 0)
        if self.max_staleness == 0:
            return {}  # the synchronous loop's history row, wherever its rollouts ran
        lag = trained - sampled if sampled is not None else 0
        return {
            "train/policy_version_sampled": sampled,
            "train/staleness_mean": float(lag),
            "train/staleness_max": int(lag),
        }

    def state_dict(self) -> dict[str, Any]:
        """The frozen policies the next ``s`` steps sample from (after ``end`` of the last finished step)."""
        if self.max_staleness == 0:
            return {}
        return {
            str(k): {"step": snap.step, "params": {n: a.copy() for n, a in snap.params.items()}}
            for k, snap in sorted(self._frozen.items())
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (before the first :meth:`begin`)."""
        if self.max_staleness == 0 or not state:
            return
        for k, item in state.items():
            params = {n: np.array(a) for n, a in item["params"].items()}
            self._frozen[int(k)] = _Snapshot(int(item["step"]), params)

    async def aclose(self) -> None:
        """Cancel rollouts prefetched for steps that will not run; stop the executor and the endpoints."""
        # the copies' passes, and the live model's queued behind them
        copies = [*self._copies.values(), self.model] if self.max_staleness > 0 else []
        await drain([t for tasks in self._tasks.values() for t in tasks], copies, 30.0)
        self._tasks.clear()
        self._copies.clear()
        for stop in self._stops.values():
            stop()
        self._stops.clear()
        if self._proc is not None:
            proc, self._proc = self._proc, None
            await proc.aclose()
        self.executor.close()
