"""Simulated judges: lab instruments with a hidden gold function and seeded, controlled defects, so an offline
run can train "with a judge" and reproduce reward hacking on a CPU (docs/judges.md, "Simulated judges")."""

from __future__ import annotations

import json
import math
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palaestra.judges.base import Candidate, GroupJudge, GroupStats
from palaestra.judges.prompt import Verdict, parse_request
from palaestra.trajectories.scripted_server import Reply
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import Trajectory

SIM_VERSION = "palaestra-sim-1"
GoldFn = Callable[[Trajectory, "Mapping[str, Any] | None"], float]

_NUMBER_RE = re.compile(r"\d")


def contains_number(text: str) -> bool:
    """Default surface feature: the completion contains a digit."""
    return bool(_NUMBER_RE.search(text))


def longer_than(min_chars: int) -> Callable[[str], bool]:
    """A verbosity feature: True when the stripped completion is longer than ``min_chars`` characters."""
    if min_chars < 0:
        raise ValueError(f"min_chars must be >= 0, got {min_chars}")

    def feature(text: str) -> bool:
        return len(text.strip()) > min_chars

    feature.__qualname__ = f"reply_longer_than_{min_chars}_chars"
    return feature


def completion_text(traj: Trajectory) -> str:
    """All assistant message text of a trajectory, joined by newlines."""
    return "\n".join(traj.assistant_texts())


class SimulatedJudge(GroupJudge):
    """A judge with known gold and seeded biases (:meth:`raw_scores`); repeats draw new noise, reproducibly."""

    kind = "simulated"

    def __init__(
        self,
        gold: GoldFn,
        *,
        noise: float = 0.0,
        position_bias: float = 0.0,
        length_bias: float = 0.0,
        format_bias: float = 0.0,
        format_feature: Callable[[str], bool] = contains_number,
        name: str = "simulated",
        **options: Any,
    ) -> None:
        if noise < 0:
            raise ValueError("noise must be >= 0")
        super().__init__(model=name, prompt_version=SIM_VERSION, **options)
        self.gold, self.format_feature, self.noise = gold, format_feature, noise
        self.position_bias, self.length_bias, self.format_bias = position_bias, length_bias, format_bias
        self._times: Counter[int] = Counter()
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        return dict(
            super().info(),
            gold=getattr(self.gold, "__qualname__", type(self.gold).__name__),
            noise=self.noise,
            position_bias=self.position_bias,
            length_bias=self.length_bias,
            format_bias=self.format_bias,
            format_feature=getattr(self.format_feature, "__qualname__", type(self.format_feature).__name__),
        )

    def raw_scores(
        self, trajectories: Sequence[Trajectory], example: Mapping[str, Any] | None, rng: random.Random
    ) -> list[tuple[float, str]]:
        """Scores (clipped to [0, 1]) and explanations for trajectories in presentation order: gold plus the
        biases of docs/judges.md, "Simulated judges"."""
        n = len(trajectories)
        texts = [completion_text(t) for t in trajectories]
        max_len = max((len(t) for t in texts), default=0)
        out = []
        for slot, (traj, text) in enumerate(zip(trajectories, texts)):
            gold = float(self.gold(traj, example))
            if not math.isfinite(gold):
                raise ValueError(f"gold function returned {gold} (not finite)")
            pos = self.position_bias * (1.0 - slot / (n - 1)) if n > 1 else 0.0
            length = self.length_bias * (len(text) / max_len) if max_len else 0.0
            feature = self.format_bias * float(bool(self.format_feature(text)))
            noise = rng.gauss(0.0, self.noise) if self.noise > 0 else 0.0
            score = min(1.0, max(0.0, gold + noise + pos + length + feature))
            why = (
                f"simulated: gold={gold:.3f} noise={noise:+.3f} slot={slot}:{pos:+.3f} "
                f"length={len(text)}:{length:+.3f} feature={feature:+.3f}"
            )
            out.append((score, why))
        return out

    async def _judge(
        self, candidates: list[Candidate], example: Mapping[str, Any] | None, seed: int, stats: GroupStats
    ) -> dict[str, Verdict]:
        with self._lock:
            self._times[seed] += 1
            count = self._times[seed]
        rng = random.Random(derive_seed(self.seed, "noise", seed, count))
        with stats.local_call():
            scored = self.raw_scores([c.trajectory for c in candidates], example, rng)
        return {c.cid: Verdict(s, why) for c, (s, why) in zip(candidates, scored)}

    def as_script(self, example: Mapping[str, Any] | None = None) -> Callable[[dict[str, Any], int], Reply]:
        """A ``ScriptedServer`` script answering RULER judge requests with :meth:`raw_scores` of the candidates,
        noise seeded by the judge seed and the request's messages; about 4 characters a token."""

        def script(request: dict[str, Any], n: int) -> Reply:
            parsed = parse_request(request)
            trajs = [
                Trajectory(messages_and_choices=[*parsed.context, *rest], tools=tools or parsed.tools)
                for _, rest, tools in parsed.candidates
            ]
            messages = json.dumps(request.get("messages", []), sort_keys=True)
            rng = random.Random(derive_seed(self.seed, "script", messages))
            scored = self.raw_scores(trajs, example, rng)
            entries = [
                {"id": cid, "explanation": why, "score": s}
                for (cid, _, _), (s, why) in zip(parsed.candidates, scored)
            ]
            content = json.dumps({"scores": entries})
            prompt_tokens, completion_tokens = max(1, len(messages) // 4), max(1, len(content) // 4)
            return Reply(content, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

        return script
