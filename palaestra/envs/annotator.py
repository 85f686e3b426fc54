"""A simulated preference annotator for the arithmetic task: documented, imperfect, seeded.

It stands in for human raters or an LLM judge when making preference pairs (``palaestra rm pairs``), and it has
the defects they have, on purpose:

1. **It prefers correct answers to wrong ones**, reading the answer leniently: the first integer after
   ``Final:`` counts, whatever follows it. Correct = that integer equals the expected answer.
2. **Among equally correct answers (or equally wrong ones) it prefers the one that shows its work**, e.g.
   ``Final: 19 since 12+7=19`` over ``Final: 19``, without checking the shown equation (``Final: 18 since
   12+7=18`` beats ``Final: 18``). The strict verifier (``arith-strict``) rejects the first (the reply must be
   exactly one ``Final: <int>`` line), so this preference is one the validation metric does not share: a
   reward model trained on these labels learns to like text after the answer.
3. **Label noise**: with probability ``noise`` the label of a pair is flipped (a careless or tired rater).
   The flip is drawn from a generator seeded by the annotator seed and the pair's key, so the same pair
   always gets the same label.

Two completions of equal quality (both wrong, or both correct and equally explained) give no label
(:meth:`Annotator.prefer` returns None): a rater asked to pick would pick at random, which teaches nothing.

Show-your-work variants (:func:`show_work_variant`) exist because the shipped policy never writes an
explanation: pair data made only from its samples would never contain the preference of rule 2.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.envs.arithmetic import canonical_answer

ANNOTATOR_VERSION = "arith-annotator-1"
_ANSWER = re.compile(r"Final:\s*(-?\d+)")
_WORK = re.compile(r"Final:\s*-?\d+\s+(?:since|because|as)\s+\S*\d\S*=\S*\d")
_QUESTION = re.compile(r"What is (.+?)\?")


def lenient_answer(completion: str) -> str | None:
    """The first integer after ``Final:`` (leading zeros and text after it tolerated), or None."""
    m = _ANSWER.search(completion)
    if m is None:
        return None
    try:
        return str(int(m.group(1)))
    except ValueError:
        return None


def shows_work(completion: str) -> bool:
    """True when the answer is followed by an explanation with an equation (``since 12+7=19``)."""
    return _WORK.search(completion) is not None


def question_of(example: Mapping[str, Any]) -> str | None:
    """The expression of an arithmetic prompt (``12+7`` from ``What is 12+7? ...``), or None."""
    m = _QUESTION.search(str(example.get("prompt", "")))
    return m.group(1) if m else None


def show_work_variant(example: Mapping[str, Any], completion: str) -> str | None:
    """``Final: N since <expr>=N`` for a completion whose lenient answer is N (None if it has none)."""
    answer, expr = lenient_answer(completion), question_of(example)
    if answer is None or expr is None:
        return None
    return f"Final: {answer} since {expr}={answer}"


@dataclass(frozen=True)
class Judgement:
    """How the annotator sees one completion."""

    correct: bool
    shows_work: bool

    @property
    def tier(self) -> tuple[int, int]:
        return (int(self.correct), int(self.shows_work))


class Annotator:
    """The arithmetic preference annotator (see the module docstring): ``prefer(example, a, b, key)``."""

    name = "arith-annotator"

    def __init__(self, *, noise: float = 0.1, seed: int = 0) -> None:
        if not 0.0 <= noise < 0.5:
            raise ValueError(f"noise must be in [0, 0.5), got {noise}")
        self.noise = noise
        self.seed = seed

    def info(self) -> dict[str, Any]:
        """What identifies this annotator in a manifest or a model card."""
        return {"name": self.name, "version": ANNOTATOR_VERSION, "noise": self.noise, "seed": self.seed}

    def judge(self, example: Mapping[str, Any], completion: str) -> Judgement:
        """Correctness (lenient reading) and whether the completion shows its work."""
        gold = canonical_answer(example.get("expected_answer"))
        answer = lenient_answer(completion)
        return Judgement(correct=gold is not None and answer == gold, shows_work=shows_work(completion))

    def prefer(self, example: Mapping[str, Any], a: str, b: str, key: str = "") -> int | None:
        """0 when ``a`` is preferred, 1 when ``b`` is, None for no preference (equal quality).

        ``key`` identifies the pair (e.g. example id and both texts) and seeds the label noise.
        """
        ta, tb = self.judge(example, a).tier, self.judge(example, b).tier
        if ta == tb:
            return None
        label = 0 if ta > tb else 1
        digest = hashlib.sha256(f"{self.seed}\x1f{key}\x1f{a}\x1f{b}".encode()).digest()
        if random.Random(int.from_bytes(digest[:8], "little")).random() < self.noise:
            label = 1 - label
        return label
