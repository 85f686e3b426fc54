"""The one continuous-batching engine of every served model: a pass admits waiting jobs between decoding steps
and, once the trainer waits for the model's lock, only jobs that end before its running rows do (a row never
mixes two policy versions). Each row has its own seed, so a result does not depend on its batch-mates."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from palaestra.models._runtime import one_blas_thread
from palaestra.models.sampling import DecodeBatch, Generation

if TYPE_CHECKING:
    from palaestra.models.served import ServedModel

_SEED_MASK = (1 << 63) - 1
_N = TypeVar("_N", int, float)


@dataclass(frozen=True)
class SamplingParams:
    """Settings shared by the ``n`` choices of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    request_rows: int = 0  # rows of the whole request this job belongs to (a scheduling hint; 0: unknown)


@dataclass
class Sample:
    """One generated completion: ``logprobs`` are under the raw model distribution (before temperature and
    top_p), ``text`` is without special tokens and a matched stop string, ``step`` is the policy version."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    prompt_ids: list[int]
    seed: int
    step: int


@dataclass
class Job:
    """One request: a prompt, its settings and one seed per choice."""

    prompt_ids: list[int]
    params: SamplingParams
    seeds: list[int]
    future: asyncio.Future[list[Sample]] = field(repr=False)
    queued_at: float = 0.0  # time.monotonic() of submission (scheduling: see BatchEngine._take_batch)
    samples: list[Sample | None] = field(default_factory=list, repr=False)  # in a pass: its samples so far
    left: int = 0  # in a pass: its rows still generating

    @property
    def gone(self) -> bool:  # its caller went away (future cancelled): its rows leave at the next token
        return self.future.cancelled()

    @property
    def rows(self) -> int:  # the rows of the whole request it belongs to
        return self.params.request_rows or len(self.seeds)


LOGPROB_FLOOR = -9999.0  # a -inf logprob as the server reports it (JSON has no infinity)
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_LOGIT_BIAS = 1024  # entries of one logit_bias map
STARVATION_S = 1.0  # a job queued longer than this goes before smaller ones
PREFILL_TOKENS = 1024  # prompt tokens one decoding step of a continuous pass takes in (at least one job)
PREFILL_TOKENS_SMALL = 256  # the same while a small request's rows are generating (its latency first)
SMALL_ROWS = 8  # a request of at most this many rows (or 1/32 of max_batch_rows) may use the headroom
HEADROOM = 8  # small requests may take max_batch_rows // HEADROOM rows above the limit


class RequestError(ValueError):
    """Invalid generation settings; ``param`` names the offending field (OpenAI-style error fields)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _number(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    return int(value)


def _between(name: str, value: _N, low: int, high: int) -> _N:
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def prepare_params(
    *,
    prompt_len: int,
    block_size: int,
    n: Any = 1,
    temperature: Any = 1.0,
    top_p: Any = 1.0,
    max_tokens: Any = None,
    stop: Any = None,
    logprobs: Any = False,
    top_logprobs: Any = 0,
    logit_bias: Any = None,
    presence_penalty: Any = None,
    frequency_penalty: Any = None,
    vocab_size: int | None = None,
    prompt_param: str = "messages",
) -> SamplingParams:
    """Check request settings and turn them into :class:`SamplingParams` (raises :class:`RequestError`);
    ``max_tokens`` (None: up to the end of the context) is clamped to the context left after the prompt."""
    _between("n", _int("n", n), 1, MAX_N)
    temp = _between("temperature", _number("temperature", temperature, 1.0), 0, 2)
    tp = _number("top_p", top_p, 1.0)
    if not 0.0 < tp <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {tp}", param="top_p")
    k = 0 if top_logprobs is None else _int("top_logprobs", top_logprobs)
    _between("top_logprobs", k, 0, MAX_TOP_LOGPROBS)
    if k and not logprobs:
        raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop may hold at most {MAX_STOP} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty", param="stop")
    room = block_size - prompt_len  # tokens that can follow the prompt
    if room < 1:
        msg = (
            f"the prompt is {prompt_len} tokens, but this model's context is {block_size} tokens "
            f"(prompt and completion together); shorten the {prompt_param}"
        )
        raise RequestError(msg, param=prompt_param, code="context_length_exceeded")
    limit = room if max_tokens is None else _int("max_tokens", max_tokens)
    if limit < 1:
        raise RequestError(f"max_tokens must be at least 1, got {limit}", param="max_tokens")
    presence = _between("presence_penalty", _number("presence_penalty", presence_penalty, 0.0), -2, 2)
    frequency = _between("frequency_penalty", _number("frequency_penalty", frequency_penalty, 0.0), -2, 2)
    return SamplingParams(
        max_tokens=min(limit, room),
        temperature=temp,
        top_p=tp,
        stop=tuple(stops),
        top_logprobs=k,
        logit_bias=_logit_bias(logit_bias, vocab_size),
        presence_penalty=presence,
        frequency_penalty=frequency,
    )


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError("logit_bias must be an object mapping token ids to biases", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        msg = f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}"
        raise RequestError(msg, param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        numeric = isinstance(key, (int, np.integer)) and not isinstance(key, bool)
        decimal = isinstance(key, str) and key.strip().lstrip("-").isdigit() and len(key) <= 12
        tid = int(key) if numeric or decimal else None
        if tid is None or tid < 0 or (vocab_size is not None and tid >= vocab_size):
            msg = f"logit_bias key {key!r} is not a token id of this model (0..{(vocab_size or 0) - 1})"
            raise RequestError(msg, param="logit_bias")
        out[tid] = _between("logit_bias", _number("logit_bias", bias, 0.0), -100, 100)
    return tuple(sorted(out.items()))


def choice_seeds(seed: int | None, n: int, salt: int = 0) -> list[int]:
    """One seed per choice: derived from ``(seed, salt, index)`` if a seed is given, else fresh entropy."""
    if seed is None:  # one read of the OS entropy source for all choices
        raw = secrets.token_bytes(8 * n)
        return [int.from_bytes(raw[i : i + 8], "little") & _SEED_MASK for i in range(0, 8 * n, 8)]
    words = np.random.SeedSequence(int(seed) % (1 << 64), spawn_key=(salt,)).generate_state(n, np.uint64)
    return [int(w) & _SEED_MASK for w in words]


_COUNTERS = {"generate_calls": 0, "requests": 0, "rows": 0, "tokens": 0, "busy_s": 0.0, "cancelled": 0}


@dataclass
class EngineStats:
    """Counters shared by all engines of one model (thread safe)."""

    counts: dict[str, float] = field(default_factory=_COUNTERS.copy)
    batch_rows: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    batch_requests: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        """Count work as it happens (``requests``, ``rows``, ``tokens``) and requests dropped (``cancelled``)."""
        with self.lock:
            for name, n in counts.items():
                self.counts[name] += n

    def record_pass(self, requests: int, rows: int, busy_s: float) -> None:
        """Count one continuous pass (its ``requests`` and ``rows`` were already counted by :meth:`add`)."""
        with self.lock:
            self.counts["generate_calls"] += 1
            self.counts["busy_s"] += busy_s
            self.batch_rows.append(rows)
            self.batch_requests.append(requests)

    def snapshot(self, batches: bool = True) -> dict[str, Any]:
        """Plain-dict copy of the counters (with the recent batch sizes when ``batches``)."""
        with self.lock:
            out: dict[str, Any] = dict(self.counts)
            if batches:
                out.update(batch_rows=list(self.batch_rows), batch_requests=list(self.batch_requests))
            return out


class WatchedLock:
    """A re-entrant lock that counts the threads waiting for it (a pass stops admitting jobs once one waits)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self.waiting = 0  # threads blocked entering it right now

    def __enter__(self) -> None:
        if self._lock.acquire(blocking=False):
            return
        with self._count:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class BatchEngine:
    """Queue of jobs for one model on one event loop."""

    def __init__(self, model: ServedModel, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self._loop = weakref.ref(loop)  # weak: the engine is the value of a WeakKeyDictionary keyed by loop
        self._pending: deque[Job] = deque()
        self._pending_lock = threading.Lock()  # the pass thread takes jobs while the loop adds them
        self._worker: asyncio.Task[None] | None = None
        self._stop = False  # set when the loop shuts down mid-pass: the pass thread ends its rows

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop of this engine is gone")
        return loop

    async def submit_many(
        self, items: Sequence[tuple[Sequence[int], SamplingParams, Sequence[int]]]
    ) -> list[list[Sample]]:
        """Queue several prompts at once (one future each, no task per prompt) and wait for all of them;
        cancelling the caller cancels every one that has not been generated yet."""
        loop, now = self.loop, time.monotonic()
        jobs = [
            Job(list(ids), params, list(seeds), loop.create_future(), now) for ids, params, seeds in items
        ]
        with self._pending_lock:
            self._pending.extend(jobs)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run(), name=f"palaestra-engine-{self.model.name}")
        if len(jobs) == 1:
            return [await jobs[0].future]
        return list(await asyncio.gather(*(job.future for job in jobs)))

    @property
    def small_rows(self) -> int:
        """Rows of a small request (it may use the headroom above ``max_batch_rows``)."""
        return max(SMALL_ROWS, self.model.max_batch_rows // 32)

    def _take_batch(self, live: int, within: int | None, busy: bool) -> list[Job]:
        """The next jobs to run beside ``live`` rows (``within``: only jobs that end within that many tokens):
        small requests first, starving ones before all; at most ``max_batch_rows`` rows (plus ``HEADROOM`` for
        small requests) and a prefill budget, as a big prefill stalls every running row."""
        limit = self.model.max_batch_rows
        room = limit + limit // HEADROOM
        small = self.small_rows
        budget = PREFILL_TOKENS_SMALL if busy else PREFILL_TOKENS
        with self._pending_lock:
            if not self._pending or live >= room:
                return []
            waiting = [job for job in self._pending if not job.gone]
            if len(waiting) < len(self._pending):  # cancelled (clients went away): no work is done for them
                self.model.stats.add(cancelled=len(self._pending) - len(waiting))
            old = time.monotonic() - STARVATION_S
            order = sorted(waiting, key=lambda job: (job.queued_at > old, job.rows))  # stable sort
            jobs: list[Job] = []
            rows, prompt_tokens = live, 0
            blocked = False  # a starving job did not fit: only small requests (in the headroom) may pass it
            for job in order:
                n = len(job.seeds)
                is_small = job.rows <= small
                fits = (
                    (rows + n <= (room if is_small else limit) or (not jobs and rows == 0))  # oversize: alone
                    and not (blocked and not is_small)
                    and not (jobs and prompt_tokens + len(job.prompt_ids) > budget)
                    and (within is None or job.params.max_tokens <= within)
                )
                if not fits:
                    blocked = blocked or job.queued_at <= old  # a starving job: only small ones pass it
                    continue
                jobs.append(job)
                rows += n
                prompt_tokens += len(job.prompt_ids)
            taken = set(map(id, jobs))
            self._pending = deque(job for job in waiting if id(job) not in taken)  # in arrival order
            return jobs

    async def _gather(self) -> None:
        """Yield to the loop while the queue grows (at least ``gather_yields`` times, at most ``batch_wait_s``)."""
        m = self.model
        deadline = self.loop.time() + m.batch_wait_s
        seen, quiet = len(self._pending), 0
        for _ in range(m.gather_yields):
            await asyncio.sleep(0)
        while m.batch_wait_s > 0 and self.loop.time() < deadline:
            quiet = quiet + 1 if len(self._pending) == seen else 0
            if quiet >= 2 or sum(len(j.seeds) for j in self._pending) >= m.max_batch_rows:
                return
            seen = len(self._pending)
            await asyncio.sleep(0)

    async def _run(self) -> None:
        try:
            while self._pending:
                await self._gather()
                self._stop = False
                try:
                    await self.loop.run_in_executor(_EXECUTOR, run_continuous, self)
                except asyncio.CancelledError:  # the loop is shutting down: the pass thread ends its rows
                    self._stop = True
                    raise
        finally:
            self._worker = None  # no reference to a finished task (and through it, to the loop)


def _settle(done: list[tuple[Job, list[Sample] | BaseException]]) -> None:
    """Resolve finished jobs' futures (on their loop)."""
    for job, result in done:
        if job.future.done():
            continue
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)


def run_continuous(engine: BatchEngine) -> None:
    """A continuous pass on the generation thread: it ends when its rows are done and nothing waits, or another
    thread waits for ``model.lock``."""
    model, loop = engine.model, engine.loop
    stats = model.stats
    with model.lock:
        step = model.step
        batch = DecodeBatch(model.row_cache())
        running: list[Job] = []
        small = engine.small_rows
        t0 = time.perf_counter()
        requests = rows = 0
        try:
            while True:
                finished: list[tuple[tuple[Job, int], Generation]] = []
                if not engine._stop:  # once another thread waits for the weights, only jobs that end in time
                    within = batch.steps_left if model.lock.waiting else None
                    busy = any(job.rows <= small for job in running)
                    jobs = [] if within == 0 else engine._take_batch(batch.live_rows, within, busy)
                    if jobs:
                        n_rows = sum(len(j.seeds) for j in jobs)
                        stats.add(requests=len(jobs), rows=n_rows)
                        finished += _admit(batch, jobs, running)
                        requests += len(jobs)
                        rows += n_rows
                if engine._stop or any(job.gone for job in running):
                    finished += batch.drop(lambda key: engine._stop or key[0].gone)
                if batch.live_rows:
                    finished += batch.step()
                done: list[tuple[Job, list[Sample] | BaseException]] = []
                stats.add(tokens=sum(len(g.token_ids) for _, g in finished))
                for (job, i), g in finished:
                    job.samples[i] = Sample(
                        **vars(g), prompt_ids=job.prompt_ids, seed=job.seeds[i], step=step
                    )
                    job.left -= 1
                    if job.left == 0:
                        done.append((job, [x for x in job.samples if x is not None]))
                running[:] = [job for job in running if job.left]
                ending = False
                if not batch.live_rows and not running:
                    with engine._pending_lock:
                        ending = engine._stop or not engine._pending or bool(model.lock.waiting)
                if ending and requests:  # recorded before the last responses resolve: their caller sees it
                    stats.record_pass(requests, rows, time.perf_counter() - t0)
                    requests = rows = 0
                if done:
                    _call(loop, done)
                if ending:
                    break
        except BaseException as exc:  # every job of the pass learns about it
            error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
            _call(loop, [(job, error) for job in running])
            if not isinstance(exc, Exception):
                raise
        finally:
            if requests:
                stats.record_pass(requests, rows, time.perf_counter() - t0)


def _admit(batch: DecodeBatch, jobs: list[Job], running: list[Job]) -> list[tuple[Any, Generation]]:
    """Prefill the rows of ``jobs`` into ``batch``, one per seed, keyed ``(job, choice index)``."""
    for job in jobs:
        job.samples, job.left = [None] * len(job.seeds), len(job.seeds)
    running += jobs
    keys = [(job, i) for job in jobs for i in range(job.left)]
    ps = [job.params for job, _ in keys]
    return batch.add(  # all-zero biases and penalties cost nothing there
        keys,
        [job.prompt_ids for job, _ in keys],
        max_new=[p.max_tokens for p in ps],
        temperature=[p.temperature for p in ps],
        top_p=[p.top_p for p in ps],
        seeds=[job.seeds[i] for job, i in keys],
        stop=[p.stop for p in ps],
        top_logprobs=[p.top_logprobs for p in ps],
        logit_bias=[dict(p.logit_bias) for p in ps],
        presence_penalty=[p.presence_penalty for p in ps],
        frequency_penalty=[p.frequency_penalty for p in ps],
    )


def _call(loop: asyncio.AbstractEventLoop, done: list[tuple[Job, list[Sample] | BaseException]]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these any more
        loop.call_soon_threadsafe(_settle, done)


# the process-wide generation thread (passes of all engines run one at a time), started on first use; it runs
# with one BLAS thread: its GEMMs are small, and the other core serves the event loop
_EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="palaestra-engine", initializer=one_blas_thread)
