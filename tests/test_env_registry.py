"""The environment registry: custom environments, and the errors a config's environment settings give (a split
the environment lacks, a ``module:function`` rollout that is malformed, missing or not callable)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from palaestra.envs import EnvSpec, get_env, load_callable, register_env
from palaestra.envs.registry import ENVS
from palaestra.envs.rollouts import single_turn_rollout
from palaestra.trainer.experiment import Experiment
from palaestra.trajectories.io import DataError


def config(model: Path, out: Path, **env: Any) -> dict[str, Any]:
    return {
        "run": {"name": "reg", "seed": 0, "output_dir": str(out), "groups_per_step": 1, "group_size": 2},
        "model": {"name": str(model)},
        "env": {"max_tokens": 4, **env},
        "reward": {"kind": "verifier"},
    }


@pytest.fixture
def restore_envs() -> Iterator[None]:
    saved = dict(ENVS)
    try:
        yield
    finally:
        ENVS.clear()
        ENVS.update(saved)


def test_a_registered_environment_is_found_and_replaced(restore_envs: None) -> None:
    spec = EnvSpec(
        name="arith-copy",
        description="the arithmetic task under another name",
        splits_module="palaestra.envs.arithmetic_data",
        verifier="arith-strict",
        rollout="palaestra.envs.rollouts:single_turn_rollout",
        prompt_template="What is {a}{op}{b}?",
    )
    with pytest.raises(DataError, match="unknown environment 'arith-copy'"):
        get_env("arith-copy")
    register_env(spec)
    assert get_env("arith-copy") is spec
    assert spec.load_split("dev") == get_env("arithmetic").load_split("dev")
    assert load_callable(spec.rollout) is single_turn_rollout
    replacement = EnvSpec(**{**spec.__dict__, "description": "replaced"})
    register_env(replacement)
    assert get_env("arith-copy") is replacement


def test_a_split_the_environment_lacks_is_named_with_the_ones_it_has(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    with pytest.raises(DataError, match=r"environment 'arithmetic' has no split 'tarin'; splits: .*train"):
        Experiment(config(tiny_model_path, tmp_path / "run", train_split="tarin"), printer=None)
    with pytest.raises(DataError, match=r"environment 'calculator' has no split 'validation'; splits: .*val"):
        get_env("calculator").load_split("validation")


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ("palaestra.envs.rollouts.single_turn_rollout", r"expected 'module:function', got 'palaestra\.envs"),
        (":single_turn_rollout", r"expected 'module:function', got ':single_turn_rollout'"),
        ("palaestra.envs.rollouts:", r"expected 'module:function', got 'palaestra\.envs\.rollouts:'"),
        ("palaestra.envs.no_such_module:run", r"cannot import module 'palaestra\.envs\.no_such_module' for"),
        ("palaestra.envs.registry:ENVS", r"'palaestra\.envs\.registry:ENVS' is not callable"),
    ],
)
def test_a_bad_rollout_reference_is_a_clear_error(
    tiny_model_path: Path, tmp_path: Path, rollout: str, message: str
) -> None:
    with pytest.raises(DataError, match=message):
        Experiment(config(tiny_model_path, tmp_path / "run", rollout=rollout), printer=None)
