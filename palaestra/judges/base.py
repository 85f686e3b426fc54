"""What every group judge shares: canonical content, dedup, presentation order, caching, deadlines and how
scores (or a failure, never a 0) are written onto the group (docs/judges.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from palaestra.judges.cache import JudgeCache
from palaestra.judges.prompt import Verdict
from palaestra.trajectories.io import sha256_text
from palaestra.trajectories.runs import scrub_error
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import ExceptionRecord, Trajectory, TrajectoryGroup

log = logging.getLogger("palaestra.judges")

OnFailure = Literal["drop", "raise"]
EXPLANATION_LIMIT = 500


class JudgeError(RuntimeError):
    """A group could not be scored (after all retries) or the judge is misconfigured."""


class JudgeDeadline(JudgeError):
    """A group's judging ran past ``max_group_seconds`` or the step deadline (the group is left unscored)."""


class JudgeConfigError(JudgeError):
    """The endpoint refused the request for a reason retrying cannot fix (auth, model, bad request)."""


def content_json(value: Any) -> str:
    """Canonical JSON (sorted keys, compact) used for hashing trajectory content."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def trajectory_key(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str:
    """Hash of one trajectory's canonical content (messages + tools)."""
    return sha256_text(content_json({"messages": list(messages), "tools": list(tools) if tools else None}))


def group_key(keys: Sequence[str]) -> str:
    """Order-independent hash of a group: the sorted set of its trajectory keys."""
    return sha256_text(content_json(sorted(set(keys))))


def common_prefix(lists: Sequence[Sequence[dict[str, Any]]]) -> int:
    """Length of the longest message prefix shared by every list."""
    n = 0
    for column in zip(*lists):  # stops at the first column that differs: later messages are not serialised
        if len({content_json(m) for m in column}) > 1:
            break
        n += 1
    return n


@dataclass
class Candidate:
    """One distinct trajectory content in a group (duplicates share it)."""

    key: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    trajectory: Trajectory
    members: list[int]
    cid: str = ""
    slot: int = -1


@dataclass
class GroupStats:
    """Calls and faults while judging one group."""

    calls: int = 0
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_chars: int = 0
    latency_s: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def record_call(self, *, latency: float, tokens: tuple[int, int] = (0, 0), prompt_chars: int = 0) -> None:
        self.calls += 1
        self.prompt_tokens += tokens[0]
        self.completion_tokens += tokens[1]
        self.prompt_chars += prompt_chars
        self.latency_s += latency
        self.latencies.append(latency)

    @contextlib.contextmanager
    def local_call(self) -> Iterator[None]:
        """Count one attempt and, if the block returns, one timed call of a local scorer (no tokens)."""
        self.attempts += 1
        start = time.perf_counter()
        yield
        self.record_call(latency=time.perf_counter() - start)


@dataclass
class JudgeUsage(GroupStats):
    """:class:`GroupStats` summed over every group a judge has scored, and how many were scored, unscored or hit."""

    groups: int = 0
    scored: int = 0
    unscored: int = 0
    cache_hits: int = 0

    def add(self, stats: GroupStats) -> None:
        for f in fields(GroupStats):  # ints and floats add, the Counter and the latency list concatenate
            setattr(self, f.name, getattr(self, f.name) + getattr(stats, f.name))


def quantize_score(score: float, levels: int | None) -> float:
    """Round ``score`` to ``levels`` evenly spaced values in [0, 1] (None: unchanged)."""
    return score if levels is None else round(score * (levels - 1)) / (levels - 1)


