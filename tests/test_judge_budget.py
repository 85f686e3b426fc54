"""The real-judge path of an experiment, with the real RulerJudge over real HTTP (a local ScriptedServer):
a judge cache in the run folder by default (a second identical run makes 0 calls), the planned number of
judge calls printed and refused above ``reward.max_judge_calls`` unless confirmed with ``--yes``,
``reward.quantize`` applied to the judge's scores, and a judge outage that stops the run with
``judge_unavailable`` (exit code 3, never ``collapse``) and resumes once the judge is back."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from palaestra.cli import main
from palaestra.judges.faults import reply_for
from palaestra.testing import Reply, ScriptedServer
from palaestra.trainer.builders import QuantizedReward, with_quantize
from palaestra.trainer.experiment import Experiment
from palaestra.trainer.stopping import EXIT_JUDGE_UNAVAILABLE
from palaestra.trajectories.io import DataError, read_groups, read_jsonl
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

GROUPS = 2
SIZE = 4


def good(request: dict[str, Any], n: int) -> Reply:
    return reply_for("good", request)


def judge_config(model: Path, out: Path, base_url: str, steps: int = 3, **reward: Any) -> dict[str, Any]:
    return {
        "run": {
            "name": "judge-budget",
            "seed": 5,
            "output_dir": str(out),
            "groups_per_step": GROUPS,
            "group_size": SIZE,
            "max_steps": steps,
            "max_concurrency": 1,  # bitwise-repeatable sampling, so a second run asks about the same groups
            "samples_per_step": GROUPS * SIZE,
            "progress": False,
        },
        "model": {"name": str(model)},
        "env": {"max_tokens": 6},
        "reward": {
            "kind": "judge",
            "judge_model": "scripted-judge",
            "judge_base_url": base_url,
            "judge_api_key_env": "PALAESTRA_TEST_UNSET_KEY",
            "judge_timeout": 2.0,
            "judge_max_retries": 0,
            "judge_backoff": 0.0,
            **reward,
        },
        "validation": {"every": 1000, "max_examples": 5, "sampled": False},
        "stopping": {"patience": 1000},
    }


def write_toml(path: Path, cfg: dict[str, Any]) -> Path:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def rewards(run: Path) -> list[list[float]]:
    return [
        [t.reward for g in read_groups(f) for t in g.trajectories]
        for f in sorted((run / "samples").glob("step_*.jsonl"))
    ]


def test_cache_lives_in_the_run_folder_and_a_second_identical_run_makes_no_calls(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    with ScriptedServer(good) as server:
        first = tmp_path / "first"
        Experiment(judge_config(tiny_model_path, first, server.base_url), printer=None).run_sync()
        calls = server.calls
        assert calls == 3 * GROUPS  # one call per group, no retries
        assert (first / "judge_cache.sqlite").is_file()
        manifest = json.loads((first / "manifest.json").read_text())
        assert manifest["train_reward"]["judge_cache"] == "judge_cache.sqlite"

        # the same run again, reading the first run's cache: every group is a hit, no request is sent
        second = tmp_path / "second"
        cfg = judge_config(
            tiny_model_path, second, server.base_url, judge_cache=str(first / "judge_cache.sqlite")
        )
        Experiment(cfg, printer=None).run_sync()
        assert server.calls == calls
    history = read_jsonl(second / "history.jsonl")[1:]
    assert sum(r["judge/calls"] for r in history) == 0
    assert rewards(second) == rewards(first)

    # judge_cache = "off": no cache file, calls again
    with ScriptedServer(good) as server:
        third = tmp_path / "third"
        Experiment(
            judge_config(tiny_model_path, third, server.base_url, judge_cache="off"), printer=None
        ).run_sync()
        assert server.calls == 3 * GROUPS
    assert not (third / "judge_cache.sqlite").exists()


def test_planned_judge_calls_are_printed_and_refused_above_the_budget_without_yes(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ScriptedServer(good) as server:
        out = tmp_path / "run"
        cfg = judge_config(tiny_model_path, out, server.base_url, steps=2, max_judge_calls=3)
        toml = write_toml(tmp_path / "exp.toml", cfg)
        assert main(["train", "--config", str(toml), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "4 planned judge calls" in err[0] and "max_judge_calls = 3" in err[0]
        assert "--yes" in err[0]
        assert server.calls == 0 and not out.exists()  # refused before any file or call

        with pytest.raises(DataError, match="max_judge_calls"):
            Experiment(cfg, printer=None).run_sync()
        assert main(["train", "--config", str(toml), "--quiet", "--yes"]) == 0
        printed = capsys.readouterr().out
        assert "this run plans 4 judge calls (2 steps x 2 groups" in printed
        assert server.calls == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stop"]["reason"] == "max_steps"


def test_quantize_applies_to_the_ruler_judges_scores(tiny_model_path: Path, tmp_path: Path) -> None:
    with ScriptedServer(good) as server:
        out = tmp_path / "run"
        Experiment(judge_config(tiny_model_path, out, server.base_url, quantize=3), printer=None).run_sync()
    seen = {r for step in rewards(out) for r in step}
    assert seen and seen <= {0.0, 0.5, 1.0}  # the scripted scores lie in [0.05, 0.95]
    assert len(seen) >= 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train_reward"]["quantize"] == 3 and manifest["train_reward"]["judge"]["quantize"] == 3


async def _score(reward: Any, values: list[float]) -> list[float]:
    group = TrajectoryGroup([Trajectory(messages_and_choices=[], reward=v) for v in values])
    scored = await reward.score_group(group, None)
    return [t.reward for t in scored.trajectories]


def test_with_quantize_wraps_any_reward() -> None:
    import asyncio

    class Keep:
        async def score_group(self, group: TrajectoryGroup, example: Any = None) -> TrajectoryGroup:
            return group

    wrapped = with_quantize(Keep(), 5)
    assert isinstance(wrapped, QuantizedReward)
    assert asyncio.run(_score(wrapped, [0.1, 0.2, 0.9, 1.0])) == [0.0, 0.25, 1.0, 1.0]
    plain = Keep()
    assert with_quantize(plain, None) is plain


def dead_port() -> int:
    """A port on 127.0.0.1 with nothing listening (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_judge_stops_with_judge_unavailable_not_collapse(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    cfg = judge_config(tiny_model_path, out, f"http://127.0.0.1:{dead_port()}/v1", steps=50)
    cfg["stopping"].update(judge_unavailable_steps=3, collapse_window=1)
    toml = write_toml(tmp_path / "exp.toml", cfg)
    assert main(["train", "--config", str(toml), "--quiet"]) == EXIT_JUDGE_UNAVAILABLE
    err = capsys.readouterr().err
    assert "--resume" in err and "no group was scored" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop"]["reason"] == "judge_unavailable" and summary["steps"] == 3
    history = read_jsonl(out / "history.jsonl")
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    assert all(r["faults/groups_dropped"] == GROUPS for r in history[1:])
    assert not any("train/reward_mean" in r for r in history)  # no group scored: no reward, not a reward of 0


def test_a_500ing_judge_stops_the_run_and_resume_continues_once_it_is_back(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    state = {"down": True}

    def script(request: dict[str, Any], n: int) -> Reply:
        return Reply("down (scripted)", status=500) if state["down"] else reply_for("good", request)

    out = tmp_path / "run"
    with ScriptedServer(script) as server:
        cfg = judge_config(tiny_model_path, out, server.base_url, steps=6)
        cfg["stopping"].update(judge_unavailable_steps=2)
        toml = write_toml(tmp_path / "exp.toml", cfg)
        assert main(["train", "--config", str(toml), "--quiet"]) == EXIT_JUDGE_UNAVAILABLE
        assert json.loads((out / "summary.json").read_text())["stop"]["reason"] == "judge_unavailable"
        assert server.calls == 2 * GROUPS
        state["down"] = False  # the judge is back; the budget may be raised on the way
        assert main(["train", "--resume", str(out), "--quiet", "--max-steps", "7"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop"]["reason"] == "max_steps" and summary["steps"] == 7
    history = read_jsonl(out / "history.jsonl")
    assert [r["step"] for r in history] == list(range(8))  # no step lost or repeated
    assert [r["faults/groups_dropped"] for r in history[1:]] == [GROUPS, GROUPS, 0, 0, 0, 0, 0]
    assert all(r["train/groups"] == GROUPS for r in history[3:])
