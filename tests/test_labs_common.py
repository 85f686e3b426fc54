"""The lab run folder (``LabRun``): numpy values and paths become plain CSV/JSON, empty tables say so."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from palaestra.evals.runs import load_run
from palaestra.labs.common import LabRun


def test_numpy_values_and_paths_are_written_as_plain_values(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    knobs = {"data": tmp_path / "d.jsonl", "n": np.int64(3), "ps": np.array([0.25, 0.75])}
    lab = LabRun(out, lab="test", seed=1, knobs=knobs)
    rows = [
        {"step": np.int64(t), "f64": np.float64(0.1) * t, "f32": np.float32(0.5), "ok": np.bool_(t > 0)}
        for t in range(3)
    ]
    lab.write_csv("curve.csv", rows, table="Curve (curve.csv)")
    lab.write_jsonl("rows.jsonl", [{"reward": np.float64(1.0), "where": tmp_path}])
    lab.table("Nothing to show", [])
    lab.finish("Test lab", "nothing", ["a sentence"], {"mean": np.float64(0.25)})

    with open(out / "curve.csv", newline="") as fh:
        got = list(csv.DictReader(fh))
    assert got == [
        {"step": "0", "f64": "0.0", "f32": "0.5", "ok": "False"},
        {"step": "1", "f64": "0.1", "f32": "0.5", "ok": "True"},
        {"step": "2", "f64": "0.2", "f32": "0.5", "ok": "True"},
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["knobs"] == {"data": str(tmp_path / "d.jsonl"), "n": 3, "ps": [0.25, 0.75]}
    assert manifest["seed"] == 1 and manifest["numbers"] == {"mean": 0.25}
    assert json.loads((out / "rows.jsonl").read_text()) == {"reward": 1.0, "where": str(tmp_path)}
    summary = (out / "summary.md").read_text()
    assert "## Nothing to show\n\n(no rows)\n" in summary
    assert "| 2 | 0.2 | 0.5 | True |" in summary
    # the run view charts every numeric column of the CSV over the steps (one series per value of 'ok')
    charts = {c.key: c for c in load_run(out).charts}
    points = sorted(p for s in charts["lab-curve.csv-f64"].series for p in s.points)
    assert points == [(0.0, 0.0), (1.0, 0.1), (2.0, 0.2)]


def test_show_browses_the_lab_rows_that_carry_a_reward(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    lab = LabRun(out, lab="test", seed=0, knobs={})
    rows = [
        {"step": 1, "reward": 1.0, "arm": 2},
        {"step": 1, "note": "a row without a reward (a header, a sample without a score)"},
        {"step": 2, "reward": "high"},  # not a number
        {"step": 2, "reward": 0.0, "advantage": -0.5, "outcome": "wrong_answer"},
    ]
    lab.write_jsonl("rows.jsonl", rows)
    lab.finish("Test lab", "nothing", [], {})
    view = load_run(out)
    shown = view.rollouts()
    assert view.kind == "lab" and view.steps() == [1, 2]
    assert [(r.step, r.reward, r.advantage, r.outcome) for r in shown] == [
        (1, 1.0, None, None),
        (2, 0.0, -0.5, "wrong_answer"),
    ]
    assert shown[0].extra == {"arm": 2} and shown[1].category == "model_math"
