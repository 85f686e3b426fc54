"""`palaestra report`: one self-contained HTML file (facts, curves, breakdown, embedded rollouts) for train,
eval and lab runs, and for a real (tiny) training run; capping, escaping, the CLI."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from watch_fixtures import make_eval_run, make_select_run, make_train_run

from palaestra.cli import main
from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.evaluate import evaluate_completions
from palaestra.evals.report import allocate, report_html, write_report
from palaestra.evals.runs import load_run
from palaestra.evals.show import diff_steps
from palaestra.evals.taxonomy import category_of
from palaestra.trajectories.io import read_jsonl


def embedded(html: str) -> dict[str, Any]:
    m = re.search(r"<script type='application/json' id='report-data'>(.*?)</script>", html, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))  # type: ignore[no-any-return]


def assert_self_contained(html: str) -> None:
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert not re.search(r"<(link|iframe|img|object|embed)\b", html, re.I)
    assert not re.search(r"\b(src|href)\s*=\s*[\"']?(https?:|//)", html, re.I)
    assert "<script src" not in html and "@import" not in html and "url(" not in html
    assert html.count("<script") == 2  # the data and the inline script


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_train_run(tmp_path_factory.mktemp("report") / "train", steps=6)


def test_allocate_shares_the_budget_evenly() -> None:
    sizes = {"a": 3, "b": 100, "c": 100, "d": 0, "e": 40}
    take = allocate(sizes, 120)
    assert sum(take.values()) == 120 and all(take[k] <= sizes[k] for k in sizes)
    assert take["a"] == 3 and take["d"] == 0 and abs(take["b"] - take["c"]) <= 1 and take["e"] == 39
    assert allocate(sizes, 10_000) == sizes and sum(allocate(sizes, 7).values()) == 7
    assert allocate({}, 5) == {} and allocate(sizes, 0) == dict.fromkeys(sizes, 0)


def test_train_report_has_facts_curves_breakdown_and_rollouts(train_run: Path, tmp_path: Path) -> None:
    out = write_report(train_run, tmp_path / "r.html")
    html = out.read_text(encoding="utf-8")
    assert_self_contained(html)
    view = load_run(train_run)
    # locked-room facts, stop reason
    for key, value in view.manifest["locked_room"].items():
        assert f"<td>{key}</td>" in html and str(value) in html
    assert "Stopped at step 6: plateau" in html
    # curves: one point per train step, val dots, stop and best markers
    assert [m for m in re.findall(r'data-chart="([^"]+)"', html)] == ["reward", "kl", "signal"]
    reward_svg = html[html.index('data-chart="reward"') : html.index('data-chart="kl"')]
    line = re.search(r'data-series="train reward \(mean\)".*?points="([^"]+)"', reward_svg, re.S)
    assert line and len(line.group(1).split()) == 6
    assert reward_svg.count("val accuracy (greedy) at step") == 4  # steps 0, 2, 4, 6
    assert "stop: plateau" in reward_svg and f"best {view.stop['best_value']:.3g}" in reward_svg  # type: ignore[index]
    # breakdown: one table row per step file, category counts as in the run
    table = html[html.index('id="breakdown-table"') :]
    table = table[: table.index("</table>")]
    counts = view.step_counts()
    assert table.count("<tr>") - 1 == len(counts)
    val4 = next(c for c in counts if c.step == 4 and c.source == "val")
    assert val4.n == 12 and sum(val4.categories.values()) == 12
    # embedded rollouts: all of them (under the cap), categories from the taxonomy table
    data = embedded(html)
    assert len(data["rollouts"]) == len(view.rollouts()) == sum(t["n"] for t in data["totals"])
    assert all(r["c"] == category_of(r["o"]) for r in data["rollouts"])
    assert len(data["texts"]) < sum(len(r["m"]) for r in data["rollouts"])  # prompts stored once
    assert data["diff"] and data["diff_default"] == [0, 6] and data["steps"] == [0, 1, 2, 3, 4, 5, 6]
    zw = [data["texts"][m[1]] for r in data["rollouts"] for m in r["m"] if "200B" in data["texts"][m[1]]]
    assert zw and all("\\u{200B ZERO WIDTH SPACE}" in t and "\u200b" not in t for t in zw)


def test_large_runs_are_capped_evenly_and_keep_diff_pairs(train_run: Path) -> None:
    view = load_run(train_run)
    data = embedded(report_html(view, max_rollouts=30, page_size=5))
    assert len(data["rollouts"]) == 30 and data["page_size"] == 5
    per_file = Counter((r["s"], r["src"]) for r in data["rollouts"])
    assert max(per_file.values()) - min(per_file.values()) <= 1 and len(per_file) == len(view.files)
    ids = {s: [r["id"] for r in data["rollouts"] if r["s"] == s and r["src"] == "val"] for s in (0, 6)}
    assert ids[0] == ids[6] and ids[0]  # the same first validation prompts at every step: diffs still pair
    assert {t["e"] for t in data["totals"]} <= {2, 3} and sum(t["n"] for t in data["totals"]) > 30
    assert "30 of " in report_html(view, max_rollouts=30)
    long = report_html(view, max_chars=5)
    assert "chars not embedded" in long


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-rollouts", "synthetic-with-suspect"])
def test_eval_run_report_has_no_curves(tmp_path: Path, frozen: bool) -> None:
    run = make_eval_run(tmp_path, frozen=frozen)
    html = write_report(run).read_text(encoding="utf-8")
    assert_self_contained(html)
    assert "data-chart=" not in html and "id='curves'" not in html and 'id="diff"' not in html
    results = read_jsonl(run / "results.jsonl")
    data = embedded(html)
    assert [r["c"] for r in data["rollouts"]] == [row["category"] for row in results]
    assert set(data["categories"]) == {row["category"] for row in results} and not data["diff"]
    assert all(r["m"][0][0] == "user" for r in data["rollouts"])  # prompts found in the dataset file
    for k, v in (("scorer_name", "arith-strict"), ("n_examples", str(len(results)))):
        assert f'<td>{k}</td><td><code title="{v}">' in html
    if not frozen:
        assert "verifier_suspect" in data["categories"]


def test_select_run_report(tmp_path: Path) -> None:
    run = make_select_run(tmp_path)
    html = write_report(run).read_text(encoding="utf-8")
    assert_self_contained(html)
    data = embedded(html)
    assert data["kind"] == "select" and len(data["rollouts"]) == len(read_jsonl(run / "results.jsonl"))
    assert "pass@N" in html and "selector" in html


def test_untrusted_text_cannot_break_out_of_the_report(tmp_path: Path) -> None:
    dev = load_split("dev")[:2]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in dev))
    evil = "</script><script>alert(1)</script><b>x</b>&amp;"
    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps({"id": e["id"], "completion": evil}) + "\n" for e in dev))
    evaluate_completions(data, comp, tmp_path / "run")
    html = write_report(tmp_path / "run").read_text(encoding="utf-8")
    assert "<script>alert" not in html and "<b>x</b>" not in html and html.count("</script>") == 2
    texts = embedded(html)["texts"]
    assert any("</script><script>alert(1)</script>" in t for t in texts)  # intact once decoded


def test_lab_run_report_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lab"
    assert main(["lab", "bandit", "--outdir", str(out), "--steps", "8", "--no-plot", "--quiet"]) == 0
    capsys.readouterr()
    view = load_run(out)
    pulls = read_jsonl(out / "pulls.jsonl")
    assert view.kind == "lab" and len(view.rollouts()) == len(pulls)
    assert [r.advantage for r in view.rollouts()] == [p["advantage"] for p in pulls]
    html = write_report(out).read_text(encoding="utf-8")
    assert_self_contained(html)
    assert 'data-chart="lab-steps.csv-p_best"' in html and "id='curves'" in html
    assert main(["show", str(out), "--step", "3", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert text.count("== step 3 | lab ==") == 2


def test_show_and_report_on_a_real_training_run(
    tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from palaestra.trainer.experiment import Experiment

    cfg = {
        "run": {
            "name": "tiny",
            "output_dir": str(tmp_path / "run"),
            "groups_per_step": 2,
            "group_size": 3,
            "max_steps": 3,
            "samples_per_step": 6,
            "progress": False,
        },
        "model": {"name": str(tiny_model_path)},
        "validation": {"every": 2, "max_examples": 6},
        "env": {"max_tokens": 6},
    }
    summary = Experiment(cfg, printer=None).run_sync()
    run = tmp_path / "run"
    assert main(["show", str(run), "--step", "last", "--limit", "0"]) == 0
    text = capsys.readouterr().out
    assert f"stop: {summary['stop']['reason']} at step 3" in text
    assert text.count("== step 3 | train |") == 6 and text.count("== step 3 | val |") == 6
    assert main(["show", str(run), "--diff", "0", "3"]) == 0
    assert "6 prompt(s) in both" in capsys.readouterr().out
    assert main(["report", str(run)]) == 0
    assert "report.html" in capsys.readouterr().out
    html = (run / "report.html").read_text(encoding="utf-8")
    assert_self_contained(html)
    assert f"Stopped at step 3: {summary['stop']['reason']}" in html
    data = embedded(html)
    assert len(data["rollouts"]) == 3 * 6 + 3 * 6  # steps 1-3 samples, val at 0, 2, 3
    src, pairs, _, _ = diff_steps(load_run(run), 0, 3)
    assert src == "val" and len(pairs) == 6


def test_report_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "run folder not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="page_size"):
        write_report(tmp_path, page_size=0)


def test_reports_of_a_run_just_started_one_step_and_many_steps(tmp_path: Path) -> None:
    # started: manifest and config written, nothing sampled or validated yet
    run = make_train_run(tmp_path / "started", steps=1, val_n=2)
    for p in [*run.glob("*/step_*.jsonl"), run / "history.jsonl", run / "summary.json"]:
        p.unlink()
    html = write_report(run).read_text(encoding="utf-8")
    assert "<p class='muted'>No rollouts saved.</p>" in html and 'data-chart="' not in html
    # killed after the validation of step 0: every curve point at one x
    run = make_train_run(tmp_path / "one", steps=1, val_n=2)
    (run / "samples" / "step_000001.jsonl").unlink()
    (run / "val" / "step_000001.jsonl").unlink()
    (run / "summary.json").unlink()
    history = run / "history.jsonl"
    history.write_text(history.read_text().splitlines(keepends=True)[0])
    html = write_report(run).read_text(encoding="utf-8")
    reward_svg = html[html.index('data-chart="reward"') :].split("</svg>")[0]
    # the one step sits on the left edge of an x axis running 0..1 (not a division by a zero range)
    assert re.search(
        r'<circle cx="56.0" cy="[\d.]+" r="3" [^>]*><title>val accuracy \(greedy\) at step 0', reward_svg
    )
    ticks = re.findall(
        r'<text x="([\d.]+)" y="\d+" class="tick" text-anchor="middle">([^<]+)</text>', reward_svg
    )
    assert ticks == [("56.0", "0"), ("744.0", "1")]
    # 14 steps: the category bars label round step numbers only
    run = make_train_run(tmp_path / "long", steps=14, groups=1, group_size=2, val_every=100, val_n=2)
    html = write_report(run).read_text(encoding="utf-8")
    bars = html[html.index("train rollouts: category shares per step") - 2000 :]
    bars = bars[bars.rindex("<svg", 0, 2000) : bars.index("</svg>", 2000)]
    labels = re.findall(r'class="tick" text-anchor="middle">(\d+)</text>', bars)
    assert bars.count('<g class="bar"') == 14 and labels == ["2", "4", "6", "8", "10", "12", "14"]
