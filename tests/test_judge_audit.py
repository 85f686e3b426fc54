"""Judge audit: biased simulated judges fail the matching gates, an unbiased one passes; the CLI writes the
report and exits non-zero on a failed gate."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

import pytest

from palaestra.judges.audit import DEFAULT_GATES, audit_judge, kendall_tau, padded_copy, strip_padding
from palaestra.judges.commands import register
from palaestra.judges.faults import chaos_script
from palaestra.judges.ruler import RulerJudge
from palaestra.judges.simulated import SimulatedJudge
from palaestra.testing import ScriptedServer
from palaestra.trajectories.io import DataError, write_groups
from palaestra.trajectories.types import Trajectory, TrajectoryGroup


def arithmetic_groups(k: int = 10, n: int = 4, seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of answers to a+b, each with gold reward 1 (right) or 0 (wrong), mixed within every group."""
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        a, b = rng.randrange(100), rng.randrange(100)
        user = {"role": "user", "content": f"What is {a}+{b}? Reply with one line: Final: <int>"}
        oks = [True, False] + [rng.random() < 0.5 for _ in range(n - 2)]
        trajs = [
            Trajectory(
                messages_and_choices=[
                    user,
                    {"role": "assistant", "content": f"Final: {a + b + (0 if ok else j + 1)}"},
                ],
                reward=float(ok),
            )
            for j, ok in enumerate(oks)
        ]
        out.append(TrajectoryGroup(trajs, metadata={"a": a, "b": b}))
    return out


def file_gold(traj: Trajectory, example: object) -> float:
    return float(traj.metrics.get("independent_reward", traj.reward))


def gate(report, name: str):
    return next(g for g in report.gates if g["name"] == name)


async def test_unbiased_judge_passes_default_gates() -> None:
    groups = arithmetic_groups()
    before = [g.model_dump() for g in groups]
    report = await audit_judge(SimulatedJudge(file_gold), groups, gold="reward", gates=DEFAULT_GATES)
    assert report.passed, report.gates
    assert report.order["kendall_tau"] == 1.0 and report.order["slot_spread"] == 0.0
    assert report.repeat["kendall_tau"] == 1.0 and report.padding["padded_preference"] == 0.5
    assert report.gold["pair_accuracy"] == 1.0 and report.protocol["unscored_rate"] == 0.0
    assert [g.model_dump() for g in groups] == before  # the audit never touches its input
    per_group_calls = 3 + 3 + 4  # repeats + permutations + 2 padded pairs in both orders
    assert report.protocol["calls"] == len(groups) * per_group_calls


async def test_position_biased_judge_fails_the_order_gate() -> None:
    groups = arithmetic_groups()
    gates = {"order_tau_min": 0.7, "slot_spread_max": 0.1, "repeat_tau_min": 0.8}
    report = await audit_judge(
        SimulatedJudge(file_gold, position_bias=0.4), groups, gold="reward", gates=gates
    )
    assert not report.passed
    assert (
        gate(report, "order_tau_min")["passed"] is False
        and gate(report, "slot_spread_max")["passed"] is False
    )
    assert gate(report, "repeat_tau_min")["passed"] is True  # the same order every time: stable, yet biased
    effects = report.order["slot_effect"]
    assert effects["0"] > 0 > effects["3"]


async def test_length_biased_judge_fails_the_padding_gate() -> None:
    report = await audit_judge(
        SimulatedJudge(file_gold, length_bias=0.3),
        arithmetic_groups(),
        gold="reward",
        gates={"padded_preference_max": 0.55, "order_tau_min": 0.7},
    )
    assert (
        gate(report, "padded_preference_max")["passed"] is False and report.padding["padded_preference"] > 0.7
    )
    assert gate(report, "order_tau_min")["passed"] is True and report.failed_gates() == [
        "padded_preference_max"
    ]


async def test_noisy_judge_and_gold_disagreement() -> None:
    def inverted(traj: Trajectory, example: object) -> float:
        return 1.0 - file_gold(traj, example)

    report = await audit_judge(
        SimulatedJudge(inverted), arithmetic_groups(6), gold="reward", gates={"pair_accuracy_min": 0.9}
    )
    assert report.gold["pair_accuracy"] == 0.0 and not report.passed
    noisy = await audit_judge(
        SimulatedJudge(file_gold, noise=0.2, seed=1), arithmetic_groups(6), gold="reward"
    )
    assert noisy.repeat["mean_score_std"] > 0.05 and noisy.repeat["kendall_tau"] < 1.0
    no_gold = await audit_judge(
        SimulatedJudge(file_gold), arithmetic_groups(3), gates={"pair_accuracy_min": 0.9}
    )
    assert no_gold.gold is None and gate(no_gold, "pair_accuracy_min")["passed"] is None and no_gold.passed


