"""ValidationStopping: each stop reason from a scripted metric sequence, min_delta edges, state round-trip."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from palaestra import ValidationStopping as TopLevelValidationStopping
from palaestra.trainer.stopping import STOP_REASONS, StopDecision, ValidationStopping


def run_val(stopper: ValidationStopping, values: list[float], every: int = 10) -> StopDecision | None:
    """Feed validation values at steps 0, every, 2*every, ...; return the first decision."""
    for i, v in enumerate(values):
        decision = stopper.update_val(i * every, v)
        if decision is not None:
            return decision
    return None


def test_top_level_export() -> None:
    assert TopLevelValidationStopping is ValidationStopping
    assert set(STOP_REASONS) == {"plateau", "target_reached", "reward_hacking", "collapse", "max_steps"}


# --------------------------------------------------------------------------- plateau and min_delta


def test_plateau_with_min_delta_keeps_best_on_subthreshold_gains() -> None:
    # the grpo_math.md section 6.4 sequence: Keras and Lightning stop at index 3 with best 0.6
    s = ValidationStopping(patience=2, min_delta=0.01, hacking_window=None)
    d = run_val(s, [0.50, 0.60, 0.605, 0.61, 0.612, 0.70])
    assert d is not None and d.reason == "plateau"
    assert d.step == 30 and d.best_step == 10 and d.best_value == 0.60
    assert s.should_stop and s.decision == d and s.wait == 2


def test_plateau_default_patience_counts_checks() -> None:
    s = ValidationStopping(patience=3, hacking_window=None)
    d = run_val(s, [0.5, 0.6, 0.605, 0.61, 0.612, 0.7, 0.69, 0.68, 0.67])
    assert (
        d is not None and d.reason == "plateau" and d.step == 80 and d.best_value == 0.7 and d.best_step == 50
    )


def test_improvement_of_exactly_min_delta_is_not_an_improvement() -> None:
    s = ValidationStopping(patience=1, min_delta=0.25, hacking_window=None)
    assert s.update_val(0, 0.5) is None
    d = s.update_val(10, 0.75)
    assert d is not None and d.reason == "plateau" and d.best_value == 0.5 and not s.improved
    t = ValidationStopping(patience=1, min_delta=0.25, hacking_window=None)
    t.update_val(0, 0.5)
    assert t.update_val(10, 0.75 + 2**-20) is None and t.improved and t.best_value == 0.75 + 2**-20


def test_min_mode_mirrors_max_mode() -> None:
    s = ValidationStopping(metric="val_loss", mode="min", patience=1, min_delta=0.25, hacking_window=None)
    s.update_val(0, 1.0)
    assert s.update_val(10, 0.5) is None and s.best_value == 0.5  # improved by .5 > .25
    d = s.update_val(20, 0.25)  # improved by exactly .25: no
    assert d is not None and d.reason == "plateau" and d.best_value == 0.5 and d.best_step == 10


def test_equal_value_without_min_delta_is_no_improvement() -> None:
    s = ValidationStopping(patience=2, hacking_window=None)
    assert run_val(s, [0.5, 0.5]) is None and s.wait == 1 and s.best_step == 0


def test_warmup_checks_do_not_count_towards_patience() -> None:
    s = ValidationStopping(patience=1, warmup=30, hacking_window=None)
    assert s.update_val(0, 0.5) is None
    assert s.update_val(10, 0.4) is None and s.wait == 0
    assert s.update_val(20, 0.4) is None
    d = s.update_val(30, 0.4)
    assert d is not None and d.reason == "plateau" and d.step == 30 and d.best_step == 0


def test_best_state_blob_is_taken_only_on_improvement() -> None:
    s = ValidationStopping(patience=5, hacking_window=None)
    calls: list[int] = []

    def snapshot(step: int) -> Any:
        def fn() -> dict[str, int]:
            calls.append(step)
            return {"weights_at": step}

        return fn

    for step, v in [(0, 0.3), (10, 0.5), (20, 0.4), (30, 0.5), (40, 0.6), (50, 0.55)]:
        s.update_val(step, v, state_fn=snapshot(step))
    assert calls == [0, 10, 40]
    assert s.best_state == {"weights_at": 40} and s.best_step == 40 and s.best_value == 0.6
    s.set_best_state("manual")
    assert s.best_state == "manual"


# --------------------------------------------------------------------------- target


def test_target_reached_keeps_the_target_state_as_best() -> None:
    s = ValidationStopping(target=0.7, patience=10, hacking_window=None)
    d = None
    for step, v in [(0, 0.5), (10, 0.65), (20, 0.7)]:
        d = s.update_val(step, v, state_fn=lambda step=step: step)
    assert d is not None and d.reason == "target_reached" and d.step == 20
    assert d.best_value == 0.7 and s.best_state == 20


def test_target_in_min_mode_and_during_warmup() -> None:
    s = ValidationStopping(mode="min", target=0.1, warmup=1000, hacking_window=None)
    assert s.update_val(0, 0.5) is None
    d = s.update_val(10, 0.09)
    assert d is not None and d.reason == "target_reached"


# --------------------------------------------------------------------------- reward hacking


def _hacking_run(train_rewards: list[float], **kw: Any) -> tuple[ValidationStopping, StopDecision | None]:
    """Val checked every 10 steps: 0.5, 0.6 (peak), 0.58, 0.52; train reward given for steps 1..30."""
    s = ValidationStopping(every=10, patience=10, hacking_window=3, hacking_drop=0.05, **kw)
    val = {0: 0.5, 10: 0.6, 20: 0.58, 30: 0.52}
    decision = s.update_val(0, val[0])
    for step in range(1, 31):
        assert s.update_train(step, train_rewards[step - 1]) is None
        if step in val:
            decision = s.update_val(step, val[step])
            if decision is not None:
                break
    return s, decision


def test_reward_hacking_when_val_falls_while_train_reward_rises() -> None:
    _, d = _hacking_run([0.2 + 0.02 * i for i in range(30)])
    assert d is not None and d.reason == "reward_hacking" and d.step == 30
    assert d.best_step == 10 and d.best_value == 0.6
    assert "fell" in d.message


def test_no_reward_hacking_when_train_reward_is_flat_or_falling() -> None:
    _, flat = _hacking_run([0.4] * 30)
    assert flat is None
    _, falling = _hacking_run([0.8 - 0.01 * i for i in range(30)])
    assert falling is None


def test_reward_hacking_rise_threshold() -> None:
    # fitted rise over steps 10..30 is 0.02 * 20 = 0.4: alarm below that threshold, not above it
    _, hit = _hacking_run([0.2 + 0.02 * i for i in range(30)], hacking_min_rise=0.39)
    assert hit is not None and hit.reason == "reward_hacking"
    _, miss = _hacking_run([0.2 + 0.02 * i for i in range(30)], hacking_min_rise=0.41)
    assert miss is None


def test_reward_hacking_only_looks_back_over_the_window() -> None:
    # each check drops .02 (< .05) from the previous one; the total drop from the first is .06
    s = ValidationStopping(patience=10, hacking_window=2, hacking_drop=0.05)
    for step in range(1, 41):
        s.update_train(step, 0.01 * step)
    assert run_val(s, [0.6, 0.58, 0.56, 0.54]) is None
    wide = ValidationStopping(patience=10, hacking_window=4, hacking_drop=0.05)
    for step in range(0, 41):
        wide.update_train(step, 0.01 * step)
    d = run_val(wide, [0.6, 0.58, 0.56, 0.54])
    assert d is not None and d.reason == "reward_hacking" and d.step == 30 and d.best_step == 0


def test_reward_hacking_is_suppressed_during_warmup() -> None:
    _, d = _hacking_run([0.2 + 0.02 * i for i in range(30)], warmup=31)
    assert d is None


# --------------------------------------------------------------------------- collapse and max_steps


def test_collapse_after_a_window_of_zero_train_reward() -> None:
    s = ValidationStopping(collapse_window=5)
    rewards = [0.2, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]
    decisions = [s.update_train(step, r) for step, r in enumerate(rewards, start=1)]
    assert all(d is None for d in decisions[:-1])
    assert decisions[-1] is not None and decisions[-1].reason == "collapse" and decisions[-1].step == 11


def test_collapse_value_and_warmup() -> None:
    s = ValidationStopping(collapse_window=3, collapse_value=-1.0, warmup=6)
    decisions = [s.update_train(step, -1.0) for step in range(1, 7)]
    assert decisions[:5] == [None] * 5
    assert decisions[5] is not None and decisions[5].reason == "collapse"
    off = ValidationStopping(collapse_window=None)
    assert all(off.update_train(step, 0.0) is None for step in range(100))


def test_max_steps_and_first_decision_wins() -> None:
    s = ValidationStopping()
    s.update_val(0, 0.4)
    d = s.stop_max_steps(200)
    assert d.reason == "max_steps" and d.step == 200 and d.best_value == 0.4 and d.best_step == 0
    assert s.update_val(210, 0.9) == d and s.update_train(211, 0.0) == d  # later updates are ignored
    assert s.val_history == [(0, 0.4)]
    p = ValidationStopping(patience=1, hacking_window=None)
    run_val(p, [0.5, 0.4])
    assert p.stop_max_steps(100).reason == "plateau"


# --------------------------------------------------------------------------- state and errors


def test_state_round_trip_resumes_to_the_same_decision() -> None:
    cfg = {"patience": 3, "min_delta": 0.01, "hacking_window": 3, "hacking_drop": 0.05, "collapse_window": 4}
    val = {0: 0.4, 5: 0.5, 10: 0.62, 15: 0.61, 20: 0.6, 25: 0.6, 30: 0.59, 35: 0.58}

    def drive(s: ValidationStopping, steps: range) -> StopDecision | None:
        for step in steps:
            if step > 0 and (d := s.update_train(step, 0.3)) is not None:
                return d
            if step in val and (d := s.update_val(step, val[step])) is not None:
                return d
        return None

    whole = ValidationStopping(**cfg)
    expected = drive(whole, range(0, 40))
    assert expected is not None and expected.reason == "plateau" and expected.step == 25

    first = ValidationStopping(**cfg)
    assert drive(first, range(0, 13)) is None
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = ValidationStopping(**cfg)
    resumed.load_state_dict(saved)
    assert resumed.best_value == 0.62 and resumed.best_step == 10 and resumed.wait == first.wait
    assert drive(resumed, range(13, 40)) == expected
    assert resumed.state_dict() == whole.state_dict()

    done = ValidationStopping(**cfg)
    done.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert done.decision == expected and done.should_stop


def test_load_state_dict_checks_config_and_shape() -> None:
    s = ValidationStopping(patience=3)
    s.update_val(0, 0.5)
    state = s.state_dict()
    other = ValidationStopping(patience=4)
    with pytest.raises(ValueError, match="patience"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict_config=False)
    assert other.patience == 4 and other.best_value == 0.5
    with pytest.raises(ValueError, match="format"):
        s.load_state_dict({"format": "other"})
    broken = dict(state)
    del broken["wait"]
    with pytest.raises(ValueError, match="malformed"):
        ValidationStopping(patience=3).load_state_dict(broken)


def test_bad_updates_raise_clear_errors() -> None:
    s = ValidationStopping()
    with pytest.raises(ValueError, match="val_accuracy"):
        s.update_val(0, float("nan"))
    s.update_val(10, 0.5)
    with pytest.raises(ValueError, match="steps must increase"):
        s.update_val(10, 0.6)
    with pytest.raises(ValueError, match="step"):
        s.update_val(20.5, 0.6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="train_reward"):
        s.update_train(1, float("inf"))
    with pytest.raises(ValueError, match=r"'val_accuracy' not in validation metrics \['val_loss'\]"):
        s.update_val_metrics(30, {"val_loss": 0.3})
    assert s.update_val_metrics(30, {"val_accuracy": 0.7, "val_loss": 0.3}) is None and s.best_value == 0.7


def test_config_validation_and_schedule() -> None:
    for bad in (
        {"patience": 0},
        {"every": 0},
        {"min_delta": -0.1},
        {"hacking_window": 1},
        {"mode": "up"},
        {"hacking_drop": 0.0},
        {"target": float("inf")},
        {"unknown_field": 1},
    ):
        with pytest.raises(ValidationError):
            ValidationStopping(**bad)
    s = ValidationStopping(every=5)
    assert [step for step in range(16) if s.should_validate(step)] == [0, 5, 10, 15]
