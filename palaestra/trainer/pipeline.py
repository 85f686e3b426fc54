"""Pipelined (asynchronous) training: rollouts of the next steps are generated while the current update runs.

``[run] max_staleness = s`` bounds the policy lag in steps. The schedule is fixed, not timing-dependent: the
rollouts of step ``k`` are sampled by the policy after update ``max(0, k - 1 - s)``, so

* ``s = 0`` is today's synchronous loop (this module then changes nothing: same calls, same objects);
* ``s = 1``: step ``k + 1``'s rollouts run (on a frozen copy of the policy) while step ``k``'s update runs.

Each trajectory records the version that sampled it (``Trajectory.policy_version``); the update's importance
ratio uses the sampling-time logprobs each Choice carries (the clipped surrogate in
:mod:`palaestra.trainer.losses`), so a stale sample is corrected and clipped like any off-policy one. History
rows report ``train/staleness_mean`` and ``train/staleness_max`` (trainer version minus sampling version).

Resume stays exact: the checkpoint holds the frozen policy copies that the next ``s`` steps sample from, and
their rollouts (lost with the process) are generated again from those copies with the same seeds.

How it plugs into the loop (:func:`palaestra.trainer.loop.train`): :class:`RolloutPipeline` wraps the
rollout function. Before step ``k`` the loop calls :meth:`RolloutPipeline.begin`, which starts the
rollouts of steps up to ``k + s`` on policy copies; when step ``k`` then calls the rollout function (in the
same order, with the same arguments), the wrapper hands back the already running rollout. Scoring, the
failure budget, timeouts and the update are the loop's own, unchanged. A call that does not match what
was prefetched is simply run live (counted in ``pipeline/unmatched``).

Where the prefetched rollouts run (``[run] pipeline_worker``, local executor):

* ``"process"`` (the default): in worker processes (:mod:`palaestra.trainer.rollout_worker`, ``[run]
  pipeline_processes``, two by default, sharing each step's calls). The trainer sends
  each frozen copy's weights and the step's rollout arguments; the worker serves the copy on its own engine
  and in-process server, runs the rollout function and sends the trajectories back as JSON. The rollout side
  is mostly Python holding the GIL (client, server, gather), so only a second process lets it use a second
  core while the update runs. The rollout function must be importable (a function of a module); one that
  is not (a closure, or one defined in the ``__main__`` script) runs on the thread instead, with a note.
* ``"thread"``: in this process, on a frozen copy's engine thread, overlapping only where kernels release
  the GIL.

Both give the same results for a seed (the same schedule, arguments and weights). Pipelining needs a model
with weights in this process that can be copied (the embedded policy). With the Ray executor each frozen copy
is served on its own 127.0.0.1 endpoint while its step's rollouts run (Ray's workers are the processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from palaestra.trainer.endpoints import RolloutExecution, endpoint_of, remote_rollout
from palaestra.trainer.rollout_worker import RolloutProcess, picklable
from palaestra.trajectories.types import Trajectory

__all__ = ["RolloutPipeline", "sampling_version"]


def sampling_version(step: int, max_staleness: int) -> int:
    """The policy version (updates done) that samples step ``step``'s rollouts (1-based steps)."""
    return max(0, step - 1 - max_staleness)


def _check_freezable(model: Any) -> None:
    from palaestra.models.embedded import EmbeddedModel

    if not isinstance(model, EmbeddedModel):
        raise NotImplementedError(
            f"max_staleness > 0 needs a policy that can be copied in process (the embedded policy); "
            f"{type(model).__name__} is not supported yet (set [run] max_staleness = 0)"
        )


def _freeze(model: Any) -> Any:
    """An independent copy of an embedded policy at its current version (same name, own engine)."""
    from palaestra.models.embedded import EmbeddedModel

    _check_freezable(model)
    with model.lock:
        gpt = model.gpt.copy()
    return EmbeddedModel(
        gpt,
        name=model.name,
        step=model.step,
        card=model.card,
        max_batch_rows=model.max_batch_rows,
        gather_yields=model.gather_yields,
        batch_wait_s=model.batch_wait_s,
    )


