"""Secrets: API keys passed by environment variable or by argument never appear in manifests, logs, run
folders, captured output or error messages.

Every endpoint here sits behind :class:`AuthProxy`, a real HTTP proxy on 127.0.0.1 that checks the
``Authorization`` header (so each test also proves the key was really sent) and answers a wrong key with
HTTP 401 — optionally echoing the key it received, as some gateways do. After each run every byte of every
file of the run folder, the captured stdout/stderr, the log records and the full text of any exception (with
its chained causes) is searched for the key.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import traceback
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from palaestra.judges.base import JudgeConfigError
from palaestra.judges.faults import fault_script
from palaestra.judges.ruler import RulerJudge
from palaestra.testing import ScriptedServer
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

ROOT = Path(__file__).resolve().parents[1]
JUDGE_KEY = "sk-palaestra-test-JUDGE-5b1f0c9e7d2a4f68"
EVAL_KEY = "sk-palaestra-test-EVAL-0d93c27aa1e84b55"
URL_KEY = "sk-palaestra-test-URL-7e6d5c4b3a291807"
ARG_KEY = "sk-palaestra-test-ARG-c0ffee00deadbeef"
QUERY_KEY = "sk-palaestra-test-QUERY-91a8b7c6d5e4f302"
SHORT_KEY = "q7Zx"  # under 8 characters: scrubbed by value where it is known to be the key


class AuthProxy:
    """Forwards POSTs to ``upstream`` when ``Authorization: Bearer <key>`` matches; otherwise HTTP 401, whose
    message quotes the received key when ``echo_key`` is set. ``seen`` lists the Authorization headers.

    Like gateways that take a key in the URL, it accepts (and drops before forwarding) a query string, also
    where the ``openai`` client puts a base URL's query: ``/v1/?api_key=Kchat/completions``."""

    def __init__(self, upstream: str, key: str, *, echo_key: bool = False, basic: str | None = None) -> None:
        self.upstream = upstream.rstrip("/").removesuffix("/v1")
        self.key = key
        self.accepted = {f"Bearer {key}"}
        if basic is not None:  # "user:password" from a URL's user info, which httpx sends as Basic auth
            self.accepted.add("Basic " + __import__("base64").b64encode(basic.encode()).decode())
        self.echo_key = echo_key
        self.seen: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                auth = self.headers.get("Authorization", "")
                proxy.seen.append(auth)
                if auth not in proxy.accepted:
                    got = auth.removeprefix("Bearer ")
                    msg = (
                        f"Incorrect API key provided: {got}"
                        if proxy.echo_key
                        else "Incorrect API key provided"
                    )
                    err = {
                        "error": {"message": msg, "type": "invalid_request_error", "code": "invalid_api_key"}
                    }
                    self._send(401, json.dumps(err).encode())
                    return
                path = self.path
                if (
                    "?" in path
                ):  # the openai client appends the route to the query: /v1/?key=Kchat/completions
                    head, _, query = path.partition("?")
                    route = next((r for r in ("chat/completions", "completions") if query.endswith(r)), "")
                    path = head.rstrip("/") + "/" + route
                req = urllib.request.Request(
                    proxy.upstream + path,
                    data=body,
                    method="POST",
                    headers={"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        self._send(resp.status, resp.read())
                except urllib.error.HTTPError as exc:
                    self._send(exc.code, exc.read())

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> AuthProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def files_containing(root: Path, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``secret`` (plain or JSON-escaped)."""
    needles = [secret.encode(), json.dumps(secret).encode()[1:-1]]
    hits = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if any(n in data for n in needles):
            hits.append(str(path.relative_to(root)))
    return hits


def full_text(exc: BaseException) -> str:
    """The exception as a traceback prints it, chained causes and contexts included."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def env_with(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return {**env, "PYTHONPATH": str(ROOT), **values}


def experiment_toml(model: Path, out: Path, judge_url: str, steps: int = 2) -> str:
    return f"""
[run]
name = "secrets"
seed = 2
output_dir = "{out}"
groups_per_step = 2
group_size = 3
max_steps = {steps}

[model]
name = "{model}"

[env]
max_tokens = 6

[reward]
kind = "judge"
judge_model = "secret-judge"
judge_base_url = "{judge_url}"
judge_api_key_env = "PALAESTRA_TEST_JUDGE_KEY"
judge_max_retries = 1
judge_timeout = 10

[validation]
every = 100
max_examples = 4
sampled = false
"""


def test_judge_key_from_env_never_written(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with ScriptedServer(fault_script()) as upstream, AuthProxy(upstream.base_url, JUDGE_KEY) as proxy:
        (tmp_path / "exp.toml").write_text(experiment_toml(tiny_model_path, out, proxy.base_url))
        done = subprocess.run(
            [sys.executable, "-m", "palaestra", "train", "--config", str(tmp_path / "exp.toml")],
            capture_output=True,
            text=True,
            env=env_with(PALAESTRA_TEST_JUDGE_KEY=JUDGE_KEY),
            cwd=tmp_path,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    assert proxy.seen and all(h == f"Bearer {JUDGE_KEY}" for h in proxy.seen)  # the key was used
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["train_reward"]["judge"]["api_key_env"] == "PALAESTRA_TEST_JUDGE_KEY"
    )  # the name, not the key
    assert files_containing(out, JUDGE_KEY) == []
    assert JUDGE_KEY not in done.stdout + done.stderr


@pytest.mark.parametrize("key", [JUDGE_KEY, SHORT_KEY], ids=["long-key", "short-key"])
def test_judge_with_a_wrong_key_fails_without_printing_it(
    tiny_model_path: Path, tmp_path: Path, key: str
) -> None:
    """The endpoint refuses the key with 401 and quotes it back; the run stops (a config error) and neither
    its output nor its folder holds the key, however short."""
    out = tmp_path / "run"
    with (
        ScriptedServer(fault_script()) as upstream,
        AuthProxy(upstream.base_url, "sk-other", echo_key=True) as proxy,
    ):
        (tmp_path / "exp.toml").write_text(experiment_toml(tiny_model_path, out, proxy.base_url, steps=1))
        done = subprocess.run(
            [sys.executable, "-m", "palaestra", "train", "--config", str(tmp_path / "exp.toml")],
            capture_output=True,
            text=True,
            env=env_with(PALAESTRA_TEST_JUDGE_KEY=key),
            cwd=tmp_path,
            timeout=300,
        )
    assert set(proxy.seen) == {f"Bearer {key}"} and len(proxy.seen) <= 2  # one call per group: no retry
    assert done.returncode != 0
    assert "401" in done.stderr and "JudgeConfigError" in done.stderr
    assert key not in done.stdout + done.stderr
    assert files_containing(out, key) == []


def _group() -> TrajectoryGroup:
    prompt = {"role": "user", "content": "What is 2+2? Reply with one line: Final: <int>"}
    return TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[prompt, {"role": "assistant", "content": f"Final: {k}"}])
            for k in (3, 4)
        ]
    )


@pytest.mark.parametrize("echo", [False, True], ids=["plain-401", "401-quoting-the-key"])
async def test_judge_401_error_never_contains_the_key(echo: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    group = _group()
    with (
        ScriptedServer(fault_script()) as upstream,
        AuthProxy(upstream.base_url, "sk-other", echo_key=echo) as proxy,
    ):
        judge = RulerJudge(
            "secret-judge", base_url=proxy.base_url, api_key=ARG_KEY, max_retries=2, backoff=0.001
        )
        with pytest.raises(JudgeConfigError, match="401") as info:
            await judge.score_group(group)
    assert proxy.seen == [f"Bearer {ARG_KEY}"]
    texts = {
        "message": str(info.value),
        "repr": repr(info.value),
        "traceback": full_text(info.value),
        "logs": caplog.text,
        "group": group.model_dump_json(),
        "info": json.dumps(judge.info()),
        "judge repr": repr(judge) + repr(vars(judge).get("_client")),
    }
    leaks = [name for name, text in texts.items() if ARG_KEY in text]
    assert leaks == [], leaks
    assert all(
        t.reward == 0.0 and "judge_score" not in t.metrics for t in group.trajectories
    )  # unscored, not 0


def _dataset(path: Path) -> Path:
    rows = [
        {
            "id": f"q{i}",
            "prompt": f"What is {i}+1? Reply with one line: Final: <int>",
            "expected_answer": str(i + 1),
        }
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_remote_model_key_from_env_and_from_url(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds.jsonl")
    with (
        ScriptedServer(lambda req, n: "Final: 2") as upstream,
        AuthProxy(upstream.base_url, EVAL_KEY) as proxy,
    ):
        runs = {}
        # 1) key in the environment (OPENAI_API_KEY, the RemoteModel default)
        runs["env"] = subprocess.run(
            [
                sys.executable,
                "-m",
                "palaestra",
                "eval",
                "--dataset",
                str(dataset),
                "--model",
                "remote-policy",
                "--base-url",
                proxy.base_url,
                "--samples",
                "2",
                "--outdir",
                str(tmp_path / "env"),
            ],
            capture_output=True,
            text=True,
            env=env_with(OPENAI_API_KEY=EVAL_KEY),
            cwd=tmp_path,
            timeout=120,
        )
        assert runs["env"].returncode == 0, runs["env"].stderr
        assert proxy.seen and all(h == f"Bearer {EVAL_KEY}" for h in proxy.seen)
        # 2) a credential in the --base-url argument (user:password@host), key also in the environment
        url = proxy.base_url.replace("http://", f"http://user:{URL_KEY}@")
        runs["url"] = subprocess.run(
            [
                sys.executable,
                "-m",
                "palaestra",
                "eval",
                "--dataset",
                str(dataset),
                "--model",
                "remote-policy",
                "--base-url",
                url,
                "--outdir",
                str(tmp_path / "url"),
            ],
            capture_output=True,
            text=True,
            env=env_with(OPENAI_API_KEY=EVAL_KEY),
            cwd=tmp_path,
            timeout=120,
        )
        assert runs["url"].returncode == 0, runs["url"].stderr
    for name, done in runs.items():
        for key in (EVAL_KEY, URL_KEY):
            assert key not in done.stdout + done.stderr, (name, key)
            assert files_containing(tmp_path / name, key) == [], (name, key)
    manifest = json.loads((tmp_path / "url" / "manifest.json").read_text())
    assert "127.0.0.1" in json.dumps(manifest)  # the endpoint is recorded, without its credential


async def test_eval_remote_model_key_by_argument_python_api(tmp_path: Path) -> None:
    from palaestra.evals.evaluate import evaluate_model
    from palaestra.models.remote import RemoteModel

    dataset = _dataset(tmp_path / "ds.jsonl")
    with (
        ScriptedServer(lambda req, n: "Final: 2") as upstream,
        AuthProxy(upstream.base_url, ARG_KEY) as proxy,
    ):
        model = RemoteModel("remote-policy", proxy.base_url, api_key=ARG_KEY, api_key_env=None)
        assert ARG_KEY not in repr(model) + str(model)
        run = await evaluate_model(dataset, model, tmp_path / "out", samples=1, progress=False)
    assert run.summary["n"] == 4
    assert proxy.seen and all(h == f"Bearer {ARG_KEY}" for h in proxy.seen)
    assert files_containing(tmp_path / "out", ARG_KEY) == []
    with pytest.raises(TypeError, match="not picklable"):
        __import__("pickle").dumps(model)


def _echoing_judge(*secrets: str) -> Any:
    """Good judge replies whose explanations quote ``secrets`` (an endpoint echoing what it was sent)."""
    from palaestra.judges.faults import good_scores

    def script(request: dict[str, Any], n: int) -> str:
        entries = good_scores(request)
        for e in entries:
            e["explanation"] = f"fine; you called me with {' and '.join(secrets)}"
        return json.dumps({"scores": entries})

    return script


def test_keys_in_the_judge_url_and_echoed_by_the_judge_are_never_written(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Issue 16.15: ``user:KEY@`` and ``?api_key=`` in ``judge_base_url`` reach neither config.json,
    manifest.json (config, reward info, command line) nor any other file or output; judge text that quotes
    the keys is scrubbed before it is saved with the samples."""
    out = tmp_path / "run"
    with (
        ScriptedServer(_echoing_judge(JUDGE_KEY, URL_KEY, QUERY_KEY)) as upstream,
        AuthProxy(upstream.base_url, JUDGE_KEY, basic=f"judge:{URL_KEY}") as proxy,
    ):
        url = proxy.base_url.replace("http://", f"http://judge:{URL_KEY}@") + f"?api_key={QUERY_KEY}&mode=x"
        (tmp_path / "exp.toml").write_text(experiment_toml(tiny_model_path, out, url))
        done = subprocess.run(
            [sys.executable, "-m", "palaestra", "train", "--config", str(tmp_path / "exp.toml")],
            capture_output=True,
            text=True,
            env=env_with(PALAESTRA_TEST_JUDGE_KEY=JUDGE_KEY),
            cwd=tmp_path,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    assert proxy.seen and set(proxy.seen) <= proxy.accepted  # the judge was really used
    samples = "".join(p.read_text() for p in out.rglob("*.jsonl") if "sample" in str(p))
    assert "you called me with" in samples  # the judge's words were saved ...
    for key in (JUDGE_KEY, URL_KEY, QUERY_KEY):
        assert files_containing(out, key) == [], key  # ... without the keys
        assert key not in done.stdout + done.stderr, key
    config = json.loads((out / "config.json").read_text())
    recorded = config["reward"]["judge_base_url"]
    assert "127.0.0.1" in recorded and "<redacted>" in recorded and "mode=x" in recorded


def _groups_file(path: Path) -> Path:
    from palaestra.trajectories.io import write_groups

    groups = [_group(), _group()]
    groups[1].trajectories[0].messages_and_choices[0]["content"] = (
        "What is 3+3? Reply with one line: Final: <int>"
    )
    write_groups(path, groups)
    return path


def test_judge_audit_report_and_errors_hold_no_key(tmp_path: Path) -> None:
    """Issue 16.15: ``judge-audit --judge-base-url ...?key=...`` writes no key into report.json; a short key
    that a refusing endpoint quotes back does not reach stderr."""
    groups = _groups_file(tmp_path / "groups.jsonl")
    with ScriptedServer(fault_script()) as upstream, AuthProxy(upstream.base_url, SHORT_KEY) as proxy:
        url = proxy.base_url + f"?key={QUERY_KEY}"
        common = [sys.executable, "-m", "palaestra", "judge-audit", "--groups", str(groups)]
        common += ["--judge-model", "secret-judge", "--judge-base-url", url, "--repeats", "1"]
        common += ["--judge-api-key-env", "PALAESTRA_TEST_JUDGE_KEY"]
        ok = subprocess.run(
            [*common, "--out", str(tmp_path / "ok" / "report.json")],
            capture_output=True,
            text=True,
            env=env_with(PALAESTRA_TEST_JUDGE_KEY=SHORT_KEY),
            cwd=tmp_path,
            timeout=120,
        )
        assert ok.returncode in (0, 1), ok.stderr  # measured (gates may fail on two groups)
        assert proxy.seen and set(proxy.seen) == {f"Bearer {SHORT_KEY}"}
        report = (tmp_path / "ok" / "report.json").read_text()
        assert "127.0.0.1" in report and "<redacted>" in report
        assert files_containing(tmp_path / "ok", QUERY_KEY) == []
        assert QUERY_KEY not in ok.stdout + ok.stderr
        with AuthProxy(upstream.base_url, "sk-other", echo_key=True) as refusing:
            bad = subprocess.run(
                [
                    *common[:-4],
                    "--judge-base-url",
                    refusing.base_url,
                    *common[-2:],
                    "--out",
                    str(tmp_path / "bad.json"),
                ],
                capture_output=True,
                text=True,
                env=env_with(PALAESTRA_TEST_JUDGE_KEY=SHORT_KEY),
                cwd=tmp_path,
                timeout=120,
            )
        assert refusing.seen and set(refusing.seen) == {f"Bearer {SHORT_KEY}"}
    assert bad.returncode == 2 and "401" in bad.stderr
    assert SHORT_KEY not in bad.stdout + bad.stderr


def test_eval_key_in_the_base_url_query_is_never_recorded(tmp_path: Path) -> None:
    """Issue 16.15: ``eval --base-url ...?api_key=KEY`` records the endpoint, not the key: neither in the
    manifest's command line and inputs nor in any other file."""
    dataset = _dataset(tmp_path / "ds.jsonl")
    with (
        ScriptedServer(lambda req, n: "Final: 2") as upstream,
        AuthProxy(upstream.base_url, EVAL_KEY) as proxy,
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "palaestra",
                "eval",
                "--dataset",
                str(dataset),
                "--model",
                "remote-policy",
                "--base-url",
                proxy.base_url + f"?api_key={QUERY_KEY}",
                "--outdir",
                str(tmp_path / "q"),
            ],
            capture_output=True,
            text=True,
            env=env_with(OPENAI_API_KEY=EVAL_KEY),
            cwd=tmp_path,
            timeout=120,
        )
    assert QUERY_KEY not in done.stdout + done.stderr
    assert files_containing(tmp_path / "q", QUERY_KEY) == []
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    command = " ".join(manifest["command_line"])
    assert "127.0.0.1" in command and "api_key=<redacted>" in command


def test_one_redaction_function_hides_every_url_credential() -> None:
    from palaestra.trajectories.runs import command_line, redact, redact_argv, scrub_text, set_command_line

    url = f"https://user:{URL_KEY}@host.example/v1?api_key={QUERY_KEY}&key=k2&access_token=t3&sig=s4&model=m"
    clean = scrub_text(url)
    for secret in (URL_KEY, QUERY_KEY, "k2", "t3", "s4"):
        assert secret not in clean
    assert clean.startswith("https://<redacted>@host.example/v1?") and "model=m" in clean
    assert scrub_text(f"HTTP 401: Incorrect API key provided: {SHORT_KEY}.", [SHORT_KEY]).endswith(
        "<redacted>."
    )
    assert scrub_text("q7Zxy stays", [SHORT_KEY]) == "q7Zxy stays"  # only the key itself, not longer words
    assert QUERY_KEY not in json.dumps(redact({"judge": {"base_url": url}, "list": [url]}))
    assert QUERY_KEY not in " ".join(redact_argv(["eval", "--base-url", url, f"--judge-base-url={url}"]))
    from palaestra.trajectories import runs

    before = runs._COMMAND_LINE
    set_command_line(["palaestra", "eval", "--base-url", url])
    try:
        assert QUERY_KEY not in " ".join(command_line()) and URL_KEY not in " ".join(command_line())
    finally:
        runs._COMMAND_LINE = before


@pytest.mark.parametrize("key", [EVAL_KEY, SHORT_KEY], ids=["long-key", "short-key"])
def test_eval_key_quoted_back_by_a_refusing_endpoint_never_printed(tmp_path: Path, key: str) -> None:
    """Issue 16.15: the policy endpoint answers 401 quoting the key it got; the failed eval's one-line error
    (built from the rollout's exception record) shows ``<redacted>``, not the key, even a 4-character one."""
    dataset = _dataset(tmp_path / "ds.jsonl")
    with (
        ScriptedServer(lambda req, n: "Final: 2") as upstream,
        AuthProxy(upstream.base_url, "sk-other", echo_key=True) as proxy,
    ):
        done = subprocess.run(
            [
                *[sys.executable, "-m", "palaestra", "eval", "--dataset", str(dataset)],
                *["--model", "remote-policy", "--base-url", proxy.base_url, "--outdir", str(tmp_path / "o")],
            ],
            capture_output=True,
            text=True,
            env=env_with(OPENAI_API_KEY=key),
            cwd=tmp_path,
            timeout=120,
        )
    assert proxy.seen and set(proxy.seen) == {f"Bearer {key}"}
    assert done.returncode != 0 and "401" in done.stderr and "<redacted>" in done.stderr
    assert key not in done.stdout + done.stderr
    assert not (tmp_path / "o").exists() or files_containing(tmp_path / "o", key) == []


def test_rollout_failure_records_never_hold_a_known_key() -> None:
    import asyncio

    from palaestra.trajectories.gather import gather_trajectories
    from palaestra.trajectories.runs import register_secret

    register_secret("Zk9w")  # a short key in use (RemoteModel and RulerJudge register theirs)

    async def refused() -> Trajectory:
        raise RuntimeError("401: Incorrect API key provided: Zk9w (see https://h/v1?api_key=Zk9w)")

    out = asyncio.run(gather_trajectories([refused()], max_exceptions=1, progress=False))
    record = out[0]
    assert not isinstance(record, Trajectory) and "<redacted>" in record.message
    assert "Zk9w" not in record.model_dump_json()


@pytest.mark.parametrize("status", [500, 401])
async def test_judge_errors_quoting_a_short_key_never_saved_or_logged(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """An endpoint that quotes a 4-character key in a 500 (retried, then the group is dropped) or a 401 (a
    config error): the group's logs and exception records (saved with samples), the log records and the
    error raised all show ``<redacted>``."""
    caplog.set_level(logging.DEBUG)
    group = _group()
    from palaestra.testing import Reply

    with ScriptedServer(
        lambda req, n: Reply(f"upstream refused key {SHORT_KEY} here", status=status)
    ) as server:
        judge = RulerJudge(
            "secret-judge", base_url=server.base_url, api_key=SHORT_KEY, max_retries=1, backoff=0.001
        )
        error: BaseException | None = None
        try:
            await judge.score_group(group)
        except JudgeConfigError as exc:
            error = exc
        await judge.aclose()
    assert (error is not None) == (status == 401)
    texts = [group.model_dump_json(), caplog.text, full_text(error) if error else ""]
    assert "<redacted>" in group.model_dump_json()
    assert all(SHORT_KEY not in t for t in texts)
