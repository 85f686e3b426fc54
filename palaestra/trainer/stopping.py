"""Early stopping on a validation metric, with reward-hacking, collapse and judge-outage alarms (docs/concepts.md,
"Stopping"); the config's ``[stopping]`` section derives from :class:`StoppingRule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

StopReason = Literal[
    "plateau", "target_reached", "reward_hacking", "collapse", "judge_unavailable", "max_steps"
]
STOP_REASONS: tuple[str, ...] = get_args(StopReason)
#: Exit code of ``palaestra train`` / ``palaestra demo`` for a run that stopped because no group could be scored.
EXIT_JUDGE_UNAVAILABLE = 3
_STATE_FORMAT = "palaestra.validation_stopping/1"
_COLLAPSE_TOL = 1e-12
_RISE_TOL = 1e-9  # a rise smaller than this is rounding, not a rise


def stop_exit_code(reason: str) -> int:
    """Exit code of a run that stopped with ``reason``: :data:`EXIT_JUDGE_UNAVAILABLE` (resume it) or 0."""
    return EXIT_JUDGE_UNAVAILABLE if reason == "judge_unavailable" else 0


def binomial_drop_se(peak: float, level: float, n: int, m: int = 1) -> float:
    """Standard error of ``peak - level`` for accuracies on ``n`` examples, ``level`` a mean of ``m`` checks:
    ``sqrt(p (1 - p) (1/n + 1/(m n)))`` with the pooled ``p = (peak + m level) / (1 + m)``, clipped to
    ``[1/(2n), 1 - 1/(2n)]`` so that a run at 0 or 1 still has a positive error."""
    if n < 1 or m < 1:
        raise ValueError(f"n and m must be >= 1, got n={n}, m={m}")
    if not (0.0 <= peak <= 1.0 and 0.0 <= level <= 1.0):
        raise ValueError(f"peak and level must be accuracies in [0, 1], got peak={peak}, level={level}")
    p = (peak + m * level) / (1 + m)
    p = min(max(p, 0.5 / n), 1.0 - 0.5 / n)
    return math.sqrt(p * (1.0 - p) * (1.0 / n + 1.0 / (m * n)))


def train_noise_sd(rewards: Sequence[float]) -> float | None:
    """Step-to-step noise of a train-reward series: ``sqrt(sum((r_i - r_{i-1})^2) / (2 (k - 1)))`` over its ``k``
    values (the successive-difference estimate: a slow trend barely moves it); ``None`` for ``k < 3``."""
    if len(rewards) < 3:
        return None
    d = np.diff(np.asarray(rewards, dtype=np.float64))
    return math.sqrt(float(np.dot(d, d)) / (2.0 * d.size))


def _ratio(a: float, b: float) -> float:
    """``a / b`` for ``b > 0``, else an infinity of the sign ``a > 0`` gives."""
    return a / b if b > 0 else (math.inf if a > 0 else -math.inf)


class StopDecision(BaseModel):
    """Why and when training should stop, and where the best validation value was."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reason: StopReason
    step: int
    best_step: int | None = None
    best_value: float | None = None
    message: str = ""


