"""Shared plumbing of the labs: the run folder (:class:`LabRun`), knob checks, command helpers."""

from __future__ import annotations

import argparse
import csv
import io
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from palaestra.trajectories.io import DataError, PathLike, atomic_write_bytes, atomic_write_text, sha256_file
from palaestra.trajectories.io import write_jsonl as _write_jsonl
from palaestra.trajectories.runs import (
    code_version,
    command_line,
    fmt,
    read_json,
    utc_now,
    write_json,
    write_run_note,
)

MANIFEST_KIND = "palaestra-lab-manifest"
MANIFEST_NAME = "manifest.json"
_OWN_FILES = (MANIFEST_NAME, "summary.md", "README.md")
#: Advantage modes of :func:`palaestra.trainer.advantages.group_advantages` the labs offer.
ADV_MODES: tuple[str, ...] = ("dr_grpo", "rloo", "grpo")


def reinforce_grad(pi: np.ndarray, actions: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """REINFORCE logit gradient ``(1/B) sum_i A_i (onehot(a_i) - pi)`` (``actions``, ``adv``: shape ``(..., B)``)."""
    onehot = np.eye(pi.shape[-1])[actions]
    return np.asarray((adv[..., None] * (onehot - pi)).mean(axis=-2))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(z / z.sum(axis=-1, keepdims=True))


def _jsonable(value: Any) -> Any:
    """Turn numpy scalars/arrays, tuples and paths into plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _jsonable(value.tolist())
    return value


class LabRun:
    """One lab run folder; ``manifest.json`` is written at once (``"status": "running"``) and by :meth:`finish`."""

    def __init__(self, outdir: PathLike, *, lab: str, seed: int | None, knobs: Mapping[str, Any]) -> None:
        self.outdir = Path(outdir)
        self.lab = lab
        self.seed = seed
        self.knobs = _jsonable(dict(knobs))
        self.created = utc_now()
        self.artifacts: list[str] = []
        self.notes: list[str] = []
        self.plots: list[str] = []
        self.tables: list[tuple[str, Sequence[Mapping[str, Any]]]] = []
        self._prepare_outdir()
        self._write_manifest(status="running", numbers={})

    def _prepare_outdir(self) -> None:
        out = self.outdir
        if out.exists() and not out.is_dir():
            raise DataError("outdir exists and is not a folder", path=out)
        if not out.exists() or not any(out.iterdir()):
            out.mkdir(parents=True, exist_ok=True)
            return
        manifest = out / MANIFEST_NAME
        old = read_json(manifest) if manifest.exists() else None
        if not (isinstance(old, dict) and old.get("kind") == MANIFEST_KIND and old.get("lab") == self.lab):
            raise DataError(
                f"outdir is not empty and holds no earlier 'lab {self.lab}' run; choose an empty or new "
                "folder",
                path=out,
            )
        for name in list(old.get("artifacts", [])) + list(_OWN_FILES):
            target = out / str(name)
            if target.parent == out and target.is_file():
                target.unlink()

    def fresh_subfolder(self, name: str) -> Path:
        """``outdir/name`` with an earlier run's copy removed."""
        path = self.outdir / name
        if path.exists():
            shutil.rmtree(path)
        return path

    def _artifact(self, name: str) -> Path:
        if name not in self.artifacts:
            self.artifacts.append(name)
        return self.outdir / name

    def write_csv(self, name: str, rows: Sequence[Mapping[str, Any]], *, table: str | None = None) -> None:
        """Write ``rows`` (dicts) as CSV; with ``table``, also show them in ``summary.md`` under that heading."""
        if table is not None:
            self.table(table, rows)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [], lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: _csv_value(v) for k, v in row.items()} for row in rows)
        atomic_write_text(self._artifact(name), buf.getvalue())

    def write_jsonl(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Write ``rows`` as JSONL atomically."""
        _write_jsonl(self._artifact(name), [_jsonable(r) for r in rows])

    def write_json(self, name: str, obj: Any) -> None:
        """Write one JSON document atomically (sorted keys, indent 2)."""
        write_json(self._artifact(name), _jsonable(obj))

    def table(self, heading: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Add a table of ``rows`` (dicts) under ``heading`` to ``summary.md``."""
        self.tables.append((heading, rows))

    def note(self, text: str) -> None:
        """Add a note for ``summary.md`` and the run note."""
        self.notes.append(text)

    def plot(self, name: str, draw: Callable[[Any], None], *, enabled: bool = True) -> None:
        """``draw(plt)`` builds a figure saved as PNG ``name``; without matplotlib or when disabled, a note."""
        if not enabled:
            return self.note(f"{name} not drawn (--no-plot).")
        try:
            import matplotlib

            matplotlib.use("Agg", force=True)
            import matplotlib.pyplot as plt
        except ImportError:
            return self.note(
                f"{name} not drawn: matplotlib is not installed (pip install 'palaestra[plot]')."
            )
        plt.close("all")
        try:
            draw(plt)
            plt.gcf().tight_layout()
            buf = io.BytesIO()
            plt.gcf().savefig(buf, format="png", dpi=110, bbox_inches="tight")
        finally:
            plt.close("all")
        atomic_write_bytes(self._artifact(name), buf.getvalue())
        self.plots.append(name)

    def finish(self, title: str, knob: str, shows: Sequence[str], numbers: Mapping[str, Any]) -> Path:
        """Write ``summary.md``, the run note and the final manifest; return outdir."""
        nums = _jsonable(dict(numbers))
        lines = [f"# {title}", "", "## What this run shows", ""]
        lines += [f"- {s}" for s in shows]
        lines += ["", "## Numbers", "", *markdown_table([{"metric": k, "value": v} for k, v in nums.items()])]
        for heading, rows in self.tables:
            lines += ["", f"## {heading}", "", *markdown_table(rows)]
        if self.plots:
            lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in self.plots]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        data = [a for a in self.artifacts if a not in self.plots]
        lines += ["", "## Files", ""] + [f"- `{a}`" for a in data + self.plots + list(_OWN_FILES)]
        atomic_write_text(self.outdir / "summary.md", "\n".join(lines) + "\n")
        locked = {"lab": self.lab, "seed": self.seed, **self.knobs, "code": code_version()}
        write_run_note(
            self.outdir,
            loop="lab",
            title=title,
            knob=knob,
            locked_room=locked,
            numbers=nums,
            notes=[*shows, *self.notes, "Details: summary.md; every setting: manifest.json."],
        )
        self._write_manifest(status="finished", numbers=nums)
        return self.outdir

    def _write_manifest(self, *, status: str, numbers: Mapping[str, Any]) -> None:
        hashes = {a: sha256_file(self.outdir / a) for a in self.artifacts if (self.outdir / a).is_file()}
        manifest = {
            "kind": MANIFEST_KIND,
            "format_version": 1,
            "loop": "lab",
            "lab": self.lab,
            "status": status,
            "seed": self.seed,
            "knobs": self.knobs,
            "code": code_version(),
            "command_line": command_line(),
            "created": self.created,
            "artifacts": list(self.artifacts),
            "sha256": hashes,
            "numbers": dict(numbers),
        }
        write_json(self.outdir / MANIFEST_NAME, manifest)