class GroupJudge:
    """Base class of the group judges; ``on_failure``, ``quantize``, ``max_group_seconds``: docs/judges.md."""

    kind = "judge"

    def __init__(
        self,
        *,
        model: str,
        prompt_version: str,
        rubric_hash: str | None = None,
        seed: int = 0,
        on_failure: OnFailure = "drop",
        cache: Any = None,
        quantize: int | None = None,
        max_group_seconds: float | None = None,
    ) -> None:
        if on_failure not in ("drop", "raise"):
            raise ValueError(f"on_failure must be 'drop' or 'raise', got {on_failure!r}")
        if quantize is not None and quantize < 2:
            raise ValueError("quantize must be None or an int >= 2 (the number of score levels)")
        if max_group_seconds is not None and not (max_group_seconds > 0 and math.isfinite(max_group_seconds)):
            raise ValueError(
                f"max_group_seconds must be None or a finite number > 0, got {max_group_seconds!r}"
            )
        self._owns_cache = isinstance(cache, (str, os.PathLike))
        if self._owns_cache:
            cache = JudgeCache(cache)
        elif cache is not None and not all(callable(getattr(cache, m, None)) for m in ("get", "put")):
            raise TypeError(
                f"cache must be a JudgeCache, a path to one (str or Path) or None, got {type(cache).__name__}"
            )
        self.model, self.rubric_hash, self.prompt_version = model, rubric_hash, prompt_version
        self.seed, self.on_failure = seed, on_failure
        self.cache, self.quantize, self.max_group_seconds = cache, quantize, max_group_seconds
        self.usage = JudgeUsage()
        self._deadline: float | None = None  # set by step_deadline

    async def aclose(self) -> None:
        """Release what this judge opened (a cache it opened from a path; RulerJudge: its HTTP client)."""
        if self._owns_cache and self.cache is not None:
            self.cache.close()
            self.cache, self._owns_cache = None, False

    @contextlib.contextmanager
    def step_deadline(self, seconds: float | None) -> Iterator[None]:
        """Bound the judging inside the block to ``seconds`` from now (None: no bound); a group past it is left
        unscored (fault ``step_deadline``). Nested blocks keep the earlier deadline."""
        if seconds is None:
            yield
            return
        if not seconds > 0:
            raise ValueError(f"step_deadline seconds must be > 0, got {seconds!r}")
        previous = self._deadline
        end = time.monotonic() + seconds
        self._deadline = end if previous is None else min(previous, end)
        try:
            yield
        finally:
            self._deadline = previous

    def _scrub(self, text: str) -> str:
        return scrub_error(text)

    @property
    def name(self) -> str:
        """``kind:model``, recorded in ``group.metadata["judge"]``."""
        return f"{self.kind}:{self.model}"

    def info(self) -> dict[str, Any]:
        """What identifies this judge in a run manifest (never secrets)."""
        keys = ("kind", "model", "rubric_hash", "prompt_version", "seed", "quantize")
        return {k: getattr(self, k) for k in keys}

    def cache_key(self) -> str:
        """Which judge produced cached scores: kind, model, rubric hash, prompt version and temperature."""
        keys = ("kind", "model", "rubric_hash", "prompt_version", "temperature")
        return sha256_text(content_json({k: self.info().get(k) for k in keys}))[:32]

    async def _judge(
        self, candidates: list[Candidate], example: Mapping[str, Any] | None, seed: int, stats: GroupStats
    ) -> dict[str, Verdict]:
        """Score ``candidates`` (presentation order), counting calls in ``stats``: ``{cid: Verdict}`` or raise."""
        raise NotImplementedError

    def candidates(self, group: TrajectoryGroup) -> list[Candidate]:
        """The distinct candidates of ``group`` in order of first appearance."""
        by_key: dict[str, Candidate] = {}
        for i, traj in enumerate(group.trajectories):
            msgs = traj.messages()
            key = trajectory_key(msgs, traj.tools)
            by_key.setdefault(key, Candidate(key, msgs, traj.tools, traj, [])).members.append(i)
        return list(by_key.values())

    async def score_group(
        self,
        group: TrajectoryGroup,
        example: Mapping[str, Any] | None = None,
        *,
        order: Sequence[int] | None = None,
        use_cache: bool = True,
    ) -> TrajectoryGroup | None:
        """Score ``group`` in place and return it (None: unscored and dropped); ``order`` (audits) is a permutation
        of the trajectory indices to present in, else a seeded shuffle (docs/judges.md)."""
        if not group.trajectories:
            return group
        n = len(group.trajectories)
        if order is not None and sorted(order) != list(range(n)):  # before any usage or metadata is touched
            raise ValueError(f"order must be a permutation of range({n}), got {list(order)}")
        cands = self.candidates(group)
        gkey = group_key([c.key for c in cands])
        salt = group.metadata.get("judge_salt")
        group_seed = derive_seed(self.seed, gkey) if salt is None else derive_seed(self.seed, gkey, salt)
        judge = {"judge": self.name, "judge_model": self.model, "judge_version": self.prompt_version}
        group.metadata.update(judge, judge_rubric_hash=self.rubric_hash, judge_seed=group_seed)
        stats = GroupStats()
        self.usage.groups += 1
        cache = self.cache if use_cache else None
        ckey = self.cache_key()
        verdicts = cache.get(ckey, gkey, [c.key for c in cands]) if cache is not None else None
        hit = verdicts is not None
        if verdicts is None:
            self._present(cands, group_seed, order)
            left = None if self._deadline is None else self._deadline - time.monotonic()
            budget, deadline_kind = self.max_group_seconds, "group_deadline"  # what this group may take
            if left is not None and (budget is None or left < budget):
                budget, deadline_kind = left, "step_deadline"
            try:
                if budget is not None and budget <= 0:
                    raise JudgeDeadline(
                        f"{deadline_kind}: the step's judging time was used up before this group"
                    )
                by_id = await asyncio.wait_for(self._judge(cands, example, group_seed, stats), budget)
            except Exception as exc:
                if isinstance(exc, (asyncio.TimeoutError, JudgeDeadline)):
                    stats.faults[deadline_kind] += 1
                if isinstance(exc, asyncio.TimeoutError):
                    exc = JudgeDeadline(f"{deadline_kind}: judging this group took longer than {budget:.3g}s")
                return self._fail(group, cands, stats, exc)
            verdicts = {c.key: by_id[c.cid] for c in cands}
            if cache is not None:
                cache.put(ckey, gkey, verdicts)
        self._record(group, cands, stats, hit=hit, unscored=False)
        self._apply(group, cands, verdicts)
        return group

    def _present(self, cands: list[Candidate], group_seed: int, order: Sequence[int] | None) -> None:
        rng = random.Random(group_seed)
        if order is None:
            cands.sort(key=lambda c: c.key)  # independent of the input order, then a seeded shuffle
            rng.shuffle(cands)
        else:
            rank = {i: k for k, i in enumerate(order)}
            cands.sort(key=lambda c: min(rank[i] for i in c.members))
        ids: list[str] = []
        while len(ids) < len(cands):
            if (cid := f"{rng.getrandbits(24):06x}") not in ids:
                ids.append(cid)
        for slot, (cand, cid) in enumerate(zip(cands, ids)):
            cand.cid, cand.slot = cid, slot

    def _record(
        self, group: TrajectoryGroup, cands: list[Candidate], stats: GroupStats, *, hit: bool, unscored: bool
    ) -> None:
        """Add ``stats`` to :attr:`usage` and write the group's ``judge_*`` metrics."""
        self.usage.add(stats)
        self.usage.scored += int(not unscored)
        self.usage.unscored += int(unscored)
        self.usage.cache_hits += int(hit)
        m = group.metrics
        m["judge_cache_hit"], m["judge_unscored"] = int(hit), int(unscored)
        for name in ("calls", "prompt_tokens", "completion_tokens", "prompt_chars", "latency_s", "attempts"):
            m[f"judge_{name}"] = getattr(stats, name)
        m["judge_retries"] = max(0, stats.attempts - 1)
        m["judge_candidates"] = len(cands)
        m["judge_duplicates"] = len(group.trajectories) - len(cands)
        m["judge_single"] = int(len(cands) == 1)
        m.update({f"judge_fault_{kind}": count for kind, count in stats.faults.items()})

    def _apply(self, group: TrajectoryGroup, cands: list[Candidate], verdicts: dict[str, Verdict]) -> None:
        """Write the scores onto the trajectories (a subclass may add its own metrics)."""
        scores = []
        for cand in cands:
            verdict = verdicts[cand.key]
            score = quantize_score(verdict.score, self.quantize)
            explanation = verdict.explanation[:EXPLANATION_LIMIT]
            for i in cand.members:
                traj = group.trajectories[i]
                if "judge_score" not in traj.metrics:
                    traj.metrics["independent_reward"] = traj.reward
                traj.reward = score
                traj.metrics["judge_score"] = score
                traj.metadata["judge_explanation"] = explanation
                if cand.cid:
                    traj.metadata["judge_id"] = cand.cid
                    traj.metadata["judge_slot"] = cand.slot
                traj.log(f"judge {self.name}: score {score:.3f}: {explanation}")
                scores.append(score)
        group.metrics["judge_score_std"] = statistics.pstdev(scores)
        if len(cands) == 1:
            group.log(f"judge {self.name}: only one distinct trajectory; its advantage will be 0")

    def _fail(
        self, group: TrajectoryGroup, cands: list[Candidate], stats: GroupStats, exc: Exception
    ) -> TrajectoryGroup | None:
        self._record(group, cands, stats, hit=False, unscored=True)
        faults = ", ".join(f"{k}={v}" for k, v in sorted(stats.faults.items())) or "none"
        line = self._scrub(
            f"judge {self.name}: group left unscored after {stats.calls} call(s) "
            f"(faults: {faults}): {type(exc).__name__}: {exc}"
        )
        group.log(line)
        log.warning("%s", line)
        error = exc if isinstance(exc, JudgeConfigError) else JudgeError(line)
        if error is not exc:
            error.__cause__ = exc
        record = ExceptionRecord.from_exception(error)  # saved with the samples: no key may ride along
        record.message, record.traceback = self._scrub(record.message), self._scrub(record.traceback)
        group.exceptions.append(record)
        if self.on_failure == "raise" or isinstance(error, JudgeConfigError):
            raise error
        return None
