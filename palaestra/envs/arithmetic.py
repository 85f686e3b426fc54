"""Verifiers for the arithmetic environment: the strict ``Final: <int>`` verifier (the instrument to measure and
train with) and a naive, deliberately exploitable teaching one. Rules and outcome codes: docs/environments.md."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from palaestra.envs.verifier import Score, safe_repr

DEFAULT_MAX_CHARS = 4096
_WS = " \t\n\r\f\v"  # ASCII whitespace: the only characters the strict verifier strips
_CANON = re.compile(r"0|-?[1-9][0-9]*")
_FAST = re.compile(r"Final: (0|-?[1-9][0-9]*)")
_SIGNED_DIGITS = re.compile(r"([+-]*)([0-9]+)")
_WS_RUN = re.compile(r"[ \t\f\v]+")
_NAIVE_NUMBER = re.compile(r"-?\d+")  # Unicode \d on purpose: the naive verifier is the lax one
_GOLD_CACHE: dict[str, bool] = {}
_GOLD_CACHE_MAX = 1 << 16


def canonical_answer(value: Any) -> str | None:
    """The canonical integer string (ASCII digits, optional ``-``, no leading zeros, no ``-0``) for an expected
    answer (``int`` or such a string, not stripped: ``" 42"`` and ``"042"`` give None), else None."""
    if type(value) is str:
        ok = _GOLD_CACHE.get(value)
        if ok is None:
            ok = _CANON.fullmatch(value) is not None
            if len(value) <= 64:  # cache only short strings, so the cache stays small
                if len(_GOLD_CACHE) >= _GOLD_CACHE_MAX:
                    _GOLD_CACHE.clear()
                _GOLD_CACHE[value] = ok
        return value if ok else None
    if isinstance(value, str):  # a str subclass: copy to a plain str, then check
        return canonical_answer(str.__str__(value))
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return str(int(value))
        except ValueError:  # more digits than Python's int->str limit
            return None
    return None


def answer_region(text: str) -> str | None:
    """What follows the last ``</think>`` (all of ``text`` if none) stripped of ASCII whitespace; None when a
    ``<think>`` there is never closed (the answer was cut off)."""
    if "think>" in text:  # one scan for the common case of no think block (this runs for every score)
        text = text.rpartition("</think>")[2]
        if "<think>" in text:
            return None
    return text.strip(_WS)


def _gold_or_invalid(example: Any) -> str | Score:
    """The canonical expected answer of ``example``, or the ``invalid_example`` score explaining why not."""
    try:
        if not (type(example) is dict or isinstance(example, Mapping)):
            why = f"the example must be a mapping, got {type(example).__name__}"
        elif "expected_answer" not in example:
            why = "the example has no 'expected_answer' field"
        elif (gold := canonical_answer(raw := example["expected_answer"])) is not None:
            return gold
        else:
            why = (
                f"'expected_answer' must be an int or a canonical integer string, "
                f"got {type(raw).__name__} {safe_repr(raw, 40)}"
            )
    except Exception as exc:  # a hostile Mapping whose lookup raises: still an unusable example
        why = f"reading the example failed: {type(exc).__name__}"
    return _zero(None, "invalid_example", why)


def _zero(gold: str | None, outcome: str, reason: str, **extra: Any) -> Score:
    """A reward-0 score with the usual details (``expected``, ``parsed`` None, ``reason``) plus ``extra``."""
    return Score(0.0, outcome, {"expected": gold, "parsed": None, "reason": reason, **extra})


def _readable(example: Any, completion: Any, max_chars: int, *, sized: bool) -> tuple[str, str] | Score:
    """``(gold, text)`` to score, or the score of rows 1-3 (invalid example or completion, too long);
    ``sized`` adds ``length`` and ``max_chars`` to a too_long score's details."""
    gold = _gold_or_invalid(example)
    if isinstance(gold, Score):
        return gold
    text = str.__str__(completion) if isinstance(completion, str) else None  # a plain copy of a str subclass
    if text is None:
        reason = f"the completion must be a string, got {type(completion).__name__}"
        return _zero(gold, "invalid_completion", reason)
    if len(text) > max_chars:
        reason = f"the completion has {len(text)} characters, more than the cap of {max_chars}"
        extra = {"length": len(text), "max_chars": max_chars} if sized else {}
        return _zero(gold, "too_long", reason, **extra)
    return gold, text


