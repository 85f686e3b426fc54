"""Where and when an experiment's rollouts run: now or ahead of time (``[run] max_staleness``), in this process
or in local worker processes (``[run] rollout_processes``); schedule and worker protocol: docs/scaling.md. Workers
send results back pickled (exact, cheaper than validating JSON); weights travel as numpy arrays, never a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.engine import Sample, SamplingParams
from palaestra.models.tinygpt import TinyGPT, checked_params
from palaestra.trainer.endpoints import endpoint_of, remote_rollout
from palaestra.trajectories.executors import Executor, InProcessExecutor, RayExecutor, frozen_heap
from palaestra.trajectories.types import Trajectory

__all__ = ["RolloutPipeline", "RolloutProcess", "WorkerProcessError", "picklable", "sampling_version"]


class WorkerProcessError(RuntimeError):
    """The rollout worker process failed to start, or exited while rollouts were pending."""


def picklable(fn: Any) -> bool:
    """True when ``fn`` can be sent to a spawned worker: a function of an importable module, not ``__main__``."""
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return getattr(fn, "__module__", None) != "__main__"


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """While a worker starts: ``spawn`` would import the parent's ``__main__`` in the child (and a script without
    a ``__name__`` guard would start its run again there), so the child is told of no main module."""
    names = vars(sys.modules["__main__"]) if "__main__" in sys.modules else {}
    saved: dict[str, Any] = {k: names[k] for k in ("__file__", "__spec__") if k in names}
    names.pop("__file__", None)
    names["__spec__"] = None
    try:
        yield
    finally:
        names.pop("__spec__", None)
        names.update(saved)


def stamped(result: Any, version: int | None) -> Any:
    """A rollout's result (a :class:`Trajectory` or a list) with the policy version that sampled it recorded."""
    for t in result if isinstance(result, list) else [result]:
        if isinstance(t, Trajectory):
            t.policy_version = version
    return result


async def drain(tasks: Iterable[asyncio.Future[Any]], models: Iterable[Any], timeout: float) -> None:
    """Cancel ``tasks``, then wait for the engines of the policy copies ``models``: no engine task outlives the run."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for model in models:
        engines = getattr(getattr(model, "_engines", None), "_engines", None) or {}
        for engine in list(engines.values()):
            worker = getattr(engine, "_worker", None)
            if worker is not None and not worker.done():
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(worker), timeout)


def serving_options(model: Any) -> dict[str, Any]:
    """The options of an embedded policy that a copy of it is served with (name, batching)."""
    return {k: getattr(model, k) for k in ("name", "max_batch_rows", "gather_yields", "batch_wait_s")}


def serve_copy(template: Any, step: int, params: dict[str, Any], *, ahead: bool = False) -> Any:
    """A copy of the embedded policy ``template`` with weights ``params`` at policy version ``step``, its own
    engine and server (``ahead``: an :class:`AheadCopy`). Copies ``params``, never the live weights: no lock."""
    gpt = TinyGPT(template.gpt.config, {k: np.array(v) for k, v in params.items()}, template.gpt.tokenizer)
    gpt.meta = dict(template.gpt.meta)
    cls = AheadCopy if ahead else EmbeddedModel
    return cls(gpt, step=step, card=template.card, **serving_options(template))


class AheadCopy(EmbeddedModel):
    """The policy copy of a step launched before its weights exist (version -1 until then): its requests wait
    for :meth:`set_weights`; weights that do not fit fail every request with the error naming the parameter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded = asyncio.Event()
        self._error: str | None = None

    def set_weights(self, version: int, params: dict[str, Any]) -> None:
        """Write the step's weights (names and shapes checked) as version ``version``; release the requests."""
        try:
            mine = self.gpt.params
            shapes = {name: p.shape for name, p in mine.items()}
            checked = checked_params(shapes, params, self.gpt.dtype, "the weights sent to the rollout worker")
            with self.lock:
                for name, value in checked.items():
                    mine[name][...] = value
                self.step = int(version)
        except Exception as exc:
            self._error = str(exc)
        self._loaded.set()

    async def submit_many(
        self, items: Sequence[tuple[Sequence[int], SamplingParams, Sequence[int]]]
    ) -> list[list[Sample]]:
        await self._loaded.wait()
        if self._error is not None:
            raise ValueError(self._error)
        return await super().submit_many(items)


def _encode_error(exc: BaseException) -> bytes:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return pickle.dumps(RuntimeError(f"rollout failed in the worker process: {detail}"))


