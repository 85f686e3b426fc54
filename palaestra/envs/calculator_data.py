"""Calculator task data: problems a tiny model cannot reliably do in its head, in deterministic disjoint splits
(docs/environments.md, "Datasets"); ``python -m palaestra.envs.calculator_data`` writes the shipped files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from palaestra.envs.calc_eval import evaluate
from palaestra.envs.splits import SplitFiles

DATA_DIR = Path(__file__).parent / "data" / "calculator"
SPLIT_SEED = 20261126
SPLIT_SIZES = {"val": 500, "test": 500, "train": 12_000}
PROMPT_TEMPLATE = "What is {expression}? Reply with one line: Final: <int>"
FAMILY_SHARE = {"add": 0.07, "mul": 0.33, "muladd": 0.2, "mulsub": 0.2, "addmul": 0.2}
_ID_CHARS = str.maketrans({"*": "x", "+": "p", "-": "m", "(": None, ")": None})


def difficulty_of(family: Any) -> str | None:
    """``"easy"`` for ``add`` (done in the head), ``"hard"`` for the other families, None for an unknown one."""
    if not isinstance(family, str) or family not in FAMILY_SHARE:
        return None
    return "easy" if family == "add" else "hard"


def family_expressions(family: str) -> list[str]:
    """Every expression of a family, in a fixed canonical order."""
    if family == "add":
        return [f"{a}+{b}" for a in range(10, 100) for b in range(2, 14)]
    if family == "mul":
        return [f"{a}*{b}" for a in range(12, 100) for b in range(12, 100)]
    if family in ("muladd", "mulsub"):
        op = "+" if family == "muladd" else "-"
        return [f"{a}*{b}{op}{c}" for a in range(12, 100) for b in range(3, 10) for c in range(10, 100)]
    if family == "addmul":
        return [f"({a}+{b})*{c}" for a in range(10, 100) for b in range(10, 100) for c in range(3, 10)]
    raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILY_SHARE)}")


def make_problem(family: str, expression: str) -> dict[str, Any]:
    """The example dict of one expression."""
    return {
        "id": f"calc-{family}-{expression.translate(_ID_CHARS)}",
        "prompt": PROMPT_TEMPLATE.format(expression=expression),
        "expected_answer": str(evaluate(expression)),  # always an integer
        "expression": expression,
        "family": family,
    }


def make_splits(seed: int = SPLIT_SEED) -> dict[str, list[dict[str, Any]]]:
    """val/test/train (disjoint) and dev (first 100 of val), deterministic in ``seed``."""
    import numpy as np  # here, so that the registry can read the templates without numpy

    rng = np.random.default_rng(seed)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLIT_SIZES}
    for family, share in FAMILY_SHARE.items():
        exprs = family_expressions(family)
        order = rng.permutation(len(exprs))
        pos = 0
        for split, size in SPLIT_SIZES.items():
            k = round(share * size)
            out[split] += [make_problem(family, exprs[int(i)]) for i in order[pos : pos + k]]
            pos += k
    for split in SPLIT_SIZES:
        rows = out[split]
        out[split] = [rows[int(i)] for i in rng.permutation(len(rows))]
    out["dev"] = out["val"][:100]
    return out


FILES = SplitFiles(DATA_DIR, make_splits, SPLIT_SEED)
SPLITS, load_split, write_splits = FILES.names, FILES.load, FILES.write  # see SplitFiles


if __name__ == "__main__":  # pragma: no cover - data build script
    print(json.dumps(write_splits()))
