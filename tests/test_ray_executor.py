"""Rollouts in Ray workers: a local 2-CPU Ray cluster runs an experiment's rollouts against the policy served
over HTTP on 127.0.0.1; results equal the in-process executor's; a worker killed mid-step is one counted
failure and the step completes. Skipped when ray is not installed (``pip install palaestra[ray]``)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds to 127.0.0.1 only (see executors)
ray = pytest.importorskip("ray")

from palaestra.envs.rollouts import single_turn_rollout  # noqa: E402
from palaestra.trainer.endpoints import serve_model  # noqa: E402
from palaestra.trainer.experiment import Experiment  # noqa: E402
from palaestra.trajectories import TrajectoryGroup, gather_trajectory_groups  # noqa: E402
from palaestra.trajectories.executors import RayExecutor, WorkerDiedError  # noqa: E402
from palaestra.trajectories.io import read_jsonl  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this module is not importable there
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback only
    try:
        yield
    finally:
        ray.shutdown()


async def crash_once_rollout(model: Any, example: dict[str, Any], *, marker: str = "", **kw: Any) -> Any:
    """Kills its own worker process the first time it runs (the marker file makes it once per test)."""
    if example.get("id") == "bad":
        raise ValueError("no such scenario")
    if marker and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return await single_turn_rollout(model, example, **kw)


def config(model: Path, out: Path, **run: Any) -> dict[str, Any]:
    return {
        "run": {
            "name": "ray",
            "seed": 5,
            "output_dir": str(out),
            "groups_per_step": 2,
            "group_size": 3,
            "max_steps": 2,
            "max_concurrency": 1,  # one rollout at a time: bit-for-bit comparable batches
            "progress": False,
            **run,
        },
        "model": {"name": str(model)},
        "env": {"max_tokens": 6},
        "reward": {"kind": "simulated_judge", "simulated": {"noise": 0.2}},  # a signal: the policy updates
        "validation": {"every": 2, "max_examples": 4},
    }


def weights(run: Path) -> dict[str, np.ndarray]:
    with np.load(run / "model.npz") as npz:
        return {k: npz[k] for k in npz.files if npz[k].dtype.kind == "f"}


def test_ray_rollouts_equal_in_process(tiny_model_path: Path, tmp_path: Path) -> None:
    local = Experiment(config(tiny_model_path, tmp_path / "local"), printer=None).run_sync()
    remote = Experiment(
        config(tiny_model_path, tmp_path / "ray", executor="ray", workers=2), printer=None
    ).run_sync()
    assert local["steps"] == remote["steps"] == 2
    assert [r["policy_version"] for r in read_jsonl(tmp_path / "ray" / "history.jsonl")[1:]] == [1, 2]
    keys = ("train/reward_mean", "train/tokens", "train/loss", "faults/rollout_exceptions")
    h_local = read_jsonl(tmp_path / "local" / "history.jsonl")
    h_ray = read_jsonl(tmp_path / "ray" / "history.jsonl")
    assert [{k: r.get(k) for k in keys} for r in h_local] == [{k: r.get(k) for k in keys} for r in h_ray]
    w_local, w_ray = weights(tmp_path / "local"), weights(tmp_path / "ray")
    assert w_local.keys() == w_ray.keys() and w_local
    for k in w_local:
        np.testing.assert_array_equal(w_local[k], w_ray[k])


def test_killed_worker_is_a_counted_failure(tiny_model_path: Path, tmp_path: Path) -> None:
    marker = tmp_path / "killed.pid"
    cfg = config(tiny_model_path, tmp_path / "run", executor="ray", max_steps=1, max_exceptions=2)
    cfg["env"].update(rollout=f"{__name__}:crash_once_rollout", options={"marker": str(marker)})
    summary = Experiment(cfg, rollout=crash_once_rollout, printer=None).run_sync()
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a worker process died, not us
    assert summary["steps"] == 1
    row = read_jsonl(tmp_path / "run" / "history.jsonl")[1]
    assert row["faults/rollout_exceptions"] == 1
    assert row["train/trajectories"] == 2 * 3 - 1  # the step trained on every other rollout


async def test_gather_with_ray_executor_from_python(tiny_model_path: Path, tmp_path: Path) -> None:
    from palaestra.models.embedded import EmbeddedModel
    from palaestra.trainer.endpoints import remote_rollout

    model = EmbeddedModel.load(tiny_model_path, name="tiny")
    executor = RayExecutor(resources={"num_cpus": 0.5})
    marker = tmp_path / "m"
    examples = [{"id": "a", "prompt": "1+1="}, {"id": "b", "prompt": "2+2="}, {"id": "bad", "prompt": "?"}]
    with serve_model(model) as endpoint:
        assert endpoint.base_urls[0].startswith("http://127.0.0.1:")
        run = remote_rollout(crash_once_rollout, executor)
        groups = await gather_trajectory_groups(
            [
                TrajectoryGroup(run(endpoint, ex, seed=i, max_tokens=4, marker=str(marker)) for i in range(2))
                for ex in examples
            ],
            max_exceptions=3,
            progress=False,
        )
    died = groups[0].exceptions + groups[1].exceptions
    assert len(died) == 1 and died[0].type == WorkerDiedError.__name__
    # the rollout's own exception keeps its class (and the worker's traceback in the message)
    assert [e.type for e in groups[2].exceptions] == ["RayTaskError(ValueError)"] * 2
    assert "no such scenario" in groups[2].exceptions[0].message
    assert sum(len(g.trajectories) for g in groups) == 3
    assert all(t.choices()[0].logprobs is not None for g in groups for t in g.trajectories)


def test_ray_with_max_staleness_equals_in_process(tiny_model_path: Path, tmp_path: Path) -> None:
    """Pipelined training with Ray workers: each frozen policy copy is served to the workers on its own
    endpoint; the run equals the in-process pipelined run."""
    runs = {}
    for name, extra in (("local", {}), ("ray", {"executor": "ray"})):
        out = tmp_path / name
        Experiment(
            config(tiny_model_path, out, max_steps=3, max_staleness=1, **extra), printer=None
        ).run_sync()
        runs[name] = read_jsonl(out / "history.jsonl")
    keys = ("train/reward_mean", "train/loss", "train/staleness_max")
    assert [r.get("train/staleness_max") for r in runs["ray"][1:]] == [0, 1, 1]
    assert [{k: r.get(k) for k in keys} for r in runs["local"]] == [
        {k: r.get(k) for k in keys} for r in runs["ray"]
    ]
    for k, v in weights(tmp_path / "local").items():
        np.testing.assert_array_equal(v, weights(tmp_path / "ray")[k])