def _worker_main(conn: Any, path: str, model_kwargs: dict[str, Any], rollout: Callable[..., Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the trainer stops us
    try:
        with frozen_heap():  # the imported modules stay out of full garbage collections (executors.py)
            asyncio.run(_serve(conn, path, model_kwargs, rollout))
    finally:
        with contextlib.suppress(Exception):
            conn.close()


async def _serve(conn: Any, path: str, model_kwargs: dict[str, Any], rollout: Callable[..., Any]) -> None:
    loop = asyncio.get_running_loop()
    try:
        template = EmbeddedModel.load(path, **model_kwargs)
    except Exception as exc:  # reported, then the worker ends
        conn.send(("fatal", "".join(traceback.format_exception(exc))))
        return
    conn.send(("ready",))
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    send_lock = threading.Lock()

    def send(msg: Any) -> None:
        with send_lock, contextlib.suppress(OSError, EOFError, BrokenPipeError):
            conn.send(msg)

    def reader() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("close",)  # the trainer is gone (ended or killed): stop
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg[0] == "close":
                return

    threading.Thread(target=reader, name="palaestra-rollout-worker-reader", daemon=True).start()
    tasks: dict[tuple[int, int], asyncio.Task[Any]] = {}
    models: dict[int, Any] = {}
    held: dict[int, asyncio.Event] = {}  # steps launched ahead, waiting for start_ready()

    def start_ready() -> None:
        """Let a step launched ahead start once this worker has no call of an earlier step left (its requests
        would only slow down the step the trainer is waiting for)."""
        for step in sorted(held):
            if any(s < step for s, _ in tasks):
                return
            held.pop(step).set()

    async def one(
        step: int, index: int, sem: asyncio.Semaphore, model: Any, args: Any, kwargs: Any, go: asyncio.Event
    ) -> None:
        try:
            await go.wait()
            async with sem:
                result = await rollout(model, *args, **kwargs)
            msg: tuple[Any, ...] = ("ok", step, index, pickle.dumps(result))
        except asyncio.CancelledError:
            return
        except Exception as exc:
            msg = ("error", step, index, _encode_error(exc))
        finally:
            tasks.pop((step, index), None)
            start_ready()
        send(msg)

    while True:
        msg = await inbox.get()
        kind = msg[0]
        if kind == "launch":
            _, step, version, params, calls, concurrency = msg
            go = asyncio.Event()
            if params is None:  # launched ahead: the weights follow in a "weights" message
                models[step] = serve_copy(template, -1, template.gpt.params, ahead=True)
                held[step] = go
            else:
                models[step] = serve_copy(template, version, params)
                go.set()
            sem = asyncio.Semaphore(concurrency)
            for index, args, kwargs in calls:
                coro = one(step, index, sem, models[step], args, kwargs, go)
                tasks[(step, index)] = asyncio.ensure_future(coro)
            start_ready()
        elif kind == "weights":
            model = models.get(msg[1])
            if isinstance(model, AheadCopy):
                model.set_weights(msg[2], msg[3])
        elif kind == "cancel":
            task = tasks.get((msg[1], msg[2]))
            if task is not None:
                task.cancel()
        elif kind == "end":  # a step ended before its weights came (the run stopped) has its calls cancelled
            held.pop(msg[1], None)
            model = models.pop(msg[1], None)
            if isinstance(model, AheadCopy) and not model._loaded.is_set():
                for key in [k for k in tasks if k[0] == msg[1]]:
                    tasks[key].cancel()
        elif kind == "close":
            held.clear()
            await drain(list(tasks.values()), list(models.values()), 10.0)
            send(("closed",))
            return


class _Process:
    """One spawned worker: its pipe and the thread reading what it sends."""

    def __init__(self, owner: RolloutProcess, path: str, kwargs: dict[str, Any], rollout: Any) -> None:
        self.owner = owner
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(child, path, kwargs, rollout),
            name="palaestra-rollout-worker",
            daemon=True,
        )
        with _main_not_imported():
            self.process.start()
        child.close()
        self.ended = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="palaestra-rollout-reader", daemon=True).start()

    def _read(self) -> None:
        loop = self.owner._loop
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the pipe closed: the process ended; reaped here for its exit code
                self.process.join(5)
                msg = ("gone", self.process.exitcode)
            last = msg[0] in ("closed", "gone", "fatal")
            if last:
                self.ended.set()
            if loop.is_closed():
                return
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.owner._on_message, msg)
            if last:
                return

    def send(self, msg: tuple[Any, ...]) -> None:
        if self.ended.is_set():
            return
        with self.lock, contextlib.suppress(OSError, ValueError, BrokenPipeError):
            self.conn.send(msg)

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
        for stop in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                stop()
                self.process.join(5.0)
        with contextlib.suppress(OSError):
            self.conn.close()


