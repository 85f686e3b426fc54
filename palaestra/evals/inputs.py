"""Harness inputs (datasets, completion/sample files, golden sets) validated with errors naming ``file:line``;
the scorer registry (a name or ``package.module:attr`` -> a verifier, with its cross-check pair) and the
validation of a scorer against golden sets (formats: docs/harness.md)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.arithmetic_data import DATA_DIR
from palaestra.envs.verifier import Verifier
from palaestra.evals.taxonomy import category_of, classify
from palaestra.trajectories.io import DataError, PathLike, iter_jsonl, json_object

ScorerFactory = Callable[[], Any]

STRICT = "arith-strict"
NAIVE = "arith-naive-TEACHING-ONLY"

_REGISTRY: dict[str, ScorerFactory] = {STRICT: StrictFinalVerifier, NAIVE: NaiveVerifier}
_CROSS: dict[str, tuple[str, str]] = {STRICT: (STRICT, NAIVE), NAIVE: (STRICT, NAIVE)}


@dataclass(frozen=True)
class CrossCheck:
    """A strict and a lenient verifier: a result is suspect when the lenient one accepts and the strict one
    rejects the same completion."""

    strict: Verifier
    lenient: Verifier

    def describe(self) -> dict[str, dict[str, str]]:
        """Names and versions, for manifests."""
        return {k: {"name": v.name, "version": v.version} for k, v in vars(self).items()}


def register_scorer(name: str, factory: ScorerFactory, *, cross_check: tuple[str, str] | None = None) -> None:
    """Register ``factory`` (called with no arguments) under ``name``; ``cross_check`` names a registered
    ``(strict, lenient)`` pair used for ``verifier_suspect``."""
    if not name or ":" in name:
        raise ValueError(f"scorer name must be non-empty and contain no ':', got {name!r}")
    _REGISTRY[name] = factory
    _CROSS.pop(name, None)
    if cross_check is not None:
        _CROSS[name] = cross_check


def get_scorer(spec: str) -> Verifier:
    """The verifier for a registered name or a ``module:attr`` reference; ``ValueError`` names the choices."""
    if spec in _REGISTRY:
        target = _REGISTRY[spec]()
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"scorer {spec!r}: cannot import ({exc})") from None
        if isinstance(target, type) or (callable(target) and not isinstance(target, Verifier)):
            try:
                target = target()
            except TypeError as exc:  # a class or function that needs arguments: not a scorer factory
                raise ValueError(
                    f"scorer {spec!r}: {attr} cannot be called with no arguments ({exc})"
                ) from exc
    else:
        raise ValueError(
            f"unknown scorer {spec!r}; choose one of {', '.join(sorted(_REGISTRY))} or module:attr"
        )
    if not isinstance(target, Verifier):
        raise ValueError(f"scorer {spec!r}: {target!r} lacks name/version/score(example, completion)")
    return target


def cross_check_for(spec: str) -> CrossCheck | None:
    """The cross-check pair registered for a scorer name (None for unknown or ``module:attr`` scorers)."""
    pair = _CROSS.get(spec)
    return None if pair is None else CrossCheck(strict=get_scorer(pair[0]), lenient=get_scorer(pair[1]))


def scorer_tag(verifier: Verifier) -> str:
    """``name@version``."""
    return f"{verifier.name}@{verifier.version}"


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


def row_id(row: Any, path: Path, line: int) -> str:
    """The ``id`` of a row, which must be a JSON object with a non-empty string ``id``."""
    ex_id = json_object(row, path, line).get("id")
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


def load_samples(path: PathLike, dataset: Dataset, *, repeats: bool = False) -> dict[str, list[SampleRow]]:
    """Completions keyed by id (dataset order), each list sorted by sample index; with ``repeats``, rows without
    ``sample`` may repeat an id (numbered in file order, as ``palaestra select`` allows)."""
    p = Path(path)
    seen: dict[tuple[str, int], int] = {}
    rows: dict[str, list[SampleRow]] = {}
    has_none: bool | None = None
    for lineno, row in iter_jsonl(p):
        ex_id = row_id(row, p, lineno)
        if ex_id not in dataset.line_of:
            raise DataError(f"id {ex_id!r} is not in the dataset {dataset.path}", path=p, line=lineno)
        completion = row_completion(row, p, lineno)
        sample = row.get("sample")
        if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 0):
            raise DataError(f"field 'sample' must be an int >= 0, got {sample!r}", path=p, line=lineno)
        lp = row.get("sum_logprob")
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp)
        ):
            raise DataError(
                f"field 'sum_logprob' must be a finite number or null, got {lp!r}", path=p, line=lineno
            )
        if has_none is not None and (sample is None) != has_none:
            where = "has no" if sample is None else "has a"
            raise DataError(
                f"this row {where} 'sample' field, unlike the rows before it", path=p, line=lineno
            )
        has_none = sample is None
        mine = rows.setdefault(ex_id, [])
        if sample is None:
            if mine and not repeats:
                raise DataError(
                    f"duplicate id {ex_id!r} (first at line {mine[0].line}); give each row a 'sample' "
                    "index to score several completions per id",
                    path=p,
                    line=lineno,
                )
            sample = len(mine)  # numbered in file order
        if (ex_id, sample) in seen:
            raise DataError(
                f"duplicate (id, sample) ({ex_id!r}, {sample}) (first at line {seen[ex_id, sample]})",
                path=p,
                line=lineno,
            )
        seen[ex_id, sample] = lineno
        extra = {k: v for k, v in row.items() if k not in ("id", "completion", "sample", "sum_logprob")}
        mine.append(SampleRow(ex_id, sample, completion, None if lp is None else float(lp), lineno, extra))
    if missing := [e["id"] for e in dataset.examples if e["id"] not in rows]:
        raise DataError(
            f"id {missing[0]!r} has no {'sample' if repeats else 'completion'} in {p} ({len(missing)} of "
            f"{len(dataset.examples)} dataset ids have none; every dataset id needs at least one)",
            path=dataset.path,
            line=dataset.line_of[missing[0]],
        )
    return {e["id"]: sorted(rows[e["id"]], key=lambda r: r.sample) for e in dataset.examples}


@dataclass(frozen=True)
class HarnessInputs:
    """What ``palaestra eval`` and ``select`` read: the dataset, the samples file and its rows by id, the
    scorer and its registered cross-check pair (None for ``module:attr`` scorers)."""

    dataset: Dataset
    path: Path
    samples: dict[str, list[SampleRow]]
    scorer: Verifier
    cross: CrossCheck | None

    def score(self, example: Mapping[str, Any], completion: str) -> dict[str, Any]:
        """Score one completion: reward, outcome, categories, suspect flag, cross-check outcomes and details."""
        score = self.scorer.score(example, completion)
        suspect = False
        cross_out: dict[str, str] | None = None
        if self.cross is not None:
            mine = (self.scorer.name, self.scorer.version)
            strict, lenient = (
                score if (v.name, v.version) == mine else v.score(example, completion)
                for v in (self.cross.strict, self.cross.lenient)
            )
            suspect = lenient.reward > 0.0 and not strict.reward > 0.0
            cross_out = {"strict": strict.outcome, "lenient": lenient.outcome}
        return {
            "reward": score.reward,
            "outcome": score.outcome,
            "category": classify(score.outcome, suspect=suspect),
            "table_category": category_of(score.outcome),
            "suspect": suspect,
            "cross_check": cross_out,
            "details": score.details,
        }


def load_inputs(dataset: PathLike, samples: PathLike, scorer: str, *, repeats: bool = False) -> HarnessInputs:
    """Resolve the scorer (first: an unknown name fails before any file is read), then load both files
    (``repeats``: see :func:`load_samples`)."""
    verifier = get_scorer(scorer)
    ds = load_dataset(dataset)
    path = Path(samples)
    return HarnessInputs(ds, path, load_samples(path, ds, repeats=repeats), verifier, cross_check_for(scorer))


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
        fields = {k: row.get(k, base.get(k)) for k in ("prompt", "expected_answer") if k in row or k in base}
        example = {"id": case_id, **fields}
        outcome = row.get(outcome_field) if outcome_field else None
        outcome = outcome if isinstance(outcome, str) else None
        klass, why = str(row.get("class", "")), str(row.get("why", ""))
        cases.append(GoldenCase(p, lineno, case_id, example, completion, float(want), outcome, klass, why))
    return cases


def _check(verifier: Verifier, case: GoldenCase) -> Mismatch | None:
    # scored twice: a different second score is a mismatch too (the verifier contract says deterministic)
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
    if not (paths := [Path(g) for g in golden] if golden else default_golden()):
        raise DataError("no golden files to validate against")
    report = ValidationReport(scorer=scorer_tag(verifier))
    for path in paths:
        if not (cases := load_golden(path, dataset=dataset, outcome_field=outcome_field)):
            raise DataError("golden file has no cases", path=path)
        report.per_file[str(path)] = len(cases)
        report.checked += len(cases)
        report.mismatches += [m for m in (_check(verifier, c) for c in cases) if m is not None]
    return report
