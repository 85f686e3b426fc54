"""Issue 16, judge client: hostile replies are counted faults and retried (item 5); ``timeout`` is a deadline
per call and a group's / a step's judging time is bounded (item 6); ``cache=`` takes a path and
``ruler_score_group`` leaves no HTTP client open (item 8). Real HTTP on 127.0.0.1, real openai client."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from palaestra.judges import prompt
from palaestra.judges.base import JudgeError
from palaestra.judges.cache import JudgeCache
from palaestra.judges.faults import (
    ENVELOPE_KINDS,
    EXPECTED_FAULT,
    content_score,
    fault_script,
    reply_for,
)
from palaestra.judges.prompt import (
    REPLY_FAULTS,
    ReplyError,
    _objects_in,
    extract_json,
    parse_reply,
    parse_request,
    validate_reply,
)
from palaestra.judges.ruler import RulerJudge, ruler_score_group
from palaestra.testing import Reply, ScriptedServer, completion_body
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

START = 0.37
HOSTILE = ("inf", "huge_score", "long_number", "deep_json", *ENVELOPE_KINDS)


def make_group(n: int = 3, tag: str = "") -> TrajectoryGroup:
    prefix = [{"role": "system", "content": "Answer."}, {"role": "user", "content": f"2+3?{tag}"}]
    return TrajectoryGroup(
        [
            Trajectory(
                messages_and_choices=[*prefix, {"role": "assistant", "content": f"F {i}"}], reward=START
            )
            for i in range(n)
        ]
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


def judge_for(server: ScriptedServer, **kw: Any) -> RulerJudge:
    kw.setdefault("backoff", 0.001)
    kw.setdefault("timeout", 10.0)
    return RulerJudge("judge-m", base_url=server.base_url, **kw)


# ---- item 5: every malformed reply is a counted fault and retried ----------------------------------------------


@pytest.mark.parametrize("kind", HOSTILE)
async def test_hostile_reply_is_counted_retried_then_scored(serve, kind: str) -> None:
    group = make_group(3)
    server = serve(fault_script(kind))
    judge = judge_for(server)
    assert await judge.score_group(group) is group
    assert server.calls == 2
    assert group.rewards() == pytest.approx(expected(group))
    assert group.metrics[f"judge_fault_{EXPECTED_FAULT[kind]}"] == 1
    assert judge.usage.faults[EXPECTED_FAULT[kind]] == 1 and judge.usage.calls == 2
    await judge.aclose()


@pytest.mark.parametrize("kind", HOSTILE)
async def test_persistent_hostile_reply_leaves_the_group_unscored_never_zero(serve, kind: str) -> None:
    group = make_group(3)
    server = serve(fault_script(then=kind))
    judge = judge_for(server, max_retries=2)
    assert await judge.score_group(group) is None
    assert server.calls == 3
    assert group.metrics[f"judge_fault_{EXPECTED_FAULT[kind]}"] == 3
    assert group.rewards() == [START] * 3 and group.metrics["judge_unscored"] == 1
    await judge.aclose()


def test_hostile_kinds_count_as_malformed_in_audits() -> None:
    kinds = {EXPECTED_FAULT[k] for k in HOSTILE} - {"bad_response"}  # an unreadable HTTP body: not a reply
    assert kinds <= REPLY_FAULTS


def _bodies(request: dict[str, Any]) -> list[str]:
    """A spread of broken 200 bodies around a good one (types swapped, fields missing, odd numbers)."""
    good = completion_body(request, Reply(reply_for("good", request).content))
    text = good["choices"][0]["message"]["content"]
    variants: list[Any] = []
    for key in ("choices", "usage", "id", "object"):
        for value in (None, 7, "many", [], {}, [1, 2], 1e308, True):
            variants.append({**good, key: value})
    for value in (None, 3, "x", [], [None], [{"text": text}], {"role": "assistant"}):
        variants.append({**good, "choices": [{"index": 0, "message": value, "finish_reason": "stop"}]})
    for value in (7, 1.5, True, {"a": 1}, [text], [{"type": "text"}]):
        msg = {"role": "assistant", "content": value}
        variants.append({**good, "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})
    for value in ("7", -1, 1.5, float("nan"), float("inf"), 10**30, [1], {"n": 1}):
        variants.append(
            {**good, "usage": {"prompt_tokens": value, "completion_tokens": 1, "total_tokens": 1}}
        )
    out = [json.dumps(v) for v in variants]
    out += ["[]", "null", '"text"', "12", "{", "{" * 50_000 + "}" * 50_000, '{"choices": ' + "9" * 5000 + "}"]
    return out


async def test_no_broken_envelope_escapes_uncounted(serve) -> None:
    """Each broken body, then a good reply: the group is always scored, with exactly one counted fault."""
    probe = make_group(2)
    bodies: list[str] = []
    good = fault_script()

    def script(request: dict[str, Any], n: int) -> Reply:
        if not bodies:
            bodies.extend(_bodies(request))
        return Reply(raw_body=bodies[n // 2]) if n % 2 == 0 else good(request, n)

    server = serve(script)
    judge = judge_for(server)
    i = 0
    while True:
        group = make_group(2, tag=str(i))
        assert await judge.score_group(group) is group, (i, bodies[i][:200])
        faults = {k: v for k, v in group.metrics.items() if k.startswith("judge_fault_")}
        assert sum(faults.values()) == 1 and group.metrics["judge_calls"] == 2, (i, bodies[i][:200], faults)
        i += 1
        if i == len(bodies):
            break
    assert judge.usage.unscored == 0 and probe.rewards() == [START, START]
    await judge.aclose()


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('{"scores": [{"id": "a", "explanation": "", "score": ' + "1" * 5000 + "}]}", "not_json"),
        ('{"scores": [{"id": "a", "explanation": "", "score": ' + str(10**400) + "}]}", "out_of_range"),
        ('{"scores": [{"id": "a", "explanation": "", "score": -' + str(10**400) + "}]}", "out_of_range"),
        ('{"scores": [{"id": "a", "explanation": "", "score": Infinity}]}', "non_finite"),
        ("[" * 100_000 + "]" * 100_000, "not_json"),
        ('prose {"scores": ' + "[" * 100_000 + "]" * 100_000 + "} more", "not_json"),
        ('Sure! {"scores": [{"id": "a", "explanation": "cut off', "not_json"),  # a truncated reply
        ('Sure! {"scores": [{"id": "a", "explanation": "x", "score": 0.5}]', "not_json"),
    ],
)
def test_parse_reply_raises_only_reply_errors(text: str, kind: str) -> None:
    with pytest.raises(ReplyError) as info:
        parse_reply(text, ["a"])
    assert info.value.kind == kind


def test_not_json_says_why_a_json_looking_chunk_could_not_be_decoded() -> None:
    with pytest.raises(ReplyError, match=r"its JSON is nested too deeply to decode$"):
        parse_reply("[" * 100_000 + "]" * 100_000, ["a"])
    too_long = '{"scores": [{"id": "a", "explanation": "", "score": ' + "1" * 5000 + "}]}"
    with pytest.raises(ReplyError, match=r"its JSON could not be decoded \(Exceeds the limit"):
        parse_reply(too_long, ["a"])
    with pytest.raises(ReplyError) as info:  # plain syntax errors give no detail
        parse_reply("{not json", ["a"])
    assert str(info.value) == "the reply does not contain a JSON object with a 'scores' list"


GOOD_OBJECT = '{"scores": [{"id": "a", "explanation": "x", "score": 0.5}]}'


@pytest.mark.parametrize(
    "text",
    [
        GOOD_OBJECT + " that is all {",  # at the very start, with an unclosed brace at the very end
        "Scores:" + GOOD_OBJECT,  # at the very end, right after a non-space character
        "Scores:" + GOOD_OBJECT + ".",  # right between two non-space characters
        'Note {"x": 1} then ' + GOOD_OBJECT + " ok",  # after an object without scores
        'Verdict {"": 0, "scores": [{"id": "a", "explanation": "a } in words", "score": 0.5}]} end',
    ],
)
def test_the_scores_object_is_cut_exactly_out_of_prose(text: str) -> None:
    assert parse_reply(text, ["a"])["a"].score == 0.5


def test_balanced_objects_are_found_in_order_each_once() -> None:
    # islice: a scan that restarted inside the last span would yield "{}" forever
    found = list(itertools.islice(_objects_in('{} x {"a": "}"} {"b": {"c": 1}} {'), 5))
    assert found == ["{}", '{"a": "}"}', '{"b": {"c": 1}}']


def test_each_entry_fault_is_named() -> None:
    ids = ["a", "b"]
    entry = '{{"id": "{}", "explanation": "", "score": {}}}'
    cases = [
        (["a", "b", "c"], "unknown_ids", "unknown candidate ids ['c']"),
        (["a", "b", "b"], "duplicate_ids", "candidate ids scored more than once: ['b']"),
        (["a"], "missing_ids", "no score for candidate ids ['b']"),
    ]
    for got, kind, message in cases:
        text = '{"scores": [' + ", ".join(entry.format(cid, 0.5) for cid in got) + "]}"
        with pytest.raises(ReplyError) as info:
            parse_reply(text, ids)
        assert (info.value.kind, str(info.value)) == (kind, message)
    # a score is quoted up to (not including) 1e300 in size; larger ones may be ints of thousands of digits
    for score, shown in [("1e299", "1e+299"), ("1e300", "a number too large for a float"), ("-2", "-2")]:
        text = '{"scores": [' + entry.format("a", 0.5) + ", " + entry.format("b", score) + "]}"
        with pytest.raises(ReplyError) as info:
            parse_reply(text, ids)
        assert (info.value.kind, str(info.value)) == (
            "out_of_range",
            f"score for id b is {shown}, outside [0, 1]",
        )


def test_schema_faults_name_where_the_reply_went_wrong() -> None:
    with pytest.raises(ReplyError) as info:
        parse_reply('{"scores": [{"explanation": "no id", "score": 0.5}]}', ["a"])
    assert info.value.kind == "schema"
    assert str(info.value) == "the JSON does not match the format (at 'scores.0.id': Field required)"
    with pytest.raises(ReplyError) as info:
        parse_reply("[1, 2]", ["a"])
    assert info.value.kind == "schema" and "(at '<root>': " in str(info.value)

    class Unreadable(dict):  # type: ignore[type-arg]
        def items(self) -> Any:
            raise TypeError("no items")

        def keys(self) -> Any:
            raise TypeError("no keys")

        def __iter__(self) -> Any:
            raise TypeError("no iteration")

        def __getitem__(self, key: Any) -> Any:
            raise TypeError("no lookup")

        def get(self, key: Any, default: Any = None) -> Any:
            raise TypeError("no lookup")

    with pytest.raises(ReplyError) as info:
        validate_reply(Unreadable(scores=[]), ["a"])
    assert (info.value.kind, str(info.value)) == ("schema", "the JSON does not match the format (TypeError)")


def test_an_unexpected_failure_is_a_counted_malformed_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(value: Any, ids: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(prompt, "validate_reply", boom)
    with pytest.raises(ReplyError) as info:
        parse_reply(GOOD_OBJECT, ["a"])
    assert (info.value.kind, str(info.value)) == ("malformed", "the reply could not be read (RuntimeError)")
    assert "malformed" in REPLY_FAULTS  # so audits count it in the malformed-reply rate


def test_extract_json_reads_a_hostile_str_subclass_as_plain_text() -> None:
    class Hostile(str):
        def strip(self, *args: Any) -> str:  # type: ignore[override]
            raise RuntimeError("boom")

        def find(self, *args: Any) -> int:  # type: ignore[override]
            raise RuntimeError("boom")

        def __str__(self) -> str:
            raise RuntimeError("boom")

    assert extract_json(Hostile(GOOD_OBJECT)) == json.loads(GOOD_OBJECT)
    assert parse_reply(Hostile(GOOD_OBJECT), ["a"])["a"].score == 0.5
    for text, kind in (("no json {", "not_json"), ("  ", "empty")):
        with pytest.raises(ReplyError) as info:
            extract_json(Hostile(text))
        assert info.value.kind == kind


def test_the_documented_fault_kinds_are_the_counted_ones() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "judges.md").read_text(encoding="utf-8")
    listed = re.search(r"a fault of one kind \(([^)]*)\)", " ".join(doc.split()))
    assert listed is not None
    assert set(re.findall(r"`([a-z_]+)`", listed.group(1))) == REPLY_FAULTS


def test_parse_reply_finds_the_object_in_prose_and_refuses_content_that_is_not_text() -> None:
    prose = 'Here you go: {"scores": [{"id": "a", "explanation": "says \\"}\\" {", "score": 0.5}]} Bye {'
    verdict = parse_reply(prose, ["a"])["a"]
    assert verdict.score == 0.5 and verdict.explanation == 'says "}" {'
    for content in ([{"type": "text", "text": "{}"}], {"scores": []}, 0.5):
        with pytest.raises(ReplyError) as info:
            parse_reply(content, ["a"])  # type: ignore[arg-type]
        assert info.value.kind == "bad_content" and type(content).__name__ in str(info.value)


def test_a_reply_of_unclosed_braces_is_scanned_once_not_once_per_brace() -> None:
    t0 = time.monotonic()
    with pytest.raises(ReplyError) as info:
        parse_reply('{"scores": ' + "{" * 20_000, ["a"])
    assert info.value.kind == "not_json" and time.monotonic() - t0 < 2.0  # a rescan from each brace: ~10 s


def test_parse_request_needs_a_user_message_with_text() -> None:
    for messages in (
        [],
        [{"role": "system", "content": "judge"}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ):
        with pytest.raises(ValueError, match="request has no user message with text content"):
            parse_request({"messages": messages})


# ---- item 6: timeout is a deadline per call; a group's and a step's judging time is bounded ----------------------


class DripServer:
    """An HTTP server on 127.0.0.1 that answers a chat completion with a good judge reply, but the first
    ``drip_first`` requests get it one byte every ``interval`` seconds (headers at once, body dripped)."""

    def __init__(self, drip_first: int, interval: float = 0.05) -> None:
        self.drip_first = drip_first
        self.interval = interval
        self.requests = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                while len(rest) < length:
                    rest += conn.recv(65536)
                body, buf = json.loads(rest[:length]), rest[length:]
                n = self.requests
                self.requests += 1
                reply = completion_body(body, Reply(reply_for("good", body).content))
                data = json.dumps(reply).encode()
                head_out = (
                    f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                ).encode()
                try:
                    conn.sendall(head_out)
                    if n < self.drip_first:
                        for i in range(len(data)):
                            if self._stop.is_set():
                                return
                            conn.sendall(data[i : i + 1])
                            time.sleep(self.interval)
                    else:
                        conn.sendall(data)
                except OSError:
                    return

    def __enter__(self) -> DripServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sock.close()


async def test_drip_fed_body_is_cut_off_at_the_timeout_and_retried() -> None:
    """A body dripped one byte every 50 ms (whole reply: tens of seconds) against timeout=2: the call gives
    up at ~2 s, counts a timeout fault, and the retry is scored."""
    with DripServer(drip_first=1) as server:
        judge = RulerJudge("m", base_url=server.base_url, timeout=2, max_retries=2, backoff=0.001)
        group = make_group(3)
        t0 = time.monotonic()
        assert await judge.score_group(group) is group
        elapsed = time.monotonic() - t0
        await judge.aclose()
    assert 1.9 < elapsed < 3.5, elapsed
    assert group.metrics["judge_fault_timeout"] == 1 and group.metrics["judge_calls"] == 2
    assert group.rewards() == pytest.approx(expected(group))


async def test_max_group_seconds_bounds_all_attempts_together() -> None:
    """Every reply drips: without a group bound this group would take 6 x timeout (2.4 s); with
    max_group_seconds=1.2 it is dropped at ~1.2 s, every call (the one cut off too) counted, rewards untouched."""
    with DripServer(drip_first=100) as server:
        judge = RulerJudge(
            "m", base_url=server.base_url, timeout=0.4, max_retries=5, backoff=0.001, max_group_seconds=1.2
        )
        group = make_group(3)
        t0 = time.monotonic()
        assert await judge.score_group(group) is None
        elapsed = time.monotonic() - t0
        await judge.aclose()
    assert 1.1 < elapsed < 2.2, elapsed
    assert group.metrics["judge_fault_group_deadline"] == 1 and group.metrics["judge_unscored"] == 1
    assert group.metrics["judge_fault_timeout"] >= 1  # calls before the bound ran out timed out on their own
    # + the call cut off by the bound (unless the bound fell in the 1 ms between two calls)
    assert group.metrics["judge_calls"] - group.metrics["judge_fault_timeout"] in (0, 1)
    assert group.rewards() == [START] * 3 and all("judge_score" not in t.metrics for t in group.trajectories)
    with pytest.raises(ValueError, match="max_group_seconds"):
        RulerJudge("m", base_url="http://127.0.0.1:9/v1", max_group_seconds=0)


async def test_step_deadline_drops_the_rest_and_counts_them(serve) -> None:
    """Inside step_deadline(0.6): groups still being judged at the deadline and groups arriving after it are
    dropped with the fault step_deadline (never 0); a group finished before it is scored."""
    slow = fault_script(then="slow", delay=3.0)
    server = serve(lambda req, n: fault_script()(req, n) if n == 0 else slow(req, n))
    judge = judge_for(server, timeout=10)
    first, late, after = make_group(2, "a"), make_group(2, "b"), make_group(2, "c")
    t0 = time.monotonic()
    with judge.step_deadline(0.6):
        assert await judge.score_group(first) is first
        assert await judge.score_group(late) is None
        assert await judge.score_group(after) is None
    assert time.monotonic() - t0 < 1.5
    assert first.rewards() == pytest.approx(expected(first))
    for g in (late, after):
        assert g.metrics["judge_fault_step_deadline"] == 1 and g.rewards() == [START, START]
    assert after.metrics["judge_calls"] == 0  # past the deadline: not even asked
    assert judge.usage.unscored == 2 and judge.usage.faults["step_deadline"] == 2
    # outside the block there is no deadline again
    server.script = fault_script()
    again = make_group(2, "d")
    assert await judge.score_group(again) is again
    await judge.aclose()


async def test_step_deadline_with_a_raising_judge(serve) -> None:
    server = serve(fault_script())
    judge = judge_for(server, on_failure="raise")
    with judge.step_deadline(0.001):
        await asyncio.sleep(0.01)
        with pytest.raises(JudgeError, match="step_deadline"):
            await judge.score_group(make_group(2, "f"))
    assert server.calls == 0
    await judge.aclose()


async def test_step_deadline_none_adds_no_bound_and_bad_seconds_are_refused(serve) -> None:
    server = serve(fault_script())
    judge = judge_for(server)
    with judge.step_deadline(None):
        free = make_group(2, "g")
        assert await judge.score_group(free) is free and free.rewards() == pytest.approx(expected(free))
    with judge.step_deadline(0.001):
        await asyncio.sleep(0.01)
        with judge.step_deadline(None):  # None inside a bound keeps that bound
            assert await judge.score_group(make_group(2, "h")) is None
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"step_deadline seconds must be > 0, got"):
            with judge.step_deadline(bad):
                pass
    assert server.calls == 1
    await judge.aclose()


async def test_bad_failure_policy_and_presentation_order_are_refused(serve) -> None:
    server = serve(fault_script())
    with pytest.raises(ValueError, match=r"on_failure must be 'drop' or 'raise', got 'ignore'"):
        judge_for(server, on_failure="ignore")
    judge = judge_for(server)
    for order in ([0, 0, 1], [0, 1], [1, 2, 3]):
        refused = make_group(3, "o")
        with pytest.raises(ValueError, match=rf"order must be a permutation of range\(3\), got \{order}"):
            await judge.score_group(refused, order=order, use_cache=False)
        assert "judge" not in refused.metadata  # refused before the group was touched
    assert server.calls == 0 and judge.usage.groups == 0
    group = make_group(3, "o")
    assert await judge.score_group(group, order=[2, 0, 1], use_cache=False) is group
    slots = [t.metadata["judge_slot"] for t in group.trajectories]
    assert slots == [1, 2, 0]  # trajectory 2 was shown first
    await judge.aclose()


# ---- item 8: cache= takes a path; ruler_score_group closes what it opens ---------------------------------------


@pytest.mark.parametrize("as_path", [False, True], ids=["str", "Path"])
async def test_cache_given_as_a_path_is_opened_and_used(serve, tmp_path: Path, as_path: bool) -> None:
    server = serve(fault_script())
    where = tmp_path / "judge.sqlite"
    judge = judge_for(server, cache=where if as_path else str(where))
    g1, g2 = make_group(3), make_group(3)
    assert await judge.score_group(g1) is g1
    assert await judge.score_group(g2) is g2
    assert server.calls == 1 and g2.metrics["judge_cache_hit"] == 1
    assert g2.rewards() == g1.rewards() == pytest.approx(expected(g1))
    await judge.aclose()
    with JudgeCache(where) as cache:
        assert len(cache) == 3  # persisted at the path given
    with pytest.raises(TypeError, match="cache must be"):
        judge_for(server, cache={"not": "a cache"})
    with pytest.raises(TypeError, match="cache must be"):
        judge_for(server, cache=42)


async def test_ruler_score_group_by_name_leaves_no_client_open(
    serve, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every AsyncOpenAI the helper makes is tracked (a real client, subclassed only to be counted): after
    each call, successful or not, all of them are closed."""
    made: list[openai.AsyncOpenAI] = []

    class Counted(openai.AsyncOpenAI):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(openai, "AsyncOpenAI", Counted)
    server = serve(fault_script())
    cache = tmp_path / "c.sqlite"
    for i in range(5):
        group = make_group(2, tag=str(i))
        out = await ruler_score_group(group, "judge-m", base_url=server.base_url, cache=str(cache))
        assert out is group and group.metrics["judge_unscored"] == 0
    assert len(made) == 5 and all(c.is_closed() for c in made)
    # a failing call closes its client too
    server.script = fault_script(then="server_error")
    with pytest.raises(JudgeError):
        await ruler_score_group(make_group(2, "x"), "judge-m", base_url=server.base_url, max_retries=0)
    assert len(made) == 6 and all(c.is_closed() for c in made)


