"""Validate a scorer against golden sets (docs/harness.md). Each case is scored twice: a different second
score, or an exception, is a mismatch too (the verifier contract says deterministic and total)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.envs.arithmetic_data import DATA_DIR
from palaestra.envs.verifier import Verifier
from palaestra.evals.inputs import row_completion, row_id, scorer_tag
from palaestra.trajectories.io import DataError, PathLike, iter_jsonl


@dataclass(frozen=True)
class GoldenCase:
    """One golden row: where it is, the example, the completion and what the scorer must say."""

    path: Path
    line: int
    id: str
    example: dict[str, Any]
    completion: str
    want: float
    want_outcome: str | None
    klass: str
    why: str


@dataclass(frozen=True)
class Mismatch:
    """A golden case the scorer got wrong."""

    case: GoldenCase
    reward: float | None
    outcome: str | None
    problem: str

    def describe(self) -> str:
        c = self.case
        why = f"; why: {c.why}" if c.why else ""
        return f"{c.path}:{c.line}: {c.id} [{c.klass}] {self.problem}; completion {c.completion[:80]!r}{why}"


@dataclass
class ValidationReport:
    """Result of :func:`validate_scorer`."""

    scorer: str
    checked: int = 0
    per_file: dict[str, int] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def format(self) -> str:
        files = ", ".join(f"{Path(p).name}: {n}" for p, n in self.per_file.items())
        head = f"{'OK' if self.ok else 'FAIL'}: scorer {self.scorer} on {self.checked} golden cases ({files})"
        return "\n".join(
            [f"{head}; {len(self.mismatches)} mismatch(es)"]
            + [f"  - {m.describe()}" for m in self.mismatches]
        )


def default_golden() -> list[Path]:
    """The shipped arithmetic golden sets."""
    return sorted(DATA_DIR.glob("golden_*.jsonl"))


def load_golden(
    path: PathLike,
    *,
    dataset: Mapping[str, Mapping[str, Any]] | None = None,
    outcome_field: str | None = None,
) -> list[GoldenCase]:
    """Parse one golden file (errors name file:line)."""
    p = Path(path)
    name = p.name.lower()
    by_name = 0.0 if "exploit" in name else 1.0 if "correct" in name else None
    cases = []
    for lineno, row in iter_jsonl(p):
        case_id = row_id(row, p, lineno)
        completion = row_completion(row, p, lineno)
        key = next((k for k in ("want", "expected_reward") if k in row), None)
        if key is None and by_name is None:
            raise DataError(
                "cannot tell the expected reward: add a 'want' field or name the file *correct*/*exploit*",
                path=p,
                line=lineno,
            )
        want = by_name if key is None else row[key]
        if isinstance(want, bool) or not isinstance(want, (int, float)):
            raise DataError(f"field {key!r} must be a number, got {want!r}", path=p, line=lineno)
        base = (dataset or {}).get(case_id, {})
        example = {"id": case_id}
        for k in ("prompt", "expected_answer"):
            if k in row or k in base:
                example[k] = row.get(k, base.get(k))
        outcome = row.get(outcome_field) if outcome_field else None
        outcome = outcome if isinstance(outcome, str) else None
        klass, why = str(row.get("class", "")), str(row.get("why", ""))
        cases.append(GoldenCase(p, lineno, case_id, example, completion, float(want), outcome, klass, why))
    return cases


def _check(verifier: Verifier, case: GoldenCase) -> Mismatch | None:
    try:
        first = verifier.score(case.example, case.completion)
        second = verifier.score(case.example, case.completion)
    except Exception as exc:  # the contract says total: an exception is a failure of the scorer
        return Mismatch(case, None, None, f"scorer raised {type(exc).__name__}: {exc}")
    if (first.reward, first.outcome, first.details) != (second.reward, second.outcome, second.details):
        problem = "not deterministic: two scores differ"
    elif first.reward != case.want:
        problem = f"want reward {case.want:g}, got {first.reward:g} ({first.outcome})"
    elif case.want_outcome is not None and first.outcome != case.want_outcome:
        problem = f"want outcome {case.want_outcome!r}, got {first.outcome!r}"
    else:
        return None
    return Mismatch(case, first.reward, first.outcome, problem)


def validate_scorer(
    verifier: Verifier,
    golden: Sequence[PathLike] | None = None,
    *,
    dataset: Mapping[str, Mapping[str, Any]] | None = None,
    outcome_field: str | None = None,
) -> ValidationReport:
    """Score every golden case (default: the shipped arithmetic golden sets) and list each mismatch."""
    paths = [Path(g) for g in golden] if golden else default_golden()
    if not paths:
        raise DataError("no golden files to validate against")
    report = ValidationReport(scorer=scorer_tag(verifier))
    for path in paths:
        cases = load_golden(path, dataset=dataset, outcome_field=outcome_field)
        if not cases:
            raise DataError("golden file has no cases", path=path)
        report.per_file[str(path)] = len(cases)
        report.checked += len(cases)
        report.mismatches += [m for m in (_check(verifier, c) for c in cases) if m is not None]
    return report
