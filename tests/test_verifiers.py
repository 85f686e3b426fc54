"""Verifier protocol, strict and naive arithmetic verifiers, the contract checker and VerifierReward."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

from palaestra.envs.arithmetic import (
    DEFAULT_MAX_CHARS,
    NaiveVerifier,
    StrictFinalVerifier,
    canonical_answer,
)
from palaestra.envs.arithmetic_data import all_problems, make_problem
from palaestra.envs.verifier import (
    SHIPPED,
    ContractViolation,
    Score,
    Verifier,
    VerifierReward,
    check_contract,
    get_verifier,
    safe_repr,
    shipped_verifiers,
)
from palaestra.trajectories import RewardFunction, Trajectory, TrajectoryGroup

STRICT = StrictFinalVerifier()
NAIVE = NaiveVerifier()
EX = {"id": "t-1", "prompt": "What is 40+2? Reply with one line: Final: <int>", "expected_answer": "42"}


def strict(completion: Any, expected: Any = "42") -> Score:
    return STRICT.score({"id": "x", "prompt": "p", "expected_answer": expected}, completion)


# ---------------------------------------------------------------- protocol, registry, contract checker


def test_shipped_verifiers_satisfy_protocol_and_are_versioned() -> None:
    verifiers = shipped_verifiers()
    assert sorted(v.name for v in verifiers) == sorted(SHIPPED)
    for v in verifiers:
        assert isinstance(v, Verifier)
        assert v.version.count(".") >= 2
    assert "TEACHING-ONLY" in NAIVE.name
    assert (STRICT.name, STRICT.version) == ("arith-strict", "1.0.0")
    with pytest.raises(KeyError, match="arith-strict"):
        get_verifier("no-such-verifier")


JUNK_EXAMPLES: list[Any] = [
    EX,
    {"expected_answer": -7},
    {"expected_answer": "0"},
    {},
    {"expected_answer": None},
    {"expected_answer": True},
    {"expected_answer": 42.0},
    {"expected_answer": "042"},
    {"expected_answer": "-0"},
    {"expected_answer": " 42"},
    {"expected_answer": ["42"]},
    {"expected_answer": 10**5000},
    None,
    42,
    "42",
    ["expected_answer", "42"],
]
JUNK_COMPLETIONS: list[Any] = [
    "Final: 42",
    "Final: -7",
    "Final: 0",
    "",
    "<think>",
    "</think>",
    "Final: ４２",
    "\ud800",
    "Final: 42\x00",
    None,
    42,
    b"Final: 42",
    "x" * (DEFAULT_MAX_CHARS + 1),
]


@pytest.mark.parametrize("verifier", shipped_verifiers(), ids=lambda v: v.name)
def test_every_shipped_verifier_keeps_the_contract(verifier: Verifier) -> None:
    assert check_contract(verifier, JUNK_EXAMPLES, JUNK_COMPLETIONS) == len(JUNK_EXAMPLES) * len(
        JUNK_COMPLETIONS
    )


class _Raises:
    name, version = "raises", "0.1.0"

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        return Score(float(len(completion)), "ok", {"reason": "length"})  # TypeError on None


class _Flaky:
    name, version = "flaky", "0.1.0"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        self.calls += 1
        return Score(0.0, "ok", {"reason": "counts calls", "n": self.calls})


class _Mute:
    name, version = "mute", "0.1.0"

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        return Score(0.0, "ok", {})


@pytest.mark.parametrize(
    ("verifier", "message"),
    [(_Raises(), "raised TypeError"), (_Flaky(), "not deterministic"), (_Mute(), "reason")],
)
def test_check_contract_catches_broken_verifiers(verifier: Any, message: str) -> None:
    with pytest.raises(ContractViolation, match=message) as caught:
        check_contract(verifier, [EX], ["Final: 42", None])
    if isinstance(verifier, _Raises):  # the verifier's own traceback stays reachable
        assert isinstance(caught.value.__cause__, TypeError)


class _Returns:
    """A verifier that answers every pair with one fixed result (whatever it is)."""

    def __init__(self, result: Any, name: Any = "fixed", version: Any = "0.1.0") -> None:
        self.result, self.name, self.version = result, name, version

    def __repr__(self) -> str:
        return f"_Returns({self.name!r})"

    def score(self, example: Mapping[str, Any], completion: str) -> Any:
        return self.result


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        (_Returns(Score(0.0, "ok", {"reason": "r"}), name=""), r"_Returns\(''\): name and version must be"),
        (_Returns(Score(0.0, "ok", {"reason": "r"}), version=None), "name and version must be non-empty"),
        (_Returns({"reward": 1.0, "outcome": "ok"}), "returned dict, not Score"),
        (_Returns(Score(1, "ok", {"reason": "r"})), "reward 1 is not a finite float"),  # type: ignore[arg-type]
        (_Returns(Score(float("nan"), "ok", {"reason": "r"})), "reward nan is not a finite float"),
        (_Returns(Score(0.0, "", {"reason": "r"})), "outcome '' is not a non-empty string"),
        (_Returns(Score(0.0, "ok", {"reason": ""})), "details lack a 'reason' sentence"),
        (_Returns(Score(0.0, "ok", {"reason": 3})), "details lack a 'reason' sentence"),
        (_Returns(Score(0.0, "ok", [("reason", "r")])), "details is list, not dict"),  # type: ignore[arg-type]
        (_Returns(Score(0.0, "ok", {"reason": "r", "x": float("inf")})), "details are not JSON-serialisable"),
        (_Returns(Score(0.0, "ok", {"reason": "r", "when": time})), "details are not JSON-serialisable"),
    ],
)
def test_check_contract_names_each_kind_of_bad_result(verifier: Any, message: str) -> None:
    with pytest.raises(ContractViolation, match=message):
        check_contract(verifier, [EX], ["Final: 42"])


class _Counting:
    name, version = "counting", "0.1.0"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        self.calls += 1
        return Score(0.0, "ok", {"reason": "the same every time"})


@pytest.mark.parametrize(("repeats", "per_pair"), [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_check_contract_scores_each_pair_repeats_times(repeats: int, per_pair: int) -> None:
    counting = _Counting()
    assert check_contract(counting, [EX, {"expected_answer": 1}], ["a", "b", "c"], repeats=repeats) == 6
    assert counting.calls == 6 * per_pair


def test_safe_repr_cuts_only_past_the_limit() -> None:
    assert safe_repr("x" * 198) == "'" + "x" * 198 + "'"  # a repr of exactly 200 characters is kept
    assert safe_repr("x" * 199) == "'" + "x" * 196 + "..."  # 201 characters: cut to 200
    assert safe_repr(12345, limit=5) == "12345" and safe_repr(123456, limit=5) == "12..."


def test_check_contract_wants_invalid_example_for_a_non_mapping_example() -> None:
    lax = _Returns(Score(0.0, "wrong_answer", {"reason": "r"}))
    assert check_contract(lax, [EX], ["Final: 42", "x"]) == 2  # fine on mapping examples
    with pytest.raises(
        ContractViolation, match=r"fixed@0\.1\.0 on example=\['a'\] .*: non-mapping example gave "
    ):
        check_contract(lax, [EX, ["a"]], ["Final: 42"])
    strict_ok = _Returns(Score(0.0, "invalid_example", {"reason": "r"}))
    assert check_contract(strict_ok, [["a"], None], ["Final: 42"]) == 2


# ---------------------------------------------------------------- strict verifier: the precedence table


@pytest.mark.parametrize(
    ("completion", "outcome"),
    [
        ("Final: 42", "ok"),
        ("Final: 41", "wrong_answer"),
        ("x" * (DEFAULT_MAX_CHARS + 1), "too_long"),
        ("<think>Final: 42", "truncated"),
        ("<think>a</think>b<think>Final: 42", "truncated"),
        ("   \n\t", "empty"),
        ("<think>42</think>  \n", "empty"),
        ("Final: 41\nFinal: 42", "multiple_markers"),
        ("reasoning\nFinal: 42", "not_single_line"),
        ("Final: 42\rjunk", "not_single_line"),
        ("Final: \uff14\uff12", "non_ascii"),
        ("Answer: 42", "missing_prefix"),
        ("Final:  42", "extra_whitespace"),
        ("Final: 4 2", "extra_whitespace"),
        ("Final:  4.2", "extra_whitespace"),  # two spaces after the marker: row 11 before row 14
        ("Final: \t4.2", "extra_whitespace"),
        ("Final: +42", "bad_sign"),
        ("Final: -0", "bad_sign"),
        ("Final: 042", "leading_zeros"),
        ("Final:42", "malformed"),
        ("Final: 42.0", "malformed"),
        # precedence between rows
        ("Final: 41\nFinal: \uff14\uff12", "multiple_markers"),  # markers before lines/non-ASCII
        ("Fin\u0430l: 42\nFinal: 42", "not_single_line"),  # lines before non-ASCII
        ("final:  042", "missing_prefix"),  # prefix before spacing and zeros
        ("<think>" + "x" * DEFAULT_MAX_CHARS, "too_long"),  # length before truncation
    ],
)
def test_strict_outcomes_follow_the_documented_precedence(completion: str, outcome: str) -> None:
    result = strict(completion)
    assert result.outcome == outcome, result.details["reason"]
    assert result.reward == (1.0 if outcome == "ok" else 0.0)
    assert {"expected", "parsed", "reason"} <= set(result.details)
    assert result.details["expected"] == "42"
    assert (result.details["parsed"] is not None) == (outcome in ("ok", "wrong_answer"))


def test_every_outcome_code_in_the_documented_table_is_reachable() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "environments.md").read_text(encoding="utf-8")
    rows = [
        line.split("|") for line in doc.splitlines() if line.startswith("| ") and line[2:4].strip().isdigit()
    ]
    table_codes = {row[2].split()[0].strip("`") for row in rows}
    assert len(rows) == 14 and "ok" in table_codes
    table_codes |= {"wrong_answer"}
    doc = StrictFinalVerifier.__doc__ or ""
    assert all(code in doc for code in table_codes)  # the class docstring names them all
    reached = {
        strict(c).outcome
        for c in [
            "Final: 42",
            "Final: 1",
            "x" * 5000,
            "<think>",
            "",
            "Final: 1\nFinal: 2",
            "a\nb",
            "é",
            "42",
            "Final:  1",
            "Final: +1",
            "Final: 01",
            "Final:1",
        ]
    }
    reached |= {strict(None).outcome, STRICT.score(None, "Final: 42").outcome}  # type: ignore[arg-type]
    assert table_codes == reached


def test_details_explain_non_ascii_and_length() -> None:
    d = strict("Final: 4\u200b2").details
    assert (d["char"], d["position"]) == ("U+200B", 8)
    assert "U+200B" in d["reason"]
    # DEL (U+007F) is ASCII, so the first non-ASCII character is the one after it; U+0080 is the smallest
    d = strict("Final: \x7f4\u00e92").details
    assert (d["char"], d["position"]) == ("U+00E9", 9)
    d = strict("Final: 4\x802").details
    assert (d["char"], d["position"]) == ("U+0080", 8)
    d = strict("9" * 5000).details
    assert (d["length"], d["max_chars"]) == (5000, DEFAULT_MAX_CHARS)
    d = strict("Final: 1\nFinal: 1\nFinal: 1").details
    assert d["markers"] == 3
    assert strict("Final: 4 x").details["reason"] == (
        "the answer after 'Final: ' must be a bare integer and nothing else"
    )


def test_strip_is_ascii_only_and_think_region_is_after_last_close() -> None:
    assert strict(" \t\r\n\f\vFinal: 42\n\v\f").reward == 1.0
    assert strict("\u00a0Final: 42").outcome == "non_ascii"  # NBSP is not stripped
    assert strict("<think>Final: 41</think>\n<think>x</think>\nFinal: 42").reward == 1.0
    assert strict("<think>Final: 42</think>Final: 41").outcome == "wrong_answer"
    assert strict("so it is 42 </think>Final: 42").reward == 1.0  # <think> was in the prompt


def test_length_cap_is_exact_and_versioned() -> None:
    padded = "Final: 42".ljust(DEFAULT_MAX_CHARS)
    assert strict(padded).outcome == "ok"
    assert strict(padded + " ").outcome == "too_long"
    small = StrictFinalVerifier(max_chars=16)
    assert small.version == "1.0.0+max_chars=16"
    assert small.score(EX, "Final: 42" + " " * 7).outcome == "ok"
    assert small.score(EX, "Final: 42" + " " * 8).outcome == "too_long"
    for bad in (0, 7, True, 8.5, "64"):
        with pytest.raises(ValueError, match="max_chars"):
            StrictFinalVerifier(max_chars=bad)  # type: ignore[arg-type]
    smallest = StrictFinalVerifier(max_chars=8)  # the smallest cap allowed fits "Final: 4"
    assert smallest.version == "1.0.0+max_chars=8"
    assert smallest.score({"expected_answer": 4}, "Final: 4").outcome == "ok"


def test_huge_inputs_are_rejected_before_any_scan() -> None:
    for text in ("Final: 42" + " 42" * 3_000_000, "<think>" * 2_000_000, "\u200b" * 8_000_000):
        start = time.perf_counter()
        for _ in range(100):
            result = strict(text)
        elapsed = (time.perf_counter() - start) / 100
        assert result.outcome == "too_long"
        assert elapsed < 1e-3, f"{elapsed * 1e3:.2f} ms per score on a {len(text)}-char input"


@pytest.mark.parametrize(
    ("expected", "ok_completion"),
    [
        ("42", "Final: 42"),
        (42, "Final: 42"),
        (-7, "Final: -7"),
        ("0", "Final: 0"),
        (0, "Final: 0"),
        (10**40, f"Final: {10**40}"),
    ],
)
def test_expected_answer_accepts_canonical_strings_and_ints(expected: Any, ok_completion: str) -> None:
    assert strict(ok_completion, expected).outcome == "ok"
    assert strict("Final: 5", expected).outcome == "wrong_answer"


@pytest.mark.parametrize(
    "example",
    [
        None,
        42,
        "Final: 42",
        [],
        {},
        {"id": "a"},
        {"expected_answer": None},
        {"expected_answer": True},
        {"expected_answer": 4.2},
        {"expected_answer": "042"},
        {"expected_answer": "+4"},
        {"expected_answer": "-0"},
        {"expected_answer": " 42"},
        {"expected_answer": "４２"},
        {"expected_answer": ""},
        {"expected_answer": 10**5000},
        {"expected_answer": {"v": 1}},
    ],
)
@pytest.mark.parametrize("verifier", shipped_verifiers(), ids=lambda v: v.name)
def test_broken_examples_give_invalid_example(example: Any, verifier: Verifier) -> None:
    result = verifier.score(example, "Final: 42")
    assert (result.outcome, result.reward) == ("invalid_example", 0.0)
    assert result.details["expected"] is None
    assert result.details["reason"]
    if not isinstance(example, Mapping):
        assert result.details["reason"] == f"the example must be a mapping, got {type(example).__name__}"


class _HostileMapping(Mapping[str, Any]):
    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("boom")

    def __contains__(self, key: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(["expected_answer"])

    def __len__(self) -> int:
        return 1


def test_hostile_mapping_and_str_subclass_do_not_break_totality() -> None:
    result = STRICT.score(_HostileMapping(), "Final: 42")
    assert result.outcome == "invalid_example"
    assert "RuntimeError" in result.details["reason"]

    class Weird(str):
        def strip(self, *args: Any) -> str:  # type: ignore[override]
            raise RuntimeError("never called")

    assert strict(Weird("Final: 42")).outcome == "ok"
    assert strict(Weird("Final: 42"), Weird("42")).outcome == "ok"
    assert strict(None).outcome == "invalid_completion"


def test_canonical_answer() -> None:
    assert canonical_answer("-12") == "-12"
    assert canonical_answer(-12) == "-12"
    assert canonical_answer(False) is None
    assert canonical_answer("1_0") is None


def test_every_generated_problem_has_a_canonical_gold_answer() -> None:
    problems = all_problems()
    assert len(problems) == 20_000
    for ex in problems:
        assert STRICT.score(ex, f"Final: {ex['expected_answer']}").reward == 1.0, ex
        assert STRICT.score(ex, f"Final: {int(ex['expected_answer']) + 1}").outcome == "wrong_answer"


def test_gold_answer_cache_stays_bounded() -> None:
    from palaestra.envs import arithmetic

    for i in range(arithmetic._GOLD_CACHE_MAX + 10):
        assert canonical_answer(str(i)) == str(i)
        assert len(arithmetic._GOLD_CACHE) <= arithmetic._GOLD_CACHE_MAX  # at every step, not only at the end
    assert 0 < len(arithmetic._GOLD_CACHE) <= arithmetic._GOLD_CACHE_MAX
    assert canonical_answer("007") is None and canonical_answer("7") == "7"
    # only strings of at most 64 characters are remembered
    short, long = "1" * 64, "2" * 65
    assert canonical_answer(short) == short and canonical_answer(long) == long
    assert short in arithmetic._GOLD_CACHE and long not in arithmetic._GOLD_CACHE


def test_make_problem_refuses_other_operators() -> None:
    assert make_problem(12, "-", 30) == {
        "id": "arith-sub-12-30",
        "prompt": "What is 12-30? Reply with one line: Final: <int>",
        "expected_answer": "-18",
    }
    for op in ("*", "", "+-"):
        with pytest.raises(ValueError, match=rf"op must be '\+' or '-', got {re.escape(repr(op))}"):
            make_problem(1, op, 2)


# ---------------------------------------------------------------- naive verifier


def test_naive_verifier_is_exploitable_on_purpose() -> None:
    spray = " ".join(str(i) for i in range(100))
    assert NAIVE.score(EX, spray).reward == 1.0
    assert NAIVE.score(EX, "Final: \uff14\uff12").reward == 1.0  # fullwidth digits
    assert NAIVE.score(EX, "I thought 42.\nFinal: 41").details["parsed"] == "42"
    assert NAIVE.score(EX, "Final: 41").outcome == "not_found"
    assert NAIVE.score(EX, "  ").outcome == "empty"
    assert NAIVE.score({"expected_answer": "-5"}, "x -5 y").reward == 1.0
    assert NAIVE.score({"expected_answer": "-5"}, "x 5 y").reward == 0.0
    assert NAIVE.score(EX, "0" * 5000 + "42").outcome == "not_found"  # over-long token skipped, not int()-ed
    # a token may be up to len(expected) + 64 characters long: "0" * 64 + "42" equals 42, one more zero is skipped
    assert NAIVE.score(EX, "x " + "0" * 64 + "42").details["parsed"] == "0" * 64 + "42"
    assert NAIVE.score(EX, "x " + "0" * 65 + "42").outcome == "not_found"
    too_long = NaiveVerifier(max_chars=10).score(EX, "42" * 6)
    assert too_long.outcome == "too_long"
    # unlike the strict verifier's, its too_long details carry no length fields
    assert set(too_long.details) == {"expected", "parsed", "reason"}


def test_naive_verifier_copes_with_answers_past_the_int_digit_limit() -> None:
    limit = sys.get_int_max_str_digits()
    if not limit:
        pytest.skip("this interpreter converts ints of any length")
    big = "7" * (limit + 1)  # int(big) raises ValueError here
    ex = {"expected_answer": big}
    found = NAIVE.score(ex, f"Final: {big}")
    assert found.reward == 1.0 and found.details["parsed"] == big
    assert NAIVE.score(ex, f"Final: {big[:-1]}8").outcome == "not_found"


# ---------------------------------------------------------------- VerifierReward


def _choice(text: str | None) -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "logprobs": None,
            "message": {"role": "assistant", "content": text},
        }
    )


def _traj(*replies: Any) -> Trajectory:
    items: list[Any] = [{"role": "user", "content": EX["prompt"]}]
    for reply in replies:
        items.append(reply if isinstance(reply, Choice) else {"role": "assistant", "content": reply})
    return Trajectory(messages_and_choices=items)


async def test_verifier_reward_scores_last_assistant_message() -> None:
    reward_fn = VerifierReward(STRICT)
    assert isinstance(reward_fn, RewardFunction)
    group = TrajectoryGroup(
        [
            _traj(_choice("Final: 42")),
            _traj("Final: 42", _choice("Final: 41")),  # the last assistant message counts
            _traj("Final: 41", "Final: 42"),
            _traj(),  # no assistant message at all
            _traj(_choice(None)),  # content None -> "" -> empty
        ]
    )
    out = await reward_fn.score_group(group, EX)
    assert out is group
    assert group.rewards() == [1.0, 0.0, 1.0, 0.0, 0.0]
    outcomes = [t.metadata["outcome"] for t in group]
    assert outcomes == ["ok", "wrong_answer", "ok", "no_completion", "empty"]
    for traj, outcome in zip(group, outcomes):
        assert traj.metrics["correct"] is (outcome == "ok")
        assert traj.metrics[f"outcome/{outcome}"] == 1
        assert traj.metadata["verifier"] == "arith-strict@1.0.0"
        details = json.loads(str(traj.metadata["score_details"]))
        assert details["reason"]
    assert json.loads(str(group.trajectories[1].metadata["score_details"]))["parsed"] == "41"
    # details are stored as compact JSON with sorted keys ("markers" comes after "expected", not last)
    markers = TrajectoryGroup([_traj("Final: 1\nFinal: 42")])
    await reward_fn.score_group(markers, EX)
    stored = str(markers.trajectories[0].metadata["score_details"])
    assert stored.startswith('{"expected":"42","markers":2,"parsed":null,"reason":"'), stored
    assert group.metrics["pass_rate"] == pytest.approx(2 / 5)
    assert group.metadata["verifier"] == "arith-strict@1.0.0"
    # the scored group survives a JSON round trip (metadata stays scalar)
    TrajectoryGroup.model_validate_json(group.model_dump_json())


async def test_verifier_reward_takes_example_from_group_metadata() -> None:
    group = TrajectoryGroup([_traj("Final: 42"), _traj("Final: 7")], metadata=dict(EX))
    await VerifierReward(STRICT).score_group(group)
    assert group.rewards() == [1.0, 0.0]
    bare = TrajectoryGroup([_traj("Final: 42")])
    await VerifierReward(STRICT).score_group(bare)
    assert bare.trajectories[0].metadata["outcome"] == "invalid_example"


async def test_verifier_reward_caps_details_and_handles_empty_group() -> None:
    class Verbose:
        name, version = "verbose", "1.0.0"

        def score(self, example: Mapping[str, Any], completion: str) -> Score:
            return Score(0.5, "meh", {"reason": "r" * 10_000})

    group = TrajectoryGroup([_traj("x")])
    await VerifierReward(Verbose(), details_limit=100).score_group(group, EX)
    assert len(str(group.trajectories[0].metadata["score_details"])) == 100
    assert group.trajectories[0].reward == 0.5
    empty = await VerifierReward(STRICT).score_group(TrajectoryGroup([]), EX)
    assert "pass_rate" not in empty.metrics