def test_experiment_step_waits_at_most_max_group_seconds_for_its_judge(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """``reward.judge_max_group_seconds`` reaches the judge an experiment builds: with a judge that takes 3 s
    per reply, each step's groups are dropped at ~0.5 s and counted, never trained on as 0."""
    from palaestra.trainer.experiment import Experiment

    out = tmp_path / "run"
    with ScriptedServer(fault_script(then="slow", delay=3.0)) as server:
        cfg = {
            "run": {"name": "slow-judge", "seed": 1, "output_dir": str(out), "groups_per_step": 2}
            | {"group_size": 3, "max_steps": 2, "progress": False},
            "model": {"name": str(tiny_model_path)},
            "env": {"max_tokens": 6},
            "reward": {
                "kind": "judge",
                "judge_model": "slow-judge",
                "judge_base_url": server.base_url,
                "judge_api_key_env": "PALAESTRA_TEST_UNSET_KEY",
                "judge_timeout": 10,
                "judge_max_group_seconds": 0.5,
            },
            "validation": {"every": 1000, "max_examples": 2, "sampled": False},
            "stopping": {"patience": 1000},
        }
        Experiment(cfg, printer=None).run_sync()
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "faults/groups_dropped" in r]
    assert steps and all(r["faults/groups_dropped"] == 2 for r in steps)
    assert all(r["judge/fault_group_deadline"] == 2 for r in steps)
    # rollouts and judging of a step together: never waited for a 3 s reply
    assert all(r["train/rollout_seconds"] < 2.5 for r in steps), [r["train/rollout_seconds"] for r in steps]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["reward"]["judge_max_group_seconds"] == 0.5


def test_usage_counts_are_whole_non_negative_numbers_of_any_size() -> None:
    from palaestra.judges.ruler import TransientError, _usage

    assert _usage({"prompt_tokens": 10**400, "completion_tokens": 3.0}) == (10**400, 3)
    for bad in (1.5, float("inf"), float("nan"), -1, True, "7"):
        with pytest.raises(TransientError, match=r"usage\.prompt_tokens is .* not a count"):
            _usage({"prompt_tokens": bad})
