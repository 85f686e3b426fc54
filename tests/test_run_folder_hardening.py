"""Run folders under hostile conditions (issue 16, items 9-12): a new config into an existing run, two processes
on one run, damaged checkpoints, a cut history, temp files left by kills, a folder that cannot be written.

Real processes and real files throughout; each refusal is checked for exit code 2, one line on stderr naming
what is wrong, and an unchanged run folder."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from palaestra.trainer.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from palaestra.trainer.experiment import Experiment
from palaestra.trainer.runfolder import RunFolder
from palaestra.trajectories.io import DataError, read_jsonl


def config_text(model: Path, out: Path, *, max_steps: int = 3, patience: int = 100, every: int = 2) -> str:
    return f"""
[run]
name = "hardening"
seed = 5
output_dir = "{out}"
groups_per_step = 2
group_size = 3
max_steps = {max_steps}
max_concurrency = 1
checkpoint_every = 1

[model]
name = "{model}"

[env]
max_tokens = 5

[reward]
kind = "simulated_judge"

[validation]
every = {every}
max_examples = 6

[stopping]
patience = {patience}
"""


def train(*args: str, process: bool = False, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``palaestra train ARGS``: in this process (the real CLI entry point), or as a child process when the
    test needs one (two processes on one folder; a child with a file-size limit)."""
    if process:
        return subprocess.run(
            [sys.executable, "-m", "palaestra", "train", *args],
            capture_output=True,
            text=True,
            timeout=300,
            **kw,
        )
    from palaestra.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["train", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["palaestra", "train", *args], code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("palaestra train: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) with its content hash; the lock file holds the pid of the
    last process that took the lock, so only its presence counts."""
    return {
        str(p.relative_to(root)): "" if p.name == ".lock" else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def steps_of(run: Path) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(run / "history.jsonl")]


@pytest.fixture(scope="module")
def template_run(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 3 steps (stopped on max_steps), made once by the CLI."""
    run = tmp_path_factory.mktemp("template") / "run"
    toml = run.parent / "exp.toml"
    toml.write_text(config_text(tiny_model_path, run))
    done = train("--config", str(toml), "--quiet")
    assert done.returncode == 0, done.stderr
    assert steps_of(run) == [0, 1, 2, 3]
    return run


@pytest.fixture()
def finished_run(template_run: Path, tiny_model_path: Path, tmp_path: Path) -> Path:
    """A private copy of the template run (and its config as ``tmp_path/exp.toml``)."""
    run = tmp_path / "run"
    shutil.copytree(template_run, run)
    (tmp_path / "exp.toml").write_text(config_text(tiny_model_path, run))
    return run


# ---- item 9: a config into a folder that holds a run -------------------------------------------------------
def test_config_into_existing_run_is_refused_and_changes_nothing(
    finished_run: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    before = snapshot(finished_run)
    # a different stopping field (was a 27-line traceback) and an identical config: both refused
    (tmp_path / "other.toml").write_text(config_text(tiny_model_path, finished_run, patience=7))
    for toml in ("other.toml", "exp.toml"):
        line = one_line_error(train("--config", str(tmp_path / toml)))
        assert str(finished_run) in line and "--resume" in line
    assert snapshot(finished_run) == before
    # the Python API refuses a different config too, naming the field, and writes nothing
    cfg = json.loads((finished_run / "config.json").read_text())
    cfg["stopping"]["patience"] = 7
    with pytest.raises(DataError, match=r"stopping\.patience: 100 -> 7"):
        Experiment(cfg, printer=None).run_sync()
    assert snapshot(finished_run) == before


# ---- item 10: one process per run folder ---------------------------------------------------------------------
def test_second_process_on_a_running_folder_is_refused(finished_run: Path) -> None:
    env = {**os.environ, "PALAESTRA_FAULT_CHECKPOINT_DELAY": "60"}
    first = subprocess.Popen(
        [sys.executable, "-m", "palaestra", "train", "--resume", str(finished_run), "--max-steps", "6"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert first.stderr is not None
        deadline = time.monotonic() + 120
        for line in first.stderr:  # the first process now holds the lock, paused inside a checkpoint write
            if "writing checkpoint" in line:
                break
            assert time.monotonic() < deadline
        second = train("--resume", str(finished_run), "--max-steps", "6", process=True)
        line = one_line_error(second)
        assert "in use by another palaestra process" in line and f"pid {first.pid}" in line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # the kernel dropped the lock with the killed process: the run continues, no step lost or repeated
    done = train("--resume", str(finished_run), "--quiet")
    assert done.returncode == 0, done.stderr
    assert steps_of(finished_run) == list(range(7))


def test_lock_is_exclusive_within_one_process_too(tmp_path: Path) -> None:
    a, b = RunFolder(tmp_path / "r"), RunFolder(tmp_path / "r")
    a.acquire()
    with pytest.raises(DataError, match="in use by another palaestra process"):
        b.acquire()
    a.release()
    b.acquire()  # released: free again
    b.release()


# ---- item 11: damaged checkpoints ----------------------------------------------------------------------------
def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # one flipped bit in the middle of the parameters
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(flipped))


@pytest.mark.parametrize("how", ["truncated", "empty", "bitflip"])
def test_damaged_checkpoint_is_detected_by_name(tmp_path: Path, how: str) -> None:
    import numpy as np

    path = tmp_path / "latest.npz"
    save_checkpoint(path, {"w": np.arange(4096, dtype=np.float32), "counters": {"step": 3}})
    damage(path, how)
    with pytest.raises(CheckpointError, match=r"latest\.npz: damaged checkpoint"):
        load_checkpoint(path)


def test_checkpoint_written_before_digests_still_loads(tmp_path: Path) -> None:
    """Older runs' checkpoints have no digest: they load (zip CRC-checked), not set aside as damaged."""
    import numpy as np

    path = tmp_path / "old.npz"
    save_checkpoint(path, {"w": np.arange(8, dtype=np.float32), "counters": {"step": 2}})
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != "__sha256__"}
    np.savez(path, **arrays)  # the same checkpoint as written before digests were stored
    state = load_checkpoint(path)
    assert np.array_equal(state["w"], np.arange(8, dtype=np.float32)) and state["counters"] == {"step": 2}


def test_every_single_bit_flip_in_the_arrays_is_caught(tmp_path: Path) -> None:
    """The digest covers the content: flips anywhere in the stored arrays never load as different numbers."""
    import numpy as np

    path = tmp_path / "c.npz"
    state = {"w": np.linspace(-1, 1, 512, dtype=np.float32)}
    save_checkpoint(path, state)
    data = path.read_bytes()
    for pos in range(0, len(data), 7):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        path.write_bytes(bytes(flipped))
        try:
            loaded = load_checkpoint(path)
        except CheckpointError:
            continue
        assert np.array_equal(loaded["w"], state["w"]), pos  # only zip-header bytes no reader uses


def test_damaged_latest_falls_back_to_previous_and_temp_files_are_cleaned(finished_run: Path) -> None:
    ckpt = finished_run / "checkpoints"
    assert load_checkpoint(ckpt / "previous.npz")["counters"]["step"] == 2  # rotation kept the one before
    damage(ckpt / "latest.npz", "bitflip")  # truncated, empty: test_damaged_checkpoint_is_detected_by_name
    left = [  # temp files of atomic writes killed before their rename (item 12): removed on resume
        finished_run / ".history.jsonl.abc123.tmp",
        finished_run / ".summary.json.x1.tmp",
        finished_run / "samples" / ".step_000004.jsonl.q.tmp",
        finished_run / "val" / ".step_000004.jsonl.q.tmp",
        ckpt / ".latest.npz.zz.tmp",
    ]
    for p in left:
        p.write_bytes(b"partial")
    done = train("--resume", str(finished_run), "--max-steps", "5", "--quiet")
    assert done.returncode == 0, done.stderr
    assert not list(finished_run.rglob("*.tmp"))
    assert "latest.npz" in done.stderr and "previous.npz" in done.stderr  # said so, naming the files
    assert (ckpt / "latest.npz.damaged").exists()  # kept aside for a post-mortem, not rotated into previous
    assert steps_of(finished_run) == list(range(6))  # step 3 redone from step 2's checkpoint, no gap
    assert load_checkpoint(ckpt / "latest.npz")["counters"]["step"] == 5


def test_no_good_checkpoint_left_is_one_line_rc2(finished_run: Path) -> None:
    ckpt = finished_run / "checkpoints"
    damage(ckpt / "latest.npz", "empty")
    damage(ckpt / "previous.npz", "truncated")
    line = one_line_error(train("--resume", str(finished_run), "--max-steps", "5"))
    assert "latest.npz" in line and "damaged checkpoint" in line


def test_damaged_best_is_reported_on_resume_and_never_crashes_the_end(finished_run: Path) -> None:
    best = finished_run / "checkpoints" / "best.npz"
    damage(best, "truncated")
    done = train("--resume", str(finished_run), "--max-steps", "5", "--quiet")
    assert done.returncode == 0, done.stderr  # was: trains on, then crashes in restore_best, every time
    assert "best.npz" in done.stderr and "damaged" in done.stderr
    assert steps_of(finished_run) == list(range(6))
    assert (finished_run / "model.npz").is_file()
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["restored_best"] is (summary["best_val"]["step"] > 3)  # only a best saved after the damage


# ---- item 12: history against checkpoint, temp files, unwritable folders ------------------------------------
def test_cut_history_is_refused_and_extended_history_is_truncated(finished_run: Path) -> None:
    history = finished_run / "history.jsonl"
    rows = history.read_text().splitlines()
    # a history cut before the checkpoint's step would resume as [0, 1, 4, 5]: refused, file untouched
    history.write_text("\n".join(rows[:2]) + "\n")
    before = snapshot(finished_run)
    line = one_line_error(train("--resume", str(finished_run), "--max-steps", "5"))
    assert "history.jsonl" in line and "step 3" in line
    assert snapshot(finished_run) == before
    # a history with a row the checkpoint does not cover (a kill between append and checkpoint), and a torn
    # last line: both dropped, the step is redone
    extra = json.loads(rows[-1]) | {"step": 4}
    history.write_text("\n".join(rows) + "\n" + json.dumps(extra) + '\n{"step": 5, "tra')
    done = train("--resume", str(finished_run), "--max-steps", "5", "--quiet")
    assert done.returncode == 0, done.stderr
    assert steps_of(finished_run) == list(range(6))


def _small_file_limit() -> None:  # in the child: files may not grow past 256 kB, as on a nearly full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


@pytest.mark.parametrize("fresh", [True, False])
def test_full_disk_is_detected_before_any_work(
    finished_run: Path, tiny_model_path: Path, tmp_path: Path, fresh: bool
) -> None:
    if fresh:
        run = tmp_path / "new"
        (tmp_path / "new.toml").write_text(config_text(tiny_model_path, run))
        proc = train("--config", str(tmp_path / "new.toml"), process=True, preexec_fn=_small_file_limit)
        line = one_line_error(proc)
        assert "cannot write the run folder" in line
        assert not run.exists()  # no half-made run folder
    else:
        before = snapshot(finished_run)
        proc = train(
            "--resume", str(finished_run), "--max-steps", "5", process=True, preexec_fn=_small_file_limit
        )
        line = one_line_error(proc)
        assert "cannot write the run folder" in line and str(finished_run) in line
        assert "step    4" not in proc.stdout  # refused before any work
        assert snapshot(finished_run) == before


def test_unwritable_folder_is_one_line_rc2(tiny_model_path: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    (tmp_path / "x.toml").write_text(config_text(tiny_model_path, blocker / "run"))
    line = one_line_error(train("--config", str(tmp_path / "x.toml")))
    assert "cannot write the run folder" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_read_only_folder_is_one_line_rc2(finished_run: Path) -> None:
    for p in [finished_run, *finished_run.rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    try:
        line = one_line_error(train("--resume", str(finished_run), "--max-steps", "5"))
        assert "cannot write the run folder" in line
    finally:
        for p in [finished_run, *finished_run.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)


# ---- edges: checkpoints, folders and flags no other test reaches ------------------------------------------
def test_checkpoint_scalars_load_as_numbers_and_a_missing_file_is_named(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "c.npz"
    save_checkpoint(path, {"counters": {"step": np.int64(7), "best": np.float32(0.5)}, "w": np.zeros(2)})
    state = load_checkpoint(path)
    assert state["counters"] == {"step": 7, "best": 0.5}
    assert type(state["counters"]["step"]) is int and type(state["counters"]["best"]) is float
    with pytest.raises(CheckpointError, match=r"gone\.npz: checkpoint not found"):
        load_checkpoint(tmp_path / "gone.npz")


@pytest.mark.parametrize("meta", [{"format": "other-tool/2", "tree": {}}, ["not", "a", "dict"]])
def test_checkpoint_of_another_format_is_named(tmp_path: Path, meta: Any) -> None:
    import numpy as np

    path = tmp_path / "foreign.npz"
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    found = repr(meta["format"]) if isinstance(meta, dict) else "None"
    with pytest.raises(
        CheckpointError,
        match=rf"foreign\.npz: unknown checkpoint format {found} \(expected palaestra-checkpoint/1\)",
    ):
        load_checkpoint(path)


def test_checkpoint_rewritten_with_other_numbers_fails_its_digest(tmp_path: Path) -> None:
    """A well-formed zip (CRCs recomputed, as by a tool that rewrote it) whose numbers are not the saved ones."""
    import numpy as np

    path = tmp_path / "edited.npz"
    save_checkpoint(path, {"w": np.arange(8, dtype=np.float32)})
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["w"] = arrays["w"] + 1.0
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match=r"edited\.npz: damaged checkpoint \(content digest mismatch\)"):
        load_checkpoint(path)


@pytest.mark.parametrize("config_json", [None, "{not json", "[1, 2]"])
def test_folder_with_a_run_but_no_readable_config_is_refused(
    finished_run: Path, config_json: str | None
) -> None:
    cfg = json.loads((finished_run / "config.json").read_text())
    cfg["run"]["output_dir"] = str(finished_run)  # the copy's config names the template's folder
    if config_json is None:
        (finished_run / "config.json").unlink()
    else:
        (finished_run / "config.json").write_text(config_json)
    before = snapshot(finished_run)
    with pytest.raises(
        DataError, match=r"already holds a run \(without a readable config\.json\); continue it"
    ):
        Experiment(cfg, printer=None).run_sync()
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("bad", ['["a list"]', '{"step": "2"}', "{broken"])
def test_unreadable_history_line_is_named_on_resume(finished_run: Path, bad: str) -> None:
    history = finished_run / "history.jsonl"
    rows = history.read_text().splitlines()
    history.write_text("\n".join([rows[0], bad, *rows[1:]]) + "\n")
    before = snapshot(finished_run)
    line = one_line_error(train("--resume", str(finished_run), "--max-steps", "5"))
    assert f"{history}:2: unreadable history line (" in line
    assert snapshot(finished_run) == before


def test_resume_of_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a run")
    line = one_line_error(train("--resume", str(tmp_path)))
    assert "not a run folder (no config.json)" in line and str(tmp_path) in line


def test_traceback_flag_lets_a_user_error_propagate(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from palaestra.cli import main
    from palaestra.models.registry import UnknownModelError

    toml = tmp_path / "exp.toml"
    toml.write_text(
        config_text(tiny_model_path, tmp_path / "run").replace(str(tiny_model_path), "no-such-model")
    )
    monkeypatch.delenv("PALAESTRA_TRACEBACK", raising=False)
    line = one_line_error(train("--config", str(toml)))  # without the flag: one line, no folder left behind
    assert "unknown model 'no-such-model'" in line and not (tmp_path / "run").exists()
    monkeypatch.setenv("PALAESTRA_TRACEBACK", "1")
    with pytest.raises(UnknownModelError, match="no-such-model"):
        main(["train", "--config", str(toml)])


def test_samples_are_capped_and_none_kept_at_zero(tmp_path: Path) -> None:
    from palaestra.trajectories.io import read_groups
    from palaestra.trajectories.types import Trajectory, TrajectoryGroup

    groups = [
        TrajectoryGroup(
            [Trajectory(messages_and_choices=[{"role": "user", "content": f"{g}.{i}"}]) for i in range(3)]
        )
        for g in range(2)
    ]
    folder = RunFolder(tmp_path / "run")
    folder.write_samples(1, groups, 0)
    assert not (folder.root / "samples").exists()
    folder.write_samples(2, groups, 4)
    saved = read_groups(folder.root / "samples" / "step_000002.jsonl")
    assert [len(g.trajectories) for g in saved] == [3, 1]
