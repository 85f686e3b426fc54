"""Pipelined training (``[run] max_staleness``): rollouts of step k+1 run on a frozen policy copy while step k
updates; trajectories record the version that sampled them; history reports the measured staleness; a run
stopped mid-way and resumed ends with the same weights as an uninterrupted one; 0 changes nothing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from palaestra.trainer.experiment import Experiment
from palaestra.trainer.pipeline import RolloutPipeline, sampling_version
from palaestra.trajectories.io import read_groups, read_jsonl


def config(model: Path, out: Path, **run: Any) -> dict[str, Any]:
    return {
        "run": {
            "name": "pipe",
            "seed": 7,
            "output_dir": str(out),
            "groups_per_step": 2,
            "group_size": 4,
            "max_steps": 4,
            "max_concurrency": 1,  # bit-for-bit comparable generation batches
            "samples_per_step": 8,
            "progress": False,
            **run,
        },
        "model": {"name": str(model)},
        "env": {"max_tokens": 6},
        "reward": {"kind": "simulated_judge", "simulated": {"noise": 0.2}},
        "validation": {"every": 2, "max_examples": 4},
        "stopping": {"patience": 100},
        "train": {"lr": 1e-3},
    }


def weights(run: Path) -> dict[str, np.ndarray]:
    with np.load(run / "model.npz") as npz:
        return {k: npz[k] for k in npz.files if npz[k].dtype.kind == "f"}


def test_schedule() -> None:
    assert [sampling_version(k, 0) for k in (1, 2, 3)] == [0, 1, 2]
    assert [sampling_version(k, 1) for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [sampling_version(k, 2) for k in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]


def test_zero_staleness_leaves_the_loop_alone(tiny_model_path: Path, tmp_path: Path) -> None:
    exp = Experiment(config(tiny_model_path, tmp_path / "r"), printer=None)

    async def rollout(model: Any, example: Any) -> Any:
        raise AssertionError("not called")

    pipe = RolloutPipeline(exp, object(), rollout)
    assert pipe.rollout is rollout and pipe.state_dict() == {}
    pipe.begin(1)
    assert pipe.end(1) == {}


def test_staleness_needs_a_copyable_policy(tiny_model_path: Path, tmp_path: Path) -> None:
    exp = Experiment(config(tiny_model_path, tmp_path / "r", max_staleness=1), printer=None)
    with pytest.raises(NotImplementedError, match="max_staleness"):
        RolloutPipeline(exp, object(), lambda model, example: None)


def test_staleness_one_records_versions_and_lag(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "s1"
    summary = Experiment(config(tiny_model_path, out, max_staleness=1), printer=None).run_sync()
    assert summary["steps"] == 4
    rows = read_jsonl(out / "history.jsonl")[1:]
    assert [r["train/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["train/policy_version_sampled"] for r in rows] == [0, 0, 1, 2]
    assert all(r["train/trajectories"] == 8 for r in rows)
    for step, version in ((1, 0), (3, 1), (4, 2)):
        trajs = [t for g in read_groups(out / "samples" / f"step_{step:06d}.jsonl") for t in g.trajectories]
        assert trajs and {t.policy_version for t in trajs} == {version}
        assert {t.metadata.get("policy") for t in trajs} <= {None, f"{tiny_model_path.stem}@step{version}"}


def test_staleness_changes_training_but_not_the_scenarios(tiny_model_path: Path, tmp_path: Path) -> None:
    Experiment(config(tiny_model_path, tmp_path / "s0", max_steps=2), printer=None).run_sync()
    Experiment(
        config(tiny_model_path, tmp_path / "s1", max_steps=2, max_staleness=1), printer=None
    ).run_sync()
    first = [read_groups(tmp_path / r / "samples" / "step_000001.jsonl") for r in ("s0", "s1")]
    # step 1 samples version 0 in both: the same rollouts
    assert [t.messages() for g in first[0] for t in g.trajectories] == [
        t.messages() for g in first[1] for t in g.trajectories
    ]
    second = [read_groups(tmp_path / r / "samples" / "step_000002.jsonl") for r in ("s0", "s1")]
    assert {t.policy_version for g in second[1] for t in g.trajectories} == {0}


class Stop(Exception):
    pass


def test_resume_with_staleness_is_exact(tiny_model_path: Path, tmp_path: Path) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    Experiment(config(tiny_model_path, full, max_staleness=1), printer=None).run_sync()

    def stop_after_step_2(line: str) -> None:
        if line.startswith("step    2"):
            raise Stop  # after step 2's checkpoint, while step 3's rollouts are in flight

    cfg = config(tiny_model_path, cut, max_staleness=1, progress=True)
    with pytest.raises(Stop):
        Experiment(cfg, printer=stop_after_step_2).run_sync()
    assert len(read_jsonl(cut / "history.jsonl")) == 3
    summary = Experiment.resume(cut, printer=None).run_sync()
    assert summary["steps"] == 4
    keys = ("step", "train/reward_mean", "train/loss", "train/staleness_max", "train/policy_version_sampled")
    strip = [{k: r.get(k) for k in keys} for r in read_jsonl(full / "history.jsonl")]
    assert strip == [{k: r.get(k) for k in keys} for r in read_jsonl(cut / "history.jsonl")]
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _engine_model(task: asyncio.Task[Any]) -> Any:
    engine = task.get_coro().cr_frame.f_locals.get("self")  # type: ignore[union-attr]
    return getattr(engine, "model", None)


def test_early_stop_leaves_no_task_behind(tiny_model_path: Path, tmp_path: Path) -> None:
    cfg = config(tiny_model_path, tmp_path / "r", max_steps=6, max_staleness=2)
    cfg["validation"]["every"] = 1
    cfg["stopping"]["patience"] = 1  # the random tiny policy never improves: a plateau stops the run early

    async def main() -> tuple[dict[str, Any], set[asyncio.Task[Any]]]:
        exp = Experiment(cfg, printer=None)
        summary = await exp.run()
        others = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
        # the live policy's own engine may still be ending a pass (as without pipelining); nothing else may run
        live = {
            t for t in others if getattr(t.get_coro(), "cr_frame", None) and _engine_model(t) is exp._model
        }
        return summary, others - live

    summary, left = asyncio.run(main())
    assert summary["stop"]["reason"] == "plateau" and summary["steps"] < 6  # later steps were in flight
    assert left == set()


@pytest.mark.parametrize(("staleness", "processes"), [(1, 1), (0, 2)])
def test_sigkill_mid_run_and_resume_is_exact(
    tiny_model_path: Path, tmp_path: Path, staleness: int, processes: int
) -> None:
    """``palaestra train`` with its rollouts in worker processes (max_staleness = 1: the next step's are in
    flight; 0: the synchronous loop) killed with SIGKILL after step 3, then resumed: no step lost or
    repeated, the same samples and bitwise the same final weights as a run with the rollouts in process; the
    orphaned worker processes end by themselves."""
    import json
    import signal
    import subprocess
    import sys
    import time

    def write(name: str, n: int) -> Path:
        cfg = config(
            tiny_model_path,
            tmp_path / name,
            max_staleness=staleness,
            max_steps=6,
            progress=True,
            rollout_processes=n,
        )
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        return path

    def toml(path: Path) -> Path:  # the CLI reads TOML: write the same dict as TOML tables
        data = json.loads(path.read_text())
        lines = []
        for section, values in data.items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if isinstance(value, dict):
                    inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                    lines.append(f"{key} = {{ {inner} }}")
                else:
                    lines.append(f"{key} = {json.dumps(value)}")
        out = path.with_suffix(".toml")
        out.write_text("\n".join(lines) + "\n")
        return out

    train = [sys.executable, "-m", "palaestra", "train"]
    clean, broken = toml(write("clean", 0)), toml(write("broken", processes))  # same results
    subprocess.run([*train, "--config", str(clean), "--quiet"], check=True, capture_output=True, timeout=300)

    proc = subprocess.Popen([*train, "--config", str(broken)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("step    3"):  # step 3 checkpointed; step 4's rollouts are running
            workers = _children(proc.pid)  # the rollout worker processes (and multiprocessing's tracker)
            assert len(workers) >= processes
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline, "step 3 never reported"
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 20  # orphaned, the worker sees its pipe close and ends
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers)
    done = subprocess.run([*train, "--resume", str(tmp_path / "broken")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

    rows = read_jsonl(tmp_path / "broken" / "history.jsonl")
    assert [r["step"] for r in rows] == list(range(7))
    for step in range(1, 7):
        name = f"samples/step_{step:06d}.jsonl"
        a = [
            (t.last_assistant_text(), t.reward, t.policy_version)
            for g in read_groups(tmp_path / "clean" / name)
            for t in g.trajectories
        ]
        b = [
            (t.last_assistant_text(), t.reward, t.policy_version)
            for g in read_groups(tmp_path / "broken" / name)
            for t in g.trajectories
        ]
        assert a == b, step
    wa, wb = weights(tmp_path / "clean"), weights(tmp_path / "broken")
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k])


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


def assert_same_runs(a: Path, b: Path, steps: int, keys: tuple[str, ...]) -> None:
    """Two runs with the same history ``keys``, the same samples (but ids and durations), bitwise weights."""
    ha, hb = read_jsonl(a / "history.jsonl"), read_jsonl(b / "history.jsonl")
    assert [{k: r.get(k) for k in keys} for r in ha] == [{k: r.get(k) for k in keys} for r in hb]
    for step in range(1, steps + 1):
        dumps = []
        for run in (a, b):
            groups = read_groups(run / f"samples/step_{step:06d}.jsonl")
            dumps.append([[t.model_dump(exclude={"id"}) for t in g.trajectories] for g in groups])
            for t in (t for g in dumps[-1] for t in g):
                t["metrics"].pop("duration", None)
        assert dumps[0] == dumps[1], step
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k])


def test_process_worker_equals_thread(tiny_model_path: Path, tmp_path: Path) -> None:
    """The rollouts prefetched in worker processes (two sharing each step here; one in the SIGKILL test) are
    the thread version's: same samples, history and weights. The legacy keys still select the worker."""
    import multiprocessing

    for worker in ("thread", "process"):
        cfg = config(tiny_model_path, tmp_path / worker, max_steps=3, max_staleness=2, pipeline_worker=worker)
        cfg["run"]["pipeline_processes"] = 2
        exp = Experiment(cfg, printer=None)
        exp.run_sync()
        assert exp._pipe is not None and exp._pipe.worker == worker
        assert multiprocessing.active_children() == []  # the worker process ended with the run
    keys = ("step", "train/reward_mean", "train/loss", "train/staleness_max", "train/policy_version_sampled")
    assert_same_runs(tmp_path / "thread", tmp_path / "process", 3, keys)


