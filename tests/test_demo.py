"""`palaestra demo` (the README's main command) runs end to end with small settings, trains with the learned
judge, validates with the strict verifier and reports the test split."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from palaestra.demo import banner, demo_config


def test_demo_quick(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "palaestra", "demo", "--quick", "--quiet", "--outdir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "learned judge arith-rm" in proc.stdout and "can be fooled" in proc.stdout
    for line in (
        "base: test accuracy (greedy)",
        "restored best: test accuracy (greedy)",
        "last step: test accuracy (greedy)",
        "best val accuracy (selection)",
        "stop ",
        "judge fooled at the last step (test)",
    ):
        assert line in proc.stdout, line
    assert "step    1" not in proc.stdout  # --quiet: no progress lines
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train_reward"]["kind"] == "learned_judge"  # trained on the learned judge's rewards ...
    assert manifest["train_reward"]["judge"]["model"] == "arith-rm"
    assert manifest["train_reward"]["judge"]["fingerprint"].startswith("sha256:")
    assert manifest["locked_room"]["validation_scorer"].startswith(
        "arith-strict@"
    )  # ... validated by the verifier
    report = json.loads((out / "demo.json").read_text())
    assert report["judge"] == "learned_judge" and report["test_split"] == "test"
    assert set(report["test"]) == {"base", "restored best", "last step"}
    for entry in report["test"].values():
        assert entry["n"] == 200 and 0.0 <= entry["test_accuracy"] <= 1.0
        assert 0.0 < entry["judge_mean_reward"] < 1.0
        assert 0 <= entry["judge_fooled"]["count"] <= entry["n"]
    assert report["judge_reward_curve"] and report["stop"]["reason"]
    assert (out / "model.npz").is_file() and (out / "README.md").is_file()
    assert (out / "curves.png").is_file() or (out / "curves.txt").is_file()


def args_for(**kw: object) -> argparse.Namespace:
    base = dict(
        outdir="x",
        seed=0,
        max_steps=None,
        quick=False,
        task="arithmetic",
        judge="learned",
        reward_model="arith-rm",
        quiet=False,
        yes=False,
        judge_model=None,
        judge_base_url=None,
        judge_api_key_env="OPENAI_API_KEY",
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_default_is_the_learned_judge_and_simulated_is_labelled() -> None:
    cfg = demo_config(args_for())
    assert cfg["reward"]["kind"] == "learned_judge" and cfg["reward"]["learned"]["model"] == "arith-rm"
    assert cfg["validation"]["max_examples"] and cfg["run"]["max_steps"] <= 100  # fixed step budget
    sim = demo_config(args_for(judge="simulated"))
    assert sim["reward"]["kind"] == "simulated_judge"
    assert "SIMULATED judge (lab instrument)" in banner(sim)


def test_demo_judge_flags_switch_to_a_real_ruler_judge() -> None:
    cfg = demo_config(
        args_for(
            quick=True, judge_model="gpt-x", judge_base_url="http://127.0.0.1:9/v1", judge_api_key_env="K"
        )
    )
    assert cfg["reward"] == {
        "kind": "judge",
        "judge_model": "gpt-x",
        "judge_base_url": "http://127.0.0.1:9/v1",
        "judge_api_key_env": "K",
    }
    assert "RULER judge gpt-x" in banner(cfg)


def test_fooled_counts_wrong_answers_the_judge_rates_above_even() -> None:
    from palaestra.demo import fooled

    examples = [{"prompt": f"What is {i}+1? Reply with one line: Final: <int>"} for i in range(4)]
    completions = ["Final: 1", "Final: 9", "Final: 3", "Final: 7"]
    correct = [True, False, True, False]
    got = fooled(examples, completions, correct, [0.9, 0.8, 0.2, 0.4])
    assert got["count"] == 1  # the right answer rated 0.9 and the wrong one rated 0.4 do not count
    assert got["example"] == {"prompt": examples[1]["prompt"], "completion": "Final: 9", "judge": 0.8}
    assert fooled(examples, completions, correct, [0.1] * 4) == {"count": 0, "example": None}
