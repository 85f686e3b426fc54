"""Fuzzing: verifiers, the OpenAI-compatible server, malformed JSONL inputs and experiment configs.

* Verifiers: ``tests/test_verifier_properties.py`` runs the contract on a few hundred hypothesis examples per
  verifier; here the slow test runs 100,000 strings per shipped verifier (totality and determinism), and the
  fast ones check what that file does not: the same scores in a fresh process with another hash seed, and
  ``VerifierReward`` on trajectories of any shape.
* Server: the real app under uvicorn on 127.0.0.1. Arbitrary JSON values, arbitrary bytes and near-valid
  request bodies (right field names, any values) never get a 5xx, and every error has the OpenAI error shape.
  With ``schemathesis`` installed, it also generates requests from an OpenAPI document built from the
  server's request models (positive and negative cases).
* Inputs: a dataset or completions JSONL with one corrupted line, and trajectory-group files, fail with an
  error naming ``file:line`` (the CLI exits 2); a config with a wrong value, an unknown key, a TOML syntax
  error or bytes that are not UTF-8 fails with the file and the field (or line), exit 2, before any work.

Run the long variants with ``pytest -m slow tests/test_fuzz.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from palaestra.cli import main as cli_main
from palaestra.envs.verifier import VerifierReward, check_contract, shipped_verifiers
from palaestra.trainer.expconfig import ExperimentConfig, load_config
from palaestra.trajectories.io import DataError, read_groups
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SLOW = settings(
    max_examples=2_000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ------------------------------------------------------------------------------------------- verifiers

ANY_CHAR = st.one_of(
    st.characters(),
    st.characters(categories=["Cs"]),
    st.sampled_from("0123456789-+: \n\t\u200b\uff10\u0660Final<think></think>"),
)
FRAGMENTS = st.sampled_from(
    [
        "Final:",
        "Final: ",
        "final:",
        "-",
        "+",
        "0",
        "42",
        "007",
        "\n",
        " ",
        "</think>",
        "<think>",
        "\\boxed{",
        "}",
        "Final: 4\n",
        "\u2212",
        "\u00a0",
        "1e3",
        "0x2a",
    ]
)
STRINGS = st.one_of(
    st.text(ANY_CHAR, max_size=64),
    st.lists(st.one_of(FRAGMENTS, st.text(ANY_CHAR, max_size=4)), max_size=16).map("".join),
    st.integers(min_value=-(10**40), max_value=10**40).map(lambda n: f"Final: {n}"),
)
EXAMPLES = st.one_of(
    st.integers(min_value=-200, max_value=200).map(lambda n: {"expected_answer": str(n)}),
    st.builds(lambda n: {"expected_answer": n}, st.integers(min_value=-(10**20), max_value=10**20)),
    st.fixed_dictionaries({"expected_answer": st.one_of(st.none(), st.text(max_size=5), st.floats())}),
)


@pytest.mark.slow
@pytest.mark.parametrize("verifier", shipped_verifiers(), ids=lambda v: v.name)
def test_100k_strings_per_verifier_total_and_deterministic(verifier: Any) -> None:
    seen = {"n": 0}

    @settings(max_examples=100_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(example=EXAMPLES, completion=STRINGS)
    def check(example: dict[str, Any], completion: str) -> None:
        seen["n"] += 1
        assert check_contract(verifier, [example], [completion], repeats=2) == 1
        assert verifier.score(example, completion).reward in (0.0, 1.0)

    check()
    assert seen["n"] >= 90_000  # hypothesis may stop early only when it has exhausted a strategy


def _seeded_cases(n: int) -> list[tuple[dict[str, Any], str]]:
    """Deterministic pseudo-random (example, completion) pairs, the same in every process."""
    import random

    rng = random.Random(1234)
    pieces = [
        "Final:",
        " ",
        "\n",
        "-",
        "+",
        "0",
        "7",
        "42",
        "</think>",
        "<think>",
        "x",
        "\u200b",
        "\uff14",
        "Final: 4",
        "\t",
        "00",
        "\\boxed{",
        "}",
    ]
    cases = []
    for _ in range(n):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        cases.append(({"expected_answer": str(rng.randint(-20, 120))}, text))
    return cases


_DIGEST_SNIPPET = """
import hashlib, json, sys
sys.path.insert(0, {root!r})
from tests.test_fuzz import _scores_digest
print(_scores_digest())
"""


def _scores_digest() -> str:
    h = hashlib.sha256()
    for verifier in shipped_verifiers():
        for example, text in _seeded_cases(3000):
            s = verifier.score(example, text)
            h.update(
                json.dumps(
                    [verifier.name, s.reward, s.outcome, s.details], sort_keys=True, default=str
                ).encode()
            )
    return h.hexdigest()


def test_verifier_scores_are_identical_in_a_fresh_process_with_another_hash_seed() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST_SNIPPET.format(root=str(ROOT))],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.strip() == _scores_digest()


CONTENT = st.one_of(
    st.none(),
    st.text(ANY_CHAR, max_size=30),
    st.integers(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
            st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
            st.text(max_size=4),
        ),
        max_size=3,
    ),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "other"]), "content": CONTENT}
)


@FAST
@given(messages=st.lists(MESSAGE, max_size=5), example=EXAMPLES)
async def test_verifier_reward_scores_trajectories_of_any_shape(
    messages: list[dict[str, Any]], example: dict[str, Any]
) -> None:
    for verifier in shipped_verifiers():
        group = TrajectoryGroup([Trajectory(messages_and_choices=list(messages)) for _ in range(2)])
        scored = await VerifierReward(verifier).score_group(group, example)
        for t in scored.trajectories:
            assert t.reward in (0.0, 1.0)
            assert isinstance(t.metadata["outcome"], str) and t.metadata["outcome"]
        assert scored.trajectories[0].reward == scored.trajectories[1].reward


# ------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """The real app (create_app) served by uvicorn on 127.0.0.1 in a background thread."""
    import uvicorn

    from palaestra.models.embedded import EmbeddedModel
    from palaestra.models.server import create_app
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=48, d_model=32, n_layer=1, n_head=2, d_ff=64)
    app = create_app(EmbeddedModel(TinyGPT(cfg, tokenizer=tok, seed=3), name="tiny"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=30) as client:
        yield client


def check_reply(resp: httpx.Response, sent: Any) -> None:
    assert resp.status_code < 500, (sent, resp.status_code, resp.text[:500])
    if resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream"):
        # a valid request with "stream": true: server-sent events, each a JSON chunk, then [DONE]
        events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line]
        assert events[-1] == "[DONE]" and len(events) > 1, (sent, resp.text[:500])
        for event in events[:-1]:
            assert isinstance(json.loads(event).get("choices"), list), (sent, event)
        return
    body = resp.json()
    if resp.status_code == 200:
        assert isinstance(body.get("choices"), list) and body["choices"], body
    else:
        assert (
            set(body) == {"error"} and isinstance(body["error"]["message"], str) and body["error"]["message"]
        )
        assert body["error"]["type"] in ("invalid_request_error", "not_found_error"), body


JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
JUNK = st.one_of(JSON, st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.just(True))
CHAT_FIELDS = {
    "n": JUNK,
    "temperature": JUNK,
    "top_p": JUNK,
    "max_tokens": JUNK,
    "max_completion_tokens": JUNK,
    "stop": JUNK,
    "seed": JUNK,
    "logprobs": JUNK,
    "top_logprobs": JUNK,
    "stream": JUNK,
    "tools": JUNK,
    "response_format": JUNK,
}
SMALL = {  # plausible values, so that many requests get past validation and into generation
    "n": st.integers(min_value=-2, max_value=4),
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "max_tokens": st.integers(min_value=-1, max_value=8),
    "seed": st.integers(min_value=-(2**64), max_value=2**64),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=-1, max_value=25),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)),
}
CHAT_MESSAGE = st.one_of(
    MESSAGE,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=20)},
        optional={"tool_calls": JSON, "name": JSON, "tool_call_id": JSON},
    ),
    JSON,
)


def near_valid(path: str) -> st.SearchStrategy[dict[str, Any]]:
    base: dict[str, Any] = {"model": st.sampled_from(["tiny", "tiny", "nope", ""])}
    if path.endswith("chat/completions"):
        base["messages"] = st.lists(CHAT_MESSAGE, max_size=4)
    else:
        base["prompt"] = st.one_of(st.text(max_size=40), st.lists(st.text(max_size=20), max_size=3), JSON)
    junk = {k: st.one_of(v, SMALL.get(k, v)) for k, v in CHAT_FIELDS.items()}
    if not path.endswith("chat/completions"):
        junk["logprobs"] = st.one_of(JUNK, st.integers(min_value=-1, max_value=6))
        junk["echo"] = JUNK
    return st.fixed_dictionaries(base, optional=junk)


PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


def _server_property(http: httpx.Client, path: str, body: Any, raw: bytes | None) -> None:
    content = raw if raw is not None else json.dumps(body).encode()
    resp = http.post(path, content=content, headers={"content-type": "application/json"})
    check_reply(resp, body if raw is None else raw)


@FAST
@given(path=PATHS, data=st.data())
def test_server_never_5xx_on_near_valid_bodies(http: httpx.Client, path: str, data: st.DataObject) -> None:
    _server_property(http, path, data.draw(near_valid(path)), None)


@FAST
@given(path=PATHS, body=JSON, raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_server_never_5xx_on_arbitrary_json_or_bytes(
    http: httpx.Client, path: str, body: Any, raw: bytes | None
) -> None:
    _server_property(http, path, body, raw)


@FAST
@given(model_id=st.text(max_size=30))
def test_server_model_lookup_never_5xx(http: httpx.Client, model_id: str) -> None:
    resp = http.get("/v1/models/" + _quote(model_id))
    assert resp.status_code in (200, 404), resp.text
    if resp.status_code == 404:
        assert "error" in resp.json()


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "0", "stream": True}),  # once drawn by the long fuzz
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "1+1"}], "stream": True},
        ),
    ],
)
def test_a_streamed_reply_passes_the_reply_check(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    resp = http.post(path, json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    check_reply(resp, body)


@pytest.mark.slow
@SLOW
@given(path=PATHS, data=st.data(), raw=st.one_of(st.none(), st.binary(max_size=200)))
def test_server_never_5xx_long(http: httpx.Client, path: str, data: st.DataObject, raw: bytes | None) -> None:
    body = data.draw(st.one_of(near_valid(path), JSON))
    _server_property(http, path, body, raw)


def openapi_document() -> dict[str, Any]:
    """An OpenAPI 3.1 document for the server, built from its pydantic request models (the app is a plain ASGI
    callable that reads raw bodies, so it has no schema of its own to serve). ``model`` is pinned to the served
    name so that generated requests reach generation, not only the 404 path."""
    from palaestra.models.server import ChatRequest, CompletionRequest

    schemas: dict[str, Any] = {}

    def body(model: Any) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"type": "string", "enum": ["tiny"]}
        return {"required": True, "content": {"application/json": {"schema": schema}}}

    chat = body(ChatRequest)
    chat["content"]["application/json"]["schema"]["properties"]["messages"]["items"] = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"type": "string"},
        },
    }
    responses = {
        "200": {"description": "completion"},
        "400": {"description": "invalid request"},
        "404": {"description": "unknown model"},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "palaestra embedded server", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": {"requestBody": chat, "responses": responses}},
            "/v1/completions": {"post": {"requestBody": body(CompletionRequest), "responses": responses}},
            "/v1/models": {"get": {"responses": responses}},
            "/health": {"get": {"responses": responses}},
        },
        "components": {"schemas": schemas},
    }


def _schemathesis_run(server_url: str, examples: int) -> dict[str, dict[int, int]]:
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(openapi_document())
    statuses: dict[str, dict[int, int]] = {}

    def fuzz(op: Any) -> None:
        counts = statuses.setdefault(op.label, {})

        @settings(  # the short CI run draws the same cases every time; the long (slow) run explores
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=examples < 100,
        )
        @given(case=op.as_strategy())
        def call(case: Any) -> None:
            resp = case.call(base_url=server_url)
            counts[resp.status_code] = counts.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (case.body, resp.text[:500])

        call()

    for result in schema.get_all_operations():
        fuzz(result.ok())
    return statuses


def test_schemathesis_no_server_errors(server_url: str) -> None:
    statuses = _schemathesis_run(server_url, 40)
    assert statuses["POST /v1/chat/completions"].get(200, 0) > 0  # generation was reached, not only errors
    assert statuses["POST /v1/completions"].get(200, 0) > 0


@pytest.mark.slow
def test_schemathesis_no_server_errors_long(server_url: str) -> None:
    _schemathesis_run(server_url, 1_000)


# ------------------------------------------------------------------------------------------- JSONL inputs

GOOD_ROW = {"id": "q1", "prompt": "What is 1+1? Reply with one line: Final: <int>", "expected_answer": "2"}
CORRUPTIONS = {  # corrupted line -> what the error must say about it
    "truncated": (lambda row: json.dumps(row)[:-3], "malformed JSON"),
    "not_object": (lambda row: json.dumps([row]), "expected a JSON object"),
    "no_id": (lambda row: json.dumps({k: v for k, v in row.items() if k != "id"}), "field 'id'"),
    "int_id": (lambda row: json.dumps({**row, "id": 7}), "field 'id'"),
    "duplicate_id": (lambda row: json.dumps({**row, "id": "q0"}), "duplicate id"),
    "trailing_garbage": (lambda row: json.dumps(row) + " x", "malformed JSON"),
    "bad_utf8": (lambda row: json.dumps(row)[:-2].encode() + b'\xff\xfe"}', "UTF-8"),
}


def _write_dataset(path: Path, n: int, bad_line: int | None = None, kind: str = "") -> None:
    lines: list[bytes] = []
    for i in range(n):
        row = {**GOOD_ROW, "id": f"q{i}"}
        if bad_line is not None and i + 1 == bad_line:
            text = CORRUPTIONS[kind][0](row)
            lines.append(text if isinstance(text, bytes) else text.encode())
        else:
            lines.append(json.dumps(row).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(argv)
    return code, capsys.readouterr().err


@FAST
@given(n=st.integers(min_value=2, max_value=8), data=st.data(), kind=st.sampled_from(sorted(CORRUPTIONS)))
def test_eval_dataset_with_a_corrupted_line_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], n: int, data: st.DataObject, kind: str
) -> None:
    bad = data.draw(
        st.integers(min_value=2, max_value=n)
    )  # line 1 holds q0, which duplicate_id collides with
    dataset, completions = tmp_path / "ds.jsonl", tmp_path / "comp.jsonl"
    _write_dataset(dataset, n, bad, kind)
    completions.write_text(
        "".join(json.dumps({"id": f"q{i}", "completion": "Final: 2"}) + "\n" for i in range(n))
    )
    code, err = _cli(
        [
            "eval",
            "--dataset",
            str(dataset),
            "--completions",
            str(completions),
            "--outdir",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 2, err
    assert f"{dataset}:{bad}: " in err and CORRUPTIONS[kind][1] in err, err
    assert not (tmp_path / "out" / "results.jsonl").exists()


@FAST
@given(n=st.integers(min_value=1, max_value=6), data=st.data())
def test_completions_with_a_corrupted_line_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], n: int, data: st.DataObject
) -> None:
    bad = data.draw(st.integers(min_value=1, max_value=n))
    kind = data.draw(
        st.sampled_from(
            ["truncated", "not_object", "unknown_id", "no_completion", "int_completion", "bad_utf8"]
        )
    )
    dataset, completions = tmp_path / "ds.jsonl", tmp_path / "comp.jsonl"
    _write_dataset(dataset, n)
    lines = []
    for i in range(n):
        row: dict[str, Any] = {"id": f"q{i}", "completion": "Final: 2"}
        text: str | bytes = json.dumps(row)
        if i + 1 == bad:
            text = {
                "truncated": json.dumps(row)[:-1],
                "not_object": json.dumps("Final: 2"),
                "unknown_id": json.dumps({**row, "id": "zz"}),
                "no_completion": json.dumps({"id": row["id"]}),
                "int_completion": json.dumps({**row, "completion": 2}),
                "bad_utf8": b'{"id": "' + row["id"].encode() + b'", "completion": "\xc3\x28"}',
            }[kind]
        lines.append(text if isinstance(text, bytes) else text.encode())
    completions.write_bytes(b"\n".join(lines) + b"\n")
    code, err = _cli(
        [
            "eval",
            "--dataset",
            str(dataset),
            "--completions",
            str(completions),
            "--outdir",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 2, err
    assert f"{completions}:{bad}: " in err, (kind, err)


def test_eval_cli_subprocess_exit_code_and_message(tmp_path: Path) -> None:
    dataset = tmp_path / "ds.jsonl"
    _write_dataset(dataset, 3, 2, "truncated")
    (tmp_path / "c.jsonl").write_text('{"id": "q0", "completion": "Final: 2"}\n')
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "palaestra",
            "eval",
            "--dataset",
            str(dataset),
            "--completions",
            str(tmp_path / "c.jsonl"),
            "--outdir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("palaestra eval: error: ") and f"{dataset}:2: malformed JSON" in out.stderr
    assert "Traceback" not in out.stderr


@FAST
@given(n=st.integers(min_value=1, max_value=4), data=st.data())
def test_read_groups_names_file_line_and_field(tmp_path: Path, n: int, data: st.DataObject) -> None:
    good = TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.5)])
    rows = [json.loads(good.model_dump_json()) for _ in range(n)]
    bad = data.draw(st.integers(min_value=1, max_value=n))
    kind = data.draw(st.sampled_from(["reward", "trajectories", "metrics", "truncated", "list"]))
    row = rows[bad - 1]
    if kind == "reward":
        row["trajectories"][0]["reward"] = data.draw(
            st.one_of(
                st.text(min_size=1, max_size=5).filter(lambda s: not _is_number(s)),
                st.lists(st.integers(), max_size=2),
                st.none(),
            )
        )
    elif kind == "trajectories":
        row["trajectories"] = data.draw(
            st.one_of(
                st.text(max_size=5),
                st.integers(),
                st.none(),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
            )
        )  # "", {} and 5 included: not lists
    elif kind == "metrics":
        row["trajectories"][0]["metrics"] = {
            "x": data.draw(
                st.one_of(
                    st.lists(st.integers(), max_size=2),
                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                )
            )
        }
    lines = [json.dumps(r) for r in rows]
    if kind == "truncated":
        lines[bad - 1] = lines[bad - 1][:-5]
    elif kind == "list":
        lines[bad - 1] = json.dumps([row])
    path = tmp_path / "groups.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        read_groups(path)
    assert str(info.value).startswith(f"{path}:{bad}: "), str(info.value)
    if kind in ("reward", "trajectories", "metrics"):
        assert f"field '{'trajectories' if kind == 'trajectories' else 'trajectories.0.' + kind}" in str(
            info.value
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------- configs


def _leaf_fields(model: Any = ExperimentConfig, prefix: str = "") -> dict[str, str]:
    """Dotted path -> annotation of every leaf field of the experiment config (dict-valued bags excluded)."""
    from pydantic import BaseModel

    out: dict[str, str] = {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_leaf_fields(ann, f"{prefix}{name}."))
        elif "dict" not in str(ann):
            out[f"{prefix}{name}"] = str(ann)
    return out


LEAF_TYPES = _leaf_fields()
LEAVES = sorted(LEAF_TYPES)


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def _nested_toml(path: str, value: Any) -> str:
    *sections, key = path.split(".")
    return (f"[{'.'.join(sections)}]\n" if sections else "") + f"{key} = {_toml_value(value)}\n"


WRONG = st.one_of(
    st.lists(st.integers(), min_size=1, max_size=3), st.fixed_dictionaries({"a": st.integers()})
)


@FAST
@given(field=st.sampled_from(LEAVES), value=WRONG)
def test_config_wrong_value_names_the_field(tmp_path: Path, field: str, value: Any) -> None:
    if isinstance(value, list) and ("tuple" in LEAF_TYPES[field] or "list" in LEAF_TYPES[field]):
        value = {"a": value}  # a list may be the right type there (e.g. train.betas)
    path = tmp_path / "exp.toml"
    path.write_text(_nested_toml(field, value))
    with pytest.raises(DataError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: field '{field}")


@FAST
@given(
    section=st.sampled_from(["", *sorted({f.rsplit(".", 1)[0] for f in LEAVES if "." in f})]),
    key=st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True),
)
def test_config_unknown_key_names_the_field(tmp_path: Path, section: str, key: str) -> None:
    if f"{section}.{key}".lstrip(".") in LEAVES or (not section and key in ExperimentConfig.model_fields):
        return
    if section and key in {f.split(".")[-1] for f in LEAVES if f.startswith(section + ".")}:
        return
    field = f"{section}.{key}" if section else key
    path = tmp_path / "exp.toml"
    path.write_text(_nested_toml(field, 1))
    with pytest.raises(DataError, match=r"unknown field") as info:
        load_config(path)
    assert f"field '{field}'" in str(info.value)


@FAST
@given(
    good=st.integers(min_value=0, max_value=5),
    junk=st.sampled_from(["name = ", "[run", "x = 'a", "= 3", "seed = 1 2", "[[run]]\n[run]"]),
)
def test_config_syntax_error_names_the_line(tmp_path: Path, good: int, junk: str) -> None:
    lines = ["[run]", *[f"# comment {i}" for i in range(good)], junk]
    path = tmp_path / "exp.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"TOML syntax error") as info:
        load_config(path)
    assert info.value.line is not None and 2 <= info.value.line <= len(lines) + 1
    assert str(info.value).startswith(f"{path}:{info.value.line}: ")


def test_config_errors_via_cli_exit_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "run"
    cases = {
        "type.toml": (f'[run]\noutput_dir = "{out_dir}"\ngroup_size = "eight"\n', "field 'run.group_size'"),
        "unknown.toml": (
            f'[run]\noutput_dir = "{out_dir}"\n[reward]\nkind = "verifier"\njudge = 1\n',
            "field 'reward.judge': unknown field",
        ),
        "literal.toml": (
            f'[run]\noutput_dir = "{out_dir}"\n[reward]\nkind = "oracle"\n',
            "field 'reward.kind'",
        ),
        "syntax.toml": (f'[run]\noutput_dir = "{out_dir}"\nseed = \n', "syntax.toml:3: TOML syntax error"),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        code, err = _cli(["train", "--config", str(tmp_path / name)], capsys)
        assert code == 2 and err.startswith("palaestra train: error: ") and expected in err, (name, err)
    (tmp_path / "utf8.toml").write_bytes(b'[run]\nseed = 1\nname = "\xff"\n')
    code, err = _cli(["train", "--config", str(tmp_path / "utf8.toml")], capsys)
    assert code == 2 and "utf8.toml:3: " in err and "UTF-8" in err, err
    code, err = _cli(["train", "--config", str(tmp_path / "missing.toml")], capsys)
    assert code == 2 and "missing.toml: config file not found" in err
    assert not out_dir.exists()  # nothing started


async def test_completions_with_one_bad_prompt_in_a_list_leaves_no_work_behind() -> None:
    """A list prompt whose second entry is invalid is refused (400) before any generation is submitted."""
    import gc
    import warnings

    from palaestra.models.embedded import EmbeddedModel
    from palaestra.models.server import create_app
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=48, d_model=32, n_layer=1, n_head=2, d_ff=64)
    model = EmbeddedModel(TinyGPT(cfg, tokenizer=tok, seed=3), name="tiny")
    transport = httpx.ASGITransport(app=create_app(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            for prompt in (["What is 1+1?", ""], ["What is 1+1?", "x" * 500]):
                resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
                assert resp.status_code == 400, resp.text
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert model.stats.snapshot(batches=False)["requests"] == 0
