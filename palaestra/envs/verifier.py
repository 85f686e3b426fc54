"""The verifier protocol: a deterministic scorer treated as a measurement instrument.

A verifier maps ``(example, completion)`` to a :class:`Score` ``(reward, outcome, details)``. Every shipped
verifier keeps this contract, and :func:`check_contract` (run by the tests for each of them) checks it:

* **deterministic**: the same ``(example, completion)`` always gives the same score;
* **total**: ``score`` never raises, whatever the completion (any string, even a non-string) or the example
  (missing keys, wrong types, ``None``); an example it cannot use gives outcome ``invalid_example``, reward 0;
* **explainable**: ``outcome`` is a short machine code that can be counted, and ``details`` is a
  JSON-serialisable dict whose ``"reason"`` is a human sentence saying why;
* **fast**: pure CPU, no I/O, no network, bounded work per call (length caps before any parsing);
* **versioned**: ``name`` and ``version`` identify the scoring rule; any change to what it accepts bumps the
  version, so two runs scored by different rules are never compared as if they were the same instrument.

:class:`VerifierReward` adapts a verifier to the reward-function protocol shared with judges
(:class:`palaestra.trajectories.protocols.RewardFunction`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from palaestra.trajectories.types import TrajectoryGroup

__all__ = [
    "NO_COMPLETION",
    "SHIPPED",
    "ContractViolation",
    "Score",
    "Verifier",
    "VerifierReward",
    "check_contract",
    "get_verifier",
    "shipped_verifiers",
]

#: Every verifier palaestra ships, by name -> ``"module:Class"`` (imported lazily). The contract tests run
#: on each of them, so a verifier added here is checked automatically.
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

    @property
    def correct(self) -> bool:
        """True when the reward is positive (for 0/1 verifiers: the answer was accepted)."""
        return self.reward > 0.0


@runtime_checkable
class Verifier(Protocol):
    """Has ``name``, ``version`` and a total, deterministic ``score(example, completion) -> Score``."""

    name: str
    version: str

    def score(self, example: Mapping[str, Any], completion: str) -> Score: ...


def get_verifier(name: str) -> Verifier:
    """A new instance (default settings) of the shipped verifier called ``name``; KeyError lists the names."""
    target = SHIPPED.get(name)
    if target is None:
        raise KeyError(f"unknown verifier {name!r}; shipped verifiers: {', '.join(sorted(SHIPPED))}")
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    verifier: Verifier = cls()
    return verifier


def shipped_verifiers() -> list[Verifier]:
    """One default instance of every shipped verifier, in name order."""
    return [get_verifier(name) for name in sorted(SHIPPED)]


class ContractViolation(AssertionError):
    """Raised by :func:`check_contract` when a verifier breaks the contract; says how and where."""


def safe_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; never raises (an int too long for repr, a broken __repr__)."""
    try:
        text = repr(value)
    except Exception as exc:  # e.g. an int too long for repr
        text = f"<{type(value).__name__}, repr failed: {type(exc).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Where:
    """Names the failing pair in a ContractViolation message (built only when formatted)."""

    def __init__(self, tag: str, example: Any, completion: Any) -> None:
        self.tag, self.example, self.completion = tag, example, completion

    def __format__(self, spec: str) -> str:
        return f"{self.tag} on example={safe_repr(self.example)} completion={safe_repr(self.completion)}"