class RolloutProcess:
    """The trainer's handle on ``processes`` rollout worker processes (create it in the running event loop)."""

    def __init__(self, model: Any, rollout: Callable[..., Any], processes: int = 1) -> None:
        self._loop = asyncio.get_running_loop()
        self._tmp = Path(tempfile.mkdtemp(prefix="palaestra-rollouts-"))
        path = self._tmp / "policy.npz"
        model.save(path)  # architecture, tokenizer, name and card, once; weights travel per step
        kwargs = serving_options(model)
        self._pending: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._versions: dict[int, int | None] = {}  # step -> the version to record (None: weights not sent)
        self._reached: dict[int, int] = {}  # step -> how many workers got calls of it
        self._failure: str | None = None
        self._closed = False
        self.workers = [_Process(self, str(path), kwargs, rollout) for _ in range(max(1, int(processes)))]

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (benchmarks count their CPU time)."""
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    def _on_message(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind in ("ok", "error"):
            future = self._pending.pop((msg[1], msg[2]), None)
            if future is None or future.done():
                return
            if kind == "ok":
                future.set_result(stamped(pickle.loads(msg[3]), self._versions.get(msg[1])))
            else:
                future.set_exception(pickle.loads(msg[3]))
        elif kind in ("fatal", "gone") and not self._closed:
            if kind == "fatal":
                self._failure = f"a rollout worker process failed to start:\n{msg[1]}"
            else:
                self._failure = f"a rollout worker process exited (exit code {msg[1]})"
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(WorkerProcessError(self._failure))
            self._pending.clear()

    def launch(
        self,
        step: int,
        version: int | None,
        params: dict[str, Any] | None,
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
        concurrency: int,
        record: bool = True,
    ) -> list[asyncio.Future[Any]]:
        """Start step ``step``'s rollout calls on weights ``params`` of ``version``, at most ``concurrency`` at once
        (``params=None``: launched ahead, generation waits for :meth:`publish`); one future per call."""
        if self._failure is not None:
            raise WorkerProcessError(f"{self._failure}\n(set [run] rollout_processes = 0 to avoid it)")
        if record:
            self._versions[step] = version if params is not None else None
        self._reached[step] = min(len(calls), len(self.workers))  # call i goes to worker i % n
        futures: list[asyncio.Future[Any]] = [self._loop.create_future() for _ in calls]
        for index, future in enumerate(futures):
            future.add_done_callback(functools.partial(self._cancelled, step, index))
            self._pending[(step, index)] = future
        n = len(self.workers)
        share = max(1, -(-concurrency // n))
        for w, worker in enumerate(self.workers):
            mine = [(i, args, kw) for i, (args, kw) in enumerate(calls) if i % n == w]
            if mine:
                worker.send(("launch", step, version, params, mine, share))
        return futures

    def publish(self, step: int, version: int, params: dict[str, Any]) -> None:
        """Send the weights of step ``step``, launched ahead (``params=None``): its rollouts generate from now."""
        if step in self._versions:
            self._versions[step] = version
        for worker in self.workers[: self._reached.get(step, 0)]:  # those that got calls of the step
            worker.send(("weights", step, version, params))

    def _cancelled(self, step: int, index: int, future: asyncio.Future[Any]) -> None:
        """Done callback of a call's future: a cancelled call (timeout, failed step) is cancelled in the worker."""
        if not future.cancelled():
            future.exception()  # retrieved: a step that ended early leaves no "never retrieved" warning
        elif self._pending.pop((step, index), None) is not None:
            self.workers[index % len(self.workers)].send(("cancel", step, index))

    def end(self, step: int) -> None:
        """Step ``step`` is over: the workers may drop its policy copy."""
        self._versions.pop(step, None)
        self._reached.pop(step, None)
        for worker in self.workers:
            worker.send(("end", step))

    async def aclose(self, timeout: float = 20.0) -> None:
        """Cancel what is pending and stop the workers (``timeout`` s each, then terminate, then kill)."""
        self._closed = True
        for future in list(self._pending.values()):
            future.cancel()
        self._pending.clear()
        for worker in self.workers:
            worker.send(("close",))
        for worker in self.workers:
            await asyncio.to_thread(worker.join, timeout)
        shutil.rmtree(self._tmp, ignore_errors=True)


def sampling_version(step: int, max_staleness: int) -> int:
    """The policy version (updates done) that samples step ``step``'s rollouts (1-based steps)."""
    return max(0, step - 1 - max_staleness)


@dataclass
class _Snapshot:
    """The weights and version of the live policy at one moment: what a step's rollouts sample from."""

    step: int
    params: dict[str, np.ndarray]


def _not_sendable(model: Any, rollout: Any) -> str | None:
    """Why the rollouts cannot run in worker processes (without ``rollout``: why the policy cannot be copied)."""
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
            copy = self.max_staleness > 0
            with self.model.lock:
                params = {n: a.copy() if copy else a for n, a in self.model.gpt.params.items()}
                snap = self._frozen[step] = _Snapshot(int(self.model.step), params)
        if step > self.run.max_steps or (step in self._tasks and step not in self._ahead):
            return
        self._versions[step] = snap.step
        if step in self._ahead and self._proc is not None:  # its requests are built: now its weights
            self._ahead.discard(step)
            self._proc.publish(step, snap.step, snap.params)
        else:
            self._start(step, snap)

    def _start(self, step: int, snap: _Snapshot | None) -> None:
        """Start the rollout calls the loop will make for ``step`` on ``snap``'s weights (``None``: launched ahead)."""
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
