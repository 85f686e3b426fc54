"""Many kills (slow): ``benchmarks/kill_resume.py`` with a short plan — SIGKILL ``palaestra train`` at seeded
random moments (start-up, inside a step, inside a checkpoint write), resume each time, and check that no
checkpoint is ever half-visible, history has no lost or repeated step, every step sampled the same completions
and rewards as an uninterrupted run, and the final weights agree with it to 1e-5 (see the script's docstring
for why not bitwise). The 10-kill version: ``python benchmarks/kill_resume.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kill_resume.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kill_resume_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_five_random_kills_then_resume_match_an_uninterrupted_run(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    bench = load_script()
    rep = bench.run(kills=5, steps=12, seed=3, model=str(tiny_model_path), workdir=tmp_path)
    assert rep["problems"] == []
    assert rep["ok"] and rep["kills_done"] >= 4
    assert rep["kills_during_checkpoint_write"] >= 1
    assert rep["same_samples"] == 12
    assert rep["max_weight_diff"] <= 1e-5


def test_kill_plan_is_seeded_and_mixed() -> None:
    bench = load_script()
    a = bench.plan_kills(10, 0, startup=1.0, step_seconds=0.1, steps=40)
    b = bench.plan_kills(10, 0, startup=1.0, step_seconds=0.1, steps=40)
    assert [k.__dict__ for k in a] == [k.__dict__ for k in b]
    modes = [k.mode for k in a]
    assert modes.count("checkpoint") >= 3 and "startup" in modes and "step" in modes
    assert [k.__dict__ for k in bench.plan_kills(10, 1, 1.0, 0.1, 40)] != [k.__dict__ for k in a]
