"""Scorer registry: a name on the command line (``arith-strict``, ``arith-naive-TEACHING-ONLY``, a registered
name or ``package.module:attr``) -> a verifier instance, and each registered name's cross-check pair."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.verifier import Verifier

ScorerFactory = Callable[[], Any]

STRICT = "arith-strict"
NAIVE = "arith-naive-TEACHING-ONLY"

_REGISTRY: dict[str, ScorerFactory] = {STRICT: StrictFinalVerifier, NAIVE: NaiveVerifier}
_CROSS: dict[str, tuple[str, str]] = {STRICT: (STRICT, NAIVE), NAIVE: (STRICT, NAIVE)}


@dataclass(frozen=True)
class CrossCheck:
    """A strict and a lenient verifier: a result is suspect when the lenient one accepts and the strict one
    rejects the same completion."""

    strict: Verifier
    lenient: Verifier

    def describe(self) -> dict[str, dict[str, str]]:
        """Names and versions, for manifests."""
        return {k: {"name": v.name, "version": v.version} for k, v in vars(self).items()}


def register_scorer(name: str, factory: ScorerFactory, *, cross_check: tuple[str, str] | None = None) -> None:
    """Register ``factory`` (called with no arguments) under ``name``; ``cross_check`` names a registered
    ``(strict, lenient)`` pair used for ``verifier_suspect``."""
    if not name or ":" in name:
        raise ValueError(f"scorer name must be non-empty and contain no ':', got {name!r}")
    _REGISTRY[name] = factory
    _CROSS.pop(name, None)
    if cross_check is not None:
        _CROSS[name] = cross_check


def get_scorer(spec: str) -> Verifier:
    """The verifier for a registered name or a ``module:attr`` reference; ``ValueError`` names the choices."""
    if spec in _REGISTRY:
        target = _REGISTRY[spec]()
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"scorer {spec!r}: cannot import ({exc})") from None
        if isinstance(target, type) or (callable(target) and not isinstance(target, Verifier)):
            try:
                target = target()
            except TypeError as exc:  # a class or function that needs arguments: not a scorer factory
                raise ValueError(
                    f"scorer {spec!r}: {attr} cannot be called with no arguments ({exc})"
                ) from exc
    else:
        raise ValueError(
            f"unknown scorer {spec!r}; choose one of {', '.join(sorted(_REGISTRY))} or module:attr"
        )
    if not isinstance(target, Verifier):
        raise ValueError(f"scorer {spec!r}: {target!r} lacks name/version/score(example, completion)")
    return target


def cross_check_for(spec: str) -> CrossCheck | None:
    """The cross-check pair registered for a scorer name (None for unknown or ``module:attr`` scorers)."""
    pair = _CROSS.get(spec)
    return None if pair is None else CrossCheck(strict=get_scorer(pair[0]), lenient=get_scorer(pair[1]))


def scorer_tag(verifier: Verifier) -> str:
    """``name@version``."""
    return f"{verifier.name}@{verifier.version}"
