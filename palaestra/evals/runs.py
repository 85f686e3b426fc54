"""Load any palaestra run folder (train, eval, select, lab) into one view: manifest, curves, rollouts, counts.

:func:`load_run` reads only the small files (manifest, summary, history); rollouts are read per file when
asked for (:meth:`RunView.rollouts`), so ``palaestra show RUN --step 12`` on a 500-step run reads one file.

Where rollouts come from:

* train runs: ``samples/step_N.jsonl`` (trajectory groups, source ``"train"``) and ``val/step_N.jsonl``
  (greedy validation rows, source ``"val"``; their prompts are looked up by id in the environment's split);
* eval and select runs: ``results.jsonl`` (source ``"eval"`` / ``"select"``, no step; prompts are looked up
  in the dataset file the manifest names when its sha256 still matches);
* lab runs: rows of the lab's JSONL artifacts that carry a ``reward`` (source ``"lab"``, no messages).

Every rollout gets a category from the one taxonomy table (:func:`palaestra.evals.taxonomy.category_of`)
unless its row already carries the final category (eval rows: ``verifier_suspect`` overrides the table).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.evals.charts import Chart, charts_for_history, charts_for_lab
from palaestra.evals.run_rollouts import (
    Rollout,
    lab_rollouts,
    num,
    result_rollouts,
    train_rollouts,
    val_rollouts,
)
from palaestra.evals.taxonomy import category_of
from palaestra.trajectories.io import DataError, PathLike, iter_jsonl, sha256_file
from palaestra.trajectories.runs import read_json

__all__ = ["Rollout", "RunView", "StepCounts", "load_run"]

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


@dataclass(frozen=True)
class StepCounts:
    """Outcome and category counts of one step and source; ``complete`` is False when they come from a
    capped sample of the step's rollouts (``samples/``) rather than from every rollout."""

    step: int | None
    source: str
    n: int
    outcomes: dict[str, int]
    categories: dict[str, int]
    reward_mean: float | None
    complete: bool