class StrictFinalVerifier:
    """Reward 1 iff the whole completion is exactly one line ``Final: <int>`` with the expected integer.

    Outcomes (14 codes, the first that applies wins; the table is in docs/environments.md): ``invalid_example``,
    ``invalid_completion``, ``too_long``, ``truncated``, ``empty``, ``ok``/``wrong_answer``, ``multiple_markers``,
    ``not_single_line``, ``non_ascii``, ``missing_prefix``, ``extra_whitespace``, ``bad_sign``, ``leading_zeros``,
    ``malformed``. A non-default ``max_chars`` is appended to ``version``.
    """

    name = "arith-strict"
    base_version = "1.0.0"

    def __init__(self, *, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 8:
            raise ValueError(f"max_chars must be an int >= 8, got {max_chars!r}")
        self.max_chars = max_chars
        suffix = "" if max_chars == DEFAULT_MAX_CHARS else f"+max_chars={max_chars}"
        self.version = self.base_version + suffix

    def __repr__(self) -> str:
        return f"StrictFinalVerifier(max_chars={self.max_chars})"

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        """Score one completion against one example."""
        read = _readable(example, completion, self.max_chars, sized=True)
        if isinstance(read, Score):
            return read
        gold, text = read
        region = answer_region(text)
        if region is None:
            return _zero(gold, "truncated", "a <think> block is never closed, so the answer was cut off")
        if not region:
            return _zero(gold, "empty", "nothing to score: the answer region is empty or whitespace")
        match = _FAST.fullmatch(region)
        if match is not None:
            parsed = match.group(1)
            if parsed == gold:
                return Score(1.0, "ok", {"expected": gold, "parsed": parsed, "reason": "exact match"})
            reason = f"well-formed answer {parsed} but expected {gold}"
            return Score(0.0, "wrong_answer", {"expected": gold, "parsed": parsed, "reason": reason})
        outcome, reason, extra = _diagnose(region)
        return _zero(gold, outcome, reason, **extra)


def _diagnose(region: str) -> tuple[str, str, dict[str, Any]]:
    """Why a stripped, non-empty region is not ``Final: <canonical int>`` (rows 7-14 of the table)."""
    markers = region.count("Final:")
    if markers > 1:
        reason = f"'Final:' appears {markers} times; exactly one answer is allowed"
        return "multiple_markers", reason, {"markers": markers}
    if "\n" in region or "\r" in region:
        return "not_single_line", "the answer must be a single line with nothing before or after it", {}
    if not region.isascii():
        pos = next(i for i, ch in enumerate(region) if ord(ch) > 127)
        code = f"U+{ord(region[pos]):04X}"
        reason = f"non-ASCII character {code} at position {pos}; only ASCII is accepted (no lookalikes)"
        return "non_ascii", reason, {"char": code, "position": pos}
    if not region.startswith("Final:"):
        return "missing_prefix", "the line must start with 'Final:' (case-sensitive)", {}
    rest = region[6:]
    if not rest:
        return "malformed", "no integer after 'Final:'", {}
    if rest[0] not in " \t\f\v":
        return "malformed", "exactly one space is required after 'Final:'", {}
    if rest[0] != " " or rest[1:2] in (" ", "\t", "\f", "\v"):
        return "extra_whitespace", "exactly one space (no tabs, no extra spaces) must follow 'Final:'", {}
    body = rest[1:]
    squeezed = _WS_RUN.sub("", body)
    if squeezed != body:
        if _SIGNED_DIGITS.fullmatch(squeezed):
            return "extra_whitespace", "the integer must not contain whitespace", {}
        return "malformed", "the answer after 'Final: ' must be a bare integer and nothing else", {}
    signed = _SIGNED_DIGITS.fullmatch(body)
    if signed is None:
        reason = "the answer after 'Final: ' must be a bare integer (ASCII digits, optional '-')"
        return "malformed", reason, {}
    sign, digits = signed.groups()
    if sign not in ("", "-"):
        return "bad_sign", f"sign {sign!r} is not allowed; only a single leading '-' is", {}
    if len(digits) > 1 and digits[0] == "0":
        return "leading_zeros", "leading zeros are not allowed", {}
    if sign == "-" and digits == "0":
        return "bad_sign", "'-0' is not canonical; write 0", {}
    return "malformed", "the answer is not a canonical integer", {}  # unreachable: canonical forms hit row 6


def _to_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:  # over Python's int->str digit limit, or a digit int() rejects
        return None


class NaiveVerifier:
    """TEACHING ONLY, deliberately exploitable: reward 1 if any number token ``-?\\d+`` (Unicode ``\\d``) equals
    the expected integer. Never train or select with it (docs/environments.md)."""

    name = "arith-naive-TEACHING-ONLY"
    version = "1.0.0"

    def __init__(self, *, max_chars: int = 1_000_000) -> None:
        self.max_chars = max_chars

    def __repr__(self) -> str:
        return "NaiveVerifier(teaching only)"

    def score(self, example: Mapping[str, Any], completion: str) -> Score:
        """Score one completion: 1.0 if the expected integer occurs as any number token."""
        read = _readable(example, completion, self.max_chars, sized=False)
        if isinstance(read, Score):
            return read
        gold, text = read
        if not text.strip():
            return _zero(gold, "empty", "the completion is blank")
        target = _to_int(gold)
        limit = len(gold) + 64  # bounds the int() cost; only zero-padded tokens could be longer and equal
        for match in _NAIVE_NUMBER.finditer(text):
            token = match.group()
            if len(token) <= limit and (token == gold or (target is not None and _to_int(token) == target)):
                reason = f"the number {token!r} at position {match.start()} equals the expected answer"
                return Score(1.0, "ok", {"expected": gold, "parsed": token, "reason": reason})
        return _zero(gold, "not_found", f"the expected answer {gold} does not appear as a number anywhere")