def test_synchronous_loop_in_worker_processes_equals_in_process(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_staleness = 0 with rollout_processes = 2: each step's rollouts run in two worker processes on the
    live weights (after the previous update), and the run equals the in-process synchronous loop: the same
    history rows, samples (no policy version recorded, as in process) and bitwise final weights. Each step is
    launched once, though the loop begins the next step as soon as an update is done and again when it starts."""
    import multiprocessing

    from palaestra.trainer.pipeline import RolloutProcess

    launched: list[int] = []
    launch = RolloutProcess.launch

    def counted(self: RolloutProcess, step: int, *args: Any, **kwargs: Any) -> Any:
        launched.append(step)
        return launch(self, step, *args, **kwargs)

    monkeypatch.setattr(RolloutProcess, "launch", counted)
    for n in (0, 2):
        exp = Experiment(
            config(tiny_model_path, tmp_path / f"p{n}", max_steps=3, rollout_processes=n), printer=None
        )
        exp.run_sync()
        assert exp._pipe is not None and exp._pipe.worker == ("process" if n else "inline")
        assert multiprocessing.active_children() == []
    rows = read_jsonl(tmp_path / "p2" / "history.jsonl")
    timing = ("time", "seconds", "latency", "per_s")  # wall-clock figures differ between any two runs
    keys = tuple(k for k in rows[-1] if not any(t in k for t in timing))
    assert "train/loss" in keys and not any("staleness" in k for k in keys)
    assert_same_runs(tmp_path / "p0", tmp_path / "p2", 3, keys)
    assert sorted(launched) == [1, 2, 3]


def test_rollout_processes_config() -> None:
    """One knob for both loops; the pre-rollout_processes keys still mean what they meant."""
    from palaestra.trainer.expconfig import RunSection

    assert RunSection().processes == 0 and RunSection(max_staleness=1).processes == 2
    assert RunSection(rollout_processes=3).processes == 3
    legacy = RunSection.model_validate({"max_staleness": 1, "pipeline_worker": "thread"})
    assert legacy.processes == 0 and legacy.rollout_processes == 0
    assert RunSection.model_validate({"max_staleness": 1, "pipeline_processes": 4}).processes == 4
    assert RunSection.model_validate({"pipeline_processes": 4}).processes == 0  # ignored at s = 0, as before
    with pytest.raises(ValueError, match="pipeline_worker"):
        RunSection.model_validate({"max_staleness": 1, "pipeline_worker": "fork"})


def test_rollout_processes_need_the_embedded_policy(tiny_model_path: Path, tmp_path: Path) -> None:
    """A policy that is not the embedded one runs its rollouts in process, with one note saying why."""
    notes: list[str] = []
    exp = Experiment(
        config(tiny_model_path, tmp_path / "r", rollout_processes=2, progress=True), printer=notes.append
    )
    from palaestra.envs.rollouts import single_turn_rollout

    pipe = RolloutPipeline(exp, object(), single_turn_rollout)
    assert pipe.worker == "inline" and pipe._proc is None and not pipe.ahead
    assert [n for n in notes if "rollout_processes" in n] == [
        "rollout_processes = 2: object is not the embedded policy, so the rollouts run in this process instead"
    ]


def test_worker_process_ends_when_the_run_fails(tiny_model_path: Path, tmp_path: Path) -> None:
    import multiprocessing

    def fail_after_step_1(line: str) -> None:
        if line.startswith("step    1"):
            raise Stop

    cfg = config(tiny_model_path, tmp_path / "r", max_staleness=1, progress=True)
    exp = Experiment(cfg, printer=fail_after_step_1)
    with pytest.raises(Stop):
        exp.run_sync()
    assert exp._pipe.worker == "process" and exp._pipe._proc is None
    assert multiprocessing.active_children() == []


def test_ctrl_c_leaves_no_worker_process(tiny_model_path: Path, tmp_path: Path) -> None:
    """A training script interrupted (SIGINT to its process group, as Ctrl-C) ends with its workers. The
    script has no ``if __name__ == "__main__"`` guard: the spawned workers must not run it again."""
    import json
    import signal
    import subprocess
    import sys
    import time

    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("needs Linux /proc children lists")
    cfg = config(tiny_model_path, tmp_path / "r", max_staleness=1, max_steps=50, progress=True)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    script = tmp_path / "train.py"
    script.write_text(
        "import json\nfrom palaestra.trainer.experiment import Experiment\n"
        f"Experiment(json.load(open({str(path)!r}))).run_sync()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("step    1"):
            break
        assert time.monotonic() < deadline, "step 1 never reported"
    workers = _children(proc.pid)
    assert workers, "no worker process"
    os.killpg(proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers)


def test_a_closure_rollout_is_prefetched_on_a_thread(tiny_model_path: Path, tmp_path: Path) -> None:
    """A rollout that cannot be sent to a worker process (a closure) runs on the thread, with a note."""
    from palaestra.models.embedded import EmbeddedModel

    notes: list[str] = []
    exp = Experiment(
        config(tiny_model_path, tmp_path / "r", max_staleness=1, progress=True), printer=notes.append
    )

    async def rollout(model: Any, example: Any) -> Any:  # a local function: not importable by a worker
        raise AssertionError("not called")

    pipe = RolloutPipeline(exp, EmbeddedModel.load(tiny_model_path), rollout)
    assert pipe.worker == "thread" and pipe._proc is None
    assert any("thread" in n for n in notes)


def test_a_step_launched_ahead_waits_for_its_weights(tiny_model_path: Path) -> None:
    """Launched without weights, a step's rollouts run up to their generation and no further: nothing comes
    back until :meth:`RolloutProcess.publish` sends the weights; then the samples are those of a launch made
    with the weights (same seeds, same choices), and the version is recorded. Weights that do not fit fail
    every call of the step with an error naming the parameter. A step launched ahead and never published is
    cancelled when the workers close, without hanging them."""
    from palaestra.envs.rollouts import single_turn_rollout
    from palaestra.models.embedded import EmbeddedModel
    from palaestra.trainer.pipeline import RolloutProcess

    model = EmbeddedModel.load(tiny_model_path)
    trained = {k: v + np.float32(0.05) * np.sign(v) for k, v in model.gpt.params.items()}  # "after an update"
    calls = [
        (({"id": f"e{i}", "prompt": f"What is {i}+{i}?"},), {"seed": 100 + i, "max_tokens": 5})
        for i in range(4)
    ]

    async def go() -> tuple[list[Any], list[Any], bool, bool]:
        proc = RolloutProcess(model, single_turn_rollout, 2)
        try:
            direct = await asyncio.gather(*proc.launch(1, 7, trained, calls, 8))
            ahead = proc.launch(2, None, None, calls, 8)
            await asyncio.sleep(1.0)  # time enough to build and send every request
            waited = not any(f.done() for f in ahead)
            proc.publish(2, 7, trained)
            later = await asyncio.wait_for(asyncio.gather(*ahead), 60)
            bad = proc.launch(3, None, None, calls, 8)
            proc.publish(3, 8, {**trained, "wte": trained["wte"][:-1]})  # a row short: every call says so
            errors = await asyncio.wait_for(asyncio.gather(*bad, return_exceptions=True), 60)
            assert len(errors) == 4 and all("'wte' has shape" in str(e) for e in errors), errors
            never = proc.launch(4, None, None, calls, 8)  # the run stops before step 4
            await asyncio.sleep(0.2)
        finally:
            t0 = asyncio.get_running_loop().time()
            await proc.aclose()
            quick = asyncio.get_running_loop().time() - t0 < 15
        assert all(f.cancelled() for f in never)
        return direct, later, waited, quick

    direct, later, waited, quick = asyncio.run(go())
    assert waited and quick
    assert [t.policy_version for t in later] == [7] * 4
    texts = [[c.message.content for c in t.choices()] for t in direct]
    assert texts == [[c.message.content for c in t.choices()] for t in later]
    assert [t.choices()[0].logprobs.content[0].logprob for t in direct] == [
        t.choices()[0].logprobs.content[0].logprob for t in later
    ]
    base = EmbeddedModel.load(tiny_model_path)  # the template's own weights would give other samples
    assert (
        asyncio.run(single_turn_rollout(base, *calls[0][0], **calls[0][1]))
        .choices()[0]
        .logprobs.content[0]
        .logprob
        != later[0].choices()[0].logprobs.content[0].logprob
    )


def test_frozen_policies_round_trip_through_the_pipeline_state(tiny_model_path: Path, tmp_path: Path) -> None:
    """What a checkpoint stores of the prefetching pipeline (the frozen weights the next steps sample from)
    is what a resumed pipeline holds and checkpoints again; at max_staleness 0 there is nothing to keep."""
    from palaestra.envs.rollouts import single_turn_rollout
    from palaestra.models.embedded import EmbeddedModel

    model = EmbeddedModel.load(tiny_model_path)
    frozen = {k: v + np.float32(0.5) for k, v in model.gpt.params.items()}
    state = {"3": {"step": 2, "params": frozen}}

    async def go(**run: Any) -> dict[str, Any]:
        exp = Experiment(config(tiny_model_path, tmp_path / "r", rollout_processes=0, **run), printer=None)
        pipe = RolloutPipeline(exp, model, single_turn_rollout)
        try:
            pipe.load_state_dict(state)
            return pipe.state_dict()
        finally:
            await pipe.aclose()

    again = asyncio.run(go(max_staleness=1))
    assert list(again) == ["3"] and again["3"]["step"] == 2
    assert again["3"]["params"].keys() == frozen.keys()
    for name, value in frozen.items():
        np.testing.assert_array_equal(again["3"]["params"][name], value)
        assert again["3"]["params"][name] is not value  # a copy: the checkpoint cannot alias live arrays
    assert asyncio.run(go(max_staleness=0)) == {}


async def _exit_the_worker(model: Any, example: Any, **kwargs: Any) -> Any:
    """A rollout that ends its process (as a crash in native code would)."""
    os._exit(3)


def test_a_worker_process_that_dies_fails_its_calls_and_the_next_launch(tiny_model_path: Path) -> None:
    from palaestra.models.embedded import EmbeddedModel
    from palaestra.trainer.pipeline import RolloutProcess, WorkerProcessError, picklable

    model = EmbeddedModel.load(tiny_model_path)
    calls = [(({"id": "e0", "prompt": "What is 1+1?"},), {"seed": 1, "max_tokens": 3})]

    async def go() -> tuple[list[int], list[Any], str]:
        proc = RolloutProcess(model, _exit_the_worker, 1)
        try:
            pids = proc.pids
            errors = await asyncio.wait_for(
                asyncio.gather(*proc.launch(1, 0, model.gpt.params, calls, 1), return_exceptions=True), 60
            )
            with pytest.raises(WorkerProcessError) as later:
                proc.launch(2, 0, model.gpt.params, calls, 1)
        finally:
            await proc.aclose()
        return pids, errors, str(later.value)

    pids, errors, later = asyncio.run(go())
    assert len(pids) == 1 and all(isinstance(p, int) for p in pids)
    assert len(errors) == 1 and isinstance(errors[0], WorkerProcessError)
    assert str(errors[0]) == "a rollout worker process exited (exit code 3)"
    assert (
        later
        == "a rollout worker process exited (exit code 3)\n(set [run] rollout_processes = 0 to avoid it)"
    )
    assert picklable(_exit_the_worker)


def test_a_rollout_defined_in_the_main_script_is_not_sent_to_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle
    import sys

    from palaestra.trainer.pipeline import picklable

    async def script_rollout(model: Any, example: Any) -> None: ...

    # as if defined at the top of the script being run: pickle finds it there, a spawned worker would not
    script_rollout.__module__, script_rollout.__qualname__ = "__main__", "script_rollout"
    monkeypatch.setattr(sys.modules["__main__"], "script_rollout", script_rollout, raising=False)
    assert pickle.loads(pickle.dumps(script_rollout)) is script_rollout
    assert not picklable(script_rollout)
