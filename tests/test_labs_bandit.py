"""Bandit lab: baseline variance, lr sign and size, the --slow trace, and the CLI's run folder."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import numpy as np
import pytest

from palaestra.cli import main
from palaestra.labs.bandit import (
    BanditConfig,
    compare_bandit,
    measure_gradient_variance,
    run_bandit_lab,
    train_bandit,
)


def read_csv(path) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_baseline_reduces_gradient_variance_on_the_same_pulls(seed: int) -> None:
    cfg = BanditConfig(seed=seed)
    at_start = measure_gradient_variance(cfg, samples=1500)
    assert at_start.var_with < at_start.var_without
    assert at_start.noise_to_signal_with < at_start.noise_to_signal_without
    # also at a policy that already prefers some arm
    skewed = measure_gradient_variance(cfg, [0.0, 1.0, 0.5, -0.5, 1.5], samples=1500)
    assert skewed.var_with < skewed.var_without


def test_estimators_aim_at_the_exact_gradient() -> None:
    cfg = BanditConfig(adv_mode="rloo", batch=4)
    gv = measure_gradient_variance(cfg, samples=6000)
    exact = np.array(gv.exact_grad)
    assert np.abs(np.array(gv.mean_with) - exact).max() < 0.01  # rloo: unbiased
    assert np.abs(np.array(gv.mean_without) - exact).max() < 0.015  # no baseline: unbiased, noisier
    dr = measure_gradient_variance(replace(cfg, adv_mode="dr_grpo"), samples=6000)
    # dr_grpo's mean includes the pull itself: (B-1)/B of the exact gradient
    assert np.abs(np.array(dr.mean_with) - 0.75 * exact).max() < 0.01


def test_positive_lr_learns_and_negative_lr_learns_the_wrong_way() -> None:
    cfg = BanditConfig(steps=150)
    up = train_bandit(cfg)
    down = train_bandit(replace(cfg, lr=-cfg.lr))
    assert up.best_prob[0] == pytest.approx(0.2)
    assert up.best_prob[-1] > 0.9
    assert down.best_prob[-1] < 0.05
    assert down.expected_reward()[-1] < down.expected_reward()[0]


def test_too_large_lr_collapses_and_sometimes_onto_a_wrong_arm() -> None:
    table, runs = compare_bandit(BanditConfig(steps=60), seeds=12)
    rows = {r.variant: r for r in table}
    assert set(rows) == {"baseline", "no-baseline", "negative-lr", "large-lr"}
    assert rows["large-lr"].lr == pytest.approx(50.0)
    assert rows["large-lr"].collapse_rate == 1.0
    assert rows["large-lr"].wrong_lockin_rate > rows["baseline"].wrong_lockin_rate
    assert rows["large-lr"].final_best_prob_min < 0.01
    assert rows["negative-lr"].final_best_prob_mean < rows["baseline"].final_best_prob_mean
    assert rows["large-lr"].update_var_at_start == pytest.approx(2500 * rows["large-lr"].grad_var_at_start)
    assert len(runs["baseline"]) == 12


def test_uses_the_trainer_advantage_function(monkeypatch: pytest.MonkeyPatch) -> None:
    import palaestra.trainer.advantages as adv

    calls: list[str] = []
    real = adv.group_advantages

    def spy(rewards, mode="grpo", eps=1e-4, **kw):  # type: ignore[no-untyped-def]
        calls.append(mode)
        return real(rewards, mode, eps, **kw)

    monkeypatch.setattr(adv, "group_advantages", spy)
    train_bandit(BanditConfig(steps=5, adv_mode="rloo"))
    assert calls == ["rloo"] * 5
    calls.clear()
    train_bandit(BanditConfig(steps=5, baseline=False))
    assert calls == []


def test_slow_trace_shows_sign_of_advantage_moving_the_pulled_arm() -> None:
    lines: list[str] = []
    run = train_bandit(BanditConfig(steps=6, batch=4), record_pulls=True, print_fn=lines.append)
    assert len(run.pulls) == 24
    assert sum("pull" in line for line in lines) == 24
    assert "baseline=" in lines[0] and "A=" in lines[0] and "p[arm]" in lines[0]
    for row in run.pulls:
        if row["advantage"] != 0:  # lr > 0: a pull alone moves its arm in the direction of its advantage
            assert np.sign(row["dp_this_pull"]) == np.sign(row["advantage"])
        assert row["baseline"] == pytest.approx(row["reward"] - row["advantage"])  # dr_grpo: r - mean


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="batch"):
        BanditConfig(batch=1)
    with pytest.raises(ValueError, match="means"):
        BanditConfig(means=(0.5, 1.5))
    with pytest.raises(ValueError, match="adv_mode"):
        BanditConfig(adv_mode="ppo")
    BanditConfig(batch=1, baseline=False)  # fine without a baseline


def test_api_result_numbers_match_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = run_bandit_lab(BanditConfig(steps=40), tmp_path / "run", plot=False, variance_samples=400)
    assert res.numbers["final_best_prob"] == pytest.approx(float(res.run.best_prob[-1]))
    assert res.numbers["grad_var_with_baseline"] < res.numbers["grad_var_without_baseline"]
    rows = read_csv(tmp_path / "run" / "steps.csv")
    assert len(rows) == 41
    assert float(rows[-1]["p_best"]) == pytest.approx(res.numbers["final_best_prob"])


def test_cli_writes_every_artifact(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bandit"
    argv = ["lab", "bandit", "--outdir", str(out), "--steps", "30", "--seed", "3", "--lr", "0.5"]
    argv += ["--compare", "--compare-seeds", "3", "--variance-samples", "300", "--slow"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "pull" in printed and "Gradient variance" in printed
    for name in ("manifest.json", "summary.md", "README.md", "steps.csv", "pulls.jsonl", "compare.csv"):
        assert (out / name).is_file(), name
    assert (out / "gradient_variance.csv").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["lab"] == "bandit" and manifest["seed"] == 3 and manifest["status"] == "finished"
    assert manifest["knobs"]["lr"] == 0.5 and manifest["knobs"]["baseline"] is True
    assert manifest["knobs"]["compare_seeds"] == 3
    assert {"palaestra", "git", "python"} <= set(manifest["code"])
    assert manifest["command_line"] and manifest["created"]
    assert set(manifest["sha256"]) == set(manifest["artifacts"])
    summary = (out / "summary.md").read_text()
    var_with = manifest["numbers"]["grad_var_with_baseline"]
    assert var_with < manifest["numbers"]["grad_var_without_baseline"]
    assert f"{var_with:.4g}" in summary
    assert "large-lr" in summary
    assert "Knob turned" in (out / "README.md").read_text()
    assert len(read_csv(out / "compare.csv")) == 4
    try:
        import matplotlib  # noqa: F401

        assert (out / "bandit.png").stat().st_size > 1000
    except ImportError:
        assert "matplotlib is not installed" in summary

    # a second run into the same folder replaces the first one
    assert main(["lab", "bandit", "--outdir", str(out), "--steps", "5", "--no-plot", "--quiet"]) == 0
    assert not (out / "compare.csv").exists() and not (out / "bandit.png").exists()
    # a folder holding something else is refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["lab", "bandit", "--outdir", str(other), "--steps", "5", "--no-plot"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "mine"


def test_gaussian_rewards_are_the_arm_mean_plus_noise() -> None:
    cfg = BanditConfig(reward="gaussian", means=(-1.0, 0.5, 3.0), noise=0.5, steps=60, batch=8)
    run = train_bandit(cfg, record_pulls=True)
    by_arm: dict[int, list[float]] = {}
    for row in run.pulls:
        by_arm.setdefault(row["arm"], []).append(row["reward"])
    assert set(by_arm) == {0, 1, 2}
    rewards = [r for rs in by_arm.values() for r in rs]
    assert len(set(rewards)) == len(rewards) and min(rewards) < 0  # continuous, not 0/1
    for arm, rs in by_arm.items():
        if len(rs) >= 20:
            assert np.mean(rs) == pytest.approx(cfg.arm_means()[arm], abs=4 * 0.5 / np.sqrt(len(rs)))
            assert np.std(rs) == pytest.approx(0.5, rel=0.35)
    assert run.best_prob[-1] > 0.95  # the arm paying 3 wins


def test_summary_explains_negative_lr_wrong_lockin_and_grpo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = BanditConfig(means=(0.2, 0.8), lr=-2.0, steps=150, adv_mode="grpo", seed=1)
    res = run_bandit_lab(cfg, tmp_path / "neg", plot=True, variance_samples=200)
    assert res.run.locked_on == 0 and res.run.wrong_lockin
    summary = (tmp_path / "neg" / "summary.md").read_text()
    assert "- The lr is negative: every step moves against the gradient" in summary
    assert "- The policy collapsed onto arm 0, which is not the best arm." in summary
    assert "- grpo divides each group by its std" in summary and "dr_grpo's baseline" not in summary
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in summary
    else:
        assert (tmp_path / "neg" / "bandit.png").stat().st_size > 1000 and "![bandit.png]" in summary
    res = run_bandit_lab(BanditConfig(steps=20), tmp_path / "pos", plot=False, variance_samples=200)
    summary = (tmp_path / "pos" / "summary.md").read_text()
    assert not res.run.wrong_lockin and "negative" not in summary and "collapsed" not in summary
    assert "grpo divides" not in summary and "dr_grpo's baseline includes the pull itself" in summary
