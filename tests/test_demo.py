"""`palaestra demo` (the README's main command) runs end to end with small settings and leaves a full run folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_quick(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "palaestra", "demo", "--quick", "--outdir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    for line in ("base val accuracy (greedy)", "best val accuracy (greedy)", "stop reason", "curves"):
        assert line in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["stop"]["reason"] == "max_steps"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train_reward"]["kind"] == "simulated_judge"  # trained on judge rewards ...
    assert (
        manifest["locked_room"]["validation_scorer"] == "arith-strict@1.0.0"
    )  # ... validated by the verifier
    assert (out / "model.npz").is_file() and (out / "README.md").is_file()
    assert (out / "curves.png").is_file() or (out / "curves.txt").is_file()


def test_demo_judge_flags_switch_to_a_real_ruler_judge() -> None:
    import argparse

    from palaestra.demo import demo_config

    args = argparse.Namespace(
        outdir="x",
        seed=0,
        max_steps=None,
        quick=True,
        task="arithmetic",
        judge_model="gpt-x",
        judge_base_url="http://127.0.0.1:9/v1",
        judge_api_key_env="K",
    )
    cfg = demo_config(args)
    assert cfg["reward"] == {
        "kind": "judge",
        "judge_model": "gpt-x",
        "judge_base_url": "http://127.0.0.1:9/v1",
        "judge_api_key_env": "K",
    }