async def test_audit_over_http_counts_malformed_replies() -> None:
    with ScriptedServer(chaos_script(0.5, seed=1, kinds=("non_json", "missing_id"))) as server:
        judge = RulerJudge("m", base_url=server.base_url, backoff=0.001, max_retries=6)
        report = await audit_judge(
            judge, arithmetic_groups(3), repeats=2, permutations=2, gates={"malformed_rate_max": 0.01}
        )
    proto = report.protocol
    assert proto["calls"] == server.calls and proto["malformed_replies"] > 0
    assert proto["malformed_rate"] == pytest.approx(proto["malformed_replies"] / proto["calls"])
    assert set(proto["faults"]) <= {"not_json", "missing_ids"} and not report.passed
    assert proto["prompt_tokens"] > 0 and proto["latency_p95_s"] >= proto["latency_mean_s"] * 0.5


def test_kendall_tau_and_padding_helpers() -> None:
    assert kendall_tau([1, 2, 3], [1, 2, 3]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 1, 1], [0.5, 0.5, 0.5]) == 1.0
    assert kendall_tau([1, 1, 1], [1, 2, 3]) == 0.0
    assert kendall_tau([1], [2]) is None
    assert kendall_tau([1, 2, 2], [1, 2, 3]) == pytest.approx(2 / (3 * 2) ** 0.5)
    t = Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]
    )
    p = padded_copy(t)
    assert (
        p is not None and p.messages()[-1]["content"].endswith("A") and len(p.messages()[-1]["content"]) > 50
    )
    assert strip_padding(p.messages()) == t.messages() and t.messages()[-1]["content"] == "A"
    assert padded_copy(Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])) is None


