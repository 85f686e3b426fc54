"""Serve an :class:`~palaestra.models.hf.model.HFModel` through the SAME OpenAI-compatible app as the embedded
policy (:func:`palaestra.models.server.create_app`), so rollout code does not change between backends.

The shared server needs from a model: ``name``, ``step``, ``stats`` (an ``EngineStats``), ``block_size``,
``tokenizer`` (``render(...).ids``, ``encode``, ``vocab``) and ``submit(prompt_ids, params, seeds)`` (the
:class:`~palaestra.models.server.Servable` protocol). An HFModel has all of them (it is a
:class:`~palaestra.models.served.ServedModel`, as the embedded model); its batching engine is the embedded one
(:class:`palaestra.models.engine.BatchEngine`: per-event-loop queue, batch gathering, one future per request)
with the generation pass swapped for :func:`run_hf_jobs`, which samples with
:func:`palaestra.models.hf.sampling.generate`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from palaestra.models.engine import BatchEngine, Job, Sample

if TYPE_CHECKING:
    from palaestra.models.hf.model import HFModel

__all__ = ["HFBatchEngine", "run_hf_jobs"]

_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """One process-wide generation thread for HF models (torch uses its own intra-op threads)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="palaestra-hf-engine")
        return _EXECUTOR


def run_hf_jobs(model: HFModel, jobs: Sequence[Job]) -> list[list[Sample]]:
    """Generate every choice of every job in one batched pass (holding ``model.lock``)."""
    rows = [(job, seed) for job in jobs for seed in job.seeds]  # one generated row per choice, jobs in order
    stops = [list(job.params.stop) for job, _ in rows]
    t0 = time.perf_counter()
    with model.lock:
        step = model.step
        gens = model.generate_ids(
            [job.prompt_ids for job, _ in rows],
            max_new_tokens=[job.params.max_tokens for job, _ in rows],
            temperature=[job.params.temperature for job, _ in rows],
            top_p=[job.params.top_p for job, _ in rows],
            seeds=[seed for _, seed in rows],
            stop=stops if any(stops) else None,
            top_logprobs=max(job.params.top_logprobs for job in jobs),
        )
    busy = time.perf_counter() - t0
    owner = [j for j, job in enumerate(jobs) for _ in job.seeds]
    out: list[list[Sample]] = [[] for _ in jobs]
    for j, (job, seed), g in zip(owner, rows, gens):
        k = job.params.top_logprobs
        out[j].append(
            Sample(
                text=g.text,
                token_ids=list(g.token_ids),
                logprobs=list(g.logprobs),
                top_logprobs=[list(t[:k]) for t in g.top_logprobs] if k else [[] for _ in g.token_ids],
                finish_reason=g.finish_reason,
                prompt_ids=job.prompt_ids,
                seed=seed,
                step=step,
            )
        )
    model.stats.record(len(jobs), len(rows), sum(len(g.token_ids) for g in gens), busy)
    return out


class HFBatchEngine(BatchEngine):
    """The embedded batching engine with the generation pass replaced by :func:`run_hf_jobs`, on its own
    generation thread."""

    def executor(self) -> ThreadPoolExecutor:
        return _executor()

    def run_batch(self, jobs: Sequence[Job]) -> list[list[Sample]]:
        return run_hf_jobs(self.model, jobs)  # type: ignore[arg-type]
