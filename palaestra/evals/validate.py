"""Validate a scorer against golden sets: completions whose reward is known in advance.

Golden JSONL rows: ``{"id", "expected_answer", "completion", "why", "class", ...}``. The reward a row must get
is, in order of precedence:

1. its ``want`` field (a number), else
2. its ``expected_reward`` field (a number), else
3. the file name: a name containing ``correct`` means 1.0 (e.g. ``golden_correct.jsonl``), one containing
   ``exploit`` means 0.0 (``golden_exploits.jsonl``); any other name with neither field is an error.

Optionally an *outcome field* (``--outcome-field strict_outcome``) names a per-row field whose value the
scorer's outcome must also equal (rows without the field are checked on reward only).

The example scored is ``{"id", "prompt", "expected_answer"}`` from the golden row; when ``--dataset`` is
given and holds the row's ``id``, missing ``prompt``/``expected_answer`` fields are taken from it.
Each case is scored twice: a different second score, or an exception, is a mismatch too (the verifier
contract says deterministic and total).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.envs.verifier import Verifier
from palaestra.evals.inputs import row_completion, row_id
from palaestra.trajectories.io import DataError, PathLike, iter_jsonl

__all__ = ["GoldenCase", "Mismatch", "ValidationReport", "default_golden", "load_golden", "validate_scorer"]


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
        return f"{c.path}:{c.line}: {c.id} [{c.klass}] {self.problem}; completion {c.completion[:80]!r}" + (
            f"; why: {c.why}" if c.why else ""
        )


@dataclass
class ValidationReport:
    """Result of :func:`validate_scorer`: ``ok`` when no mismatch."""

    scorer: str
    checked: int = 0
    per_file: dict[str, int] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def format(self) -> str:
        head = "OK" if self.ok else "FAIL"
        files = ", ".join(f"{Path(p).name}: {n}" for p, n in self.per_file.items())
        n_bad = len(self.mismatches)
        lines = [
            f"{head}: scorer {self.scorer} on {self.checked} golden cases ({files}); {n_bad} mismatch(es)"
        ]
        lines += [f"  - {m.describe()}" for m in self.mismatches]
        return "\n".join(lines)


def default_golden() -> list[Path]:
    """The shipped arithmetic golden sets."""
    from palaestra.envs.arithmetic_data import DATA_DIR

    return sorted(DATA_DIR.glob("golden_*.jsonl"))


def _want_from_name(path: Path) -> float | None:
    name = path.name.lower()
    if "exploit" in name:
        return 0.0
    if "correct" in name:
        return 1.0
    return None


def _number(value: Any, name: str, path: Path, line: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"field {name!r} must be a number, got {value!r}", path=path, line=line)
    return float(value)


def load_golden(
    path: PathLike,
    *,
    dataset: Mapping[str, Mapping[str, Any]] | None = None,
    outcome_field: str | None = None,
) -> list[GoldenCase]:
    """Parse one golden file (errors name file:line)."""
    p = Path(path)
    by_name = _want_from_name(p)
    cases = []
    for lineno, row in iter_jsonl(p):
        case_id = row_id(row, p, lineno)
        completion = row_completion(row, p, lineno)
        if "want" in row:
            want = _number(row["want"], "want", p, lineno)
        elif "expected_reward" in row:
            want = _number(row["expected_reward"], "expected_reward", p, lineno)
        elif by_name is not None:
            want = by_name
        else:
            raise DataError(
                "cannot tell the expected reward: add a 'want' field or name the file *correct*/*exploit*",
                path=p,
                line=lineno,
            )
        base = dict((dataset or {}).get(case_id, {}))
        example = {"id": case_id}
        for key in ("prompt", "expected_answer"):
            if key in row:
                example[key] = row[key]
            elif key in base:
                example[key] = base[key]
        want_outcome = row.get(outcome_field) if outcome_field else None
        cases.append(
            GoldenCase(
                path=p,
                line=lineno,
                id=case_id,
                example=example,
                completion=completion,
                want=want,
                want_outcome=want_outcome if isinstance(want_outcome, str) else None,
                klass=str(row.get("class", "")),
                why=str(row.get("why", "")),
            )
        )
    return cases


def _check(verifier: Verifier, case: GoldenCase) -> Mismatch | None:
    try:
        first = verifier.score(case.example, case.completion)
        second = verifier.score(case.example, case.completion)
    except Exception as exc:  # the contract says total: an exception is a failure of the scorer
        return Mismatch(case, None, None, f"scorer raised {type(exc).__name__}: {exc}")
    if (first.reward, first.outcome, first.details) != (second.reward, second.outcome, second.details):
        return Mismatch(case, first.reward, first.outcome, "not deterministic: two scores differ")
    if first.reward != case.want:
        return Mismatch(
            case,
            first.reward,
            first.outcome,
            f"want reward {case.want:g}, got {first.reward:g} ({first.outcome})",
        )
    if case.want_outcome is not None and first.outcome != case.want_outcome:
        return Mismatch(
            case, first.reward, first.outcome, f"want outcome {case.want_outcome!r}, got {first.outcome!r}"
        )
    return None


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
    report = ValidationReport(scorer=f"{verifier.name}@{verifier.version}")
    for path in paths:
        cases = load_golden(path, dataset=dataset, outcome_field=outcome_field)
        if not cases:
            raise DataError("golden file has no cases", path=path)
        report.per_file[str(path)] = len(cases)
        for case in cases:
            report.checked += 1
            bad = _check(verifier, case)
            if bad is not None:
                report.mismatches.append(bad)
    return report
