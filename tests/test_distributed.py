"""Data-parallel HF training under torchrun: two gloo processes run the same experiment config one step; the
LoRA weights equal a single process's step on the same global batch, and only rank 0 writes files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

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
max_steps = 1
samples_per_step = 2
progress = false

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


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def lora(run: Path) -> dict[str, np.ndarray]:
    state = load_checkpoint(run / "checkpoints" / "latest.npz")["trainer"]
    return {k: np.asarray(v) for k, v in state.items() if k.startswith("backend/lora/")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_gloo_ranks_equal_one_process_and_only_rank0_writes(tmp_path: Path) -> None:
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    (tmp_path / "single.toml").write_text(CONFIG.format(out=single_dir))
    (tmp_path / "ddp.toml").write_text(CONFIG.format(out=ddp_dir))
    work = tmp_path / "cwd"  # every rank's working directory: nothing may appear here
    work.mkdir()
    # loopback only: the rendezvous on 127.0.0.1 and gloo's sockets on the lo interface
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env["MASTER_ADDR"] = "127.0.0.1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    cmd += ["-m", "palaestra", "train", "--config", str(tmp_path / "ddp.toml"), "--quiet"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = Experiment(load_config(tmp_path / "single.toml"), printer=None).run_sync()
    assert summary["steps"] == 1

    single, ddp = lora(single_dir), lora(ddp_dir)
    assert single.keys() == ddp.keys() and single
    moved = 0.0
    for k in single:
        np.testing.assert_allclose(ddp[k], single[k], rtol=0, atol=1e-6, err_msg=k)
        moved = max(moved, float(np.abs(single[k]).max()))
    assert moved > 0  # the step changed the adapters (LoRA B starts at zero)

    # Rank 0 wrote the run folder exactly as one process does; rank 1 wrote nothing anywhere we can see.
    assert files_under(ddp_dir) == files_under(single_dir)
    assert files_under(work) == set()
    assert not [p for p in ddp_dir.rglob("*") if "rank" in p.name.lower()]
