"""Harness inputs: datasets and completion/sample files, validated with errors naming ``file:line``.

* dataset JSONL: one example per line, ``{"id", "prompt", "expected_answer", ...}``; ``id`` must be a unique
  non-empty string (an example the verifier cannot use is *scored* ``invalid_example``, not rejected).
* completions / samples JSONL: ``{"id", "completion", "sample"?, "sum_logprob"?, ...}``; other keys are kept
  as ``extra``. An id not in the dataset, a dataset id with no row, a repeated ``(id, sample)``, a non-string
  completion, a non-numeric ``sum_logprob`` or rows that mix having and lacking ``sample`` are errors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.trajectories.io import DataError, PathLike, iter_jsonl

__all__ = ["Dataset", "SampleRow", "check_equal_counts", "load_dataset", "load_samples"]


@dataclass(frozen=True)
class Dataset:
    """A loaded dataset: examples in file order and the line of each id."""

    path: Path
    examples: list[dict[str, Any]]
    line_of: dict[str, int]

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self.examples}


@dataclass(frozen=True)
class SampleRow:
    """One completion of one example: ``sample`` is its index (file order when the row has none)."""

    id: str
    sample: int
    completion: str
    sum_logprob: float | None
    line: int
    extra: dict[str, Any] = field(default_factory=dict)


def load_dataset(path: PathLike) -> Dataset:
    """Load a dataset JSONL; rows must be objects with a unique non-empty string ``id``."""
    p = Path(path)
    examples: list[dict[str, Any]] = []
    line_of: dict[str, int] = {}
    for lineno, row in iter_jsonl(p):
        ex_id = row_id(row, p, lineno)
        if ex_id in line_of:
            raise DataError(f"duplicate id {ex_id!r} (first at line {line_of[ex_id]})", path=p, line=lineno)
        line_of[ex_id] = lineno
        examples.append(row)
    if not examples:
        raise DataError("dataset is empty", path=p)
    return Dataset(path=p, examples=examples, line_of=line_of)


_KNOWN = ("id", "completion", "sample", "sum_logprob")


def row_id(row: Any, path: Path, line: int) -> str:
    """The ``id`` of a row, which must be a JSON object with a non-empty string ``id``."""
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object, got {type(row).__name__}", path=path, line=line)
    ex_id = row.get("id")
    if not isinstance(ex_id, str) or not ex_id:
        raise DataError(f"field 'id' must be a non-empty string, got {ex_id!r}", path=path, line=line)
    return ex_id


def row_completion(row: dict[str, Any], path: Path, line: int) -> str:
    """The row's ``completion``, which must be a string."""
    if "completion" not in row:
        raise DataError("field 'completion' is missing", path=path, line=line)
    completion = row["completion"]
    if not isinstance(completion, str):
        raise DataError(
            f"field 'completion' must be a string, got {type(completion).__name__}", path=path, line=line
        )
    return completion


def _parse_row(p: Path, lineno: int, row: Any, dataset: Dataset) -> tuple[str, int | None, str, float | None]:
    ex_id = row_id(row, p, lineno)
    if ex_id not in dataset.line_of:
        raise DataError(f"id {ex_id!r} is not in the dataset {dataset.path}", path=p, line=lineno)
    completion = row_completion(row, p, lineno)
    sample = row.get("sample")
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 0):
        raise DataError(f"field 'sample' must be an int >= 0, got {sample!r}", path=p, line=lineno)
    lp = row.get("sum_logprob")
    if lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise DataError(
                f"field 'sum_logprob' must be a finite number or null, got {lp!r}", path=p, line=lineno
            )
        lp = float(lp)
    return ex_id, sample, completion, lp


def load_samples(
    path: PathLike, dataset: Dataset, *, repeats: bool = False, what: str = "completion"
) -> dict[str, list[SampleRow]]:
    """Load completions/samples keyed by id (dataset order), each list sorted by sample index.

    ``repeats``: whether rows without a ``sample`` field may repeat an id (numbered in file order, as
    ``palaestra select`` allows); otherwise a repeated id is an error. Rows must all carry ``sample`` or none.
    """
    p = Path(path)
    seen: dict[tuple[str, int], int] = {}
    first_line: dict[str, int] = {}
    rows: dict[str, list[SampleRow]] = {}
    has_sample: bool | None = None
    for lineno, raw in iter_jsonl(p):
        ex_id, sample, completion, lp = _parse_row(p, lineno, raw, dataset)
        if has_sample is None:
            has_sample = sample is not None
        elif has_sample != (sample is not None):
            where = "has no" if sample is None else "has a"
            raise DataError(
                f"this row {where} 'sample' field, unlike the rows before it", path=p, line=lineno
            )
        if sample is None:
            if ex_id in first_line and not repeats:
                raise DataError(
                    f"duplicate id {ex_id!r} (first at line {first_line[ex_id]}); give each row a 'sample' "
                    "index to score several completions per id",
                    path=p,
                    line=lineno,
                )
            sample = len(rows.get(ex_id, []))
        if (ex_id, sample) in seen:
            raise DataError(
                f"duplicate (id, sample) ({ex_id!r}, {sample}) (first at line {seen[ex_id, sample]})",
                path=p,
                line=lineno,
            )
        seen[ex_id, sample] = lineno
        first_line.setdefault(ex_id, lineno)
        extra = {k: v for k, v in raw.items() if k not in _KNOWN}
        rows.setdefault(ex_id, []).append(SampleRow(ex_id, sample, completion, lp, lineno, extra))
    missing = [e["id"] for e in dataset.examples if e["id"] not in rows]
    if missing:
        raise DataError(
            f"id {missing[0]!r} has no {what} in {p} ({len(missing)} of {len(dataset.examples)} dataset ids "
            f"have none; every dataset id needs at least one)",
            path=dataset.path,
            line=dataset.line_of[missing[0]],
        )
    return {e["id"]: sorted(rows[e["id"]], key=lambda r: r.sample) for e in dataset.examples}


def check_equal_counts(samples: Mapping[str, list[SampleRow]], path: Path) -> int:
    """The number of rows per id, which must be the same for every id."""
    counts = {ex_id: len(rows) for ex_id, rows in samples.items()}
    k = next(iter(counts.values()))
    for ex_id, c in counts.items():
        if c != k:
            first = next(iter(counts))
            raise DataError(
                f"id {ex_id!r} has {c} completions but {first!r} has {k}; every id needs the same number",
                path=path,
                line=samples[ex_id][0].line,
            )
    return k
