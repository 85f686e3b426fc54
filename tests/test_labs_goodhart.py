"""Goodhart lab: a real seeded run on a biased proxy ends with the reward-hacking alarm, true accuracy below
its peak, and hacked replies the strict verifier rejects; config and CLI plumbing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.verifier import VerifierReward
from palaestra.judges.simulated import SimulatedJudge
from palaestra.labs.goodhart import (
    GoodhartConfig,
    GoodhartResult,
    build_proxy,
    experiment_config,
    run_goodhart_lab,
    verbosity_feature,
)
from palaestra.trainer.stopping import binomial_drop_se
from palaestra.trajectories.io import DataError, read_jsonl


@pytest.fixture(scope="module")
def hacked_run(tmp_path_factory: pytest.TempPathFactory) -> GoodhartResult:
    out = tmp_path_factory.mktemp("goodhart") / "lab"
    return run_goodhart_lab(GoodhartConfig(seed=0, compare_no_alarm=False), out, plot=False)


def test_run_ends_with_reward_hacking_and_val_below_peak(hacked_run: GoodhartResult) -> None:
    n = hacked_run.numbers
    assert hacked_run.stop_reason == "reward_hacking", hacked_run.run.summary["stop"]
    assert n["val_accuracy_final"] < n["val_accuracy_peak"]
    assert n["val_final_step"] == n["stop_step"] > n["val_peak_step"]
    # the policy learned to pad: replies at the end are longer than at the start
    assert n["reply_chars_last"] > n["reply_chars_first"]
    assert n["val_prompts_lost"] > n["val_prompts_gained"]  # more base-solved prompts broken than new ones
    # what the alarm saw, re-read from the experiment's own history
    history = read_jsonl(hacked_run.run.run_dir / "history.jsonl")
    val = [(r["step"], r["val/greedy_accuracy"]) for r in history if "val/greedy_accuracy" in r]
    cfg = hacked_run.config
    peak_step, peak = max(val, key=lambda sv: (sv[1], sv[0]))
    recent = [v for s, v in val[-cfg.hacking_window :] if s > peak_step]
    level = sum(recent) / len(recent)
    se = binomial_drop_se(peak, level, cfg.val_examples, len(recent))
    assert peak - level > max(cfg.hacking_drop, 3.0 * se)  # the statistical drop of the stopping rule
    summary = json.loads((hacked_run.run.run_dir / "summary.json").read_text())
    assert summary["stop"]["reason"] == "reward_hacking" and summary["steps"] == n["stop_step"]


def test_hacked_examples_are_loved_by_the_proxy_and_rejected_by_the_verifier(
    hacked_run: GoodhartResult,
) -> None:
    strict = StrictFinalVerifier()
    train = [h for h in hacked_run.hacked if h["kind"] == "train"]
    assert train and hacked_run.numbers["hacked_replies_listed"] == len(train)
    for h in train:
        example = {"expected_answer": h["expected"]}
        assert strict.score(example, h["reply"]).reward == 0.0
        assert h["outcome"] == strict.score(example, h["reply"]).outcome
    assert [h["proxy_reward"] for h in train] == sorted((h["proxy_reward"] for h in train), reverse=True)
    assert train[0]["proxy_reward"] > 0.5  # the judge scored this wrong reply above the middle
    val = [h for h in hacked_run.hacked if h["kind"] == "val"]
    assert val  # validation prompts the base policy solved and the hacked policy no longer does
    for h in val:
        example = {"expected_answer": h["expected"]}
        assert strict.score(example, h["base_reply"]).outcome == "ok"
        assert strict.score(example, h["reply"]).reward == 0.0


def test_run_folder_artifacts(hacked_run: GoodhartResult) -> None:
    out = hacked_run.outdir
    assert out is not None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["lab"] == "goodhart" and manifest["status"] == "finished" and manifest["seed"] == 0
    assert {"goodhart_curve.csv", "hacked_examples.jsonl"} <= set(manifest["artifacts"])
    assert manifest["numbers"]["stop_reason"] == "reward_hacking"
    with open(out / "goodhart_curve.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert int(rows[-1]["step"]) == hacked_run.numbers["stop_step"] and rows[0]["val_greedy_accuracy"]
    exp_manifest = json.loads((out / "run" / "manifest.json").read_text())
    judge = exp_manifest["train_reward"]["judge"]
    assert judge["kind"] == "simulated" and judge["format_feature"] == "reply_longer_than_12_chars"
    assert exp_manifest["locked_room"]["validation_scorer"].startswith("arith-strict@")
    summary = (out / "summary.md").read_text()
    assert "reward_hacking" in summary and "hacked_examples.jsonl" in summary


def test_verbosity_feature_and_proxies() -> None:
    f = verbosity_feature(10)
    assert not f("Final: 198") and not f("  Final: -99\n") and f("Final: 42 because")
    assert f.__qualname__ == "reply_longer_than_10_chars"
    assert isinstance(build_proxy(GoodhartConfig()), SimulatedJudge)
    length = build_proxy(GoodhartConfig(proxy="length"))
    assert isinstance(length, SimulatedJudge) and length.format_bias == 0.0 and length.length_bias == 0.5
    naive = build_proxy(GoodhartConfig(proxy="naive"))
    assert isinstance(naive, VerifierReward) and naive.verifier.name.startswith("arith-naive")
    cfg = experiment_config(GoodhartConfig(alarm=False, max_steps=7), "x")
    assert cfg["stopping"]["hacking_window"] is None and cfg["stopping"]["patience"] == 8
    assert experiment_config(GoodhartConfig(proxy="naive"), "x")["reward"]["kind"] == "verifier"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"proxy": "judgee"}, "proxy"),
        ({"group_size": 1}, "group_size"),
        ({"temperature": 3.0}, "temperature"),
    ],
)
def test_bad_knobs_are_named(change: dict, field: str) -> None:
    with pytest.raises(DataError, match=field):
        GoodhartConfig(**change).check()  # type: ignore[arg-type]


def test_cli_runs_and_reruns_into_the_same_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gh"
    args = [
        "lab",
        "goodhart",
        "--outdir",
        str(out),
        "--max-steps",
        "2",
        "--val-every",
        "1",
        "--val-examples",
        "10",
        "--groups-per-step",
        "2",
        "--group-size",
        "2",
        "--no-plot",
        "--quiet",
    ]
    assert main(args) == 0
    assert main([*args, "--no-compare"]) == 0  # replaces the earlier run (not resumed from it)
    assert f"wrote {out}" in capsys.readouterr().out
    history = read_jsonl(out / "run" / "history.jsonl")
    assert [r["step"] for r in history] == [0, 1, 2]
    assert not (out / "run_no_alarm").exists()  # the first run's comparison folder went with it
    assert "goodhart_curve_no_alarm.csv" not in json.loads((out / "manifest.json").read_text())["artifacts"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("not a lab run")
    assert main(["lab", "goodhart", "--outdir", str(tmp_path / "other"), "--quiet"]) == 2
