"""Loop B (`palaestra select`): tie-break order, pass@k against hand-computed values, determinism, errors."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.evaluate import ranked, select_best
from palaestra.evals.inputs import SampleRow
from palaestra.trajectories.io import DataError, read_jsonl


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def examples() -> list[dict[str, Any]]:
    return load_split("dev")[:3]


@pytest.fixture
def dataset(tmp_path: Path, examples: list[dict[str, Any]]) -> Path:
    return write(tmp_path / "data.jsonl", examples)


def row(sample: int, completion: str, lp: float | None) -> SampleRow:
    return SampleRow(id="x", sample=sample, completion=completion, sum_logprob=lp, line=sample + 1)


def test_tie_break_order() -> None:
    rows = [
        row(0, "Final: 1", -9.0),  # reward 0
        row(1, "Final: 42", None),  # reward 1, no logprob: after every sample with one
        row(2, "Final: 42", -3.0),  # reward 1
        row(3, "Final: 42  ", -1.0),  # reward 1, best logprob
        row(4, "Final: 42 ", -3.0),  # reward 1, same logprob as 2 but longer
        row(5, "Final: 43", -3.0),  # reward 1 (pretend), same logprob and length as 2, later in string order
        row(6, "Final: 42", -3.0),  # identical to 2: the lower sample index wins
    ]
    rewards = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert ranked(rows, rewards) == [3, 2, 6, 5, 4, 1, 0]


def test_sum_logprob_ranks_higher_first_across_zero() -> None:
    # any finite sum_logprob is accepted; 0.0 is a value like any other (not "missing")
    rows = [
        row(0, "Final: 1", 0.0),
        row(1, "Final: 2", 0.5),
        row(2, "Final: 3", -0.5),
        row(3, "Final: 4", None),
    ]
    assert ranked(rows, [1.0, 1.0, 1.0, 1.0]) == [1, 0, 2, 3]


def samples_rows(examples: list[dict[str, Any]], plan: dict[int, list[bool]]) -> list[dict[str, Any]]:
    """Rows where ``plan[i][j]`` says if sample j of example i is correct; wrong ones get higher logprobs."""
    rows = []
    for i, ex in enumerate(examples):
        gold = int(ex["expected_answer"])
        for j, good in enumerate(plan[i]):
            text = f"Final: {gold}" if good else f"Final: {gold + 1 + j}"
            rows.append({"id": ex["id"], "sample": j, "completion": text, "sum_logprob": -1.0 - j - 5 * good})
    return rows


PLAN = {
    0: [False, True, False, False, True, True],  # first 4: c=1
    1: [True, False, True, False, False, False],  # first 4: c=2
    2: [False, False, False, False, True, True],  # first 4: c=0 (the correct ones are beyond N)
}


def test_pass_at_k_hand_computed(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]) -> None:
    samples = write(tmp_path / "s.jsonl", samples_rows(examples, PLAN))
    run = select_best(dataset, samples, tmp_path / "run", n=4)
    s = run.summary
    # per id with n=4: c=1 -> pass@1 1/4, pass@2 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1
    #                  c=2 -> pass@1 1/2, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 = 1
    #                  c=0 -> 0
    assert s["pass@1"] == pytest.approx((1 / 4 + 1 / 2 + 0) / 3)
    assert s["pass_at_k"]["2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert s["pass@N"] == s["pass@4"] == pytest.approx(2 / 3)
    assert s["pass_rate"] == pytest.approx(2 / 3)  # oracle selection: best-of-N == pass@N
    assert s["N"] == 4 and s["n_ids"] == 3 and s["all_samples"]["n"] == 12
    results = {r["id"]: r for r in read_jsonl(tmp_path / "run" / "results.jsonl")}
    first = results[examples[0]["id"]]
    assert first["chosen_sample"] == 1 and first["reward"] == 1.0 and first["n_correct"] == 1
    assert [x["sample"] for x in first["ranking"]] == [1, 0, 2, 3]  # wrong ones by logprob: -1 > -3 > -4
    # among two correct samples the higher sum_logprob wins: sample 0 (-6) beats sample 2 (-8)
    assert results[examples[1]["id"]]["chosen_sample"] == 0
    assert results[examples[2]["id"]]["reward"] == 0.0 and results[examples[2]["id"]]["pass_at_n"] == 0.0
    m = run.manifest
    assert m["loop"] == "B" and m["selection_n"] == 4 and m["samples_per_id"] == 4
    assert m["selector"]["name"] == "arith-strict" and "sum_logprob desc" in m["tie_break"]
    note = (tmp_path / "run" / "README.md").read_text()
    assert "Loop B" in note and "| selection_n | `4` |" in note
    assert "- **Knob turned:** selection: best-of-N with N=4, selector arith-strict@1.0.0" in note
    assert "- selector = scorer: oracle best-of-N, so the chosen pass rate equals pass@N" in note


def test_best_of_one_is_the_first_sample(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]
) -> None:
    samples = write(tmp_path / "s.jsonl", samples_rows(examples, PLAN))
    run = select_best(dataset, samples, tmp_path / "run", n=1, knob="first sample only")
    # the first samples of PLAN are wrong, right, wrong
    assert run.summary["N"] == 1 and run.summary["pass_rate"] == pytest.approx(1 / 3)
    assert run.summary["pass@1"] == run.summary["pass@N"] == pytest.approx(1 / 3)
    assert [r["chosen_sample"] for r in run.results] == [0, 0, 0]
    assert "- **Knob turned:** first sample only" in (tmp_path / "run" / "README.md").read_text()


def test_selection_is_deterministic(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]) -> None:
    rows = samples_rows(examples, PLAN)
    a = write(tmp_path / "a.jsonl", rows)
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    b = write(tmp_path / "b.jsonl", shuffled)  # same samples, other file order (rows carry 'sample')
    select_best(dataset, a, tmp_path / "r1", n=6)
    select_best(dataset, a, tmp_path / "r2", n=6)
    select_best(dataset, b, tmp_path / "r3", n=6)
    first = (tmp_path / "r1" / "results.jsonl").read_bytes()
    assert (
        first
        == (tmp_path / "r2" / "results.jsonl").read_bytes()
        == (tmp_path / "r3" / "results.jsonl").read_bytes()
    )
    assert (tmp_path / "r1" / "summary.json").read_bytes() == (tmp_path / "r2" / "summary.json").read_bytes()


def test_file_order_defines_samples_without_index(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]
) -> None:
    rows = [{k: v for k, v in r.items() if k != "sample"} for r in samples_rows(examples, PLAN)]
    s = write(tmp_path / "s.jsonl", rows)
    run = select_best(dataset, s, tmp_path / "run", n=4)
    assert run.summary["pass@4"] == pytest.approx(2 / 3)


def test_naive_selector_is_measured_by_the_strict_scorer(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]
) -> None:
    rows = []
    for ex in examples:
        gold = ex["expected_answer"]
        rows += [
            {
                "id": ex["id"],
                "completion": f"I think {gold}",
                "sum_logprob": -0.5,
            },  # naive accepts, strict not
            {"id": ex["id"], "completion": f"Final: {gold}", "sum_logprob": -2.0},
        ]
    s = write(tmp_path / "s.jsonl", rows)
    oracle = select_best(dataset, s, tmp_path / "oracle", n=2)
    naive = select_best(dataset, s, tmp_path / "naive", n=2, selector="arith-naive-TEACHING-ONLY")
    assert oracle.summary["pass_rate"] == 1.0
    assert naive.summary["pass_rate"] == 0.0  # naive ties at 1, logprob picks the exploit-looking one
    assert naive.summary["counts_by_category"]["verifier_suspect"] == 3
    assert naive.manifest["selector"]["name"] == "arith-naive-TEACHING-ONLY"
    assert naive.summary["pass@2"] == oracle.summary["pass@2"] == 1.0
    naive_note = (tmp_path / "naive" / "README.md").read_text()
    assert "oracle" not in naive_note and "selector arith-naive-TEACHING-ONLY@1.0.0" in naive_note


def test_errors(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], capsys: Any) -> None:
    rows = samples_rows(examples, PLAN)
    s = write(tmp_path / "s.jsonl", rows)
    with pytest.raises(
        DataError, match=re.escape(f"{s}:1: id '{examples[0]['id']}' has 6 samples, fewer than N=7")
    ):
        select_best(dataset, s, tmp_path / "run", n=7)
    dup = write(tmp_path / "dup.jsonl", [*rows, rows[3]])
    with pytest.raises(DataError, match=re.escape(f"{dup}:19: duplicate (id, sample)")):
        select_best(dataset, dup, tmp_path / "run", n=2)
    missing = write(tmp_path / "m.jsonl", rows[:12])
    with pytest.raises(DataError, match=re.escape(f"{dataset}:3: id '{examples[2]['id']}' has no sample")):
        select_best(dataset, missing, tmp_path / "run", n=2)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        select_best(dataset, s, tmp_path / "run", n=0)
    assert (
        main(
            [
                "select",
                "--dataset",
                str(dataset),
                "--samples",
                str(s),
                "--n",
                "7",
                "--outdir",
                str(tmp_path / "r"),
            ]
        )
        == 2
    )
    assert "fewer than N=7" in capsys.readouterr().err
    assert (
        main(
            [
                "select",
                "--dataset",
                str(dataset),
                "--samples",
                str(s),
                "--n",
                "4",
                "--outdir",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    assert "pass@4=0.6667" in capsys.readouterr().out
