"""A simulated, imperfect, seeded preference annotator for the arithmetic task (docs/environments.md, "The
preference annotator")."""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from typing import Any

from palaestra.envs.arithmetic import canonical_answer

ANNOTATOR_VERSION = "arith-annotator-1"
_ANSWER = re.compile(r"Final:\s*(-?\d+)")
_WORK = re.compile(r"Final:\s*-?\d+\s+(?:since|because|as)\s+\S*\d\S*=\S*\d")
_QUESTION = re.compile(r"What is (.+?)\?")


def lenient_answer(completion: str) -> str | None:
    """The first integer after ``Final:`` (leading zeros and text after it tolerated), or None."""
    if (m := _ANSWER.search(completion)) is None:
        return None
    try:
        return str(int(m.group(1)))
    except ValueError:
        return None


def show_work_variant(example: Mapping[str, Any], completion: str) -> str | None:
    """``Final: N since <expr>=N`` for a completion whose lenient answer is N (None if it has none, or the prompt
    has no ``What is <expr>?``)."""
    answer, question = lenient_answer(completion), _QUESTION.search(str(example.get("prompt", "")))
    if answer is None or question is None:
        return None
    return f"Final: {answer} since {question.group(1)}={answer}"


class Annotator:
    """The arithmetic preference annotator (docs/environments.md): ``prefer(example, a, b, key)``."""

    name = "arith-annotator"

    def __init__(self, *, noise: float = 0.1, seed: int = 0) -> None:
        if not 0.0 <= noise < 0.5:
            raise ValueError(f"noise must be in [0, 0.5), got {noise}")
        self.noise, self.seed = noise, seed

    def info(self) -> dict[str, Any]:
        """What identifies this annotator in a manifest or a model card."""
        return {"name": self.name, "version": ANNOTATOR_VERSION, "noise": self.noise, "seed": self.seed}

    def tier(self, example: Mapping[str, Any], completion: str) -> tuple[bool, bool]:
        """How the annotator ranks one completion: (correct by the lenient reading, shows its work: the answer
        is followed by an explanation with an equation, ``since 12+7=19``)."""
        gold = canonical_answer(example.get("expected_answer"))
        return gold is not None and lenient_answer(completion) == gold, _WORK.search(completion) is not None

    def prefer(self, example: Mapping[str, Any], a: str, b: str, key: str = "") -> int | None:
        """0 when ``a`` is preferred, 1 when ``b`` is, None for no preference (equal quality); ``key``
        identifies the pair (e.g. example id and both texts) and seeds the label noise."""
        ta, tb = self.tier(example, a), self.tier(example, b)
        if ta == tb:
            return None
        label = 0 if ta > tb else 1
        digest = hashlib.sha256(f"{self.seed}\x1f{key}\x1f{a}\x1f{b}".encode()).digest()
        if random.Random(int.from_bytes(digest[:8], "little")).random() < self.noise:
            label = 1 - label
        return label
