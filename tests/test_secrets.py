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


class AuthProxy:
    """Forwards POSTs to ``upstream`` when ``Authorization: Bearer <key>`` matches; otherwise HTTP 401, whose
    message quotes the received key when ``echo_key`` is set. ``seen`` lists the Authorization headers."""

    def __init__(self, upstream: str, key: str, *, echo_key: bool = False) -> None:
        self.upstream = upstream.rstrip("/").removesuffix("/v1")
        self.key = key
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
                if auth != f"Bearer {proxy.key}":
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
                req = urllib.request.Request(
                    proxy.upstream + self.path,
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


def test_judge_with_a_wrong_key_fails_without_printing_it(tiny_model_path: Path, tmp_path: Path) -> None:
    """The endpoint refuses the key with 401 and quotes it back; the run stops (a config error) and neither
    its output nor its folder holds the key."""
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
            env=env_with(PALAESTRA_TEST_JUDGE_KEY=JUDGE_KEY),
            cwd=tmp_path,
            timeout=300,
        )
    assert set(proxy.seen) == {f"Bearer {JUDGE_KEY}"} and len(proxy.seen) <= 2  # one call per group: no retry
    assert done.returncode != 0
    assert "401" in done.stderr and "JudgeConfigError" in done.stderr
    assert JUDGE_KEY not in done.stdout + done.stderr
    assert files_containing(out, JUDGE_KEY) == []


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
