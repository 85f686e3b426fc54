"""Property tests (hypothesis) for every shipped verifier, and the golden correct / exploit sets."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.verifier import Verifier, check_contract, shipped_verifiers
from palaestra.trajectories.io import read_jsonl

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "palaestra" / "envs" / "data" / "arithmetic"
STRICT = StrictFinalVerifier()
NAIVE = NaiveVerifier()
VERIFIERS = [*shipped_verifiers(), StrictFinalVerifier(max_chars=32), NaiveVerifier(max_chars=64)]
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INVISIBLE = (
    "\u200b\u200c\u200d\u2060\ufeff\u00ad\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
LOOKALIKES = (
    "\uff10\uff14\uff12\u0664\u0662\u06f4\u096a\U0001d7d2"  # digits
    "\u2074\u00b2\u2082\u2463\u0456\u0430\u03b9\uff1a\u2212"  # scripts, circled, letters, colon, minus
)
SPACES = " \t\n\r\f\v\u00a0\u3000\u2028\u2029\x85"
FRAGMENTS = [
    "Final:",
    "Final: ",
    "final:",
    "42",
    "-",
    "+",
    "0",
    "7",
    "<think>",
    "</think>",
    "\n",
    " ",
    "\t",
    ".",
    "\\boxed{",
    "}",
    "<move>",
    "</move>",
]

any_char = st.one_of(
    st.characters(),  # every code point except surrogates
    st.characters(categories=["Cs"]),  # lone surrogates, legal in a Python str
    st.sampled_from(INVISIBLE + LOOKALIKES + SPACES),
)
unicode_text = st.text(any_char, max_size=80)
structured_text = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(any_char, max_size=3)), max_size=12
).map("".join)
completions = st.one_of(unicode_text, structured_text)
canonical_ints = st.integers(min_value=-(10**30), max_value=10**30)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(any_char, max_size=10),
    st.binary(max_size=5),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
examples = st.one_of(
    junk,
    st.fixed_dictionaries({"expected_answer": junk}),
    st.fixed_dictionaries({"id": junk, "prompt": junk, "expected_answer": st.one_of(junk, canonical_ints)}),
    canonical_ints.map(lambda n: {"expected_answer": str(n)}),
)


@pytest.mark.parametrize("verifier", VERIFIERS, ids=lambda v: f"{v.name}@{v.version}")
@PROPS
@given(example=examples, completion=st.one_of(completions, junk))
def test_total_and_deterministic_on_anything(verifier: Verifier, example: Any, completion: Any) -> None:
    assert check_contract(verifier, [example], [completion], repeats=2) == 1
    result = verifier.score(example, completion)
    assert result.reward in (0.0, 1.0)
    assert (result.reward == 1.0) == (result.outcome == "ok")


@PROPS
@given(n=canonical_ints, left=st.text(" \t\n\r\f\v", max_size=4), right=st.text(" \t\n\r\f\v", max_size=4))
def test_strict_accepts_exactly_the_canonical_line(n: int, left: str, right: str) -> None:
    example = {"expected_answer": str(n)}
    result = STRICT.score(example, f"{left}Final: {n}{right}")
    assert (result.outcome, result.details["parsed"]) == ("ok", str(n))
    assert STRICT.score({"expected_answer": n}, f"Final: {n}").reward == 1.0
    assert STRICT.score(example, f"Final: {n + 1}").outcome == "wrong_answer"


@PROPS
@given(n=canonical_ints, data=st.data())
def test_any_non_ascii_insertion_breaks_a_correct_answer(n: int, data: st.DataObject) -> None:
    line = f"Final: {n}"
    char = data.draw(any_char.filter(lambda c: ord(c) > 127))
    pos = data.draw(st.integers(min_value=0, max_value=len(line)))
    assert STRICT.score({"expected_answer": str(n)}, line[:pos] + char + line[pos:]).reward == 0.0


@PROPS
@given(n=canonical_ints, extra=st.text(any_char, min_size=1, max_size=20), before=st.booleans())
def test_any_extra_line_breaks_a_correct_answer(n: int, extra: str, before: bool) -> None:
    assume("think>" not in extra)  # "</think>\nFinal: 0" is legitimately correct
    if not extra.strip(" \t\n\r\f\v"):
        extra += "x"
    text = f"{extra}\nFinal: {n}" if before else f"Final: {n}\n{extra}"
    assert STRICT.score({"expected_answer": str(n)}, text).reward == 0.0


@PROPS
@given(example=examples, completion=completions)
def test_strict_acceptance_implies_naive_acceptance(example: Any, completion: str) -> None:
    strict = STRICT.score(example, completion)
    if strict.reward == 1.0:
        assert NAIVE.score(example, completion).reward == 1.0
        region = completion.rsplit("</think>", 1)[-1].strip(" \t\n\r\f\v")
        assert region == f"Final: {strict.details['expected']}"


# ---------------------------------------------------------------- golden sets

REQUIRED_CLASSES = {
    "several_answers",
    "number_spray",
    "unicode_digits",
    "letter_lookalike",
    "invisible_chars",
    "whitespace",
    "sign",
    "leading_zeros",
    "hidden_in_reasoning",
    "grader_note",
    "huge",
    "empty",
}
FIELDS = {
    "id",
    "class",
    "expected_answer",
    "completion",
    "expected_reward",
    "strict_outcome",
    "naive_accepts",
    "why",
}


def _golden(name: str) -> list[dict[str, Any]]:
    rows = read_jsonl(GOLDEN_DIR / name)
    for row in rows:
        assert set(row) == FIELDS, row["id"]
        assert isinstance(row["why"], str) and len(row["why"]) > 10, row["id"]
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({(repr(r["expected_answer"]), r["completion"]) for r in rows}) == len(rows), "duplicate cases"
    return rows


def test_golden_correct_all_score_one() -> None:
    rows = _golden("golden_correct.jsonl")
    assert len(rows) >= 15
    for row in rows:
        result = STRICT.score(row, row["completion"])
        assert (row["expected_reward"], result.reward, result.outcome) == (1.0, 1.0, "ok"), (
            row["id"],
            result,
        )
        assert NAIVE.score(row, row["completion"]).reward == 1.0, row["id"]
        assert row["naive_accepts"] is True


def test_golden_exploits_all_score_zero_with_the_recorded_outcome() -> None:
    rows = _golden("golden_exploits.jsonl")
    assert len(rows) >= 40
    classes = Counter(r["class"] for r in rows)
    assert set(classes) >= REQUIRED_CLASSES, REQUIRED_CLASSES - set(classes)
    for row in rows:
        result = STRICT.score(row, row["completion"])
        assert row["expected_reward"] == 0.0
        assert result.reward == 0.0, (row["id"], row["why"])
        assert result.outcome == row["strict_outcome"], (row["id"], result.details["reason"])
    outcomes = {r["strict_outcome"] for r in rows}
    assert {
        "multiple_markers",
        "not_single_line",
        "non_ascii",
        "missing_prefix",
        "extra_whitespace",
        "bad_sign",
        "leading_zeros",
        "malformed",
        "wrong_answer",
        "truncated",
        "empty",
        "too_long",
    } <= outcomes


def test_golden_exploits_record_what_the_naive_verifier_accepts() -> None:
    rows = _golden("golden_exploits.jsonl")
    for row in rows:
        accepted = NAIVE.score(row, row["completion"]).reward == 1.0
        assert accepted is row["naive_accepts"], (row["id"], row["completion"][:60])
    fooled = sum(r["naive_accepts"] for r in rows)
    assert fooled >= len(rows) // 2, "the teaching verifier should be fooled by most exploits"


@pytest.mark.parametrize(
    "text",
    [
        "Final: 42" + "\n" * 10_000,
        " " * 10_000 + "Final: 42",
        "Final: " + "9" * 10_000,
        "42 " * 100_000,
        "<think>" + "Final: 42 " * 50_000 + "</think>Final: 42",
        "\u200b" * 20_000 + "Final: 42",
    ],
    ids=["trailing-newlines", "leading-spaces", "giant-int", "spray-300k", "giant-think", "zero-width-flood"],
)
def test_huge_inputs_score_zero(text: str) -> None:
    result = STRICT.score({"expected_answer": "42"}, text)
    assert (result.reward, result.outcome) == (0.0, "too_long")
