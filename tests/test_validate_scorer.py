"""`palaestra validate-scorer`: golden sets catch a broken scorer, listing every mismatch."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.arithmetic_data import DATA_DIR
from palaestra.envs.verifier import Score
from palaestra.evals.inputs import default_golden, load_golden, validate_scorer
from palaestra.trajectories.io import DataError, read_jsonl

EXPLOITS = DATA_DIR / "golden_exploits.jsonl"
CORRECT = DATA_DIR / "golden_correct.jsonl"


class NfkcVerifier:
    """A deliberately broken 'helpful' strict verifier: NFKC-normalises first, so lookalike digits pass."""

    name = "arith-strict-nfkc"
    version = "0-broken"

    def __init__(self) -> None:
        self.inner = StrictFinalVerifier()

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        return self.inner.score(example, unicodedata.normalize("NFKC", completion))


class Flaky:
    name = "flaky"
    version = "1"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        self.calls += 1
        if "\u200b" in completion:
            raise RuntimeError("boom")
        return Score(float(self.calls % 2), "ok", {"reason": "coin"})


def test_strict_verifier_passes_the_shipped_golden_sets() -> None:
    report = validate_scorer(StrictFinalVerifier(), outcome_field="strict_outcome")
    assert report.ok and report.checked == len(read_jsonl(CORRECT)) + len(read_jsonl(EXPLOITS))
    assert report.format().startswith("OK: scorer arith-strict@1.0.0")
    assert sorted(Path(p).name for p in report.per_file) == ["golden_correct.jsonl", "golden_exploits.jsonl"]
    assert default_golden() == [CORRECT, EXPLOITS]


def test_naive_verifier_fails_the_exploit_set() -> None:
    report = validate_scorer(NaiveVerifier(), [CORRECT, EXPLOITS])
    accepted = [g for g in read_jsonl(EXPLOITS) if g["naive_accepts"]]
    assert not report.ok and len(accepted) > 10
    assert sorted(m.case.id for m in report.mismatches) == sorted(g["id"] for g in accepted)
    assert all(m.case.path == EXPLOITS and m.reward == 1.0 for m in report.mismatches)
    text = report.format()
    assert text.startswith("FAIL") and f"{len(accepted)} mismatch(es)" in text
    first = report.mismatches[0]
    assert (
        f"{EXPLOITS}:{first.case.line}: {first.case.id} [{first.case.klass}] want reward 0, got 1 (ok)"
        in text
    )


def test_a_broken_scorer_is_caught() -> None:
    report = validate_scorer(NfkcVerifier(), [CORRECT, EXPLOITS])
    assert not report.ok
    classes = {m.case.klass for m in report.mismatches}
    assert any("unicode" in c or "lookalike" in c or "digit" in c for c in classes), classes
    for m in report.mismatches:  # each one is an exploit the real strict verifier rejects
        assert (
            m.case.want == 0.0
            and StrictFinalVerifier().score(m.case.example, m.case.completion).reward == 0.0
        )


def test_exceptions_and_nondeterminism_are_mismatches(tmp_path: Path) -> None:
    g = tmp_path / "golden_correct_small.jsonl"
    g.write_text(
        json.dumps({"id": "a", "expected_answer": "1", "completion": "Final: 1"})
        + "\n"
        + json.dumps({"id": "b", "expected_answer": "1", "completion": "Final: 1\u200b"})
        + "\n"
    )
    report = validate_scorer(Flaky(), [g])
    problems = [m.problem for m in report.mismatches]
    assert problems == ["not deterministic: two scores differ", "scorer raised RuntimeError: boom"]


def test_want_field_name_rule_and_dataset(tmp_path: Path) -> None:
    rows = [
        {"id": "x1", "completion": "Final: 5", "want": 1},
        {"id": "x2", "expected_answer": "6", "completion": "Final: 5", "want": 0, "outcome": "wrong_answer"},
    ]
    g = tmp_path / "mixed.jsonl"
    g.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = {"x1": {"id": "x1", "prompt": "What is 2+3?", "expected_answer": "5"}}
    cases = load_golden(g, dataset=dataset, outcome_field="outcome")
    assert cases[0].example == {"id": "x1", "prompt": "What is 2+3?", "expected_answer": "5"}
    assert cases[1].want_outcome == "wrong_answer" and cases[1].want == 0.0
    assert validate_scorer(StrictFinalVerifier(), [g], dataset=dataset, outcome_field="outcome").ok
    # without a want/expected_reward field, the file name decides; a name that says nothing is an error
    plain = tmp_path / "cases.jsonl"
    plain.write_text(json.dumps({"id": "p", "expected_answer": "1", "completion": "Final: 1"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{plain}:1: cannot tell the expected reward")):
        load_golden(plain)
    named = tmp_path / "my_exploits.jsonl"
    named.write_text(plain.read_text())
    assert load_golden(named)[0].want == 0.0
    bad = tmp_path / "golden_correct_bad.jsonl"
    bad.write_text('{"id": "q", "completion": 5}\n')
    with pytest.raises(DataError, match=re.escape(f"{bad}:1: field 'completion' must be a string")):
        load_golden(bad)


def test_cli(tmp_path: Path, capsys: Any) -> None:
    assert main(["validate-scorer"]) == 0
    assert capsys.readouterr().out.startswith("OK")
    assert main(["validate-scorer", "--scorer", "arith-naive-TEACHING-ONLY", "--golden", str(EXPLOITS)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and out.count(f"  - {EXPLOITS}:") == sum(
        g["naive_accepts"] for g in read_jsonl(EXPLOITS)
    )
    assert (
        main(["validate-scorer", "--scorer", "test_validate_scorer:NfkcVerifier", "--golden", str(EXPLOITS)])
        == 1
    )
    assert "arith-strict-nfkc@0-broken" in capsys.readouterr().out
    assert main(["validate-scorer", "--golden", str(tmp_path / "none.jsonl")]) == 2
    assert "file not found" in capsys.readouterr().err
    d = tmp_path / "d.jsonl"
    d.write_text('{"id": "a"}\n{"id": "a"}\n')
    assert main(["validate-scorer", "--dataset", str(d)]) == 2
    assert f"{d}:2: duplicate id 'a'" in capsys.readouterr().err


def test_golden_files_without_cases_or_a_numeric_want_and_outcome_mismatches(
    tmp_path: Path, capsys: Any
) -> None:
    empty = tmp_path / "golden_correct_empty.jsonl"
    empty.write_text("\n")
    assert main(["validate-scorer", "--golden", str(empty)]) == 2
    assert f"{empty}: golden file has no cases" in capsys.readouterr().err
    bad = tmp_path / "cases.jsonl"
    bad.write_text(
        json.dumps({"id": "w", "expected_answer": "1", "completion": "Final: 1", "want": "1"}) + "\n"
    )
    assert main(["validate-scorer", "--golden", str(bad)]) == 2
    assert f"{bad}:1: field 'want' must be a number, got '1'" in capsys.readouterr().err
    # the reward is right but the outcome code is not the one the golden row names
    rows = [
        {
            "id": "o1",
            "expected_answer": "7",
            "completion": "Final: 8",
            "want": 0,
            "strict_outcome": "wrong_answer",
        },
        {
            "id": "o2",
            "expected_answer": "7",
            "completion": "Final: 07",
            "want": 0,
            "strict_outcome": "wrong_answer",
        },
    ]
    golden = tmp_path / "outcomes.jsonl"
    golden.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["validate-scorer", "--golden", str(golden), "--outcome-field", "strict_outcome"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "1 mismatch(es)" in out
    assert f"{golden}:2: o2 [" in out and "want outcome 'wrong_answer', got 'leading_zeros'" in out
    assert main(argv[:3]) == 0  # without --outcome-field only the reward counts