class RunView:
    """A run folder read into one shape, whatever wrote it (see the module docstring)."""

    def __init__(self, root: Path, kind: str, manifest: dict[str, Any], summary: dict[str, Any]) -> None:
        self.root = root
        self.kind = kind
        self.manifest = manifest
        self.summary = summary
        self.config: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.charts: list[Chart] = []
        self.files: dict[tuple[int | None, str], Path] = {}
        self._cache: dict[tuple[int | None, str], list[Rollout]] = {}
        self._prompts: dict[str, str] | None = None

    # ---- facts ---------------------------------------------------------------------------------------------
    @property
    def title(self) -> str:
        name = self.config.get("run", {}).get("name") if isinstance(self.config.get("run"), dict) else None
        return f"{self.kind} run {name or self.root.name}"

    @property
    def stop(self) -> dict[str, Any] | None:
        """``summary["stop"]`` of a finished train run (reason, step, message, best_step), else None."""
        stop = self.summary.get("stop")
        return stop if isinstance(stop, dict) else None

    def locked_room(self) -> dict[str, Any]:
        """The facts two runs must share to be compared, as the run's manifest records them."""
        m = self.manifest
        if self.kind == "train":
            return dict(m.get("locked_room") or {})
        if self.kind == "lab":
            return {
                "lab": m.get("lab"),
                "seed": m.get("seed"),
                **(m.get("knobs") or {}),
                "code": m.get("code"),
            }
        from palaestra.evals.manifest import locked_room

        facts = locked_room(m)
        facts["code"] = m.get("code")
        return facts

    def sources(self) -> list[str]:
        """Rollout sources of this run in display order."""
        found = {src for _, src in self.files}
        return [s for s in ("train", "val", "eval", "select", "lab") if s in found]

    def steps(self, source: str | None = None) -> list[int]:
        """Steps that have rollouts (of ``source`` when given), ascending."""
        found = {s for s, src in self.files if s is not None and (source is None or src == source)}
        if self.kind == "lab" and source in (None, "lab") and (None, "lab") in self.files:
            found |= {r.step for r in self.load((None, "lab")) if r.step is not None}
        return sorted(found)

    # ---- rollouts ------------------------------------------------------------------------------------------
    def rollouts(
        self, *, steps: Iterable[int] | None = None, sources: Iterable[str] | None = None
    ) -> list[Rollout]:
        """Rollouts of the chosen steps and sources (all by default), in step then file order."""
        want_steps = None if steps is None else set(steps)
        want_src = None if sources is None else set(sources)
        out: list[Rollout] = []
        for key in self.file_keys():
            step, src = key
            if (want_steps is not None and step is not None and step not in want_steps) or (
                want_src is not None and src not in want_src
            ):
                continue
            rows = self.load(key)
            out += (
                rows if want_steps is None or step is not None else [r for r in rows if r.step in want_steps]
            )
        return out

    def file_keys(self) -> list[tuple[int | None, str]]:
        """``(step, source)`` of every rollout file, in step order (train samples before val rows)."""
        return sorted(self.files, key=lambda k: (-1 if k[0] is None else k[0], k[1] != "train", k[1]))

    def count_rollouts(self, key: tuple[int | None, str]) -> int:
        """How many rollouts the file ``key`` holds (validation and result files: one per non-blank line,
        counted without parsing)."""
        if key in self._cache or key[1] in ("train", "lab"):
            return len(self.load(key))
        with open(self.files[key], encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())

    def head(self, key: tuple[int | None, str], n: int) -> list[Rollout]:
        """The first ``n`` rollouts of file ``key``; validation and result files are read only that far."""
        if key in self._cache or key[1] in ("train", "lab"):
            return self.load(key)[:n]
        return self._read(key, n)

    def load(self, key: tuple[int | None, str]) -> list[Rollout]:
        """The rollouts of one file (read once, then cached)."""
        if key not in self._cache:
            self._cache[key] = self._read(key)
        return self._cache[key]

    def _read(self, key: tuple[int | None, str], limit: int | None = None) -> list[Rollout]:
        step, src = key
        path = self.files[key]
        if src == "train":
            return train_rollouts(path, step)
        if src == "lab":
            return lab_rollouts(path)
        if src == "val":
            return val_rollouts(path, step, self._prompt_table(), limit)
        return result_rollouts(path, src, self._prompt_table(), limit)

    def _prompt_table(self) -> dict[str, str]:
        if self._prompts is None:
            self._prompts = _find_prompts(self)
        return self._prompts

    # ---- counts --------------------------------------------------------------------------------------------
    def step_counts(self) -> list[StepCounts]:
        """Outcome/category counts per step and source: validation from history (all examples), train from
        ``train/outcome/*`` history keys when logged, else from the saved samples; eval from every row."""
        out: list[StepCounts] = []
        logged: dict[tuple[int, str], StepCounts] = {}
        for row in self.history:
            step = row.get("step")
            if not isinstance(step, int):
                continue
            for src in ("train", "val"):
                codes = {
                    k.split("/", 2)[2]: int(v)
                    for k, v in row.items()
                    if k.startswith(f"{src}/outcome/") and num(v) is not None
                }
                if codes:
                    mean = num(row.get("train/reward_mean" if src == "train" else "val/greedy_accuracy"))
                    logged[(step, src)] = _counts(step, src, codes, mean, complete=True)
        for key in self.file_keys():
            step, src = key
            if step is not None and (step, src) in logged:
                out.append(logged.pop((step, src)))
                continue
            rows = self.load(key)
            codes = dict(Counter(r.outcome or "-" for r in rows))
            mean = sum(r.reward for r in rows) / len(rows) if rows else None
            out.append(_counts(step, src, codes, mean, complete=src != "train"))
        out += logged.values()
        return sorted(out, key=lambda c: (-1 if c.step is None else c.step, c.source))


def _counts(
    step: int | None, src: str, codes: dict[str, int], mean: float | None, *, complete: bool
) -> StepCounts:
    cats: Counter[str] = Counter()
    for code, n in codes.items():
        cats["-" if code == "-" else category_of(code)] += n
    return StepCounts(step, src, sum(codes.values()), dict(sorted(codes.items())), dict(cats), mean, complete)


