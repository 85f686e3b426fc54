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


def test_compare_credit_records_both_turn_credits(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "credit"
    argv = ["lab", "two-step", "--outdir", str(out), "--steps", "150", "--no-plot", "--rewards", "1,0,1,0"]
    argv += ["--step1-rewards", "0.5,0", "--turn-credit", "returns", "--compare-credit"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "(turn credit returns): p(A) 0.5 -> " in printed and "(turn credit final): p(A) 0.5 -> " in printed
    manifest = json.loads((out / "manifest.json").read_text())
    knobs = manifest["knobs"]
    assert knobs["compare_credit"] is True and knobs["compare"] is False and knobs["turn_credit"] == "returns"
    n = manifest["numbers"]
    assert n["turn_credit"] == "returns" and n["other.turn_credit"] == "final"
    assert n["final_p_A"] > 0.9 > n["other.final_p_A"]  # only per-turn credit learns the first choice
    rows = read_csv(out / "steps.csv")
    assert {r["turn_credit"] for r in rows} == {"returns", "final"} and len(rows) == 2 * 151
    assert "Knob turned:** turn_credit (returns vs final, same seed)" in (out / "README.md").read_text()
    assert "## Final vs per-turn credit (compare.csv)" in (out / "summary.md").read_text()
    # one second run at a time
    assert main([*argv, "--compare"]) == 2
    assert "compare_credit: cannot be combined with compare, got True" in capsys.readouterr().err


def test_slow_trace_has_one_line_per_step() -> None:
    lines: list[str] = []
    rewards = (1.0, 0.0, 0.4, 0.2)
    cfg = TwoStepConfig(steps=5, batch=8, credit_step1=False, rewards=rewards)
    run = train_two_step(cfg, print_fn=lines.append)
    assert len(lines) == 5 and lines[0].startswith("step    0: paths {")
    for step, line in enumerate(lines):
        counts = json.loads(line.split("paths ")[1].split("}")[0].replace("'", '"') + "}")
        assert list(counts) == ["AX", "AY", "BX", "BY"] and sum(counts.values()) == 8
        # the paths taken are the ones that paid the step's mean reward
        mean = sum(n * r for n, r in zip(counts.values(), rewards)) / 8
        assert mean == pytest.approx(run.mean_reward[step]) and f"mean r={mean:.3f}" in line
        assert "(dropped)" in line
    assert f"p(A) 0.500->{run.pi1[1, 0]:.3f}" in lines[0]
