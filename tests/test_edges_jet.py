"""Edge paths of the run records (palaestra.trajectories.runs): secret flags hidden on a recorded command line,
URLs that cannot be parsed, and a damaged run config named with its file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from palaestra.trajectories.io import DataError
from palaestra.trajectories.runs import (
    REDACTED,
    command_line,
    read_json,
    redact_argv,
    scrub_text,
    set_command_line,
)


def test_secret_flags_on_a_command_line_are_hidden() -> None:
    argv = [
        "palaestra",
        "eval",
        "--judge-api-key",
        "sk-live-1234567890",
        "--api-key=sk-other-0987654321",
        "--judge-api-key-env",
        "MY_JUDGE_KEY",
        "--base-url",
        "https://user:sk-in-url-555@judge.example/v1",
        "--seed",
        "3",
    ]
    assert redact_argv(argv) == [
        "palaestra",
        "eval",
        "--judge-api-key",
        REDACTED,
        "--api-key=<redacted>",
        "--judge-api-key-env",  # names a variable, not a key: kept
        "MY_JUDGE_KEY",
        "--base-url",
        f"https://{REDACTED}@judge.example/v1",
        "--seed",
        "3",
    ]
    set_command_line(argv)
    try:
        recorded = " ".join(command_line())
    finally:
        set_command_line([])
    assert "sk-" not in recorded and "MY_JUDGE_KEY" in recorded


def test_unparsable_urls_and_empty_text_pass_through() -> None:
    from palaestra.trajectories.runs import url_secrets

    assert url_secrets("http://[::1/v1") == []  # an unclosed IPv6 bracket: urlsplit raises ValueError
    assert url_secrets("https://judge.example/v1?api_key=sk-q-123456789") == ["sk-q-123456789"]
    assert scrub_text("") == ""


def test_a_damaged_run_config_is_named_with_its_line(tmp_path: Path) -> None:
    from palaestra.trainer.experiment import Experiment

    (tmp_path / "config.json").write_text('{\n  "run": {"seed": 1,}\n}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"config\.json:2: malformed JSON \(Expecting property name"):
        Experiment.resume(tmp_path)
    with pytest.raises(DataError, match=r"missing\.json: file not found"):
        read_json(tmp_path / "missing.json")
