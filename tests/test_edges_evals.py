"""Edges of the ``palaestra`` command line itself: no subcommand, and Ctrl-C while a command waits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic_data import load_split


def test_no_subcommand_prints_the_help_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: palaestra ") and "COMMAND" in out
    for command in ("demo", "train", "eval", "gate", "show", "report", "lab"):
        assert f"\n    {command} " in out, command


def test_ctrl_c_while_waiting_for_an_endpoint_exits_130(tmp_path: Path) -> None:
    """A live eval waiting on an endpoint that never answers: SIGINT (Ctrl-C) ends it with exit code 130
    and one line, no traceback, and no half-written run folder."""
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(e) + "\n" for e in load_split("dev")[:2]))
    with socket.socket() as silent:  # accepts connections, never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent.settimeout(60)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        argv = ["eval", "--dataset", str(dataset), "--model", "far", "--base-url", url]
        argv += ["--outdir", str(tmp_path / "run")]
        proc = subprocess.Popen(
            [sys.executable, "-m", "palaestra", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OPENAI_API_KEY": "test-key"},
        )
        try:
            conn, _ = silent.accept()  # the request is in flight: the command is waiting on it
            with conn:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, err
    assert err == "interrupted\n" and out == ""
    assert not (tmp_path / "run").exists()


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """``palaestra lab kl | head -1``: the command's output goes to a pipe whose reader has left. It stops
    with SIGPIPE's exit status (141) and no traceback on stderr; the run folder is written whole."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # the reader is gone before the command prints a line
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "palaestra", "lab", "kl", "--outdir", str(tmp_path / "kl")],
            stdout=w_fd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w_fd)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""
    assert (tmp_path / "kl" / "summary.md").is_file()


def test_palaestra_traceback_shows_the_traceback_of_a_bad_input(tmp_path: Path) -> None:
    """A bad config is one line and exit 2; with PALAESTRA_TRACEBACK=1 the same error shows its traceback."""
    config = tmp_path / "bad.toml"
    config.write_text('[run]\ngroup_sise = 4\noutput_dir = "run"\n')
    argv = [sys.executable, "-m", "palaestra", "train", "--config", str(config)]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert plain.returncode == 2
    assert plain.stderr.count("\n") == 1 and "group_sise" in plain.stderr, plain.stderr
    env = {**os.environ, "PALAESTRA_TRACEBACK": "1"}
    loud = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert loud.returncode == 1
    assert "Traceback (most recent call last)" in loud.stderr and "group_sise" in loud.stderr


@pytest.mark.parametrize("command", ["inspect", "show", "report"])
def test_palaestra_traceback_reaches_the_harness_commands(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DataError of eval/show/report/... is one line and exit 2, or raised with PALAESTRA_TRACEBACK=1."""
    from palaestra.trajectories.io import DataError

    missing = str(tmp_path / "no-such-run")
    monkeypatch.delenv("PALAESTRA_TRACEBACK", raising=False)
    assert main([command, missing]) == 2
    err = capsys.readouterr().err
    assert err == f"palaestra {command}: error: {missing}: run folder not found\n"
    monkeypatch.setenv("PALAESTRA_TRACEBACK", "1")
    with pytest.raises(DataError, match="run folder not found"):
        main([command, missing])