async def _drain(model: Any, timeout: float = 30.0) -> None:
    """Wait for a policy copy's generation engine to finish its pass (its rows stop once their requests are
    cancelled), so that no engine task outlives the run."""
    engines = getattr(getattr(model, "_engines", None), "_engines", None) or {}
    for engine in list(engines.values()):
        worker = getattr(engine, "_worker", None)
        if worker is not None and not worker.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(worker), timeout)


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return repr((args[1:], sorted(kwargs.items())))


class _Snapshot:
    """The weights and version of the live policy at one moment (what the worker process samples from)."""

    def __init__(self, step: int, params: dict[str, np.ndarray]) -> None:
        self.step = step
        self.params = params

    @classmethod
    def of(cls, model: Any) -> _Snapshot:
        with model.lock:
            return cls(int(model.step), {n: a.copy() for n, a in model.gpt.params.items()})


def _params(frozen: Any) -> dict[str, np.ndarray]:
    return frozen.params if isinstance(frozen, _Snapshot) else frozen.gpt.params


class RolloutPipeline:
    """Runs an experiment's rollouts with its executor and staleness (module docstring)."""

    def __init__(self, experiment: Any, model: Any, rollout: Callable[..., Any]) -> None:
        run = experiment.config.run
        self.exp = experiment
        self.model = model
        self.max_staleness = int(getattr(run, "max_staleness", 0))
        if self.max_staleness > 0:
            _check_freezable(model)  # before any work, not at the first step
        self.execution = RolloutExecution(
            getattr(run, "executor", "local"),
            workers=getattr(run, "workers", None),
            resources=getattr(run, "rollout_resources", None) or None,
            address=getattr(run, "ray_address", None),
        )
        self._raw = rollout
        self.rollout, _ = self.execution.wrap(rollout, model)
        self._frozen: dict[int, Any] = {}  # step -> the frozen policy its rollouts use
        self._tasks: dict[int, list[tuple[str, asyncio.Future[Any]]]] = {}
        self._cursor: dict[int, int] = {}
        self._versions: dict[int, list[int]] = {}
        self._trained: dict[int, int] = {}
        self._unmatched = 0
        self._step = 0
        if self.max_staleness > 0:
            self.rollout = self._prefetched(self.rollout)
        self._stops: dict[int, Callable[[], None]] = {}  # step -> stops its frozen copy's endpoint (Ray)
        self.worker = str(getattr(run, "pipeline_worker", "process"))
        self._proc: RolloutProcess | None = None
        if self.max_staleness > 0 and self.execution.kind == "ray":
            self.worker = "ray"
        elif self.max_staleness > 0 and self.worker == "process":
            if picklable(rollout):
                # starts now: it warms up during the base validation
                self._proc = RolloutProcess(model, rollout, int(getattr(run, "pipeline_processes", 2)))
            else:
                self.worker = "thread"
                experiment.say(
                    f"pipeline: rollout {getattr(rollout, '__qualname__', rollout)!r} cannot be sent to a worker "
                    "process (not a module-level function); prefetching on a thread instead"
                )

    # ------------------------------------------------------------------ scheduling
    def _arguments(
        self, step: int, fn: Callable[..., Any]
    ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        """The rollout calls of ``step`` exactly as the loop makes them (``Experiment.rollout_calls``): ``(key,
        arguments after the model, keyword arguments)``."""
        calls = self.exp.rollout_calls(step, fn)
        return [(_key((None, *args), kw), args, kw) for group in calls for args, kw in group]

    def _calls(self, step: int, model: Any, fn: Callable[..., Any]) -> list[tuple[str, Callable[[], Any]]]:
        """The rollout calls of ``step`` bound to ``model``, keyed by arguments."""
        return [
            (key, functools.partial(fn, model, *args, **kw)) for key, args, kw in self._arguments(step, fn)
        ]

    def _launch_in_process(self, step: int) -> None:
        assert self._proc is not None
        frozen = self._frozen.get(step)
        if frozen is None:  # frozen even past max_steps: a resume with a larger budget needs it
            frozen = self._frozen[step] = _Snapshot.of(self.model)
        if step in self._tasks or step > self.exp.config.run.max_steps:
            return
        calls = self._arguments(step, self._raw)
        futures = self._proc.launch(
            step,
            int(frozen.step),
            _params(frozen),
            [(args, kw) for _, args, kw in calls],
            self.exp.config.run.max_concurrency or 1 << 30,
        )
        self._tasks[step] = [(key, fut) for (key, _, _), fut in zip(calls, futures)]
        self._cursor[step] = 0
        self._versions[step] = [int(frozen.step)]

    def _launch(self, step: int) -> None:
        if self._proc is not None:
            self._launch_in_process(step)
            return
        frozen = self._frozen.get(step)
        if frozen is None:  # frozen even past max_steps: a resume with a larger budget needs it
            frozen = self._frozen[step] = _freeze(self.model)
        if step in self._tasks or step > self.exp.config.run.max_steps:
            return
        version = int(frozen.step)
        sem = asyncio.Semaphore(self.exp.config.run.max_concurrency or 1 << 30)

        async def one(call: Callable[[], Any]) -> Any:
            async with sem:
                result = await call()
            for t in result if isinstance(result, list) else [result]:
                if isinstance(t, Trajectory):
                    t.policy_version = version
            return result

        tasks: list[tuple[str, asyncio.Future[Any]]] = []
        fn = self._raw
        if self.execution.kind == "ray":  # workers reach the frozen copy over HTTP, until end(step)
            endpoint, self._stops[step] = endpoint_of(frozen)
            fn = remote_rollout(self._raw, self.execution.executor, endpoint)
        for key, call in self._calls(step, frozen, fn):
            task = asyncio.ensure_future(one(call))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
            tasks.append((key, task))
        self._tasks[step] = tasks
        self._cursor[step] = 0
        self._versions[step] = [version]

    def begin(self, step: int) -> None:
        """Step ``step`` starts: make sure the rollouts of steps ``step .. step + s`` are running."""
        self._step = step
        if self.max_staleness == 0:
            return
        self._trained[step] = int(self.model.step)  # the version step's update starts from
        for k in range(step, step + self.max_staleness + 1):
            self._launch(k)  # a new launch freezes the live policy: by the schedule, the version k needs

    def _prefetched(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(model: Any, *args: Any, **kwargs: Any) -> Any:
            step = self._step
            tasks = self._tasks.get(step, [])
            i = self._cursor.get(step, 0)
            if i < len(tasks) and tasks[i][0] == _key((model, *args), kwargs):
                self._cursor[step] = i + 1
                return tasks[i][1]
            self._unmatched += 1
            return fn(model, *args, **kwargs)

        return call

    def end(self, step: int) -> dict[str, Any]:
        """Step ``step`` finished its update: staleness figures for its history row; frees its copy."""
        if self.max_staleness == 0:
            return {}
        sampled = self._versions.pop(step, [])
        self._tasks.pop(step, None)
        self._cursor.pop(step, None)
        self._frozen.pop(step, None)
        stop = self._stops.pop(step, None)
        if stop is not None:
            stop()
        if self._proc is not None:
            self._proc.end(step)
        trained = self._trained.pop(step, 0)
        lags = [trained - v for v in sampled] or [0]
        return {
            "train/policy_version_sampled": min(sampled) if sampled else None,
            "train/staleness_mean": float(np.mean(lags)),
            "train/staleness_max": int(max(lags)),
            "pipeline/unmatched": self._unmatched,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The frozen policies the next ``s`` steps sample from (after ``end`` of the last finished step)."""
        if self.max_staleness == 0:
            return {}
        return {
            str(k): {"step": int(m.step), "params": {n: a.copy() for n, a in _params(m).items()}}
            for k, m in sorted(self._frozen.items())
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (before the first :meth:`begin`)."""
        if self.max_staleness == 0 or not state:
            return
        for k, item in state.items():
            if self._proc is not None:
                self._frozen[int(k)] = _Snapshot(
                    int(item["step"]), {n: np.array(a) for n, a in item["params"].items()}
                )
                continue
            frozen = _freeze(self.model)
            for name, arr in item["params"].items():
                frozen.gpt.params[name][...] = np.asarray(arr)
            frozen.step = int(item["step"])
            self._frozen[int(k)] = frozen

    async def aclose(self) -> None:
        """Cancel rollouts prefetched for steps that will not run; stop the executor and endpoint."""
        pending = [t for tasks in self._tasks.values() for _, t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.max_staleness > 0:  # the copies' passes, and the live model's queued behind them
            for model in [*self._frozen.values(), self.model]:
                await _drain(model)
        self._tasks.clear()
        for stop in self._stops.values():
            stop()
        self._stops.clear()
        if self._proc is not None:
            proc, self._proc = self._proc, None
            await proc.aclose()
        self.execution.close()
