"""Registered environments: for each, its dataset splits, default verifier and default rollout function (which
experiments may override with a ``module:function`` reference, :func:`load_callable`)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from palaestra.envs import arithmetic_data, calculator_data
from palaestra.trajectories.io import DataError, sha256_text


@dataclass(frozen=True)
class EnvSpec:
    """An environment as experiments see it."""

    name: str
    description: str
    splits_module: str  # module with load_split(name) and SPLITS
    verifier: str | None  # default verifier name (None: the rollout sets the reward itself)
    rollout: str  # default rollout, "module:function"
    prompt_template: str  # recorded (hashed) in manifests: part of the Locked Room
    group_rollout: str | None = None  # "module:function" sampling n attempts in one call, if the env has one
    # "module:function": async (model, examples, *, seed, greedy, sampled, max_tokens, verifier, ...) -> dict
    # with n, greedy_accuracy, sampled_accuracy, rows, ...; replaces single-turn validation (multi-turn envs)
    validate: str | None = None

    def load_split(self, split: str) -> list[dict[str, Any]]:
        """The examples of a split."""
        module = importlib.import_module(self.splits_module)
        if split not in module.SPLITS:
            raise DataError(
                f"environment {self.name!r} has no split {split!r}; splits: {', '.join(module.SPLITS)}"
            )
        return list(module.load_split(split))

    @property
    def prompt_hash(self) -> str:
        """sha256 of the prompt template."""
        return sha256_text(self.prompt_template)


ENVS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in (
        EnvSpec(
            name="arithmetic",
            description="single-turn a+b / a-b with a strict 'Final: <int>' answer",
            splits_module="palaestra.envs.arithmetic_data",
            verifier="arith-strict",
            rollout="palaestra.envs.rollouts:single_turn_rollout",
            prompt_template=arithmetic_data.PROMPT_TEMPLATE,
            group_rollout="palaestra.envs.rollouts:single_turn_group_rollout",
        ),
        EnvSpec(
            name="calculator",
            description="multi-turn: a 'calc' tool (OpenAI tools API) for multi-digit products and mixed "
            "expressions, then a strict 'Final: <int>' answer",
            splits_module="palaestra.envs.calculator_data",
            verifier="arith-strict",
            rollout="palaestra.envs.calculator:calculator_rollout",
            prompt_template="tools=[calc(expression: string)] " + calculator_data.PROMPT_TEMPLATE,
            group_rollout="palaestra.envs.calculator:calculator_group_rollout",
            validate="palaestra.envs.calculator:evaluate_calculator",
        ),
    )
}


def get_env(name: str) -> EnvSpec:
    """The registered environment called ``name``; unknown names list the available ones."""
    if (spec := ENVS.get(name)) is None:
        raise DataError(f"unknown environment {name!r}; available: {', '.join(sorted(ENVS))}")
    return spec


def register_env(spec: EnvSpec) -> None:
    """Register (or replace) an environment."""
    ENVS[spec.name] = spec


def load_callable(ref: str) -> Callable[..., Any]:
    """Import ``module:function`` (e.g. a custom rollout); errors say what is missing."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise DataError(f"expected 'module:function', got {ref!r}")
    try:
        obj = pkgutil.resolve_name(ref)
    except (ImportError, ValueError) as exc:  # ValueError: not a valid dotted name
        raise DataError(f"cannot import module {module_name!r} for {ref!r}: {exc}") from None
    except AttributeError as exc:
        raise DataError(f"{ref!r}: {exc}") from None
    if not callable(obj):
        raise DataError(f"{ref!r} is not callable")
    return obj  # type: ignore[no-any-return]