async def test_bad_gate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown gates"):
        await audit_judge(SimulatedJudge(file_gold), arithmetic_groups(1), gates={"vibes_min": 1})


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_writes_report_and_gates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "groups.jsonl"
    write_groups(path, arithmetic_groups(6))
    out = tmp_path / "report.json"
    base = ["judge-audit", "--groups", str(path), "--simulated", "--out", str(out)]
    assert run_cli([*base, "--gate", "default"]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["gold"]["pair_accuracy"] == 1.0 and report["groups"] == 6
    assert "PASSED" in capsys.readouterr().out

    assert run_cli([*base, "--sim-position-bias", "0.4", "--gate", "order_tau_min=0.7"]) == 1
    assert json.loads(out.read_text())["gates"][0]["passed"] is False
    assert "FAIL" in capsys.readouterr().out

    http = [
        *base,
        "--simulated-http",
        "--sim-length-bias",
        "0.3",
        "--gate",
        "padded_preference_max=0.55",
        "--max-groups",
        "2",
        "--repeats",
        "1",
        "--permutations",
        "2",
    ]
    assert run_cli(http) == 1
    report = json.loads(out.read_text())
    assert report["judge"]["kind"] == "ruler" and report["protocol"]["calls"] > 0

    with pytest.raises(DataError, match="--gate"):
        run_cli([*base, "--gate", "nonsense=1"])
    with pytest.raises(DataError, match="judge-model"):
        run_cli(["judge-audit", "--groups", str(path), "--out", str(out)])


async def test_misconfigured_judge_stops_the_audit_at_once() -> None:
    from palaestra.judges.base import JudgeConfigError
    from palaestra.testing import Reply

    with ScriptedServer(lambda req, n: Reply("model not found", status=404)) as server:
        judge = RulerJudge("m", base_url=server.base_url, backoff=0.001)
        with pytest.raises(JudgeConfigError, match="404"):
            await audit_judge(judge, arithmetic_groups(10), max_concurrency=4)
        await asyncio.sleep(0.05)
    assert 1 <= server.calls <= 10  # of 100 runs planned: the rest were cancelled, not run


def test_cli_bad_input_exits_2_naming_the_flag_or_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from palaestra.cli import main
    from palaestra.judges.prompt import rubric_hash

    path = tmp_path / "groups.jsonl"
    write_groups(path, arithmetic_groups(2))
    out = tmp_path / "report.json"
    base = ["judge-audit", "--groups", str(path), "--simulated", "--out", str(out)]

    def fails(argv: list[str], message: str) -> None:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("palaestra judge-audit: error: ") and message in err, err
        assert not out.exists()

    fails([*base, "--gate", "order_tau_min=high"], "--gate 'order_tau_min=high': 'high' is not a number")
    fails(
        [*base, "--rubric-file", str(tmp_path / "nope.txt")],
        f"{tmp_path / 'nope.txt'}: rubric file not found",
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails(["judge-audit", "--groups", str(empty), "--simulated", "--out", str(out)], "no groups to audit")
    for flag, value, message in [
        ("--repeats", "0", "--repeats must be >= 1, got 0"),
        ("--permutations", "1", "--permutations must be >= 2, got 1"),
        ("--concurrency", "0", "--concurrency must be >= 1, got 0"),  # it used to wait forever
        ("--max-groups", "-1", "--max-groups must be >= 1, got -1"),  # it used to drop the last group
        ("--judge-max-retries", "-1", "--judge-max-retries must be >= 0, got -1"),
        ("--judge-timeout", "0", "--judge-timeout must be a finite number of seconds > 0, got 0.0"),
        ("--sim-quantize", "1", "--sim-quantize must be >= 2, got 1"),
    ]:
        fails([*base, flag, value], message)
    # a remote judge without its key stops before any call
    monkeypatch.delenv("PALAESTRA_TEST_NO_SUCH_KEY", raising=False)
    remote = ["--judge-model", "m", "--judge-base-url", "https://judge.invalid/v1"]
    key_env = ["--judge-api-key-env", "PALAESTRA_TEST_NO_SUCH_KEY"]
    fails(
        ["judge-audit", "--groups", str(path), "--out", str(out), *remote, *key_env],
        "no API key for judge 'm'",
    )

    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Prefer the correct sum; nothing else matters.\n", encoding="utf-8")
    fast = ["--repeats", "1", "--permutations", "2", "--no-padding"]
    assert main([*base, "--simulated-http", "--rubric-file", str(rubric), *fast]) == 0
    assert json.loads(out.read_text())["judge"]["rubric_hash"] == rubric_hash(
        rubric.read_text(encoding="utf-8")
    )


async def test_audit_argument_checks() -> None:
    groups = arithmetic_groups(2)
    judge = SimulatedJudge(file_gold)
    with pytest.raises(ValueError, match="repeats must be >= 1 and permutations >= 2"):
        await audit_judge(judge, groups, repeats=0)
    with pytest.raises(ValueError, match="repeats must be >= 1 and permutations >= 2"):
        await audit_judge(judge, groups, permutations=1)
    with pytest.raises(ValueError, match="examples must be aligned with groups"):
        await audit_judge(judge, groups, examples=[None])
    with pytest.raises(ValueError, match="max_concurrency must be >= 1, got 0"):
        await asyncio.wait_for(audit_judge(judge, groups, max_concurrency=0), 5.0)
    with pytest.raises(ValueError, match=r"gold must be a callable, 'reward' or None, got 'gold'"):
        await audit_judge(judge, groups, gold="gold")  # type: ignore[arg-type]


async def test_audit_with_a_gold_callable_more_orders_unscored_runs_and_nothing_to_pad() -> None:
    groups = arithmetic_groups(3)
    report = await audit_judge(
        SimulatedJudge(file_gold), groups, gold=lambda t: t.reward, permutations=5, padding=False
    )
    assert report.gold is not None and report.gold["pair_accuracy"] == 1.0 and report.permutations == 5
    assert (
        report.protocol["runs"] == report.protocol["calls"] == 3 * (3 + 5)
    )  # 5 distinct presentation orders

    with ScriptedServer(chaos_script(1.0, seed=0, kinds=("non_json",))) as server:
        judge = RulerJudge("m", base_url=server.base_url, backoff=0.001, max_retries=0, on_failure="raise")
        failing = await audit_judge(judge, arithmetic_groups(2), repeats=1, permutations=2, padding=False)
        await judge.aclose()
    proto = failing.protocol
    assert proto["runs"] == proto["unscored_runs"] == 2 * (1 + 2) and proto["unscored_rate"] == 1.0
    assert failing.repeat["kendall_tau"] is None and failing.order["kendall_tau"] is None

    user = {"role": "user", "content": "What is 1+1?"}
    mute = Trajectory(messages_and_choices=[user])  # no answer: nothing to pad
    answered = Trajectory(messages_and_choices=[user, {"role": "assistant", "content": "Final: 2"}])
    unpadded = await audit_judge(
        SimulatedJudge(file_gold), [TrajectoryGroup([mute, answered])], repeats=1, permutations=2
    )
    assert unpadded.padding["pairs"] == 0 and unpadded.protocol["runs"] == 1 + 2
    with pytest.raises(ValueError, match="score vectors differ in length"):
        kendall_tau([1, 2, 3], [1, 2])