class StoppingRule(BaseModel):
    """The settings of the stopping rule and their bounds (:class:`ValidationStopping`, ``[stopping]``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    patience: int = Field(
        5, ge=1, description="Stop ('plateau') after this many checks past warmup without improvement."
    )
    min_delta: float = Field(0.0, ge=0.0, description="An improvement must exceed the best by strictly more.")
    warmup: int = Field(0, ge=0, description="No plateau, reward_hacking or collapse stop before this step.")
    target: float | None = Field(None, description="Stop ('target_reached') once the metric reaches this.")
    hacking_window: int | None = Field(
        3, ge=2, description="Hacking alarm: the latest checks whose post-peak mean is the level; None: off."
    )
    hacking_z: float = Field(
        3.0, gt=0.0, description="The drop from the peak must exceed this many binomial standard errors."
    )
    hacking_drop: float = Field(
        0.0, ge=0.0, description="...and this absolute amount (the only threshold when val_size is unknown)."
    )
    hacking_rise_z: float = Field(
        1.5, ge=0.0, description="The train-reward rise since the peak must exceed this many standard errors."
    )
    hacking_min_rise: float = Field(0.0, ge=0.0, description="...and the fitted rise must exceed this.")
    collapse_window: int | None = Field(
        20, ge=1, description="Stop ('collapse') when this many latest train rewards equal collapse_value."
    )
    collapse_value: float = Field(0.0, description="Train reward that counts as collapsed (default 0).")
    judge_unavailable_steps: int | None = Field(
        3, ge=1, description="Unscored steps in a row before stopping ('judge_unavailable'); None: never."
    )


class _Seen(BaseModel):
    """What a :class:`ValidationStopping` has seen: its resume state (besides its format and config)."""

    best_value: float | None = None
    best_step: int | None = None
    wait: int = 0  # validation checks past warmup since the last improvement
    improved: bool = False  # whether the latest check improved on the best
    val_history: list[tuple[int, float]] = []
    train_history: list[tuple[int, float]] = []  # scored steps only
    last_train_step: int | None = None
    unscored_steps: int = 0  # consecutive latest steps without a train reward
    decision: StopDecision | None = None


class ValidationStopping(StoppingRule):
    """Validation-metric early stopping: :meth:`update_val` on validation steps (:meth:`should_validate`),
    :meth:`update_train` after every train step; stop on the decision either returns."""

    metric: str = Field("val_accuracy", description="Name of the validation metric (named in messages).")
    mode: Literal["max", "min"] = Field("max", description="'max': higher is better; 'min': lower is.")
    every: int = Field(10, ge=1, description="Validate every this many train steps (see should_validate).")
    val_size: int | None = Field(
        None, ge=1, description="Validation examples per check, when the metric is a proportion (binomial)."
    )

    _s: _Seen = PrivateAttr(default_factory=_Seen)
    _best_state: Any = PrivateAttr(None)  # not in state_dict: the caller keeps it

    @property
    def decision(self) -> StopDecision | None:
        """The stop decision, or ``None`` while training should go on."""
        return self._s.decision

    @property
    def best_value(self) -> float | None:
        return self._s.best_value

    @property
    def best_step(self) -> int | None:
        return self._s.best_step

    @property
    def best_state(self) -> Any:
        """What ``state_fn()`` returned at the best check (``None`` if no ``state_fn`` was given)."""
        return self._best_state

    @property
    def improved(self) -> bool:
        """Whether the latest validation check improved on the best."""
        return self._s.improved

    def should_validate(self, step: int) -> bool:
        """True on steps that are multiples of ``every`` (step 0 included: validate the base policy)."""
        return step % self.every == 0

    def _decide(self, reason: StopReason, step: int, message: str) -> StopDecision:
        s = self._s
        s.decision = StopDecision(
            reason=reason, step=step, best_step=s.best_step, best_value=s.best_value, message=message
        )
        return s.decision

    @staticmethod
    def _check_step(what: str, step: int, last: int | None) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"step: expected an int, got {step!r}")
        if last is not None and step <= last:
            raise ValueError(f"step: {what} steps must increase, got {step} after {last}")
        return int(step)

    @staticmethod
    def _check_value(what: str, step: int, value: float) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: expected a number, got {value!r}") from None
        if not np.isfinite(v):
            raise ValueError(f"{what}: value at step {step} is {v!r}; expected a finite number")
        return v

    def update_train(self, step: int, train_reward: float | None) -> StopDecision | None:
        """Record ``step``'s train reward (None: nothing scored); may stop (collapse, judge_unavailable)."""
        s = self._s
        if s.decision is not None:
            return s.decision
        step = self._check_step("train_reward", step, s.last_train_step)
        r = None if train_reward is None else self._check_value("train_reward", step, train_reward)
        s.last_train_step = step
        if r is None:
            s.unscored_steps += 1
            k = self.judge_unavailable_steps
            if k is not None and s.unscored_steps >= k:
                return self._decide(
                    "judge_unavailable",
                    step,
                    f"no group was scored in the last {s.unscored_steps} steps (every group dropped: is the "
                    "judge reachable?); resume the run once it is back",
                )
            return None
        s.unscored_steps = 0
        s.train_history.append((step, r))
        w = self.collapse_window
        if (
            w is not None
            and step >= self.warmup
            and len(s.train_history) >= w
            and all(abs(v - self.collapse_value) <= _COLLAPSE_TOL for _, v in s.train_history[-w:])
        ):
            return self._decide(
                "collapse", step, f"train reward == {self.collapse_value} for the last {w} scored steps"
            )
        return None

    def update_val(
        self, step: int, value: float, *, state_fn: Callable[[], Any] | None = None
    ) -> StopDecision | None:
        """Record a validation value; on improvement remember the step and, if given, ``state_fn()`` as
        :attr:`best_state` (called only then). Returns the stop decision, if any."""
        s = self._s
        if s.decision is not None:
            return s.decision
        step = self._check_step(self.metric, step, s.val_history[-1][0] if s.val_history else None)
        v = self._check_value(self.metric, step, value)
        s.val_history.append((step, v))
        best = s.best_value  # an improvement is strict, beyond min_delta (always one before any check)
        s.improved = best is None or (
            v - self.min_delta > best if self.mode == "max" else v + self.min_delta < best
        )
        if s.improved:
            s.best_value, s.best_step, s.wait = v, step, 0
            if state_fn is not None:
                self._best_state = state_fn()
        elif step >= self.warmup:
            s.wait += 1
        sign = 1.0 if self.mode == "max" else -1.0
        if self.target is not None and sign * (v - self.target) >= 0.0:
            return self._decide("target_reached", step, f"{self.metric}={v:g} reached target {self.target:g}")
        if step >= self.warmup:
            hacked = self.hacking_evidence()
            if hacked is not None and hacked["alarm"]:
                return self._decide("reward_hacking", step, str(hacked["message"]))
            if s.wait >= self.patience:
                why = f"no improvement of {self.metric} beyond {self.min_delta:g} in {s.wait} checks"
                return self._decide("plateau", step, why)
        return None

    def stop_max_steps(self, step: int) -> StopDecision:
        """The caller ran out of steps: stop with ``max_steps`` (an earlier decision is kept and returned)."""
        return self._s.decision or self._decide(
            "max_steps", int(step), f"reached the step budget at step {step}"
        )

    def reopen(self) -> bool:
        """Clear a resumable decision (``judge_unavailable``) so the run can go on; True if one was cleared."""
        if self._s.decision is None or self._s.decision.reason != "judge_unavailable":
            return False
        self._s.decision = None
        self._s.unscored_steps = 0
        return True

    def hacking_evidence(self) -> dict[str, Any] | None:
        """The reward-hacking rule's quantities at the latest check and ``alarm`` (both conditions hold; warmup
        not applied); ``None`` when the alarm is off or no check came after the peak yet."""
        w, history = self.hacking_window, self._s.val_history
        if w is None or len(history) < 2:
            return None
        step = history[-1][0]
        sign = 1.0 if self.mode == "max" else -1.0
        # the peak: the best check, the latest among ties
        peak_step, peak = max(history, key=lambda sv: (sign * sv[1], sv[0]))
        recent = [v for s, v in history[-w:] if s > peak_step]
        if not recent:
            return None
        m = len(recent)

        def drop_test(lv: float, k: int) -> tuple[tuple[bool, float], float, int, float | None, float]:
            d = sign * (peak - lv)
            se_k = binomial_drop_se(peak, lv, self.val_size, k) if self.val_size is not None else None
            thr = max(self.hacking_drop, self.hacking_z * se_k) if se_k is not None else self.hacking_drop
            return (d > thr, _ratio(d, thr)), lv, k, se_k, thr

        # the level: the mean of the recent checks (a slow decline) or the latest check alone (a steep one),
        # whichever is further beyond its threshold (the first among equals)
        tests = [drop_test(sum(recent) / m, m)] + ([drop_test(recent[-1], 1)] if m > 1 else [])
        _, level, k_used, se, threshold = max(tests, key=lambda t: t[0])
        drop = sign * (peak - level)
        rise: float | None = None
        rise_se: float | None = None
        rise_how: str | None = None
        rose = False
        # the train rise: least-squares slope of train reward on step over the steps since the peak, judged
        # against the train reward's step-to-step noise over the whole recorded history (many degrees of
        # freedom, so a rise over a few steps is not judged by its own few residuals)
        span = [(s, r) for s, r in self._s.train_history if peak_step <= s <= step]
        sigma = train_noise_sd([r for _, r in self._s.train_history])
        if sigma is not None and len(span) >= 3:
            xs = np.array([s for s, _ in span], dtype=np.float64)
            xc = xs - xs.mean()
            sxx = float(np.dot(xc, xc))
            slope = float(np.dot(xc, np.array([r for _, r in span]))) / sxx
            width = float(xs[-1] - xs[0])
            rise, rise_se = slope * width, sigma / math.sqrt(sxx) * width
            rise_how = f"slope since the peak, steps {int(xs[0])}..{int(xs[-1])}"
            rose = _ratio(rise, rise_se) > self.hacking_rise_z and rise > max(
                self.hacking_min_rise, _RISE_TOL
            )
        alarm = drop > threshold and rose
        message = ""
        if alarm:
            why = (
                f"> {threshold:.4g} = max(hacking_drop {self.hacking_drop:g}, {self.hacking_z:g} x se {se:.4g}, "
                f"n={self.val_size})"
                if se is not None
                else f"> hacking_drop {self.hacking_drop:g}"
            )
            what = "the latest check" if k_used == 1 and m > 1 else f"mean of {k_used} check(s) since"
            message = (
                f"{self.metric} fell {drop:.4g} from its peak {peak:.4g} (step {peak_step}) to {level:.4g} "
                f"({what}) {why}, while train reward rose {rise:.4g} ({rise_how}; "
                f"> {self.hacking_rise_z:g} x se {rise_se:.3g})"
            )
        return {
            "peak_step": peak_step,
            "peak": peak,
            "level": level,
            "checks_after_peak": m,
            "checks_in_level": k_used,
            "drop": drop,
            "drop_se": se,
            "drop_threshold": threshold,
            "dropped": drop > threshold,
            "rise": rise,
            "rise_se": rise_se,
            "rise_how": rise_how,
            "rose": rose,
            "alarm": alarm,
            "message": message,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state for resume: format, config, best, wait, histories, decision."""
        return {
            "format": _STATE_FORMAT,
            "config": self.model_dump(mode="json"),
            **self._s.model_dump(mode="json"),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; a saved config that differs from this object's raises ``ValueError``
        naming the fields (fields an older state did not record are not compared)."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"format: expected {_STATE_FORMAT!r}, got {state.get('format')!r}")
        current = self.model_dump(mode="json")
        diff = sorted(k for k, v in state.get("config", {}).items() if k in current and v != current[k])
        if diff:
            raise ValueError(f"config: saved stopping config differs in {diff}")
        # A state saved before these two were kept: no unscored steps; the last train step is the last scored one.
        t = state.get("train_history")
        last = t[-1][0] if isinstance(t, list) and t and isinstance(t[-1], (list, tuple)) else None
        state = {"unscored_steps": 0, "last_train_step": last, **state}
        missing = sorted(set(_Seen.model_fields) - set(state))
        try:
            if missing:
                raise ValueError(f"missing {missing}")
            self._s = _Seen.model_validate({k: state[k] for k in _Seen.model_fields})
        except ValueError as exc:  # pydantic's ValidationError included
            raise ValueError(f"state: malformed validation-stopping state ({exc})") from None