def check_contract(
    verifier: Any, examples: Iterable[Any], completions: Iterable[Any], *, repeats: int = 2
) -> int:
    """Check the verifier contract on every ``(example, completion)`` pair; returns how many were checked.

    Checks: ``name``/``version`` are non-empty strings; ``score`` never raises; it returns a :class:`Score`
    with a finite float reward, a non-empty string outcome and a dict of details that is JSON-serialisable
    and has a non-empty string ``"reason"``; scoring the same pair ``repeats`` times gives equal scores; an
    example that is not a mapping gives outcome ``invalid_example``. Raises :class:`ContractViolation` on the
    first breach, naming the verifier, the example and the completion.
    """
    name = getattr(verifier, "name", None)
    version = getattr(verifier, "version", None)
    if not isinstance(name, str) or not name or not isinstance(version, str) or not version:
        raise ContractViolation(f"{verifier!r}: name and version must be non-empty strings")
    tag = f"{name}@{version}"
    examples = list(examples)
    completions = list(completions)
    checked = 0
    for example in examples:
        for completion in completions:
            where = _Where(tag, example, completion)
            first: Score | None = None
            for _ in range(max(1, repeats)):
                try:
                    result = verifier.score(example, completion)
                except Exception as exc:  # the contract is exactly that this never happens
                    raise ContractViolation(f"{where}: raised {type(exc).__name__}: {exc}") from exc
                if not isinstance(result, Score):
                    raise ContractViolation(f"{where}: returned {type(result).__name__}, not Score")
                if not isinstance(result.reward, float) or result.reward != result.reward:
                    raise ContractViolation(f"{where}: reward {result.reward!r} is not a finite float")
                if result.reward in (float("inf"), float("-inf")):
                    raise ContractViolation(f"{where}: reward {result.reward!r} is not finite")
                if not isinstance(result.outcome, str) or not result.outcome:
                    raise ContractViolation(f"{where}: outcome {result.outcome!r} is not a non-empty string")
                if not isinstance(result.details, dict):
                    raise ContractViolation(f"{where}: details is {type(result.details).__name__}, not dict")
                reason = result.details.get("reason")
                if not isinstance(reason, str) or not reason:
                    raise ContractViolation(f"{where}: details lack a 'reason' sentence")
                try:
                    json.dumps(result.details, allow_nan=False)
                except (TypeError, ValueError) as exc:
                    raise ContractViolation(f"{where}: details are not JSON-serialisable: {exc}") from exc
                if first is None:
                    first = result
                elif first != result:  # the dataclass compares reward, outcome and details
                    raise ContractViolation(f"{where}: not deterministic: {first!r} then {result!r}")
            if not isinstance(example, Mapping) and first is not None and first.outcome != "invalid_example":
                raise ContractViolation(f"{where}: non-mapping example gave outcome {first.outcome!r}")
            checked += 1
    return checked


def _details_json(details: Mapping[str, Any], limit: int) -> str:
    text = json.dumps(details, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


class VerifierReward:
    """Adapts a :class:`Verifier` to the group reward-function protocol shared with judges.

    ``await VerifierReward(v).score_group(group, example)`` scores each trajectory of the group in place and
    returns the group (never None: a verifier always produces a score). For each trajectory:

    * the completion is the content of its **last assistant message** (``Trajectory.last_assistant_text``); a
      trajectory with no assistant message gets outcome ``no_completion`` and reward 0 (the verifier is not
      called);
    * ``reward`` is set to the score's reward;
    * ``metrics["correct"]`` = ``reward > 0`` (bool) and ``metrics["outcome/<code>"] = 1`` (one key per
      trajectory, so summing a metric across trajectories counts outcomes);
    * ``metadata["outcome"]`` = the code, ``metadata["verifier"]`` = ``"name@version"``, and
      ``metadata["score_details"]`` = the details as compact JSON (metadata holds scalars only), cut to
      ``details_limit`` characters.

    The example is the ``example`` argument or, when that is None, ``group.metadata`` itself (so a group
    built with ``metadata={"id": ..., "prompt": ..., "expected_answer": ...}`` scores on its own). If neither
    holds a usable example, the verifier reports ``invalid_example`` for every trajectory.

    The group also gets ``metrics["pass_rate"]`` (fraction with reward > 0) and ``metadata["verifier"]``.
    """

    def __init__(self, verifier: Verifier, *, details_limit: int = 2000) -> None:
        self.verifier = verifier
        self.details_limit = details_limit

    @property
    def tag(self) -> str:
        """``name@version`` of the wrapped verifier."""
        return f"{self.verifier.name}@{self.verifier.version}"

    def score_text(self, example: Mapping[str, Any], completion: str | None) -> Score:
        """Score one completion (None = no assistant message, outcome ``no_completion``)."""
        if completion is None:
            return Score(0.0, NO_COMPLETION, {"reason": "the trajectory has no assistant message to score"})
        return self.verifier.score(example, completion)

    async def score_group(
        self, group: TrajectoryGroup, example: Mapping[str, Any] | None = None
    ) -> TrajectoryGroup:
        """Score every trajectory of ``group`` in place (see the class docstring) and return it."""
        source: Mapping[str, Any] = group.metadata if example is None else example
        tag = self.tag
        passed = 0
        for traj in group.trajectories:
            result = self.score_text(source, traj.last_assistant_text())
            traj.reward = result.reward
            traj.metrics["correct"] = result.reward > 0.0
            traj.metrics[f"outcome/{result.outcome}"] = 1
            traj.metadata["outcome"] = result.outcome
            traj.metadata["verifier"] = tag
            traj.metadata["score_details"] = _details_json(result.details, self.details_limit)
            passed += result.reward > 0.0
        if group.trajectories:
            group.metrics["pass_rate"] = passed / len(group.trajectories)
        group.metadata["verifier"] = tag
        return group
