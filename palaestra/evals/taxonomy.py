"""Failure taxonomy: every outcome code a shipped verifier can emit, mapped to one category (docs/harness.md).
``verifier_suspect`` is not in the table: :func:`classify` assigns it per result from the cross-check."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

OK = "ok"
MODEL_MATH = "model_math"
MODEL_FORMAT = "model_format"
DATA_INVALID = "data_invalid"
VERIFIER_SUSPECT = "verifier_suspect"
#: Category given to an outcome code missing from the table (a new verifier code): shown loudly by inspect.
UNMAPPED = "unmapped"

CATEGORIES: tuple[str, ...] = (OK, MODEL_MATH, MODEL_FORMAT, DATA_INVALID, VERIFIER_SUSPECT)
#: Every category a rollout can show, in display order (``-``: no outcome).
KNOWN_CATEGORIES: tuple[str, ...] = (*CATEGORIES, UNMAPPED, "-")

CATEGORY_MEANING: Mapping[str, str] = MappingProxyType(
    {
        OK: "accepted",
        MODEL_MATH: "the answer was parsed and is the wrong number (model)",
        MODEL_FORMAT: "no answer could be parsed: the output spec was broken (model, or a too-strict spec)",
        DATA_INVALID: "the example or the completion record is broken (data)",
        VERIFIER_SUSPECT: "a lenient verifier accepts what the strict one rejects: look by hand (verifier?)",
        UNMAPPED: "outcome code missing from the taxonomy table: add it to palaestra/evals/taxonomy.py",
    }
)

# The table. Codes of palaestra.envs.arithmetic.StrictFinalVerifier (rows 1-14 of its docstring table),
# NaiveVerifier, and palaestra.envs.verifier.VerifierReward (no_completion).
OUTCOME_CATEGORY: Mapping[str, str] = MappingProxyType(
    {
        "ok": OK,
        "wrong_answer": MODEL_MATH,  # strict: well-formed `Final: <int>` with the wrong integer
        "not_found": MODEL_MATH,  # naive: the expected integer appears nowhere in the text
        "empty": MODEL_FORMAT,
        "too_long": MODEL_FORMAT,
        "truncated": MODEL_FORMAT,
        "multiple_markers": MODEL_FORMAT,
        "not_single_line": MODEL_FORMAT,
        "non_ascii": MODEL_FORMAT,
        "missing_prefix": MODEL_FORMAT,
        "extra_whitespace": MODEL_FORMAT,
        "bad_sign": MODEL_FORMAT,
        "leading_zeros": MODEL_FORMAT,
        "malformed": MODEL_FORMAT,
        "no_completion": MODEL_FORMAT,  # the trajectory holds no assistant message at all
        "invalid_example": DATA_INVALID,  # no usable expected_answer
        "invalid_completion": DATA_INVALID,  # the completion is not a string: a broken record, not model text
    }
)


def category_of(outcome: str) -> str:
    """The table category of an outcome code (:data:`UNMAPPED` for a code the table does not know)."""
    return OUTCOME_CATEGORY.get(outcome, UNMAPPED)


def classify(outcome: str, *, suspect: bool = False) -> str:
    """``verifier_suspect`` when the cross-check flagged the result (even over ``ok``: an accepted exploit is
    exactly what needs a look), else the table category."""
    return VERIFIER_SUSPECT if suspect else category_of(outcome)


def display_order(present: Iterable[str]) -> list[str]:
    """The categories in ``present`` in display order: the table's, ``unmapped``, ``-`` (no outcome), others."""
    found = set(present)
    return [c for c in KNOWN_CATEGORIES if c in found] + sorted(found - set(KNOWN_CATEGORIES))
