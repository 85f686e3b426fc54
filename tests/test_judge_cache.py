"""JudgeCache: a re-run makes 0 HTTP calls, permuted groups hit, keys separate judges, concurrency is safe."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from palaestra.judges.cache import JudgeCache
from palaestra.judges.faults import content_score, fault_script
from palaestra.judges.prompt import Verdict
from palaestra.judges.ruler import RulerJudge
from palaestra.testing import ScriptedServer
from palaestra.trajectories.types import Trajectory, TrajectoryGroup


def make_group(answers: list[str], q: str = "What is 2+3?") -> TrajectoryGroup:
    prefix = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}]
    return TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[*prefix, {"role": "assistant", "content": a}], reward=0.5)
            for a in answers
        ]
    )


def groups(k: int = 5) -> list[TrajectoryGroup]:
    return [make_group([f"Final: {i}{j}" for j in range(4)], q=f"Q{i}") for i in range(k)]


def expected(group: TrajectoryGroup) -> list[float]:
    return [round(content_score(t.messages()[2:]), 6) for t in group.trajectories]


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(fault_script()) as s:
        yield s


@pytest.fixture
def fresh(server: ScriptedServer) -> ScriptedServer:
    server.requests.clear()
    return server


def judge(server: ScriptedServer, cache: JudgeCache, **kw) -> RulerJudge:
    return RulerJudge("judge-m", base_url=server.base_url, cache=cache, backoff=0.001, **kw)


async def test_second_run_makes_no_calls_and_permuted_groups_hit(
    fresh: ScriptedServer, tmp_path: Path
) -> None:
    with JudgeCache(tmp_path / "judge.sqlite") as cache:
        first = groups()
        j = judge(fresh, cache)
        for g in first:
            await j.score_group(g)
        assert fresh.calls == 5 and len(cache) == 20
        assert all(g.metrics["judge_cache_hit"] == 0 for g in first)

        again = groups()
        j2 = judge(fresh, cache)
        for g in again:
            await j2.score_group(g)
        assert fresh.calls == 5  # 0 new HTTP calls
        assert [g.rewards() for g in again] == [g.rewards() for g in first]
        assert all(g.metrics["judge_cache_hit"] == 1 and g.metrics["judge_calls"] == 0 for g in again)
        assert all(g.trajectories[0].metrics["independent_reward"] == 0.5 for g in again)

        permuted = [TrajectoryGroup(list(reversed(g.model_copy(deep=True).trajectories))) for g in groups()]
        for g in permuted:
            await j2.score_group(g)
            assert g.rewards() == pytest.approx(expected(g))  # scores follow content, not position
        assert fresh.calls == 5 and cache.hits == 10
        assert j2.usage.cache_hits == 10 and j2.usage.calls == 0


async def test_cache_survives_reopening_and_separates_judges(fresh: ScriptedServer, tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with JudgeCache(path) as cache:
        await judge(fresh, cache).score_group(make_group(["a", "b"]))
    with JudgeCache(path) as cache:
        await judge(fresh, cache).score_group(make_group(["b", "a"]))
        assert fresh.calls == 1
        await judge(fresh, cache, rubric="- Other standards.").score_group(make_group(["a", "b"]))
        assert fresh.calls == 2  # another rubric is another judge
        await RulerJudge("other-model", base_url=fresh.base_url, cache=cache).score_group(
            make_group(["a", "b"])
        )
        assert fresh.calls == 3
        await judge(fresh, cache).score_group(make_group(["a", "b", "c"]))
        assert fresh.calls == 4  # a different group is a different ranking context
        await judge(fresh, cache).score_group(make_group(["a", "b", "a"]))
        assert fresh.calls == 4  # duplicates do not change the group's content
        before = fresh.calls
        await judge(fresh, cache).score_group(make_group(["a", "b"]), use_cache=False)
        assert fresh.calls == before + 1


async def test_failed_groups_are_not_cached(server: ScriptedServer, tmp_path: Path) -> None:
    server.requests.clear()
    server.script = fault_script(then="non_json")
    try:
        with JudgeCache(tmp_path / "c.sqlite") as cache:
            assert await judge(server, cache, max_retries=0).score_group(make_group(["a", "b"])) is None
            assert len(cache) == 0
    finally:
        server.script = fault_script()


async def test_concurrent_asyncio_use(fresh: ScriptedServer, tmp_path: Path) -> None:
    with JudgeCache(tmp_path / "c.sqlite") as cache:
        j = judge(fresh, cache)
        await asyncio.gather(*(j.score_group(g) for g in groups(20)))
        assert fresh.calls == 20 and len(cache) == 80
        await asyncio.gather(*(j.score_group(g) for g in groups(20)))
        assert fresh.calls == 20


def test_several_processes_share_one_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite"
    code = textwrap.dedent(f"""
        import sys
        from palaestra.judges.cache import JudgeCache
        from palaestra.judges.prompt import Verdict
        w = int(sys.argv[1])
        with JudgeCache({str(path)!r}) as c:
            for i in range(60):
                c.put("j", f"g{{w}}-{{i}}", {{f"t{{k}}": Verdict(k / 3, "x") for k in range(3)}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(w)]) for w in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    with JudgeCache(path) as cache:
        assert len(cache) == 3 * 60 * 3
        got = cache.get("j", "g2-59", ["t0", "t1", "t2"])
        assert got == {"t0": Verdict(0.0, "x"), "t1": Verdict(1 / 3, "x"), "t2": Verdict(2 / 3, "x")}
        assert cache.get("j", "g2-59", ["t0", "t9"]) is None
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        len(cache)
