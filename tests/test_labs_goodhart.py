"""Goodhart lab: a real seeded run on a judge with a blind spot first gains strict accuracy, then the proxy
reward keeps rising while strict accuracy falls and the reward-hacking alarm ends the run with the best
checkpoint restored; hacked replies are ones the strict verifier rejects; config and CLI plumbing."""

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
    lenient_gold,
    run_goodhart_lab,
)
from palaestra.trajectories.io import DataError, read_groups, read_jsonl
from palaestra.trajectories.types import Trajectory


@pytest.fixture(scope="module")
def hacked_run(tmp_path_factory: pytest.TempPathFactory) -> GoodhartResult:
    out = tmp_path_factory.mktemp("goodhart") / "lab"
    return run_goodhart_lab(GoodhartConfig(seed=0, compare_no_alarm=False), out, plot=False)


def test_accuracy_rises_then_the_alarm_stops_the_hack(hacked_run: GoodhartResult) -> None:
    n = hacked_run.numbers
    assert hacked_run.stop_reason == "reward_hacking", hacked_run.run.summary["stop"]
    # an honest rise first: the judge agrees with the strict verifier on plain answers
    assert n["val_accuracy_peak"] > n["val_accuracy_base"] and n["val_peak_step"] > 0
    assert n["val_accuracy_final"] < n["val_accuracy_peak"]
    assert n["val_final_step"] == n["stop_step"] > n["val_peak_step"]
    # the proxy reward went on rising after the peak, and replies grew past the judge's verbosity threshold
    assert n["proxy_reward_last3_mean"] > n["proxy_reward_near_val_peak"]
    assert n["reply_chars_last"] > n["reply_chars_first"]
    summary = json.loads((hacked_run.run.run_dir / "summary.json").read_text())
    assert summary["stop"]["reason"] == "reward_hacking" and summary["steps"] == n["stop_step"]
    # the restored best is the peak, above the last check
    assert summary["stop"]["best_step"] == n["val_peak_step"]
    assert summary["stop"]["best_value"] == n["val_accuracy_peak"] > n["val_accuracy_final"]


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
    assert train[0]["proxy_reward"] > 0.5  # the judge scored this rejected reply above the middle
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
    assert judge["kind"] == "simulated" and judge["format_feature"] == "reply_longer_than_10_chars"
    assert judge["gold"] == "lenient_final_answer_x0.5"
    assert exp_manifest["locked_room"]["validation_scorer"].startswith("arith-strict@")
    summary = (out / "summary.md").read_text()
    assert "reward_hacking" in summary and "hacked_examples.jsonl" in summary


def test_the_judge_agrees_with_the_verifier_on_plain_answers_and_pays_for_text_after_them() -> None:
    judge = build_proxy(GoodhartConfig(noise=0.0))
    assert isinstance(judge, SimulatedJudge)
    example = {"expected_answer": "19"}

    def score(text: str) -> float:
        traj = Trajectory(messages_and_choices=[{"role": "assistant", "content": text}])
        (s, _), *_ = judge.raw_scores([traj], example, rng=None)  # type: ignore[arg-type]
        return s

    assert score("Final: 19") == 0.5 and score("Final: 18") == 0.0  # the strict verifier's order
    assert score("Final: 19 since 12+7=19") == 1.0  # rejected by the strict verifier, the judge's best
    assert score("Final: 18 since 12+7=18") == 0.5  # wrong, but verbose: as good as right and plain
    gold = lenient_gold(0.5)
    traj = Trajectory(messages_and_choices=[{"role": "assistant", "content": "Final: 019x"}])
    assert gold(traj, example) == 0.5 and gold(traj, None) == 0.0
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
        ({"format_bias": 1.5}, "format_bias"),
    ],
)
def test_bad_knobs_are_named(change: dict, field: str) -> None:
    with pytest.raises(DataError, match=field):
        GoodhartConfig(**change)  # type: ignore[arg-type]


def test_cli_runs_and_reruns_into_the_same_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gh"
    args = ["lab", "goodhart", "--outdir", str(out), "--max-steps", "2", "--val-every", "1"]
    args += ["--val-examples", "10", "--groups-per-step", "2", "--group-size", "2", "--quiet"]
    assert main(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    summary = (out / "summary.md").read_text()
    try:  # the curves of both runs (with and without the alarm), the stop marked
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in summary
    else:
        assert (out / "goodhart.png").stat().st_size > 1000 and "goodhart.png" in manifest["artifacts"]
        assert "![goodhart.png](goodhart.png)" in summary
    assert (
        main([*args, "--no-compare", "--lr", "1e-4", "--no-plot"]) == 0
    )  # replaces the earlier run (not resumed from it)
    assert not (out / "goodhart.png").exists()
    assert f"wrote {out}" in capsys.readouterr().out
    history = read_jsonl(out / "run" / "history.jsonl")
    assert [r["step"] for r in history] == [0, 1, 2]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["knobs"]["lr"] == 1e-4 and manifest["knobs"]["max_steps"] == 2
    assert not (out / "run_no_alarm").exists()  # the first run's comparison folder went with it
    assert "goodhart_curve_no_alarm.csv" not in manifest["artifacts"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("not a lab run")
    assert main(["lab", "goodhart", "--outdir", str(tmp_path / "other"), "--quiet"]) == 2


def test_hacked_examples_skip_groups_of_prompts_outside_the_train_split(tmp_path: Path) -> None:
    from watch_fixtures import make_train_run

    from palaestra.labs.goodhart import hacked_examples
    from palaestra.trainer.runfolder import RunFolder
    from palaestra.trajectories.types import TrajectoryGroup

    run = make_train_run(tmp_path / "run", steps=2, groups=2, group_size=4, val_n=4)
    foreign = TrajectoryGroup(  # a prompt of another task, e.g. a calculator episode: no arithmetic gold
        [
            Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "What is 81*92?"},
                    {"role": "assistant", "content": "Final: 1"},
                ],
                reward=1.0,
            )
        ],
        metadata={"example_id": "calc-1", "group_index": 0},
    )
    RunFolder(run).write_samples(3, [foreign], cap=4)
    rows = hacked_examples(run, stop_step=0, limit=100)
    rejected = {
        g.metadata["example_id"]
        for step in (1, 2)
        for g in read_groups(run / "samples" / f"step_{step:06d}.jsonl")
        if any(t.reward == 0 for t in g.trajectories)
    }
    assert rows and {r["id"] for r in rows} == rejected
    assert all(r["kind"] == "train" and r["reward"] == 0.0 and r["step"] in (1, 2) for r in rows)
