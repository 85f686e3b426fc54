"""Every example in examples/ (hello_rollout.py has its own test) runs with --quick as a subprocess and exits
0, offline and, where it takes one, against a real OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from palaestra import read_groups
from palaestra.judges.simulated import SimulatedJudge
from palaestra.testing import Reply, ScriptedServer
from palaestra.trajectories.io import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
OWN_TESTS = {"hello_rollout.py", "agentic_calculator.py", "mcp_calc_server.py"}  # each has its own test


def run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert proc.returncode == 0, f"{name} {args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_every_example_is_covered() -> None:
    found = {p.name for p in EXAMPLES.glob("*.py")} - OWN_TESTS
    assert found == set(QUICK), f"examples without a smoke test: {sorted(found - set(QUICK))}"


QUICK: dict[str, list[str]] = {
    "custom_rollout.py": [],
    "verifier_vs_judge.py": ["--reward", "judge"],
    "hybrid_train_judge_stop_val.py": ["--outdir", "hybrid"],
    "play_2048.py": [],
    "best_of_n.py": ["--outdir", "bon"],
}


def test_every_example_takes_quick(tmp_path: Path) -> None:
    """The README promises --quick for every example: each one's --help lists it, and hello_rollout.py (tested
    against a server in test_example_hello.py) also runs offline with it."""
    servers = {"mcp_calc_server.py"}  # an MCP tool server other code starts, not a run: nothing to shorten
    for path in sorted(p for p in EXAMPLES.glob("*.py") if p.name not in servers):
        proc = run(path.name, "--help", cwd=tmp_path)
        assert "--quick" in proc.stdout, path.name
    proc = run("hello_rollout.py", "--quick", "--out", "hello.jsonl", cwd=tmp_path)
    assert sum(len(g) for g in read_groups(tmp_path / "hello.jsonl")) == 4


@pytest.mark.parametrize("name", sorted(QUICK))
def test_example_runs_offline(name: str, tmp_path: Path) -> None:
    proc = run(name, "--quick", *QUICK[name], cwd=tmp_path)
    assert proc.stdout.strip()


def _answer(question: str) -> int:
    a, op, b = re.search(r"What is (\d+)([+-])(\d+)\?", question).groups()  # type: ignore[union-attr]
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def arithmetic_and_tools(request: dict[str, Any], n: int) -> Reply:
    """Answers single-turn questions (wrong on odd requests); with tools, calls the calculator first."""
    messages = request["messages"]
    question = next(m["content"] for m in messages if m["role"] == "user")
    if request.get("tools") and messages[-1]["role"] != "tool":
        args = json.dumps({"expression": re.search(r"What is (\d+[+-]\d+)\?", question).group(1)})  # type: ignore[union-attr]
        return Reply(
            None,
            tool_calls=[
                {"id": f"c{n}", "type": "function", "function": {"name": "calculator", "arguments": args}}
            ],
        )
    if messages[-1]["role"] == "tool":
        return Reply(f"Final: {messages[-1]['content']}")
    return Reply(f"Final: {_answer(question) + n % 2}")


def test_custom_rollout_against_an_endpoint(tmp_path: Path) -> None:
    out = tmp_path / "groups.jsonl"
    with ScriptedServer(arithmetic_and_tools, model="m") as server:
        proc = run(
            "custom_rollout.py",
            "--quick",
            "--base-url",
            server.base_url,
            "--model",
            "m",
            "--out",
            str(out),
            cwd=tmp_path,
        )
        tool_requests = [r for r in server.requests if r.get("tools")]
    groups = read_groups(out)
    single, tools = groups[:3], groups[3:]
    assert [len(g) for g in groups] == [2] * 6
    assert all(t.tools is None for g in single for t in g)
    assert all(t.reward == 1.0 and t.metrics["tool_calls"] == 1 for g in tools for t in g)
    tool_msgs = [m for t in tools[0] for m in t.messages() if m["role"] == "tool"]
    assert tool_msgs and all(
        m["content"] == str(_answer(tools[0].trajectories[0].messages()[1]["content"])) for m in tool_msgs
    )
    assert len(tool_requests) == 12 and "tool calls per rollout: 1.00" in proc.stdout


def test_hybrid_with_a_real_ruler_judge_over_http(tmp_path: Path) -> None:
    def gold(traj: Any, example: Any) -> float:
        question = next(m["content"] for m in traj.messages() if m["role"] == "user")
        return float((traj.last_assistant_text() or "").strip() == f"Final: {_answer(question)}")

    judge = SimulatedJudge(gold, noise=0.05, seed=1)
    with ScriptedServer(judge.as_script(), model="judge") as server:
        proc = run(
            "hybrid_train_judge_stop_val.py",
            "--quick",
            "--outdir",
            "run",
            "--judge-model",
            "judge",
            "--judge-base-url",
            server.base_url,
            cwd=tmp_path,
        )
        calls = server.calls
    assert calls >= 4 * 4  # one judge request per group: 4 groups x 4 steps (plus any retries)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["train_reward"]["kind"] == "judge" and manifest["train_reward"]["model"] == "judge"
    assert "stop reason:" in proc.stdout
    history = read_jsonl(tmp_path / "run" / "history.jsonl")
    assert all(r.get("judge/calls", 0) >= 4 for r in history[1:])


def test_play_2048_multi_turn_against_an_endpoint(tmp_path: Path) -> None:
    moves = ["left", "down", "right", "up"]
    with ScriptedServer(lambda req, n: moves[(len(req["messages"]) // 2) % 4], model="player") as server:
        proc = run(
            "play_2048.py",
            "--quick",
            "--base-url",
            server.base_url,
            "--model",
            "player",
            "--out",
            str(tmp_path / "g.jsonl"),
            cwd=tmp_path,
        )
        calls = server.calls
    groups = read_groups(tmp_path / "g.jsonl")
    turns = [t.metrics["turns"] for g in groups for t in g]
    assert calls == sum(turns) and max(turns) > 1  # games last several turns
    assert all(t.metrics["moves"] >= 1 for g in groups for t in g)
    assert "invalid-move rate" in proc.stdout


def test_best_of_n_against_an_endpoint(tmp_path: Path) -> None:
    with ScriptedServer(
        lambda req, n: f"Final: {_answer(req['messages'][-1]['content']) + (n % 3 != 0)}", model="m"
    ) as server:
        run(
            "best_of_n.py",
            "--quick",
            "--base-url",
            server.base_url,
            "--model",
            "m",
            "--outdir",
            "bon",
            cwd=tmp_path,
        )
    summary = json.loads((tmp_path / "bon" / "best-of-4" / "summary.json").read_text())
    assert summary["pass@N"] >= summary["pass@1"] and summary["N"] == 4
    meta = json.loads((tmp_path / "bon" / "samples.meta.json").read_text())
    assert meta["policy"]["backend"] == "remote" and meta["sampling"]["samples_per_id"] == 4
