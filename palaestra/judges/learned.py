"""A learned judge: a reward model (any :class:`TextScorer`) behind the group-judge protocol, scoring relatively
within the group (docs/judges.md, "Learned judges")."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from palaestra.judges.base import Candidate, GroupJudge, GroupStats
from palaestra.judges.prompt import Verdict
from palaestra.trajectories.types import TrajectoryGroup

LEARNED_VERSION = "palaestra-learned-1"
_RAW = re.compile(r"raw=([-+0-9.eE]+|nan|inf|-inf)")


@runtime_checkable
class TextScorer(Protocol):
    """What a learned judge needs from a reward model: one raw score per completion (higher = better)."""

    name: str

    @property
    def fingerprint(self) -> str: ...

    def score_texts(
        self, prompt: str | Sequence[Mapping[str, Any]], completions: Sequence[str]
    ) -> list[float]: ...


def relative_scores(raw: Sequence[float], min_span: float) -> list[float]:
    """Map raw scores of one group to [0, 1] relative to each other: with ``mid = (max r + min r) / 2`` and
    ``span = max(max r - min r, min_span)``, ``0.5 + (r_i - mid) / span`` (0.5 each when the span is 0)."""
    hi, lo = max(raw, default=0.0), min(raw, default=0.0)
    mid, span = (hi + lo) / 2.0, max(hi - lo, min_span)
    if span <= 0:
        return [0.5 for _ in raw]
    return [min(1.0, max(0.0, 0.5 + (r - mid) / span)) for r in raw]


def sigmoid(x: float) -> float:
    """``1 / (1 + exp(-x))`` without overflow: the absolute reading of a raw score."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class LearnedJudge(GroupJudge):
    """A reward model as a group judge; also writes ``metrics["judge_raw"]`` and ``metrics["judge_absolute"] =
    sigmoid(raw)`` per trajectory, ``judge_absolute_sum``/``_n`` per group."""

    kind = "learned"

    def __init__(self, scorer: TextScorer, *, min_span: float = 1.0, **options: Any) -> None:
        if not isinstance(scorer, TextScorer):
            raise TypeError("scorer must have name, fingerprint and score_texts(prompt, completions)")
        if min_span < 0:
            raise ValueError(f"min_span must be >= 0, got {min_span}")
        version = f"{LEARNED_VERSION}:{scorer.fingerprint}:min_span={min_span:g}"
        super().__init__(model=str(scorer.name), prompt_version=version, **options)
        self.scorer, self.min_span, self.scorer_calls = scorer, min_span, 0

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(fingerprint=self.scorer.fingerprint, min_span=self.min_span, normalisation="group")
        meta = getattr(self.scorer, "meta", None)
        if isinstance(meta, Mapping):
            out["card"] = {k: meta[k] for k in ("pairs", "heldout_pair_accuracy", "annotator") if k in meta}
        return out

    async def _judge(
        self, candidates: list[Candidate], example: Mapping[str, Any] | None, seed: int, stats: GroupStats
    ) -> dict[str, Verdict]:
        msgs = candidates[0].messages  # the prompt: what comes before the last reply (shared by the group)
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
        prompt = [dict(m) for m in msgs[:last]]
        texts = [c.trajectory.last_assistant_text() or "" for c in candidates]
        self.scorer_calls += 1
        with stats.local_call():
            raw = [float(r) for r in self.scorer.score_texts(prompt, texts)]
            if len(raw) != len(candidates) or not all(math.isfinite(r) for r in raw):
                raise ValueError(
                    f"scorer {self.scorer.name} returned {raw!r} for {len(candidates)} completions"
                )
            rel = relative_scores(raw, self.min_span)
        return {
            c.cid: Verdict(s, f"reward model {self.model}: raw={r:.6g}, relative {s:.3f} in its group")
            for c, r, s in zip(candidates, raw, rel)
        }

    def _apply(self, group: TrajectoryGroup, cands: list[Candidate], verdicts: dict[str, Verdict]) -> None:
        super()._apply(group, cands, verdicts)
        absolute = []
        for cand in cands:  # the raw score is read back from the explanation, which cached verdicts keep
            if (m := _RAW.search(verdicts[cand.key].explanation)) is None:
                continue
            raw = float(m.group(1))
            score = sigmoid(raw)
            for i in cand.members:
                group.trajectories[i].metrics.update(judge_raw=raw, judge_absolute=score)
                absolute.append(score)
        if absolute:  # sums (summed again over groups by a run's history); mean = sum / n
            group.metrics["judge_absolute_sum"] = sum(absolute)
            group.metrics["judge_absolute_n"] = len(absolute)
