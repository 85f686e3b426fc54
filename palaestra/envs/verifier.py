"""The verifier protocol, a scorer treated as a measurement instrument (the contract: docs/environments.md,
:func:`check_contract`), and :class:`VerifierReward`, which adapts one to the reward-function protocol."""

from __future__ import annotations

import itertools
import json
import math
import pkgutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from palaestra.trajectories.types import TrajectoryGroup

#: Every verifier palaestra ships, by name -> ``"module:Class"``; the contract tests run on each of them.
SHIPPED: dict[str, str] = {
    "arith-strict": "palaestra.envs.arithmetic:StrictFinalVerifier",
    "arith-naive-TEACHING-ONLY": "palaestra.envs.arithmetic:NaiveVerifier",
}

#: Outcome given by :class:`VerifierReward` to a trajectory that has no assistant message at all.
NO_COMPLETION = "no_completion"


@dataclass(frozen=True, slots=True)
class Score:
    """A verifier's verdict: ``reward`` (float), ``outcome`` (a short code), ``details`` (JSON-able dict)."""

    reward: float
    outcome: str
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Verifier(Protocol):
    """Has ``name``, ``version`` and a total, deterministic ``score(example, completion) -> Score``."""

    name: str
    version: str

    def score(self, example: Mapping[str, Any], completion: str) -> Score: ...


def get_verifier(name: str) -> Verifier:
    """A new instance (default settings) of the shipped verifier called ``name``; KeyError lists the names."""
    if (target := SHIPPED.get(name)) is None:
        raise KeyError(f"unknown verifier {name!r}; shipped verifiers: {', '.join(sorted(SHIPPED))}")
    return pkgutil.resolve_name(target)()  # type: ignore[no-any-return]  # "module:Class", imported now


def shipped_verifiers() -> list[Verifier]:
    """One default instance of every shipped verifier, in name order."""
    return [get_verifier(name) for name in sorted(SHIPPED)]


class ContractViolation(AssertionError):
    """Raised by :func:`check_contract` when a verifier breaks the contract; says how and where."""


def safe_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; never raises (an int too long for repr, a broken __repr__)."""
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<{type(value).__name__}, repr failed: {type(exc).__name__}>"
    return _cut(text, limit)


def check_contract(
    verifier: Any, examples: Iterable[Any], completions: Iterable[Any], *, repeats: int = 2
) -> int:
    """Check the verifier contract (docs/environments.md) on every ``(example, completion)`` pair, each scored
    ``repeats`` times; returns how many were checked. :class:`ContractViolation` names the first breach."""
    name, version = getattr(verifier, "name", None), getattr(verifier, "version", None)
    if not isinstance(name, str) or not name or not isinstance(version, str) or not version:
        raise ContractViolation(f"{verifier!r}: name and version must be non-empty strings")
    checked = 0
    for example, completion in itertools.product(examples, completions):
        first: Score | None = None
        for _ in range(max(1, repeats)):
            problem: str | None
            cause: BaseException | None
            try:
                result = verifier.score(example, completion)
            except Exception as exc:  # the contract is exactly that this never happens
                result, problem, cause = None, f"raised {type(exc).__name__}: {exc}", exc
            else:
                problem, cause = _breach(result)
            if problem is None and first is not None and first != result:  # compares reward, outcome, details
                problem = f"not deterministic: {first!r} then {result!r}"
            if problem is None and not isinstance(example, Mapping) and result.outcome != "invalid_example":
                problem = f"non-mapping example gave outcome {result.outcome!r}"
            if problem is not None:
                where = f"{name}@{version} on example={safe_repr(example)} completion={safe_repr(completion)}"
                raise ContractViolation(f"{where}: {problem}") from cause
            first = result
        checked += 1
    return checked


def _breach(result: Any) -> tuple[str | None, BaseException | None]:
    """What is wrong with one verifier result (None when nothing is), and the exception that showed it."""
    if not isinstance(result, Score):
        return f"returned {type(result).__name__}, not Score", None
    if not isinstance(result.reward, float) or not math.isfinite(result.reward):
        return f"reward {result.reward!r} is not a finite float", None
    if not isinstance(result.outcome, str) or not result.outcome:
        return f"outcome {result.outcome!r} is not a non-empty string", None
    if not isinstance(result.details, dict):
        return f"details is {type(result.details).__name__}, not dict", None
    reason = result.details.get("reason")
    if not isinstance(reason, str) or not reason:
        return "details lack a 'reason' sentence", None
    try:
        json.dumps(result.details, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"details are not JSON-serialisable: {exc}", exc
    return None, None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(eq=False)
class VerifierReward:
    """Adapts a :class:`Verifier` to the group reward-function protocol shared with judges: scores the last
    assistant message of each trajectory against ``example`` (else ``group.metadata``); docs/environments.md."""

    verifier: Verifier
    details_limit: int = field(default=2000, kw_only=True)

    async def score_group(
        self, group: TrajectoryGroup, example: Mapping[str, Any] | None = None
    ) -> TrajectoryGroup:
        """Score every trajectory of ``group`` in place and return it."""
        source: Mapping[str, Any] = group.metadata if example is None else example
        tag = f"{self.verifier.name}@{self.verifier.version}"
        passed = 0
        missing = Score(0.0, NO_COMPLETION, {"reason": "the trajectory has no assistant message to score"})
        for traj in group.trajectories:
            completion = traj.last_assistant_text()
            result = missing if completion is None else self.verifier.score(source, completion)
            traj.reward = result.reward
            traj.metrics.update({"correct": result.reward > 0.0, f"outcome/{result.outcome}": 1})
            details = json.dumps(result.details, sort_keys=True, separators=(",", ":"), default=repr)
            traj.metadata.update(
                outcome=result.outcome, verifier=tag, score_details=_cut(details, self.details_limit)
            )
            passed += result.reward > 0.0
        if group.trajectories:
            group.metrics["pass_rate"] = passed / len(group.trajectories)
        group.metadata["verifier"] = tag
        return group
