"""Early stopping on a validation metric, with reward-hacking and collapse alarms.

Improvement follows Keras/Lightning: in ``mode="max"`` a value improves on the best iff
``value - min_delta > best`` (``mode="min"``: ``value + min_delta < best``), strictly, so a change of exactly
``min_delta`` is not an improvement; ``best`` moves only on an improvement (unlike HF, which also moves it
on sub-threshold gains). The first validation check always improves.

Every stop carries one reason (``StopReason``):

- ``target_reached``: the value reaches ``target`` (``>=`` for max, ``<=`` for min; allowed during warmup).
- ``reward_hacking``: among the last ``hacking_window`` validation checks (the current one included), the
  value has fallen by more than ``hacking_drop`` below the best of them (the peak), while the train reward
  rose over the same span: the least-squares slope of train reward on step over steps ``peak..now``, times
  the span length, exceeds ``hacking_min_rise`` (needs at least two train rewards in the span).
- ``plateau``: ``patience`` validation checks at steps ``>= warmup`` without improvement.
- ``collapse``: the last ``collapse_window`` train rewards all equal ``collapse_value`` (default 0).
- ``max_steps``: reported by the caller through :meth:`ValidationStopping.stop_max_steps`.

Checks run in that order after the best value is updated, so a stop on target keeps the target state as best.
``warmup`` (in steps) suppresses ``plateau``, ``reward_hacking`` and ``collapse`` (not ``target_reached``).
Once a decision exists, later updates are ignored and return it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

StopReason = Literal["plateau", "target_reached", "reward_hacking", "collapse", "max_steps"]
STOP_REASONS: tuple[str, ...] = get_args(StopReason)
_STATE_FORMAT = "palaestra.validation_stopping/1"
_COLLAPSE_TOL = 1e-12

__all__ = ["STOP_REASONS", "StopDecision", "StopReason", "ValidationStopping"]


class StopDecision(BaseModel):
    """Why and when training should stop, and where the best validation value was."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reason: StopReason
    step: int
    best_step: int | None = None
    best_value: float | None = None
    message: str = ""


