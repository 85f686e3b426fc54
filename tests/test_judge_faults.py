"""Every judge reply failure mode, each with its exact outcome, through a real HTTP server and the real
openai client: usable as is, retried then scored, or left unscored and dropped/raised. Never scored 0."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from palaestra.judges.base import JudgeError
from palaestra.judges.faults import (
    ENVELOPE_KINDS,
    EXPECTED_FAULT,
    HTTP_KINDS,
    INVALID_KINDS,
    USABLE_KINDS,
    chaos_script,
    content_score,
    fault_script,
    reply_for,
)
from palaestra.judges.ruler import RulerJudge
from palaestra.testing import Reply, ScriptedServer
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

START = 0.37  # a non-zero reward before judging: a failure must leave it, never write 0


def make_group(n: int = 3, tag: str = "") -> TrajectoryGroup:
    prefix = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": f"What is 2+3?{tag}"},
    ]
    return TrajectoryGroup(
        [
            Trajectory(
                messages_and_choices=[*prefix, {"role": "assistant", "content": f"Final: {i}"}], reward=START
            )
            for i in range(n)
        ],
        metadata={"scenario": tag or "s"},
    )


def expected(group: TrajectoryGroup) -> list[float]:
    return [round(content_score(t.messages()[2:]), 6) for t in group.trajectories]


@pytest.fixture(scope="module")
def shared_server():
    with ScriptedServer(fault_script()) as server:
        yield server


@pytest.fixture
def serve(shared_server: ScriptedServer):
    def use(script) -> ScriptedServer:
        shared_server.script = script
        shared_server.requests.clear()
        return shared_server

    return use


def judge_for(server: ScriptedServer, **kw) -> RulerJudge:
    kw.setdefault("backoff", 0.001)
    kw.setdefault("timeout", 5.0)
    return RulerJudge("judge-m", base_url=server.base_url, **kw)


def assert_untouched(group: TrajectoryGroup) -> None:
    assert group.rewards() == [START] * len(group)
    for t in group.trajectories:
        assert "judge_score" not in t.metrics and "independent_reward" not in t.metrics
    assert group.metrics["judge_unscored"] == 1
    assert any("unscored" in line for line in group.logs)
    assert group.exceptions and group.exceptions[-1].type in ("JudgeError", "TransientError", "ReplyError")


@pytest.mark.parametrize("kind", USABLE_KINDS)
async def test_usable_replies_score_on_the_first_call(serve, kind: str) -> None:
    group = make_group(4)
    server = serve(fault_script(kind, delay=0.05))
    await judge_for(server).score_group(group)
    assert server.calls == 1
    assert group.rewards() == pytest.approx(expected(group))
    assert not [k for k in group.metrics if k.startswith("judge_fault_")]


@pytest.mark.parametrize("kind", INVALID_KINDS + ENVELOPE_KINDS + HTTP_KINDS)
async def test_one_bad_reply_is_retried_then_scored(serve, kind: str) -> None:
    group = make_group(4)
    server = serve(fault_script(kind))
    await judge_for(server).score_group(group)
    assert server.calls == 2
    assert group.rewards() == pytest.approx(expected(group))
    assert group.metrics[f"judge_fault_{EXPECTED_FAULT[kind]}"] == 1
    assert group.metrics["judge_retries"] == 1 and group.metrics["judge_unscored"] == 0
    retry = server.requests[1]["messages"]
    if kind in INVALID_KINDS:  # the retry shows the bad reply and names the problem
        assert [m["role"] for m in retry] == ["system", "user", "assistant", "user"]
        assert "could not be used" in retry[-1]["content"]
    else:  # an HTTP failure or a broken envelope is re-sent unchanged
        assert retry == server.requests[0]["messages"]


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("missing_id", "no score for candidate ids"),
        ("duplicate_id", "more than once"),
        ("unknown_id", "unknown candidate ids"),
        ("out_of_range", "outside [0, 1]"),
        ("nan", "not a finite number"),
        ("non_json", "does not contain a JSON object"),
    ],
)
async def test_correction_names_the_problem(serve, kind: str, words: str) -> None:
    server = serve(fault_script(kind))
    await judge_for(server).score_group(make_group(3))
    assert words in server.requests[1]["messages"][-1]["content"]


@pytest.mark.parametrize("kind", INVALID_KINDS + ENVELOPE_KINDS + HTTP_KINDS)
@pytest.mark.parametrize("policy", ["drop", "raise"])
async def test_persistent_fault_leaves_group_unscored_never_zero(serve, kind: str, policy: str) -> None:
    group = make_group(3)
    server = serve(fault_script(then=kind))
    judge = judge_for(server, max_retries=2, on_failure=policy)
    if policy == "drop":
        assert await judge.score_group(group) is None
    else:
        with pytest.raises(JudgeError, match="left unscored after 3 call"):
            await judge.score_group(group)
    assert server.calls == 3
    assert group.metrics[f"judge_fault_{EXPECTED_FAULT[kind]}"] == 3
    assert_untouched(group)
    assert group.metadata["scenario"] == "s"
    assert judge.usage.unscored == 1 and judge.usage.scored == 0


async def test_out_of_range_is_never_clamped(serve) -> None:
    group = make_group(2)
    server = serve(fault_script(then="out_of_range"))
    assert await judge_for(server, max_retries=1).score_group(group) is None
    assert server.calls == 2 and all(r == START for r in group.rewards())


async def test_retry_after_is_honoured(serve) -> None:
    server = serve(fault_script("rate_limit", retry_after=0.3))
    start = time.perf_counter()
    group = make_group(2)
    await judge_for(server, backoff=0.001).score_group(group)
    assert time.perf_counter() - start >= 0.3
    assert server.calls == 2 and group.metrics["judge_fault_rate_limit"] == 1


async def test_slow_reply_times_out_then_succeeds(serve) -> None:
    server = serve(fault_script("slow", delay=0.6))
    group = make_group(2)
    await judge_for(server, timeout=0.2).score_group(group)
    assert group.metrics["judge_fault_timeout"] == 1 and group.metrics["judge_unscored"] == 0
    assert group.rewards() == pytest.approx(expected(group))


async def test_non_json_http_body_is_retried(serve) -> None:
    good = fault_script()
    server = serve(lambda req, n: Reply(raw_body="<html>bad gateway</html>") if n == 0 else good(req, n))
    group = make_group(2)
    await judge_for(server).score_group(group)
    assert server.calls == 2 and group.metrics["judge_fault_bad_response"] == 1


async def test_connection_refused_is_unscored() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = make_group(2)
    judge = RulerJudge("m", base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, backoff=0.001, timeout=2)
    assert await judge.score_group(group) is None
    assert group.metrics["judge_fault_connection"] == 2
    assert_untouched(group)


async def test_chaos_run_scores_every_group_correctly(serve) -> None:
    script = chaos_script(0.4, seed=7)
    server = serve(script)
    judge = judge_for(server, max_retries=8)
    groups = [make_group(4, tag=str(i)) for i in range(12)]
    results = await asyncio.gather(*(judge.score_group(g) for g in groups))
    assert all(r is not None for r in results)
    for g in groups:
        assert g.rewards() == pytest.approx(expected(g))
    faults = sum(v for k, v in script.counts.items() if k not in ("good", "reordered", "code_fenced"))
    assert faults > 0 and server.calls == sum(script.counts.values())
    assert judge.usage.calls == server.calls


def test_chaos_draws_are_reproducible() -> None:
    request = {
        "messages": [
            {"role": "system", "content": "x"},
            {
                "role": "user",
                "content": 'Candidates (1):\n\n<candidate id="abcdef">\n'
                '[{"role": "assistant", "content": "hi"}]\n</candidate>',
            },
        ]
    }
    a, b = chaos_script(0.5, seed=3), chaos_script(0.5, seed=3)
    seq_a = [a(request, i).content for i in range(20)]
    seq_b = [b(request, i).content for i in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 1
    with pytest.raises(ValueError, match="unknown fault kind"):
        reply_for("teapot", request)


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_chaos_fault_rate_must_be_a_probability(rate: float) -> None:
    with pytest.raises(ValueError, match=r"fault_rate must be in \[0, 1\]"):
        chaos_script(rate)
