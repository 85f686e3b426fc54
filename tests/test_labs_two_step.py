"""Two-step lab: the end reward must credit the first choice, or the first choice never learns."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from palaestra.cli import main
from palaestra.labs.two_step import TwoStepConfig, expected_reward, run_two_step_lab, train_two_step


def read_csv(path) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step1_stays_uniform_without_credit_and_learns_with_it(seed: int) -> None:
    cfg = TwoStepConfig(steps=200, seed=seed)
    credit = train_two_step(cfg)
    blind = train_two_step(TwoStepConfig(steps=200, seed=seed, credit_step1=False))
    # without credit: the first choice stays at its initial uniform distribution while step 2 learns
    assert np.abs(blind.p_first_a - 0.5).max() < 0.02
    assert blind.pi2[-1, 0, 0] > 0.9
    # the step-1 signal was there (A is better on average) and was thrown away
    assert blind.step1_grad[:, 0].mean() > 0.05
    # with credit: both steps learn the best path A -> X
    assert credit.p_first_a[-1] > 0.9
    assert credit.pi2[-1, 0, 0] > 0.9
    assert credit.expected_reward()[-1] > 0.95
    assert blind.expected_reward()[-1] < 0.75
    assert credit.expected_reward()[-1] - blind.expected_reward()[-1] > 0.2


def test_expected_reward_formula() -> None:
    table = TwoStepConfig().table()
    assert expected_reward(np.array([0.5, 0.5]), np.full((2, 2), 0.5), table) == pytest.approx(0.45)
    learnt = np.array([[1.0, 0.0], [0.5, 0.5]])
    assert expected_reward(np.array([1.0, 0.0]), learnt, table) == pytest.approx(1.0)


def test_api_compare_and_numbers() -> None:
    res = run_two_step_lab(TwoStepConfig(steps=150, credit_step1=False), compare=True)
    assert res.other is not None and res.other.config.credit_step1
    assert res.numbers["final_p_A"] == pytest.approx(0.5, abs=0.02)
    assert res.numbers["other.final_p_A"] > 0.9
    assert res.numbers["final_regret"] > res.numbers["other.final_regret"]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="rewards"):
        TwoStepConfig(rewards=(1.0, 0.0, 0.4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch"):
        TwoStepConfig(batch=1)


def test_cli_writes_every_artifact(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "two"
    argv = ["lab", "two-step", "--outdir", str(out), "--steps", "120", "--no-credit-step1", "--compare"]
    assert main([*argv, "--seed", "5"]) == 0
    assert "WITHOUT step-1 credit" in capsys.readouterr().out
    for name in ("manifest.json", "summary.md", "README.md", "steps.csv", "compare.csv"):
        assert (out / name).is_file(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["lab"] == "two-step" and manifest["seed"] == 5
    assert manifest["knobs"]["credit_step1"] is False and manifest["knobs"]["rewards"] == [1.0, 0.0, 0.4, 0.4]
    rows = read_csv(out / "compare.csv")
    by_credit = {r["credit_step1"]: r for r in rows}
    assert float(by_credit["False"]["final_p_A"]) == pytest.approx(0.5, abs=0.02)
    assert float(by_credit["True"]["final_p_A"]) > 0.9
    summary = (out / "summary.md").read_text()
    assert "thrown away" in summary and f"{manifest['numbers']['final_expected_reward']:.4g}" in summary
    try:
        import matplotlib  # noqa: F401

        assert (out / "two_step.png").is_file()
    except ImportError:
        assert "matplotlib is not installed" in summary


def test_cli_bad_rewards_names_the_option(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["lab", "two-step", "--outdir", str(tmp_path / "x"), "--rewards", "1,0,zero,0.4"])
    assert rc == 2
    assert "--rewards" in capsys.readouterr().err
