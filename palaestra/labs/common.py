"""Shared plumbing of the labs: the run folder (:class:`LabRun`), common CLI arguments and input parsing.

A lab run folder holds::

    manifest.json   lab, seed, every knob, code version, command line, created time, artifacts (sha256)
    <data>.csv / <data>.jsonl
    <plot>.png      when matplotlib (the ``plot`` extra) is installed; otherwise summary.md says so
    summary.md      what the run shows, with its numbers
    README.md       the run note (loop "lab", knob turned), as every palaestra run folder

A lab module writes its run with::

    run = LabRun(outdir, lab="bandit", seed=cfg.seed, knobs=asdict(cfg))
    run.write_csv("steps.csv", rows)
    run.plot("bandit.png", draw)          # draw(plt) makes the figure; skipped with a note without matplotlib
    run.finish(title=..., knob=..., shows=[...], numbers={...})

Re-running into a folder that holds an earlier run of the *same* lab replaces that run (the artifacts its
manifest lists are removed first); any other non-empty folder is refused, so a lab never mixes its files with
someone else's.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from palaestra.trajectories.io import DataError, PathLike, atomic_write_bytes, atomic_write_text, sha256_file
from palaestra.trajectories.io import append_jsonl as _append_jsonl
from palaestra.trajectories.io import write_jsonl as _write_jsonl
from palaestra.trajectories.runs import (
    code_version,
    command_line,
    read_json,
    utc_now,
    write_json,
    write_run_note,
)

__all__ = [
    "MANIFEST_KIND",
    "LabRun",
    "add_common_args",
    "fmt",
    "markdown_table",
    "parse_floats",
    "print_table",
]

MANIFEST_KIND = "palaestra-lab-manifest"
MANIFEST_NAME = "manifest.json"
_OWN_FILES = (MANIFEST_NAME, "summary.md", "README.md")


def fmt(value: Any, digits: int = 4) -> str:
    """Short human form of a number (``4`` significant digits) or of anything else via ``str``."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


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
    """One lab run folder: data files, an optional plot, ``summary.md``, ``README.md``, ``manifest.json``.

    ``knobs`` holds every setting of the run (what ``manifest.json`` records under ``"knobs"``); ``seed`` is
    recorded on its own (``None`` for a lab without randomness). The manifest is written at once with
    ``"status": "running"`` and rewritten by :meth:`finish` with the artifact list and the headline numbers.
    """

    def __init__(
        self,
        outdir: PathLike,
        *,
        lab: str,
        seed: int | None,
        knobs: Mapping[str, Any],
        argv: Sequence[str] | None = None,
    ) -> None:
        self.outdir = Path(outdir)
        self.lab = lab
        self.seed = seed
        self.knobs = _jsonable(dict(knobs))
        self.argv = list(argv) if argv is not None else command_line()
        self.created = utc_now()
        self.artifacts: list[str] = []
        self.notes: list[str] = []
        self.plots: list[str] = []
        self._prepare_outdir()
        self._write_manifest(status="running", numbers={})

    # -- folder --------------------------------------------------------------------------------------------
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

    def path(self, name: str) -> Path:
        """Path of an artifact ``name`` (a plain file name) inside the run folder."""
        if not name or Path(name).name != name:
            raise ValueError(f"artifact name must be a plain file name, got {name!r}")
        return self.outdir / name

    def add_artifact(self, name: str) -> Path:
        """Record ``name`` as an artifact of this run (for files written by other code into ``outdir``)."""
        if name not in self.artifacts:
            self.artifacts.append(name)
        return self.path(name)

    # -- data ----------------------------------------------------------------------------------------------
    def write_csv(
        self, name: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
    ) -> Path:
        """Write ``rows`` (dicts) as CSV atomically; ``columns`` defaults to the first row's keys in order."""
        cols = list(columns) if columns is not None else (list(rows[0].keys()) if rows else [])
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="raise", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
        path = self.add_artifact(name)
        atomic_write_text(path, buf.getvalue())
        return path

    def write_jsonl(self, name: str, rows: Sequence[Mapping[str, Any]]) -> Path:
        """Write ``rows`` as JSONL atomically."""
        path = self.add_artifact(name)
        _write_jsonl(path, [_jsonable(r) for r in rows])
        return path

    def append_jsonl(self, name: str, rows: Sequence[Mapping[str, Any]]) -> Path:
        """Append ``rows`` to a JSONL log and fsync (for long labs that log step by step)."""
        path = self.add_artifact(name)
        _append_jsonl(path, [_jsonable(r) for r in rows])
        return path

    def write_json(self, name: str, obj: Any) -> Path:
        """Write one JSON document atomically (sorted keys, indent 2)."""
        path = self.add_artifact(name)
        write_json(path, _jsonable(obj))
        return path

    def write_text(self, name: str, text: str) -> Path:
        """Write a text artifact atomically."""
        path = self.add_artifact(name)
        atomic_write_text(path, text)
        return path

    def note(self, text: str) -> None:
        """Add a note for ``summary.md`` and the run note."""
        self.notes.append(text)

    # -- plot ----------------------------------------------------------------------------------------------
    def plot(self, name: str, draw: Callable[[Any], None], *, enabled: bool = True) -> Path | None:
        """Draw a figure with matplotlib (Agg backend) and save it as ``name``; return its path.

        ``draw(plt)`` receives ``matplotlib.pyplot`` and builds the current figure(s); this method saves and
        closes it. Without matplotlib (the ``plot`` extra) nothing is drawn, a note saying so goes into
        ``summary.md`` and ``None`` is returned; ``enabled=False`` (``--no-plot``) skips with a note too.
        """
        if not enabled:
            self.note(f"{name} not drawn (--no-plot).")
            return None
        try:
            import matplotlib

            matplotlib.use("Agg", force=True)
            import matplotlib.pyplot as plt
        except ImportError:
            self.note(f"{name} not drawn: matplotlib is not installed (pip install 'palaestra[plot]').")
            return None
        plt.close("all")
        try:
            draw(plt)
            buf = io.BytesIO()
            plt.gcf().savefig(
                buf, format=Path(name).suffix.lstrip(".") or "png", dpi=110, bbox_inches="tight"
            )
        finally:
            plt.close("all")
        path = self.add_artifact(name)
        atomic_write_bytes(path, buf.getvalue())
        self.plots.append(name)
        return path

    # -- finish --------------------------------------------------------------------------------------------
    def finish(
        self,
        *,
        title: str,
        knob: str,
        shows: Sequence[str],
        numbers: Mapping[str, Any],
        tables: Sequence[tuple[str, Sequence[Mapping[str, Any]]]] = (),
    ) -> Path:
        """Write ``summary.md``, the ``README.md`` run note and the final ``manifest.json``; return outdir.

        ``shows``: sentences saying what the run shows (with its numbers); ``numbers``: the headline figures
        (also stored in the manifest); ``tables``: ``(heading, rows)`` pairs rendered as markdown tables.
        """
        nums = _jsonable(dict(numbers))
        lines = [f"# {title}", "", "## What this run shows", ""]
        lines += [f"- {s}" for s in shows]
        lines += ["", "## Numbers", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in nums.items()]
        for heading, rows in tables:
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
        hashes = {a: sha256_file(self.path(a)) for a in self.artifacts if self.path(a).is_file()}
        manifest = {
            "kind": MANIFEST_KIND,
            "format_version": 1,
            "loop": "lab",
            "lab": self.lab,
            "status": status,
            "seed": self.seed,
            "knobs": self.knobs,
            "code": code_version(),
            "command_line": self.argv,
            "created": self.created,
            "artifacts": list(self.artifacts),
            "sha256": hashes,
            "numbers": dict(numbers),
        }
        write_json(self.outdir / MANIFEST_NAME, manifest)


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value)
    if hasattr(value, "item"):
        return _csv_value(value.item())
    return value


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Rows of dicts as markdown table lines (columns from the first row)."""
    if not rows:
        return ["(no rows)"]
    cols = list(rows[0].keys())
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return out


def print_table(rows: Sequence[Mapping[str, Any]], print_fn: Callable[[str], None] = print) -> None:
    """Print rows of dicts as an aligned plain-text table."""
    if not rows:
        return
    cols = list(rows[0].keys())
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print_fn("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print_fn("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def parse_floats(text: str, *, field: str) -> list[float]:
    """Parse ``"0.1,0.5,1"`` into floats; errors name the ``field`` (e.g. ``--means``) and the bad item."""
    items = [t.strip() for t in text.split(",")]
    out = []
    for i, item in enumerate(items):
        try:
            value = float(item)
        except ValueError:
            raise DataError(f"{field}: item {i} ({item!r}) is not a number") from None
        if not math.isfinite(value):
            raise DataError(f"{field}: item {i} ({item!r}) is not finite")
        out.append(value)
    return out


def add_common_args(p: argparse.ArgumentParser, *, lab: str, seed: bool = True) -> None:
    """``--outdir`` (default ``runs/lab-<lab>``), ``--seed``, ``--no-plot``, ``--quiet``."""
    p.add_argument("--outdir", default=f"runs/lab-{lab}", help="run folder (default: %(default)s)")
    if seed:
        p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="do not draw plots")
    p.add_argument("--quiet", action="store_true", help="print only the run folder")
