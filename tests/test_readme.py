"""The README's quickstart runs as written, and the README keeps exactly the two set-up commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from palaestra import read_groups

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs(tmp_path: Path) -> None:
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    groups = read_groups(tmp_path / "groups.jsonl")
    assert len(groups) == 10 and all(len(g) == 8 for g in groups)


def test_two_setup_commands() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    commands = [line for b in blocks for line in b.strip().splitlines()]
    assert len(commands) == 2
    assert commands[0].endswith("palaestra demo") and commands[1].endswith("python -m pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci  # CI runs the README's test command verbatim
