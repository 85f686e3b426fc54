"""Data-parallel HF training launched by torchrun and by ``accelerate launch``: two gloo processes on 127.0.0.1 run
the same experiment config; the LoRA weights equal a single process's on the same global batch, only rank 0
writes files, and a distributed run killed after a step resumes under torchrun to the same weights and history
as an uninterrupted distributed run."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from palaestra.trainer.checkpoints import load_checkpoint
from palaestra.trainer.expconfig import load_config
from palaestra.trainer.experiment import Experiment

pytestmark = pytest.mark.hf

CONFIG = """
[run]
name = "ddp"
seed = 11
output_dir = "{out}"
groups_per_step = 2
group_size = 4
max_steps = {steps}
samples_per_step = 2
progress = {progress}

[model]
backend = "hf"
name = "tiny-random-llama"

[env]
max_tokens = 8

[reward]
kind = "simulated_judge"

[validation]
every = 1
max_examples = 2
sampled = false

[train]
lr = 1e-3
"""

TIMING = ("time", "seconds", "latency", "per_s")  # history fields that measure the clock, not the run


def write_config(tmp: Path, name: str, steps: int = 1, progress: bool = False) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(CONFIG.format(out=tmp / name, steps=steps, progress=str(progress).lower()))
    return path


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def lora(run: Path) -> dict[str, np.ndarray]:
    state = load_checkpoint(run / "checkpoints" / "latest.npz")["trainer"]
    return {k: np.asarray(v) for k, v in state.items() if k.startswith("backend/lora/")}


def assert_same_lora(a: Path, b: Path) -> None:
    wa, wb = lora(a), lora(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        np.testing.assert_allclose(wb[k], wa[k], rtol=0, atol=1e-6, err_msg=k)
    assert max(float(np.abs(v).max()) for v in wa.values()) > 0  # trained (LoRA B starts at zero)


def history(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def assert_same_history(a: Path, b: Path) -> None:
    ha, hb = history(a), history(b)
    assert [sorted(r) for r in ha] == [sorted(r) for r in hb]
    for ra, rb in zip(ha, hb):
        for k, v in ra.items():
            if isinstance(v, float) and math.isfinite(v):
                assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (ra["step"], k)
            else:
                assert rb[k] == v, (ra["step"], k)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for(tmp: Path) -> dict[str, str]:
    # loopback only: the rendezvous on 127.0.0.1 and gloo's sockets on the lo interface; HF_HOME keeps any
    # user accelerate config out of the launch
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.update(MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1", HF_HOME=str(tmp / "hf_home"))
    return env


def torchrun(*args: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]  # the store binds a port itself
    return [*cmd, "-m", "palaestra", "train", *args]


def run_ok(cmd: list[str], cwd: Path, tmp: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env_for(tmp), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """Every rank's working directory: nothing may appear here."""
    (tmp_path / "cwd").mkdir()
    return tmp_path / "cwd"


def test_two_gloo_ranks_equal_one_process_and_only_rank0_writes(tmp_path: Path, work: Path) -> None:
    out = run_ok(torchrun("--config", str(write_config(tmp_path, "ddp")), "--quiet"), work, tmp_path)
    assert "HF backend on 2 ranks (data parallel" in out
    summary = Experiment(load_config(write_config(tmp_path, "single")), printer=None).run_sync()
    assert summary["steps"] == 1

    assert_same_lora(tmp_path / "single", tmp_path / "ddp")
    assert_same_history(tmp_path / "single", tmp_path / "ddp")
    # Rank 0 wrote the run folder exactly as one process does; rank 1 wrote nothing anywhere we can see.
    assert files_under(tmp_path / "ddp") == files_under(tmp_path / "single")
    assert files_under(work) == set()
    assert not [p for p in (tmp_path / "ddp").rglob("*") if "rank" in p.name.lower()]


def test_killed_distributed_run_resumes_under_torchrun_exactly(tmp_path: Path, work: Path) -> None:
    """SIGKILL to torchrun and both ranks after step 1's checkpoint (step 2's rollouts running), then
    ``torchrun ... palaestra train --resume RUN``: the weights and history of an uninterrupted 2-rank run."""
    run_ok(torchrun("--config", str(write_config(tmp_path, "full", steps=2)), "--quiet"), work, tmp_path)

    cut = write_config(tmp_path, "cut", steps=2, progress=True)
    proc = subprocess.Popen(
        torchrun("--config", str(cut)), cwd=work, env=env_for(tmp_path), stdout=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: the kill takes torchrun and both ranks
    )  # fmt: skip
    assert proc.stdout is not None
    deadline, killed = time.monotonic() + 240, False
    for line in proc.stdout:
        if line.startswith("step    1"):  # printed after step 1's checkpoint
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        assert time.monotonic() < deadline, "step 1 never reported"
    proc.wait(timeout=60)
    assert killed and proc.returncode == -signal.SIGKILL
    assert [r["step"] for r in history(tmp_path / "cut")] == [0, 1]

    run_ok(torchrun("--resume", str(tmp_path / "cut"), "--quiet"), work, tmp_path)
    assert_same_lora(tmp_path / "full", tmp_path / "cut")
    assert_same_history(tmp_path / "full", tmp_path / "cut")
    assert files_under(tmp_path / "cut") == files_under(tmp_path / "full")
    assert files_under(work) == set()


def test_accelerate_launch_trains_like_torchrun(tmp_path: Path, work: Path) -> None:
    """``accelerate launch --multi_gpu --num_processes 2`` on a machine without GPUs starts two ranks through
    torch's elastic launcher (RANK/WORLD_SIZE set): palaestra joins them with gloo. (``--cpu`` instead starts
    ONE process unless an MPI ``--mpirun_hostfile`` is given: see docs/scaling.md.)"""
    pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port())]
    cmd += ["-m", "palaestra", "train", "--config", str(write_config(tmp_path, "acc")), "--quiet"]
    run_ok(cmd, work, tmp_path)
    Experiment(load_config(write_config(tmp_path, "single")), printer=None).run_sync()
    assert_same_lora(tmp_path / "single", tmp_path / "acc")
    assert files_under(tmp_path / "acc") == files_under(tmp_path / "single")
    assert files_under(work) == set()
