"""examples/hello_rollout.py runs against a real OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from palaestra import read_groups
from palaestra.testing import ScriptedServer

ROOT = Path(__file__).resolve().parents[1]


def answer(request: dict, n: int) -> str:
    a, b = map(int, re.findall(r"(\d+)\+(\d+)", request["messages"][-1]["content"])[0])
    return f"Final: {a + b}" if n % 2 == 0 else "Final: 0"


def test_hello_rollout_example(tmp_path: Path) -> None:
    out = tmp_path / "groups.jsonl"
    with ScriptedServer(answer, model="tiny") as server:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "hello_rollout.py"),
                "--base-url",
                server.base_url,
                "--model",
                "tiny",
                "--groups",
                "3",
                "--group-size",
                "4",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert server.calls == 12
        assert all(r["model"] == "tiny" and r["logprobs"] is True for r in server.requests)
    groups = read_groups(out)
    assert [len(g) for g in groups] == [4, 4, 4]
    rewards = [r for g in groups for r in g.rewards()]
    assert sorted(set(rewards)) == [0.0, 1.0] and sum(rewards) == 6.0
    assert "12 trajectories in 3 groups" in proc.stdout
