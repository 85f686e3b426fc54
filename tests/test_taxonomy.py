"""The failure taxonomy: one table, covering every outcome code the shipped verifiers can emit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from palaestra.envs import arithmetic
from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.arithmetic_data import DATA_DIR, load_split
from palaestra.envs.verifier import NO_COMPLETION
from palaestra.evals.taxonomy import (
    CATEGORIES,
    CATEGORY_MEANING,
    OUTCOME_CATEGORY,
    UNMAPPED,
    category_of,
    classify,
)
from palaestra.trajectories.io import read_jsonl

ENV_DOC = Path(__file__).parents[1] / "docs" / "environments.md"


def documented_strict_codes() -> set[str]:
    """Outcome codes from the numbered strict-verifier table of docs/environments.md (rows `| 6 | ok / x |`)."""
    codes = set()
    for line in ENV_DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| \d+ \| (`[a-z_]+`(?: / `[a-z_]+`)*) \|", line)
        if m:
            codes |= set(re.findall(r"`([a-z_]+)`", m.group(1)))
    return codes


def documented_naive_codes() -> set[str]:
    """Outcome codes listed after "Outcomes:" in the NaiveVerifier paragraph of docs/environments.md."""
    doc = ENV_DOC.read_text(encoding="utf-8")
    para = doc[doc.index("`NaiveVerifier`") :]
    para = para[para.index("Outcomes:") :]
    return set(re.findall(r"`([a-z_]+)`", para[: para.index(".")]))


def exposed_codes() -> set[str]:
    """Any code list the verifier module exposes (none today; picked up automatically if added)."""
    found: set[str] = set()
    for attr in ("OUTCOMES", "STRICT_OUTCOMES", "NAIVE_OUTCOMES", "OUTCOME_CODES"):
        value = getattr(arithmetic, attr, None)
        if value is not None:
            found |= set(value)
    for cls in (StrictFinalVerifier, NaiveVerifier):
        value = getattr(cls, "outcomes", None)
        if value is not None:
            found |= set(value)
    return found


def emitted_codes() -> set[str]:
    """Outcomes actually produced on golden sets, tricky completions and broken examples."""
    golden = read_jsonl(DATA_DIR / "golden_correct.jsonl") + read_jsonl(DATA_DIR / "golden_exploits.jsonl")
    pairs: list[tuple[Any, Any]] = [
        ({"id": g["id"], "expected_answer": g["expected_answer"]}, g["completion"]) for g in golden
    ]
    ex = load_split("dev")[0]
    gold = ex["expected_answer"]
    tricky = [
        f"Final: {gold}",
        "Final: 123456",
        "",
        "   ",
        "x" * 5000,
        "<think>unfinished",
        f"Final: {gold}\nFinal: 1",
        f"Final:\n{gold}",
        f"Final: {gold}\u200b",
        f"final: {gold}",
        f"Final:  {gold}",
        "Final: +5",
        "Final: 007",
        "Final: 4.0",
        "Final:",
        f"the answer is {gold}",
        "no number at all",
        None,
        42,
    ]
    pairs += [(ex, c) for c in tricky]
    pairs += [
        (bad, "Final: 1") for bad in (None, {}, {"expected_answer": "01"}, {"expected_answer": 1.5}, [1])
    ]
    codes = {NO_COMPLETION}
    for verifier in (StrictFinalVerifier(), NaiveVerifier()):
        for example, completion in pairs:
            codes.add(verifier.score(example, completion).outcome)  # type: ignore[arg-type]
    return codes


def test_documentation_parsers_found_the_codes() -> None:
    # guards the introspection itself: if the documentation changes shape, these sets would silently shrink
    assert {
        "ok",
        "wrong_answer",
        "invalid_example",
        "malformed",
        "leading_zeros",
    } <= documented_strict_codes()
    assert {"ok", "not_found", "invalid_example"} <= documented_naive_codes()


def test_every_shipped_outcome_code_is_in_the_table() -> None:
    codes = documented_strict_codes() | documented_naive_codes() | exposed_codes() | emitted_codes()
    missing = sorted(c for c in codes if c not in OUTCOME_CATEGORY)
    assert missing == []


def test_table_values_are_categories_and_meanings_exist() -> None:
    assert set(OUTCOME_CATEGORY.values()) <= set(CATEGORIES)
    assert "verifier_suspect" not in OUTCOME_CATEGORY.values()  # assigned per result, never by code
    for cat in (*CATEGORIES, UNMAPPED):
        assert CATEGORY_MEANING[cat]


@pytest.mark.parametrize(
    ("outcome", "category"),
    [
        ("ok", "ok"),
        ("wrong_answer", "model_math"),
        ("not_found", "model_math"),
        ("missing_prefix", "model_format"),
        ("extra_whitespace", "model_format"),
        ("not_single_line", "model_format"),
        ("leading_zeros", "model_format"),
        ("non_ascii", "model_format"),
        ("empty", "model_format"),
        ("truncated", "model_format"),
        ("too_long", "model_format"),
        ("multiple_markers", "model_format"),
        ("invalid_example", "data_invalid"),
    ],
)
def test_spec_codes_map_as_the_issue_says(outcome: str, category: str) -> None:
    assert category_of(outcome) == category


def test_unknown_codes_are_flagged_not_hidden() -> None:
    assert category_of("brand_new_code") == UNMAPPED
    assert classify("brand_new_code") == UNMAPPED


def test_suspect_overrides_the_table() -> None:
    assert classify("leading_zeros", suspect=True) == "verifier_suspect"
    assert classify("leading_zeros", suspect=False) == "model_format"
    # the naive scorer accepting an exploit the strict one rejects: the acceptance itself is suspect
    assert classify("ok", suspect=True) == "verifier_suspect"


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        OUTCOME_CATEGORY["ok"] = "model_math"  # type: ignore[index]
