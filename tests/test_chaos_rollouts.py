"""Rollout chaos: custom rollout functions that raise, hang past ``run.rollout_timeout`` or return something
that is not a Trajectory, at planned (step, group, rollout) positions of a hybrid experiment.

Within the budget (``run.max_exceptions``) every failure is recorded in its group (type and message), counted
per step in ``history.jsonl`` (``faults/rollout_exceptions``) and in ``summary.json``, hung rollouts are
cancelled, and the run goes on. One failure past the budget stops the run with a :class:`GatherError` naming
the counts; the step is not recorded and the run resumes from the last checkpoint with no lost step.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from palaestra.envs.rollouts import single_turn_rollout
from palaestra.trainer.checkpoints import load_checkpoint
from palaestra.trainer.experiment import Experiment
from palaestra.trainer.tokenize import MissingLogprobsError
from palaestra.trajectories.gather import GatherError
from palaestra.trajectories.io import read_groups, read_jsonl
from palaestra.trajectories.seeds import derive_seed

SEED = 5
GROUPS = 3
GROUP_SIZE = 4
TIMEOUT = 1.0
#: what each fault looks like in the group's exception records
RECORDED = {
    "raise": ("RuntimeError", "injected rollout failure"),
    "hang": ("TimeoutError", f"rollout exceeded rollout_timeout={TIMEOUT}s"),
    "dict": ("TypeError", "rollout returned dict, expected a Trajectory"),
    "none": ("TypeError", "rollout returned NoneType, expected a Trajectory"),
    "str": ("TypeError", "rollout returned str, expected a Trajectory"),
}


class ChaosRollout:
    """The default arithmetic rollout, except at planned positions ``(step, group, rollout)``.

    The experiment passes each rollout its sampling seed, ``derive_seed(run seed, step, group, rollout)``,
    so the plan is keyed by that seed."""

    def __init__(self, plan: Mapping[tuple[int, int, int], str], steps: int) -> None:
        self.by_seed = {derive_seed(SEED, *pos): kind for pos, kind in plan.items()}
        assert len(self.by_seed) == len(plan)
        self.cancelled = 0
        self.steps = steps

    async def __call__(
        self, model: Any, example: Mapping[str, Any], *, seed: int, temperature: float, max_tokens: int
    ) -> Any:
        kind = self.by_seed.get(seed)
        if kind == "raise":
            raise RuntimeError("injected rollout failure")
        if kind == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if kind == "dict":
            return {"messages": [{"role": "assistant", "content": "Final: 1"}]}
        if kind == "none":
            return None
        if kind == "str":
            return "Final: 1"
        return await single_turn_rollout(
            model, example, seed=seed, temperature=temperature, max_tokens=max_tokens
        )


def config(model: Path, out: Path, steps: int, budget: float) -> dict[str, Any]:
    return {
        "run": {
            "name": "rollout-chaos",
            "seed": SEED,
            "output_dir": str(out),
            "groups_per_step": GROUPS,
            "group_size": GROUP_SIZE,
            "max_steps": steps,
            "samples_per_step": GROUPS * GROUP_SIZE,
            "max_exceptions": budget,
            "rollout_timeout": TIMEOUT,
            "checkpoint_every": 1,  # a checkpoint after every step: the resume below starts where it failed
            "progress": False,
        },
        "model": {"name": str(model)},
        "env": {"max_tokens": 6},
        "reward": {"kind": "simulated_judge", "simulated": {"noise": 0.1}},
        "validation": {"every": 1000, "max_examples": 5, "sampled": False},
        "stopping": {"patience": 1000},
    }


PLAN_WITHIN = {  # budget 0.25 of 12 rollouts = 3 failures per step
    (1, 0, 0): "raise",
    (2, 1, 2): "hang",
    (2, 2, 3): "dict",
    (4, 0, 1): "raise",
    (4, 0, 2): "hang",
    (4, 2, 0): "none",
    (5, 1, 1): "str",
}


def test_failures_within_budget_are_recorded_and_counted(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = 6
    rollout = ChaosRollout(PLAN_WITHIN, steps)
    summary = Experiment(config(tiny_model_path, out, steps, 0.25), rollout=rollout, printer=None).run_sync()

    assert summary["steps"] == steps and summary["stop"]["reason"] == "max_steps"
    assert summary["faults"]["rollout_exceptions"] == len(PLAN_WITHIN)
    assert rollout.cancelled == 2  # both hung rollouts were cancelled at the timeout, not left running
    per_step = Counter(s for s, _, _ in PLAN_WITHIN)
    history = read_jsonl(out / "history.jsonl")
    assert [r["step"] for r in history] == list(range(steps + 1))
    for r in history[1:]:
        assert r["faults/rollout_exceptions"] == per_step[r["step"]], r["step"]
        assert r["train/exceptions"] == per_step[r["step"]]
        assert r["train/trajectories"] == GROUPS * GROUP_SIZE - per_step[r["step"]]

    for step in range(1, steps + 1):
        groups = read_groups(out / "samples" / f"step_{step:06d}.jsonl")
        assert [g.metadata["group_index"] for g in groups] == list(range(GROUPS))
        for g in groups:
            planned = sorted(
                kind
                for (s, gi, _), kind in PLAN_WITHIN.items()
                if (s, gi) == (step, g.metadata["group_index"])
            )
            recorded = sorted((e.type, e.message) for e in g.exceptions)
            assert recorded == sorted(RECORDED[k] for k in planned), (step, g.metadata["group_index"])
            assert len(g.trajectories) == GROUP_SIZE - len(planned)
            assert all(e.traceback for e in g.exceptions)


def test_one_failure_past_budget_raises_gather_error_then_resumes(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    plan = {(2, 0, 0): "raise", (2, 0, 3): "dict", (2, 1, 1): "raise", (2, 2, 2): "none"}  # 4 > 3
    with pytest.raises(
        GatherError, match=r"^4 of 12 rollouts failed, more than max_exceptions=0\.25 allows"
    ) as info:
        Experiment(
            config(tiny_model_path, out, 3, 0.25), rollout=ChaosRollout(plan, 3), printer=None
        ).run_sync()
    assert (info.value.failures, info.value.total) == (4, 12)
    assert "First failure (" in str(info.value) and "Traceback" in str(info.value)
    # step 2 never happened as far as the run folder is concerned
    assert [r["step"] for r in read_jsonl(out / "history.jsonl")] == [0, 1]
    assert load_checkpoint(out / "checkpoints" / "latest.npz")["counters"]["step"] == 1
    assert not (out / "samples" / "step_000002.jsonl").exists()
    # fixed rollout: resume continues at step 2, no step lost or repeated
    summary = Experiment.resume(out, rollout=ChaosRollout({}, 3), printer=None).run_sync()
    assert summary["steps"] == 3
    assert [r["step"] for r in read_jsonl(out / "history.jsonl")] == [0, 1, 2, 3]


def test_count_budget_from_config(tiny_model_path: Path, tmp_path: Path) -> None:
    """``max_exceptions = 2`` (an int in the TOML/dict) is a count of failures per step, not a fraction."""
    plan = {(1, 0, 0): "raise", (1, 2, 1): "dict"}
    out = tmp_path / "ok"
    summary = Experiment(
        config(tiny_model_path, out, 1, 2), rollout=ChaosRollout(plan, 1), printer=None
    ).run_sync()
    assert summary["faults"]["rollout_exceptions"] == 2
    plan[(1, 1, 3)] = "none"
    with pytest.raises(GatherError, match=r"^3 of 12 rollouts failed, more than max_exceptions=2 allows"):
        Experiment(
            config(tiny_model_path, tmp_path / "over", 1, 2), rollout=ChaosRollout(plan, 1), printer=None
        ).run_sync()


def _strip_logprobs(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def rollout(
        model: Any, example: Mapping[str, Any], *, seed: int, temperature: float, max_tokens: int
    ) -> Any:
        traj = await fn(model, example, seed=seed, temperature=temperature, max_tokens=max_tokens)
        traj.messages_and_choices[-1].logprobs = None  # a Trajectory, but not trainable as sampled
        return traj

    return rollout


def test_trajectory_without_logprobs_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    """A Trajectory the trainer cannot use (a Choice without sampling-time logprobs) is not a gather failure:
    the step stops with an error naming the trajectory and the fix, before any weight changes."""
    out = tmp_path / "run"
    exp = Experiment(
        config(tiny_model_path, out, 2, 0.25), rollout=_strip_logprobs(single_turn_rollout), printer=None
    )
    with pytest.raises(MissingLogprobsError, match=r"trajectory [0-9a-f]+: .*logprobs=True"):
        exp.run_sync()
    assert [r["step"] for r in read_jsonl(out / "history.jsonl")] == [0]
    assert load_checkpoint(out / "checkpoints" / "latest.npz")["counters"]["step"] == 0