class ValidationStopping(BaseModel):
    """Validation-metric early stopping (semantics in the module docstring).

    Typical use: ``if stopper.should_validate(step): decision = stopper.update_val(step, acc,
    state_fn=model.state_dict)``; ``stopper.update_train(step, mean_reward)`` after every train step; on
    ``decision`` stop and restore ``stopper.best_state``. ``state_dict()`` holds everything except the best
    state blob, which the caller persists itself (e.g. a ``best`` checkpoint).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    metric: str = Field(
        "val_accuracy", description="Name of the validation metric (key for update_val_metrics)."
    )
    mode: Literal["max", "min"] = Field(
        "max", description="'max' when higher is better, 'min' when lower is."
    )
    every: int = Field(10, ge=1, description="Validate every this many train steps (see should_validate).")
    patience: int = Field(
        3,
        ge=1,
        description="Stop ('plateau') after this many validation checks past warmup without improvement.",
    )
    min_delta: float = Field(0.0, ge=0.0, description="An improvement must exceed the best by strictly more.")
    warmup: int = Field(
        0, ge=0, description="Steps before which plateau, reward_hacking and collapse cannot stop the run."
    )
    target: float | None = Field(
        None, description="Stop ('target_reached') once the metric reaches this value."
    )
    hacking_window: int | None = Field(
        3,
        ge=2,
        description="Validation checks looked back over by the reward-hacking alarm; None disables it.",
    )
    hacking_drop: float = Field(
        0.05,
        gt=0.0,
        description="Alarm when the metric is worse than its peak in the window by more than this.",
    )
    hacking_min_rise: float = Field(
        0.0, ge=0.0, description="...and the fitted train-reward rise since the peak is strictly above this."
    )
    collapse_window: int | None = Field(
        20,
        ge=1,
        description="Stop ('collapse') when this many latest train rewards all equal collapse_value.",
    )
    collapse_value: float = Field(0.0, description="Train reward that counts as collapsed (default 0).")

    _best_value: float | None = PrivateAttr(None)
    _best_step: int | None = PrivateAttr(None)
    _wait: int = PrivateAttr(0)
    _improved: bool = PrivateAttr(False)
    _val: list[tuple[int, float]] = PrivateAttr(default_factory=list)
    _train: list[tuple[int, float]] = PrivateAttr(default_factory=list)
    _decision: StopDecision | None = PrivateAttr(None)
    _best_state: Any = PrivateAttr(None)

    # ----------------------------------------------------------------- queries
    @property
    def decision(self) -> StopDecision | None:
        """The stop decision, or ``None`` while training should go on."""
        return self._decision

    @property
    def should_stop(self) -> bool:
        return self._decision is not None

    @property
    def best_value(self) -> float | None:
        return self._best_value

    @property
    def best_step(self) -> int | None:
        return self._best_step

    @property
    def wait(self) -> int:
        """Validation checks past warmup since the last improvement."""
        return self._wait

    @property
    def improved(self) -> bool:
        """Whether the latest validation check improved on the best."""
        return self._improved

    @property
    def best_state(self) -> Any:
        """The opaque blob stored for the best check (``None`` if none was stored)."""
        return self._best_state

    def set_best_state(self, state: Any) -> None:
        """Store the blob to restore later (e.g. after checking :attr:`improved`)."""
        self._best_state = state

    @property
    def val_history(self) -> list[tuple[int, float]]:
        return list(self._val)

    @property
    def train_history(self) -> list[tuple[int, float]]:
        return list(self._train)

    def should_validate(self, step: int) -> bool:
        """True on steps that are multiples of ``every`` (step 0 included: validate the base policy)."""
        return step % self.every == 0

    def is_improvement(self, value: float) -> bool:
        """Strict improvement on the current best beyond ``min_delta`` (always True before any check)."""
        if self._best_value is None:
            return True
        if self.mode == "max":
            return value - self.min_delta > self._best_value
        return value + self.min_delta < self._best_value

    # ----------------------------------------------------------------- updates
    def _decide(self, reason: StopReason, step: int, message: str) -> StopDecision:
        self._decision = StopDecision(
            reason=reason, step=step, best_step=self._best_step, best_value=self._best_value, message=message
        )
        return self._decision

    @staticmethod
    def _check_point(what: str, step: int, value: float, history: list[tuple[int, float]]) -> float:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"step: expected an int, got {step!r}")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: expected a number, got {value!r}") from None
        if not np.isfinite(v):
            raise ValueError(f"{what}: value at step {step} is {v!r}; expected a finite number")
        if history and step <= history[-1][0]:
            raise ValueError(f"step: {what} steps must increase, got {step} after {history[-1][0]}")
        return v

    def update_train(self, step: int, train_reward: float) -> StopDecision | None:
        """Record the train reward of ``step``; may stop with ``collapse``."""
        if self._decision is not None:
            return self._decision
        r = self._check_point("train_reward", step, train_reward, self._train)
        self._train.append((int(step), r))
        w = self.collapse_window
        if (
            w is not None
            and step >= self.warmup
            and len(self._train) >= w
            and all(abs(v - self.collapse_value) <= _COLLAPSE_TOL for _, v in self._train[-w:])
        ):
            return self._decide(
                "collapse", int(step), f"train reward == {self.collapse_value} for the last {w} steps"
            )
        return None

    def update_val(
        self, step: int, value: float, *, state_fn: Callable[[], Any] | None = None
    ) -> StopDecision | None:
        """Record a validation value; on improvement remember the step and, if given, ``state_fn()`` as the
        best state (called only then). Returns the stop decision, if any."""
        if self._decision is not None:
            return self._decision
        v = self._check_point(self.metric, step, value, self._val)
        step = int(step)
        self._val.append((step, v))
        self._improved = self.is_improvement(v)
        if self._improved:
            self._best_value, self._best_step, self._wait = v, step, 0
            if state_fn is not None:
                self._best_state = state_fn()
        elif step >= self.warmup:
            self._wait += 1
        sign = 1.0 if self.mode == "max" else -1.0
        if self.target is not None and sign * (v - self.target) >= 0.0:
            return self._decide("target_reached", step, f"{self.metric}={v:g} reached target {self.target:g}")
        if step >= self.warmup:
            hacked = self._hacking_message(step, v, sign)
            if hacked:
                return self._decide("reward_hacking", step, hacked)
            if self._wait >= self.patience:
                return self._decide(
                    "plateau",
                    step,
                    f"no improvement of {self.metric} beyond {self.min_delta:g} in {self._wait} checks",
                )
        return None

    def update_val_metrics(
        self, step: int, metrics: Mapping[str, Any], *, state_fn: Callable[[], Any] | None = None
    ) -> StopDecision | None:
        """:meth:`update_val` with ``metrics[self.metric]``; a missing key raises, naming the keys."""
        if self.metric not in metrics:
            raise ValueError(f"metric: {self.metric!r} not in validation metrics {sorted(metrics)}")
        return self.update_val(step, metrics[self.metric], state_fn=state_fn)

    def stop_max_steps(self, step: int) -> StopDecision:
        """The caller ran out of steps: stop with ``max_steps`` (an earlier decision is kept and returned)."""
        if self._decision is not None:
            return self._decision
        return self._decide("max_steps", int(step), f"reached the step budget at step {step}")

    def _hacking_message(self, step: int, value: float, sign: float) -> str | None:
        w = self.hacking_window
        if w is None or len(self._val) < 2:
            return None
        window = self._val[-w:]
        peak_step, peak = max(window, key=lambda sv: (sign * sv[1], sv[0]))  # best; latest among ties
        drop = sign * (peak - value)
        if not drop > self.hacking_drop:
            return None
        span = [(s, r) for s, r in self._train if peak_step <= s <= step]
        if len(span) < 2:
            return None
        xs = np.array([s for s, _ in span], dtype=np.float64)
        ys = np.array([r for _, r in span], dtype=np.float64)
        xc = xs - xs.mean()
        slope = float(np.dot(xc, ys - ys.mean()) / np.dot(xc, xc))
        rise = slope * float(xs[-1] - xs[0])
        if not rise > self.hacking_min_rise:
            return None
        return (
            f"{self.metric} fell {drop:g} from {peak:g} (step {peak_step}) to {value:g} while train reward "
            f"rose by {rise:g} (fitted) over steps {int(xs[0])}..{int(xs[-1])}"
        )

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state for resume: config, best, wait, histories, decision (not the best-state blob)."""
        return {
            "format": _STATE_FORMAT,
            "config": self.model_dump(mode="json"),
            "best_value": self._best_value,
            "best_step": self._best_step,
            "wait": self._wait,
            "improved": self._improved,
            "val_history": [[s, v] for s, v in self._val],
            "train_history": [[s, r] for s, r in self._train],
            "decision": None if self._decision is None else self._decision.model_dump(mode="json"),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, strict_config: bool = True) -> None:
        """Restore from :meth:`state_dict`. With ``strict_config`` a saved config that differs from this
        object's raises ``ValueError`` naming the fields; otherwise this object's config is kept."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"format: expected {_STATE_FORMAT!r}, got {state.get('format')!r}")
        saved = state.get("config", {})
        current = self.model_dump(mode="json")
        diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        if strict_config and diff:
            raise ValueError(f"config: saved stopping config differs in {diff}")
        try:
            val = [(int(s), float(v)) for s, v in state["val_history"]]
            train = [(int(s), float(r)) for s, r in state["train_history"]]
            best_value = None if state["best_value"] is None else float(state["best_value"])
            best_step = None if state["best_step"] is None else int(state["best_step"])
            wait, improved = int(state["wait"]), bool(state["improved"])
            decision = None if state["decision"] is None else StopDecision.model_validate(state["decision"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"state: malformed validation-stopping state ({exc!r})") from None
        self._val, self._train = val, train
        self._best_value, self._best_step, self._wait, self._improved = best_value, best_step, wait, improved
        self._decision = decision
