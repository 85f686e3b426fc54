"""Selection lab: pass@N from one frozen policy is non-decreasing in N and agrees with the harness' best-of-N;
a short GRPO run raises pass@1; the decision rules on hand-made samples."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from palaestra.cli import main
from palaestra.evals.evaluate import select_best
from palaestra.labs.selection import SelectionConfig, SelectionResult, decision_table, run_selection_lab
from palaestra.trajectories.io import DataError


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> SelectionResult:
    cfg = SelectionConfig(examples=120, train_steps=60, seed=0)
    return run_selection_lab(cfg, tmp_path_factory.mktemp("selection") / "lab", plot=False)


def test_pass_at_n_is_nondecreasing_and_training_raises_pass_at_1(lab: SelectionResult) -> None:
    assert lab.after is not None
    for table in (lab.before, lab.after):
        values = [table.pass_at[n] for n in (1, 2, 4, 8, 16)]
        assert values == sorted(values), table.phase
        assert values[-1] > values[0]  # selection alone lifts the reported number
        assert table.majority[1] == pytest.approx(table.pass_at[1])  # N=1: every rule is one sample
        assert table.max_logprob[1] == pytest.approx(table.pass_at[1])
    assert lab.after.pass_at[1] > lab.before.pass_at[1]
    assert lab.numbers["pass@1_gain"] == pytest.approx(lab.after.pass_at[1] - lab.before.pass_at[1])
    assert lab.numbers["train_steps"] == 60 and lab.numbers["train_stop_reason"] == "max_steps"


def test_samples_agree_with_the_harness_best_of_n(lab: SelectionResult, tmp_path: Path) -> None:
    out = lab.outdir
    assert out is not None
    for phase, table in (("before", lab.before), ("after", lab.after)):
        assert table is not None
        run = select_best(out / "dataset.jsonl", out / f"samples_{phase}.jsonl", tmp_path / phase, n=16)
        assert run.summary["pass@N"] == pytest.approx(table.pass_at[16])
        assert run.summary["pass@1"] == pytest.approx(table.pass_at[1])
        assert run.manifest["sampling"]["samples_per_id"] == 16  # read from our sidecar


def test_run_folder(lab: SelectionResult) -> None:
    out = lab.outdir
    assert out is not None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["lab"] == "selection" and manifest["status"] == "finished"
    assert {"passk.csv", "dataset.jsonl", "samples_before.jsonl", "samples_after.jsonl"} <= set(
        manifest["artifacts"]
    )
    with open(out / "passk.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["phase"], int(r["N"])) for r in rows] == [
        (p, n) for p in ("before", "after") for n in (1, 2, 4, 8, 16)
    ]
    assert (out / "train" / "summary.json").is_file()
    assert "pass@N" in (out / "summary.md").read_text()


def rows_for(ex_id: str, completions: list[tuple[str, float]]) -> list[dict]:
    return [
        {"id": ex_id, "sample": i, "completion": c, "sum_logprob": lp}
        for i, (c, lp) in enumerate(completions)
    ]


def test_decision_rules_on_hand_made_samples() -> None:
    examples = [{"id": "a", "expected_answer": "5"}, {"id": "b", "expected_answer": "7"}]
    rows = rows_for("a", [("Final: 4", -1.0), ("Final: 5", -3.0), ("Final: 4", -2.0), ("Final: 5", -0.5)])
    rows += rows_for("b", [("Final: 7 ", -2.0), ("Final: 7", -1.0), ("seven", -0.1), ("Final: 8", -0.2)])
    t = decision_table("x", examples, rows, [1, 2, 4])
    # a: 2 of 4 correct; b: 2 of 4 correct ("Final: 7 " strips to the answer)
    assert t.pass_at[1] == pytest.approx(0.5)
    assert t.pass_at[4] == pytest.approx(1.0)
    # chunks of 2. a: [4, 5] tie -> first seen (4): wrong, twice; b: [7, 7] right; [none, 8] wrong
    assert t.majority[2] == pytest.approx(0.25)
    # a: [4 (-1), 5 (-3)] -> 4 wrong; [4 (-2), 5 (-0.5)] -> 5 right; b: [7,7] -> right; [seven, 8] -> wrong
    assert t.max_logprob[2] == pytest.approx(0.5)
    # N=4: a votes 4:2, 5:2 -> 4 (first seen): wrong; b: 7:2, 8:1 -> right
    assert t.majority[4] == pytest.approx(0.5)
    # a: highest is "Final: 5" (-0.5): right; b: highest is "seven" (-0.1): wrong
    assert t.max_logprob[4] == pytest.approx(0.5)
    with pytest.raises(DataError, match="fewer than N=8"):
        decision_table("x", examples, rows, [8])
    with pytest.raises(DataError, match="'c' has no samples"):
        decision_table("x", [*examples, {"id": "c", "expected_answer": "1"}], rows, [1])


def test_cli_loop_b_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sel"
    args = [
        "lab",
        "selection",
        "--outdir",
        str(out),
        "--examples",
        "12",
        "--ns",
        "1,2,4",
        "--train-steps",
        "0",
        "--quiet",
    ]
    assert main(args) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        "samples_after.jsonl" not in manifest["artifacts"]
        and manifest["numbers"]["pass@N_nondecreasing_before"]
    )
    summary = (out / "summary.md").read_text()
    try:  # the decision-rule curves of the base policy alone (no trained policy to draw)
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in summary
    else:
        assert (out / "selection.png").stat().st_size > 1000 and "selection.png" in manifest["artifacts"]
        assert "![selection.png](selection.png)" in summary
    assert main([*args[:-1], "--ns", "1,x", "--quiet"]) == 2


def test_lab_inputs_name_what_is_wrong() -> None:
    from palaestra.labs.common import arithmetic_grpo_config, parse_floats

    with pytest.raises(DataError, match=r"--ns: item 1 \('1.5'\) is not an integer"):
        parse_floats("1,1.5", field="--ns", kind=int)
    with pytest.raises(DataError, match=r"--means: item 0 \('x'\) is not a number"):
        parse_floats("x", field="--means")
    with pytest.raises(TypeError, match="unknown section"):  # a misspelt section is not dropped silently
        arithmetic_grpo_config("r", name="a", model="m", seed=0, steps=3, reward={}, valdation={"every": 1})
