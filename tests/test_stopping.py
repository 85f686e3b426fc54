"""ValidationStopping: each stop reason from a scripted metric sequence, min_delta edges, state round-trip."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from palaestra import ValidationStopping as TopLevelValidationStopping
from palaestra.trainer.stopping import (
    EXIT_JUDGE_UNAVAILABLE,
    STOP_REASONS,
    StopDecision,
    StoppingRule,
    ValidationStopping,
    binomial_drop_se,
    stop_exit_code,
    train_noise_sd,
)


def run_val(stopper: ValidationStopping, values: list[float], every: int = 10) -> StopDecision | None:
    """Feed validation values at steps 0, every, 2*every, ...; return the first decision."""
    for i, v in enumerate(values):
        decision = stopper.update_val(i * every, v)
        if decision is not None:
            return decision
    return None


def test_top_level_export() -> None:
    assert TopLevelValidationStopping is ValidationStopping
    assert set(STOP_REASONS) == {
        "plateau",
        "target_reached",
        "reward_hacking",
        "collapse",
        "judge_unavailable",
        "max_steps",
    }


# --------------------------------------------------------------------------- plateau and min_delta


def test_plateau_with_min_delta_keeps_best_on_subthreshold_gains() -> None:
    # the grpo_math.md section 6.4 sequence: Keras and Lightning stop at index 3 with best 0.6
    s = ValidationStopping(patience=2, min_delta=0.01, hacking_window=None)
    d = run_val(s, [0.50, 0.60, 0.605, 0.61, 0.612, 0.70])
    assert d is not None and d.reason == "plateau"
    assert d.step == 30 and d.best_step == 10 and d.best_value == 0.60
    assert s.decision == d and s.state_dict()["wait"] == 2


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
    assert run_val(s, [0.5, 0.5]) is None and s.state_dict()["wait"] == 1 and s.best_step == 0


def test_warmup_checks_do_not_count_towards_patience() -> None:
    s = ValidationStopping(patience=1, warmup=30, hacking_window=None)
    assert s.update_val(0, 0.5) is None
    assert s.update_val(10, 0.4) is None and s.state_dict()["wait"] == 0
    assert s.update_val(20, 0.4) is None
    d = s.update_val(30, 0.4)
    assert d is not None and d.reason == "plateau" and d.step == 30 and d.best_step == 0


def test_best_state_blob_is_taken_only_on_improvement() -> None:
    s = ValidationStopping(patience=5, hacking_window=None)
    calls: list[int] = []
    improved: list[int] = []

    def snapshot(step: int) -> Any:
        def fn() -> dict[str, int]:
            calls.append(step)
            return {"weights_at": step}

        return fn

    for step, v in [(0, 0.3), (10, 0.5), (20, 0.4), (30, 0.5), (40, 0.6), (50, 0.55)]:
        s.update_val(step, v, state_fn=snapshot(step))
        if s.improved:  # what a caller keeping the state itself checks (the experiment: checkpoints/best.npz)
            improved.append(step)
    assert calls == improved == [0, 10, 40]
    assert s.best_state == {"weights_at": 40} and s.best_step == 40 and s.best_value == 0.6


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


def _hacking_run(
    train_rewards: list[float], val: dict[int, float] | None = None, **kw: Any
) -> tuple[ValidationStopping, StopDecision | None]:
    """Val checked every 10 steps: 0.5, 0.6 (peak), 0.56, 0.50; train reward given for steps 1..30."""
    kw.setdefault("hacking_drop", 0.05)
    s = ValidationStopping(every=10, patience=10, hacking_window=3, **kw)
    val = val or {0: 0.5, 10: 0.6, 20: 0.56, 30: 0.50}
    decision = s.update_val(0, val[0])
    for step in range(1, max(val) + 1):
        assert s.update_train(step, train_rewards[step - 1]) is None
        if step in val:
            decision = s.update_val(step, val[step])
            if decision is not None:
                break
    return s, decision


def noisy(values: list[float], sd: float, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(v + rng.normal(0.0, sd)) for v in values]


def test_reward_hacking_when_val_falls_while_train_reward_rises() -> None:
    # recent level = mean of the checks after the peak in the window: (0.56 + 0.50) / 2 = 0.53, drop 0.07
    _, d = _hacking_run([0.2 + 0.02 * i for i in range(30)])
    assert d is not None and d.reason == "reward_hacking" and d.step == 30
    assert d.best_step == 10 and d.best_value == 0.6
    assert "fell" in d.message and "peak 0.6 (step 10)" in d.message


def test_no_reward_hacking_when_train_reward_is_flat_or_falling() -> None:
    _, flat = _hacking_run([0.4] * 30)
    assert flat is None
    _, falling = _hacking_run([0.8 - 0.01 * i for i in range(30)])
    assert falling is None


def test_train_rise_must_exceed_its_noise() -> None:
    # a small trend buried in step-to-step noise is not a rise; the same trend with little noise is
    trend = [0.4 + 0.002 * i for i in range(30)]
    _, buried = _hacking_run(noisy(trend, 0.08, seed=1))
    assert buried is None
    _, clear = _hacking_run(noisy(trend, 0.002, seed=1))
    assert clear is not None and clear.reason == "reward_hacking"
    s, _ = _hacking_run(noisy(trend, 0.08, seed=1))
    ev = s.hacking_evidence()
    assert ev is not None and ev["dropped"] and not ev["rose"]
    assert ev["rise"] <= 1.5 * ev["rise_se"]  # hacking_rise_z = 1.5 by default


def test_reward_hacking_rise_threshold() -> None:
    # fitted rise over steps 10..30 is 0.02 * 20 = 0.4: alarm below that threshold, not above it
    _, hit = _hacking_run([0.2 + 0.02 * i for i in range(30)], hacking_min_rise=0.39)
    assert hit is not None and hit.reason == "reward_hacking"
    _, miss = _hacking_run([0.2 + 0.02 * i for i in range(30)], hacking_min_rise=0.41)
    assert miss is None


def test_drop_threshold_is_binomial_standard_errors_for_the_validation_size() -> None:
    rising = [0.2 + 0.02 * i for i in range(30)]
    val = {0: 0.5, 10: 0.6, 20: 0.55, 30: 0.55}  # drop 0.05 from the peak, mean of 2 checks after it
    se_100 = binomial_drop_se(0.6, 0.55, 100, 2)
    se_2000 = binomial_drop_se(0.6, 0.55, 2000, 2)
    assert se_100 > 0.05 / 3 > se_2000
    # on 100 examples a drop of 0.05 is noise; on 2000 it is more than 3 standard errors
    _, small = _hacking_run(rising, val, hacking_drop=0.0, val_size=100)
    assert small is None
    s, large = _hacking_run(rising, val, hacking_drop=0.0, val_size=2000)
    assert large is not None and large.reason == "reward_hacking" and "n=2000" in large.message
    ev = s.hacking_evidence()
    assert ev is not None and large.step == 20 and ev["checks_after_peak"] == 1  # one check sufficed here
    assert ev["drop_threshold"] == pytest.approx(3.0 * binomial_drop_se(0.6, 0.55, 2000, 1))
    # hacking_drop is a floor on top of the statistical threshold
    _, floored = _hacking_run(rising, val, hacking_drop=0.06, val_size=2000)
    assert floored is None
    # hacking_z scales it
    _, loose = _hacking_run(rising, val, hacking_drop=0.0, val_size=100, hacking_z=0.5)
    assert loose is not None


def test_binomial_drop_se_formula() -> None:
    p = (0.6 + 2 * 0.55) / 3
    assert binomial_drop_se(0.6, 0.55, 100, 2) == pytest.approx(math.sqrt(p * (1 - p) * (1 / 100 + 1 / 200)))
    assert binomial_drop_se(1.0, 1.0, 50, 1) > 0.0  # clipped away from 0 and 1
    with pytest.raises(ValueError):
        binomial_drop_se(0.5, 0.5, 0, 1)


def test_train_noise_sd_is_the_successive_difference_estimate() -> None:
    # hand computation: differences 2, -1, 3, -1 -> sum of squares 15 -> sigma^2 = 15 / (2 * 4)
    assert train_noise_sd([1.0, 3.0, 2.0, 5.0, 4.0]) == pytest.approx(math.sqrt(15 / 8))
    assert train_noise_sd([0.3, 0.3, 0.3]) == 0.0 and train_noise_sd([0.1, 0.9]) is None
    # a slow trend barely moves it: the same noise on a rising line
    flat, rising = (
        noisy([0.5] * 200, 0.05, seed=2),
        noisy([0.3 + 0.001 * i for i in range(200)], 0.05, seed=2),
    )
    assert train_noise_sd(rising) == pytest.approx(train_noise_sd(flat), rel=0.01)


def test_a_short_rise_is_judged_against_the_runs_noise_not_its_own_residuals() -> None:
    # three exactly collinear rewards since the peak (their own residuals are 0) after a noisy run: the rise of
    # 0.04 is within the run's step-to-step noise, so no alarm; after a quiet run the same rise is significant
    def run(sd: float) -> tuple[ValidationStopping, StopDecision | None]:
        s = ValidationStopping(patience=100, hacking_window=3, val_size=1000)
        rewards = [*noisy([0.4] * 19, sd, seed=3), 0.40, 0.42, 0.44]
        for step, value in ((0, 0.5), (10, 0.55), (20, 0.6)):
            for t in range(max(1, step - 9), step + 1):
                s.update_train(t, rewards[t - 1])
            assert s.update_val(step, value) is None
        s.update_train(21, rewards[20])
        s.update_train(22, rewards[21])
        return s, s.update_val(22, 0.3)

    s, noisy_run = run(0.05)
    ev = s.hacking_evidence()
    assert noisy_run is None and ev is not None and ev["dropped"] and not ev["rose"]
    assert ev["rise"] == pytest.approx(0.04) and ev["rise_how"] == "slope since the peak, steps 20..22"
    sigma = train_noise_sd([r for _, r in s.state_dict()["train_history"]])
    assert sigma is not None and ev["rise_se"] == pytest.approx(sigma / math.sqrt(2.0) * 2.0)
    _, quiet_run = run(0.001)
    assert quiet_run is not None and quiet_run.reason == "reward_hacking"


def test_slow_decline_is_caught_by_the_smoothed_recent_level() -> None:
    # each check falls 0.02 below the one before (never a big single drop); the mean of the last 3 checks
    # falls below the peak by more than 3 standard errors on 1000 examples
    s = ValidationStopping(patience=100, hacking_window=3, val_size=1000)
    values = [0.50, 0.60, 0.57, 0.55, 0.54, 0.54, 0.545]
    decision = None
    for i, v in enumerate(values):
        step = 10 * i
        if step:
            for t in range(step - 9, step + 1):
                s.update_train(t, 0.3 + 0.01 * t + (0.01 if t % 2 else -0.01))
        decision = s.update_val(step, v)
        if decision is not None:
            break
    assert decision is not None and decision.reason == "reward_hacking"
    assert decision.best_step == 10
    ev = s.hacking_evidence()
    assert decision.step == 50 and ev is not None and ev["checks_in_level"] == 3
    assert ev["level"] == pytest.approx((0.55 + 0.54 + 0.54) / 3)
    # the latest check alone (0.54, 0.06 below the peak) is within its own threshold: only the mean is beyond
    assert 3.0 * binomial_drop_se(0.6, 0.54, 1000, 1) > 0.06
    # each check against the one before never exceeded the threshold: only the smoothed level did
    assert all(a - b < ev["drop_threshold"] for a, b in itertools.pairwise(values[1:]))


def test_a_steep_drop_of_the_latest_check_is_caught_before_the_mean_moves() -> None:
    # on 300 examples: the mean of the last three checks (0.5467) is within its threshold, the latest alone not
    rising = [0.2 + 0.02 * i for i in range(40)]
    val = {0: 0.5, 10: 0.6, 20: 0.59, 30: 0.58, 40: 0.47}
    s, d = _hacking_run(rising, val, hacking_drop=0.0, val_size=300)
    assert d is not None and d.reason == "reward_hacking" and d.step == 40 and "the latest check" in d.message
    ev = s.hacking_evidence()
    assert ev is not None and ev["checks_in_level"] == 1 and ev["level"] == 0.47
    mean = (0.59 + 0.58 + 0.47) / 3
    assert 0.6 - mean < 3.0 * binomial_drop_se(0.6, mean, 300, 3)


def test_peak_is_the_best_check_of_the_run_not_only_of_the_window() -> None:
    # the peak left the window long ago; the recent level is still compared with it
    s = ValidationStopping(patience=100, hacking_window=2, hacking_drop=0.05)
    for step in range(1, 61):
        s.update_train(step, 0.01 * step)
    assert run_val(s, [0.6, 0.58, 0.57, 0.56]) is None  # at step 30: mean 0.565, latest 0.56: not > 0.05
    d = s.update_val(40, 0.52)
    assert d is not None and d.reason == "reward_hacking" and d.best_step == 0


def test_reward_hacking_is_suppressed_during_warmup() -> None:
    _, d = _hacking_run([0.2 + 0.02 * i for i in range(30)], warmup=31)
    assert d is None


def test_min_mode_hacking_mirrors_max_mode() -> None:
    s = ValidationStopping(mode="min", metric="val_loss", patience=100, hacking_drop=0.05)
    for step in range(1, 31):
        s.update_train(step, 0.2 + 0.02 * step)
    assert s.update_val(0, 0.5) is None and s.update_val(10, 0.4) is None and s.update_val(20, 0.44) is None
    d = s.update_val(30, 0.5)
    assert d is not None and d.reason == "reward_hacking" and d.best_value == 0.4


# --------------------------------------------------------------------------- judge outage


def test_judge_unavailable_after_consecutive_unscored_steps() -> None:
    s = ValidationStopping(judge_unavailable_steps=3, collapse_window=2, warmup=1000)
    assert s.update_train(1, 0.4) is None
    assert s.update_train(2, None) is None and s.update_train(3, None) is None
    assert s.update_train(4, 0.5) is None and s.state_dict()["unscored_steps"] == 0  # a scored step resets it
    assert s.update_train(5, None) is None and s.update_train(6, None) is None
    d = s.update_train(7, None)
    assert d is not None and d.reason == "judge_unavailable" and d.step == 7  # not suppressed by warmup
    assert s.state_dict()["train_history"] == [
        [1, 0.4],
        [4, 0.5],
    ]  # unscored steps never enter the train history
    assert stop_exit_code(d.reason) == EXIT_JUDGE_UNAVAILABLE != 0 and stop_exit_code("plateau") == 0


def test_an_outage_is_never_a_collapse() -> None:
    s = ValidationStopping(collapse_window=3, judge_unavailable_steps=None)
    assert all(s.update_train(step, None) is None for step in range(1, 50))
    assert s.decision is None
    assert [s.update_train(step, 0.0) for step in (50, 51)] == [None, None]
    d = s.update_train(52, 0.0)
    assert d is not None and d.reason == "collapse"


def test_reopen_after_judge_unavailable_and_state_round_trip() -> None:
    s = ValidationStopping(judge_unavailable_steps=2)
    s.update_val(0, 0.5)
    s.update_train(1, 0.3)
    s.update_train(2, None)
    saved = json.loads(json.dumps(s.state_dict()))
    resumed = ValidationStopping(judge_unavailable_steps=2)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["unscored_steps"] == 1
    with pytest.raises(ValueError, match="steps must increase"):
        resumed.update_train(2, 0.3)  # the unscored step 2 counts for the step order
    d = resumed.update_train(3, None)
    assert d is not None and d.reason == "judge_unavailable"
    assert resumed.reopen() and resumed.decision is None and resumed.state_dict()["unscored_steps"] == 0
    assert resumed.update_train(4, 0.35) is None
    p = ValidationStopping(patience=1, hacking_window=None)
    run_val(p, [0.5, 0.4])
    assert not p.reopen() and p.decision is not None and p.decision.reason == "plateau"


def test_config_section_shares_the_stoppers_fields_and_bounds() -> None:
    from palaestra.trainer.expconfig import StoppingSection, config_from_dict
    from palaestra.trajectories.io import DataError

    rule = set(StoppingRule.model_fields)
    assert rule <= set(StoppingSection.model_fields) and rule <= set(ValidationStopping.model_fields)
    assert set(StoppingSection.model_fields) - rule == {"restore_best"}
    for name in rule:
        assert StoppingSection.model_fields[name].metadata == ValidationStopping.model_fields[name].metadata
    for bad in ({"hacking_drop": -0.1}, {"hacking_z": 0.0}, {"hacking_min_rise": -1.0}, {"patience": 0}):
        with pytest.raises(ValidationError):
            ValidationStopping(**bad)
        field = next(iter(bad))
        with pytest.raises(DataError, match=f"stopping.{field}"):
            config_from_dict({"stopping": bad})
    # every value the config accepts, the stopper accepts too
    section = config_from_dict(
        {"stopping": {"hacking_drop": 0.0, "hacking_min_rise": 0.0, "warmup": 5}}
    ).stopping
    ValidationStopping(**section.model_dump(exclude={"restore_best"}))


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
    assert s.state_dict()["val_history"] == [[0, 0.4]]
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
    assert (
        resumed.best_value == 0.62
        and resumed.best_step == 10
        and resumed.state_dict()["wait"] == first.state_dict()["wait"]
    )
    assert drive(resumed, range(13, 40)) == expected
    assert resumed.state_dict() == whole.state_dict()

    done = ValidationStopping(**cfg)
    done.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert done.decision == expected


def test_load_state_dict_checks_config_and_shape() -> None:
    s = ValidationStopping(patience=3)
    s.update_val(0, 0.5)
    state = s.state_dict()
    other = ValidationStopping(patience=4)
    with pytest.raises(ValueError, match="patience"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        s.load_state_dict({"format": "other"})
    broken = dict(state)
    del broken["wait"]
    with pytest.raises(ValueError, match="malformed"):
        ValidationStopping(patience=3).load_state_dict(broken)
    s.update_train(1, 0.25)
    s.update_train(2, 0.5)
    older = {k: v for k, v in s.state_dict().items() if k not in ("last_train_step", "unscored_steps")}
    restored = ValidationStopping(patience=3)
    restored.load_state_dict(older)  # a state saved before those two fields were kept
    assert restored.state_dict() == s.state_dict()


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


def test_config_validation_and_schedule() -> None:
    for bad in (
        {"patience": 0},
        {"every": 0},
        {"min_delta": -0.1},
        {"hacking_window": 1},
        {"mode": "up"},
        {"hacking_drop": -0.01},
        {"hacking_z": 0.0},
        {"judge_unavailable_steps": 0},
        {"target": float("inf")},
        {"unknown_field": 1},
    ):
        with pytest.raises(ValidationError):
            ValidationStopping(**bad)
    s = ValidationStopping(every=5)
    assert [step for step in range(16) if s.should_validate(step)] == [0, 5, 10, 15]


def test_a_value_that_is_not_a_number_is_named() -> None:
    s = ValidationStopping()
    with pytest.raises(ValueError, match="val_accuracy: expected a number, got 'high'"):
        s.update_val(0, "high")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"train_reward: expected a number, got \[0.5\]"):
        s.update_train(1, [0.5])  # type: ignore[arg-type]
    assert s.update_val(0, "0.5") is None  # a numeric string is a number (float() accepts it)


# --------------------------------------------------------------------------- defaults, bounds and edges


def test_documented_defaults() -> None:
    # docs/concepts.md, "Stopping", and the field descriptions
    s = ValidationStopping()
    documented = {
        "patience": 5,
        "min_delta": 0.0,
        "warmup": 0,
        "target": None,
        "hacking_window": 3,
        "hacking_z": 3.0,
        "hacking_drop": 0.0,
        "hacking_rise_z": 1.5,
        "hacking_min_rise": 0.0,
        "collapse_window": 20,
        "collapse_value": 0.0,
        "judge_unavailable_steps": 3,
        "metric": "val_accuracy",
        "mode": "max",
        "every": 10,
        "val_size": None,
    }
    dumped = s.model_dump()
    assert {name: dumped[name] for name in documented} == documented
    # a fresh stopper has seen nothing
    assert s.best_value is None and s.best_step is None and not s.improved and s.decision is None
    fresh = s.state_dict()
    assert fresh["wait"] == 0 and fresh["unscored_steps"] == 0 and fresh["improved"] is False
    assert (
        EXIT_JUDGE_UNAVAILABLE == 3 and stop_exit_code("judge_unavailable") == 3
    )  # the documented exit code


def test_default_judge_unavailable_and_collapse_counts() -> None:
    # no scored step yet: the third unscored step stops (not the second)
    s = ValidationStopping()
    assert s.update_train(1, None) is None and s.update_train(2, None) is None
    d = s.update_train(3, None)
    assert d is not None and d.reason == "judge_unavailable"
    # 20 zero rewards in a row collapse, 19 do not
    c = ValidationStopping()
    assert all(c.update_train(step, 0.0) is None for step in range(1, 20))
    d = c.update_train(20, 0.0)
    assert d is not None and d.reason == "collapse"
    # warmup 0: even step 0 can collapse
    w = ValidationStopping(collapse_window=1)
    d = w.update_train(0, 0.0)
    assert d is not None and d.reason == "collapse" and d.step == 0


def test_collapse_tolerance_is_1e_12() -> None:
    s = ValidationStopping(collapse_window=2)
    assert s.update_train(1, 1e-12) is None
    d = s.update_train(2, -1e-12)  # within the tolerance on either side
    assert d is not None and d.reason == "collapse"
    t = ValidationStopping(collapse_window=2)
    assert t.update_train(1, 1e-9) is None and t.update_train(2, 1e-9) is None


def test_smallest_allowed_settings_are_accepted_and_below_them_refused() -> None:
    ValidationStopping(
        patience=1,
        warmup=0,
        hacking_window=2,
        hacking_drop=0.0,
        hacking_rise_z=0.0,
        hacking_min_rise=0.0,
        collapse_window=1,
        judge_unavailable_steps=1,
        every=1,
        val_size=1,
    )
    for bad in (
        {"warmup": -1},
        {"hacking_rise_z": -0.1},
        {"collapse_window": 0},
        {"val_size": 0},
    ):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ValidationStopping(**bad)


def test_settings_are_checked_on_assignment_and_decisions_are_frozen() -> None:
    s = ValidationStopping()
    with pytest.raises(ValidationError, match="patience"):
        s.patience = 0
    p = ValidationStopping(patience=1, hacking_window=None)
    d = run_val(p, [0.5, 0.4])
    assert d is not None
    with pytest.raises(ValidationError):
        d.step = 0  # type: ignore[misc]


def test_validation_steps_must_increase_over_the_latest_check() -> None:
    s = ValidationStopping()
    s.update_val(0, 0.5)
    s.update_val(10, 0.5)
    with pytest.raises(ValueError, match="steps must increase, got 5 after 10"):
        s.update_val(5, 0.5)


def test_binomial_drop_se_edges() -> None:
    # default m = 1: p = (0.6 + 0.55) / 2, se = sqrt(p (1 - p) * 2 / n)
    p = 0.575
    assert binomial_drop_se(0.6, 0.55, 100) == pytest.approx(math.sqrt(p * (1 - p) * 2 / 100))
    # n = 1 is allowed: p = 0.5 is both clip bounds
    assert binomial_drop_se(1.0, 0.0, 1, 1) == pytest.approx(math.sqrt(0.25 * 2))
    # at 1 or 0, p is clipped to 1 - 1/(2n) or 1/(2n): n = 50 -> 0.99 or 0.01
    assert binomial_drop_se(1.0, 1.0, 50, 1) == pytest.approx(math.sqrt(0.99 * 0.01 * 2 / 50))
    assert binomial_drop_se(0.0, 0.0, 50, 1) == pytest.approx(math.sqrt(0.01 * 0.99 * 2 / 50))
    with pytest.raises(ValueError, match="m=0"):
        binomial_drop_se(0.5, 0.5, 10, 0)


@pytest.mark.parametrize(
    ("peak", "level", "bad"),
    [(1.5, 0.5, "peak=1.5"), (-0.1, 0.5, "peak=-0.1"), (0.5, 1.01, "level=1.01"), (0.5, -1.0, "level=-1.0")],
)
def test_binomial_drop_se_rejects_values_outside_0_1(peak: float, level: float, bad: str) -> None:
    with pytest.raises(ValueError, match=rf"must be accuracies in \[0, 1\].*{bad}"):
        binomial_drop_se(peak, level, 100, 2)
    with pytest.raises(ValueError, match="must be accuracies"):
        binomial_drop_se(math.nan, 0.5, 100, 1)
    with pytest.raises(ValueError, match="n=0"):
        binomial_drop_se(0.5, 0.5, 0, 1)


def test_peak_is_the_latest_of_equal_best_checks() -> None:
    s = ValidationStopping(patience=100)
    run_val(s, [0.6, 0.6, 0.5])
    ev = s.hacking_evidence()
    assert ev is not None and ev["peak_step"] == 10 and ev["checks_after_peak"] == 1


def test_two_checks_are_enough_for_the_alarm() -> None:
    # peak at step 0, one check after it: the fall is judged at the second check already
    s = ValidationStopping(patience=100, hacking_drop=0.05)
    assert s.update_val(0, 0.6) is None
    for step in range(1, 31):
        s.update_train(step, 0.02 * step)
    d = s.update_val(30, 0.3)
    assert d is not None and d.reason == "reward_hacking" and d.best_step == 0


def test_no_rise_is_measured_without_three_train_rewards_since_the_peak() -> None:
    # a large fall with no train reward at all: no rise, so no alarm
    s = ValidationStopping(patience=100, hacking_drop=0.05)
    assert run_val(s, [0.5, 0.6, 0.3, 0.3]) is None
    ev = s.hacking_evidence()
    assert ev is not None and ev["dropped"] and ev["rise"] is None and not ev["rose"] and not ev["alarm"]
    # five train rewards in all (so their noise is known), but only two since the peak: still none measured
    t = ValidationStopping(patience=100, hacking_drop=0.05)
    t.update_val(0, 0.5)
    for step, r in ((1, 0.1), (2, 0.2), (3, 0.3)):
        t.update_train(step, r)
    t.update_val(10, 0.6)
    t.update_train(11, 0.5)
    t.update_train(12, 0.9)
    assert t.update_val(12, 0.3) is None
    ev = t.hacking_evidence()
    assert ev is not None and ev["peak_step"] == 10 and ev["dropped"]
    assert ev["rise"] is None and ev["rise_se"] is None and not ev["rose"]
    # only two train rewards in all: no noise estimate, none measured either
    u = ValidationStopping(patience=100, hacking_drop=0.05)
    u.update_val(0, 0.6)
    u.update_train(1, 0.1)
    u.update_train(2, 0.9)
    assert u.update_val(3, 0.3) is None
    ev = u.hacking_evidence()
    assert ev is not None and ev["rise"] is None and not ev["rose"]


def test_a_drop_of_exactly_the_threshold_is_not_a_drop() -> None:
    # drop 0.75 - 0.5 = 0.25 (exact in binary) against hacking_drop 0.25, while train reward rises
    def run(level: float) -> tuple[ValidationStopping, StopDecision | None]:
        s = ValidationStopping(patience=100, hacking_drop=0.25)
        s.update_val(0, 0.75)
        for step in range(1, 31):
            s.update_train(step, 0.02 * step)
        return s, s.update_val(30, level)

    s, d = run(0.5)
    ev = s.hacking_evidence()
    assert d is None and ev is not None and ev["drop"] == 0.25 and not ev["dropped"] and ev["rose"]
    _, d = run(0.4375)
    assert d is not None and d.reason == "reward_hacking"


def test_a_rise_of_exactly_its_threshold_is_not_a_rise() -> None:
    # train rewards step / 64 on steps 1..30; since the peak (steps 10..30) the fitted rise is 20 / 64 exactly
    rewards = [step / 64 for step in range(1, 31)]
    s, at = _hacking_run(rewards, hacking_min_rise=0.3125)
    ev = s.hacking_evidence()
    assert at is None and ev is not None and ev["rise"] == 0.3125 and not ev["rose"]
    _, above = _hacking_run(rewards, hacking_min_rise=0.3124)
    assert above is not None and above.reason == "reward_hacking"


def test_a_rise_of_exactly_hacking_rise_z_standard_errors_is_not_a_rise() -> None:
    # History (step: reward): 1: -2.625, 2: -0.625, 3: 0, then since the peak at step 10: 10: 0, 13: .375,
    # 14: .5, 17: .875 (slope 1/8). Successive differences 2, .625, 0, 0, .375, .125, .375: sum of squares
    # 300/64 over 6 -> sigma^2 = 300/64/12 = 25/64, sigma = 5/8. Steps 10, 13, 14, 17: sxx = 25. Rise = 7/8,
    # its se = sigma / 5 * 7 = 7/8: exactly 1 standard error.
    def run(z: float) -> tuple[ValidationStopping, StopDecision | None]:
        s = ValidationStopping(patience=100, hacking_rise_z=z)
        s.update_val(0, 0.5)
        for step, r in ((1, -2.625), (2, -0.625), (3, 0.0), (10, 0.0)):
            s.update_train(step, r)
        s.update_val(10, 0.6)
        for step, r in ((13, 0.375), (14, 0.5), (17, 0.875)):
            s.update_train(step, r)
        return s, s.update_val(17, 0.3)

    s, d = run(1.0)
    ev = s.hacking_evidence()
    assert d is None and ev is not None and ev["rise"] == 0.875 and ev["rise_se"] == 0.875 and not ev["rose"]
    _, d = run(0.999)
    assert d is not None and d.reason == "reward_hacking"


def test_level_choice_and_message_with_two_checks_after_the_peak() -> None:
    rising = [0.2 + 0.02 * i for i in range(30)]
    # a steep last drop: mean (0.58 + 0.47) / 2 is 0.075 below the peak (1.5x hacking_drop), the latest 0.13
    s, d = _hacking_run(rising, {0: 0.5, 10: 0.6, 20: 0.58, 30: 0.47})
    ev = s.hacking_evidence()
    assert d is not None and ev is not None and ev["checks_after_peak"] == 2 and ev["checks_in_level"] == 1
    assert "(the latest check)" in d.message
    # two equal checks: the mean is as far beyond its threshold as the latest, and it comes first (train reward
    # flat until step 20, so the first of them alone raises no alarm)
    late_rise = [0.2] * 20 + [0.2 + 0.02 * i for i in range(1, 11)]
    s, d = _hacking_run(late_rise, {0: 0.5, 10: 0.6, 20: 0.5, 30: 0.5})
    ev = s.hacking_evidence()
    assert d is not None and d.step == 30 and ev is not None and ev["checks_in_level"] == 2
    assert "(mean of 2 check(s) since)" in d.message
    # one check after the peak: the mean of that one
    _, d = _hacking_run(rising, {0: 0.5, 10: 0.6, 20: 0.4})
    assert d is not None and d.step == 20 and "(mean of 1 check(s) since)" in d.message


def test_with_no_drop_threshold_the_mean_level_is_used() -> None:
    # hacking_drop 0 and no val_size: every fall is beyond a zero threshold, so the mean (the first test) is kept
    # even when its fall is below 1 and the latest's above (not a proportion: val reward 5.0 at its peak)
    s = ValidationStopping(patience=100)
    run_val(s, [4.0, 5.0, 4.8, 3.9])
    ev = s.hacking_evidence()
    assert ev is not None and ev["checks_in_level"] == 2 and ev["level"] == pytest.approx(4.35)
