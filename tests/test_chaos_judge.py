"""Judge chaos: a hybrid experiment whose RULER judge endpoint (a real HTTP ScriptedServer) answers 30% of
requests with a fault — 500, 429 + Retry-After, timeouts, non-JSON, missing / duplicate / unknown ids,
out-of-range and NaN scores — over 100 steps.

The run must complete with no crash; no group may be scored 0 because its judge failed (every saved
trajectory carries the judge's own score, and a group the judge gave up on never reaches the trainer); every
fault the server served is counted, by kind, in ``history.jsonl`` and ``summary.json``; the fraction of groups
dropped is reported. The full-size version is ``benchmarks/judge_chaos.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from palaestra.judges.base import JudgeError
from palaestra.judges.faults import CHAOS_KINDS, EXPECTED_FAULT, chaos_script, fault_script
from palaestra.testing import ScriptedServer
from palaestra.trainer.builders import build_reward
from palaestra.trainer.checkpoints import load_checkpoint
from palaestra.trainer.expconfig import config_from_dict
from palaestra.trainer.experiment import Experiment
from palaestra.trajectories.io import read_groups, read_jsonl

STEPS = 100
GROUPS = 2
GROUP_SIZE = 4
JUDGE_TIMEOUT = 0.5  # the "slow" fault replies after 1 s, so it is a client-side timeout
#: Usable-but-odd replies the judge must accept as they are: not faults.
HARMLESS = {"good", "reordered", "code_fenced", "prose_wrapped"}


def chaos_config(model: Path, out: Path, base_url: str, **reward: Any) -> dict[str, Any]:
    return {
        "run": {
            "name": "judge-chaos",
            "seed": 7,
            "output_dir": str(out),
            "groups_per_step": GROUPS,
            "group_size": GROUP_SIZE,
            "max_steps": STEPS,
            "samples_per_step": GROUPS * GROUP_SIZE,
            "progress": False,
        },
        "model": {"name": str(model)},
        "env": {"max_tokens": 6},
        "reward": {
            "kind": "judge",
            "judge_model": "chaos-judge",
            "judge_base_url": base_url,
            "judge_api_key_env": "PALAESTRA_TEST_UNSET_KEY",
            "judge_timeout": JUDGE_TIMEOUT,
            "judge_max_retries": 1,
            **reward,
        },
        "validation": {"every": 1000, "max_examples": 5, "sampled": False},
        "stopping": {"patience": 1000},
    }


def fast_judge(cfg: dict[str, Any], out: Path) -> Any:
    """The judge the config describes, built by the experiment's own builder, with millisecond backoff.

    The config has no backoff knob (RulerJudge's default is 0.5 s doubling); ``backoff`` is a public
    attribute of the judge, so it is set here rather than waiting seconds between retries."""
    judge = build_reward(config_from_dict(cfg), out)
    judge.backoff = 0.001
    return judge


def expected_faults(served: Counter[str]) -> Counter[str]:
    """The fault counts a judge must record for what the chaos script served (by judge fault name)."""
    out: Counter[str] = Counter()
    for kind, n in served.items():
        if kind in HARMLESS:
            continue
        out[EXPECTED_FAULT[kind]] += n
    return out


def test_judge_chaos_run_completes_and_counts_every_fault(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = chaos_script(0.3, seed=3, kinds=(*CHAOS_KINDS, "slow"), retry_after=0.01, delay=1.0)
    with ScriptedServer(script) as server:
        cfg = chaos_config(tiny_model_path, out, server.base_url)
        judge = fast_judge(cfg, out)
        summary = Experiment(cfg, reward=judge, printer=None).run_sync()
        calls = server.calls

    served: Counter[str] = script.counts  # type: ignore[attr-defined]
    expected = expected_faults(served)
    faults_served = sum(expected.values())
    # the script really injected ~30% faults of every kind (about 24% are faults, 6% harmless oddities)
    assert 0.15 < faults_served / calls < 0.35, served
    assert set(expected) >= {
        "server_error",
        "rate_limit",
        "timeout",
        "not_json",
        "missing_ids",
        "duplicate_ids",
        "unknown_ids",
        "out_of_range",
        "non_finite",
    }, served

    # completes, no crash
    assert summary["steps"] == STEPS and summary["stop"]["reason"] == "max_steps"
    history = read_jsonl(out / "history.jsonl")
    assert [r["step"] for r in history] == list(range(STEPS + 1))
    rows = history[1:]

    # every fault counted, by kind: history == summary == the judge's own totals == what the server served
    in_history: Counter[str] = Counter()
    for r in rows:
        for k, v in r.items():
            if k.startswith("judge/fault_"):
                in_history[k.removeprefix("judge/fault_")] += int(v)
    saved = json.loads((out / "summary.json").read_text())
    in_summary = Counter(
        {k.removeprefix("fault_"): int(v) for k, v in saved["judge_usage"].items() if k.startswith("fault_")}
    )
    seen_by_judge = Counter(judge.usage.faults)
    assert in_history == seen_by_judge, (in_history, served)
    assert in_summary == seen_by_judge
    # ... and the judge saw exactly what was served; a good reply delayed past the timeout on a loaded
    # machine would add a timeout the script did not plan, so that one kind may only exceed the plan
    timeouts_seen, timeouts_served = seen_by_judge.pop("timeout", 0), expected.pop("timeout", 0)
    assert seen_by_judge == expected and timeouts_seen >= timeouts_served > 0, (seen_by_judge, served)
    assert sum(r["judge/calls"] for r in rows) == calls == judge.usage.calls  # no request uncounted

    # dropped groups: counted in history and summary, reported as a fraction, never trained on
    dropped = sum(r["faults/groups_dropped"] for r in rows)
    assert dropped == judge.usage.unscored == sum(r["judge/unscored"] for r in rows) > 0
    assert saved["faults"]["groups_dropped"] == dropped
    assert saved["faults"]["groups_total"] == STEPS * GROUPS
    assert saved["groups_dropped_fraction"] == pytest.approx(dropped / (STEPS * GROUPS))
    assert saved["faults"]["rollout_exceptions"] == 0
    for r in rows:
        assert r["train/groups"] == r["faults/groups_total"] - r["faults/groups_dropped"], r["step"]

    # 0 groups silently scored 0: every saved group was scored by the judge, each trajectory's reward is
    # the judge's score for it (the scripted scores lie in [0.05, 0.95], so a 0 can only be a fallback)
    saved_groups = 0
    for r in rows:
        groups = read_groups(out / "samples" / f"step_{r['step']:06d}.jsonl")
        assert len(groups) == r["train/groups"], r["step"]
        for g in groups:
            saved_groups += 1
            assert g.metrics["judge_unscored"] == 0
            assert len(g.trajectories) == GROUP_SIZE
            for t in g.trajectories:
                assert t.reward == t.metrics["judge_score"]
                assert 0.05 <= t.reward <= 0.95, t.reward
    assert saved_groups == STEPS * GROUPS - dropped


def test_judge_failure_with_on_failure_raise_stops_cleanly(tiny_model_path: Path, tmp_path: Path) -> None:
    """``on_failure = "raise"``: the first unscorable group stops the run with a JudgeError naming the faults;
    the step is not recorded, nothing was trained on it, and the last checkpoint is whole (resumable)."""
    out = tmp_path / "run"
    with ScriptedServer(fault_script(then="server_error")) as server:
        cfg = chaos_config(tiny_model_path, out, server.base_url, on_failure="raise", judge_max_retries=0)
        with pytest.raises(JudgeError, match=r"server_error=1"):
            Experiment(cfg, reward=fast_judge(cfg, out), printer=None).run_sync()
    assert [r["step"] for r in read_jsonl(out / "history.jsonl")] == [0]
    assert load_checkpoint(out / "checkpoints" / "latest.npz")["counters"]["step"] == 0
    assert not list((out / "samples").glob("*.jsonl"))
