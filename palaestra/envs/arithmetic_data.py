"""Arithmetic task data: all 20,000 problems ``a op b`` in deterministic disjoint splits (docs/environments.md,
"Datasets"); ``python -m palaestra.envs.arithmetic_data`` writes the shipped files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from palaestra.envs.splits import SplitFiles

DATA_DIR = Path(__file__).parent / "data" / "arithmetic"
SPLIT_SEED = 20261125
PROMPT_TEMPLATE = "What is {a}{op}{b}? Reply with one line: Final: <int>"


def make_problem(a: int, op: str, b: int) -> dict[str, Any]:
    """Return the example dict ``{"id", "prompt", "expected_answer"}`` for ``a op b``."""
    if op not in "+-" or len(op) != 1:
        raise ValueError(f"op must be '+' or '-', got {op!r}")
    answer = a + b if op == "+" else a - b
    name = "add" if op == "+" else "sub"
    return {
        "id": f"arith-{name}-{a:02d}-{b:02d}",
        "prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b),
        "expected_answer": str(answer),
    }


def all_problems() -> list[dict[str, Any]]:
    """All 20,000 problems in a fixed canonical order."""
    return [make_problem(a, op, b) for op in "+-" for a in range(100) for b in range(100)]


def make_splits(seed: int = SPLIT_SEED) -> dict[str, list[dict[str, Any]]]:
    """Split all problems by a seeded permutation; val, test and train are disjoint, dev is a subset of val."""
    import numpy as np  # here, so that the registry can read the templates without numpy

    problems = all_problems()
    order = np.random.default_rng(seed).permutation(len(problems))
    shuffled = [problems[i] for i in order]
    val, test, train = shuffled[:1000], shuffled[1000:2000], shuffled[2000:]
    return {"train": train, "val": val, "test": test, "dev": val[:200]}


FILES = SplitFiles(DATA_DIR, make_splits, SPLIT_SEED)
SPLITS, load_split, write_splits = FILES.names, FILES.load, FILES.write  # see SplitFiles


if __name__ == "__main__":  # pragma: no cover - data build script
    print(json.dumps(write_splits()))