def _csv_value(value: Any) -> Any:
    if hasattr(value, "item"):  # a numpy scalar first: np.float64 is a float whose repr names its type
        value = value.item()
    return repr(value) if isinstance(value, float) else value


def _cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Columns (the first row's keys) and the formatted cells of ``rows``."""
    cols = list(rows[0].keys()) if rows else []
    return cols, [[fmt(r.get(c, "")) for c in cols] for r in rows]


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Rows of dicts as markdown table lines (columns from the first row)."""
    if not rows:
        return ["(no rows)"]
    cols, cells = _cells(rows)
    head, *body = ["| " + " | ".join(r) + " |" for r in [cols, *cells]]
    return [head, "|" + "---|" * len(cols), *body]


def parse_floats(text: str, *, field: str, kind: Callable[[str], Any] = float) -> list[Any]:
    """Parse ``"0.1,0.5,1"`` into numbers (``kind``: float or int); errors name ``field`` and the bad item."""
    out = []
    for i, item in enumerate(t.strip() for t in text.split(",")):
        try:
            value = kind(item)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise DataError(f"{field}: item {i} ({item!r}) is not {what}") from None
        if not math.isfinite(value):
            raise DataError(f"{field}: item {i} ({item!r}) is not finite")
        out.append(value)
    return out


C = TypeVar("C")


def config_from_args(cls: type[C], args: argparse.Namespace, **values: Any) -> C:
    """``cls(**values)``, each other field of the dataclass ``cls`` taken from ``args`` when it has one."""
    known = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    return cls(**{**known, **values})


def print_result(
    outdir: Path | None, *, quiet: bool, blocks: Sequence[str | Sequence[Mapping[str, Any]]]
) -> int:
    """Print each block (a line, or rows as a table) unless ``quiet``, then ``wrote OUTDIR``; return 0."""
    if not quiet:
        for block in blocks:
            if isinstance(block, str):
                print(block)
            elif block:
                cols, cells = _cells(block)
                widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
                for row in [cols, *cells]:
                    print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    print(f"wrote {outdir}")
    return 0


def arithmetic_grpo_config(
    run_dir: PathLike,
    *,
    name: str,
    model: str,
    seed: int,
    steps: int,
    reward: Mapping[str, Any],
    **sections: Any,
) -> dict[str, Any]:
    """A lab's GRPO run config on the arithmetic task; each of ``sections`` adds its options to that section."""
    base: dict[str, dict[str, Any]] = {
        "run": {"name": name, "seed": seed, "output_dir": str(run_dir), "max_steps": steps},
        "model": {"name": model},
        "env": {"name": "arithmetic"},
        "reward": dict(reward),
        "validation": {"sampled": False},
        "train": {"seed": seed},
        "stopping": {"patience": steps + 1, "collapse_window": None},
    }
    unknown = sorted(set(sections) - set(base))
    if unknown:  # a misspelt section would otherwise be dropped without a word
        raise TypeError(
            f"arithmetic_grpo_config: unknown section(s) {unknown}; expected some of {sorted(base)}"
        )
    return {key: {**value, **sections.get(key, {})} for key, value in base.items()}


def require(ok: Any, field: str, rule: str, value: Any) -> None:
    """A knob check: raise :class:`DataError` ``"<field>: <rule>, got <value>"`` unless ``ok``."""
    if not ok:
        raise DataError(f"{field}: {rule}, got {value!r}")


def require_in(cfg: Any, name: str, options: Sequence[str]) -> None:
    """Raise :class:`DataError` unless the knob ``name`` of ``cfg`` is one of ``options``."""
    require(getattr(cfg, name) in options, name, f"expected one of {', '.join(options)}", getattr(cfg, name))


def require_at_least(cfg: Any, low: int, *names: str) -> None:
    """Raise :class:`DataError` naming the first knob of ``names`` whose value on ``cfg`` is below ``low``."""
    for name in names:
        require(getattr(cfg, name) >= low, name, f"must be >= {low}", getattr(cfg, name))