# ---- helpers ---------------------------------------------------------------------------------------
def _find_prompts(view: RunView) -> dict[str, str]:
    """id -> prompt text: the environment's splits (train runs) or the eval dataset file (eval runs)."""
    rows: list[Mapping[str, Any]] = []
    if view.kind == "train":
        env = view.manifest.get("environment")
        env = env if isinstance(env, dict) else {}
        env_cfg = view.config.get("env")
        env_cfg = env_cfg if isinstance(env_cfg, dict) else {}
        try:
            from palaestra.envs.registry import get_env

            spec = get_env(str(env.get("name") or env_cfg.get("name")))
            rows = list(spec.load_split(str(env_cfg.get("val_split", "val"))))
        except Exception:  # an unknown or unavailable environment: prompts just stay unknown
            rows = []
    elif view.kind in ("eval", "select"):
        rec = (view.manifest.get("inputs") or {}).get("dataset") or {}
        for cand in (Path(str(rec.get("path", ""))), view.root.parent / str(rec.get("path", ""))):
            if rec.get("path") and cand.is_file() and sha256_file(cand) == rec.get("sha256"):
                rows = [r for _, r in iter_jsonl(cand) if isinstance(r, dict)]
                break
    return {str(r["id"]): str(r["prompt"]) for r in rows if "id" in r and isinstance(r.get("prompt"), str)}


def _step_files(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))}


def _detect_kind(root: Path, manifest: Mapping[str, Any]) -> str:
    kind = manifest.get("kind")
    if kind == "palaestra-lab-manifest" or manifest.get("loop") == "lab":
        return "lab"
    if kind == "train" or (root / "history.jsonl").exists():
        return "train"
    if manifest.get("command") == "select" or manifest.get("loop") == "B":
        return "select"
    if manifest.get("command") == "eval" or manifest.get("loop") == "A" or (root / "results.jsonl").exists():
        return "eval"
    raise DataError(
        "not a palaestra run folder (no history.jsonl, results.jsonl or known manifest.json)", path=root
    )


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def load_run(run_dir: PathLike) -> RunView:
    """Read a run folder's manifest, summary and history and index its rollout files."""
    root = Path(run_dir)
    if not root.is_dir():
        raise DataError("run folder not found", path=root)
    manifest = read_json(root / "manifest.json") if (root / "manifest.json").exists() else {}
    summary = read_json(root / "summary.json") if (root / "summary.json").exists() else {}
    if not isinstance(manifest, dict) or not isinstance(summary, dict):
        raise DataError("manifest.json and summary.json must hold JSON objects", path=root)
    view = RunView(root, _detect_kind(root, manifest), manifest, summary)
    if view.kind == "train":
        if (root / "config.json").exists():
            cfg = read_json(root / "config.json")
            view.config = cfg if isinstance(cfg, dict) else {}
        if (root / "history.jsonl").exists():
            for line, row in iter_jsonl(root / "history.jsonl"):
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise DataError(
                        "history row needs an integer 'step'", path=root / "history.jsonl", line=line
                    )
                view.history.append(row)
        for folder, src in (("samples", "train"), ("val", "val")):
            view.files.update({(step, src): p for step, p in _step_files(root / folder).items()})
        view.charts = charts_for_history(view.history, view.stop)
    elif view.kind == "lab":
        tables = {}
        for name in manifest.get("artifacts") or []:
            p = root / str(name)
            if p.suffix == ".csv" and p.is_file():
                tables[p.name] = _read_csv(p)
            elif p.suffix == ".jsonl" and p.is_file() and (None, "lab") not in view.files:
                view.files[(None, "lab")] = p  # the first JSONL artifact: rows with a reward are browsed
        view.charts = charts_for_lab(tables)
    elif (root / "results.jsonl").exists():
        view.files[(None, view.kind)] = root / "results.jsonl"
    return view
