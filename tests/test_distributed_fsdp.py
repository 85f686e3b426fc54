"""FSDP for the HF backend (``HFBackend(..., fsdp=True)``): two gloo processes shard the frozen base weights with
FSDP2 and keep the LoRA adapters whole; one update (micro-batches of unequal count per rank, KL to the
adapter-disabled reference) gives the adapters a single process's step gives, within 1e-6. And the experiment
with ``[train] distributed = "fsdp"`` under torchrun, sampling on a stand-in vLLM server (the tiny model's own
OpenAI-compatible app over HTTP with vLLM's LoRA-loading endpoints added), trains like one process.

Run by pytest; torchrun runs this same file as the script of each rank (``__main__`` below)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

import torch
from server_fixtures import serve_in_thread
from test_distributed import CONFIG, assert_same_history, assert_same_lora, files_under, run_ok, torchrun

from palaestra.models.hf import HFModel
from palaestra.trainer import distributed as dist_util
from palaestra.trainer.backend import TrainBatch
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.hf_backend import HFBackend
from palaestra.trajectories import Trajectory, TrajectoryGroup
from palaestra.trajectories.io import read_groups, write_groups

pytestmark = pytest.mark.hf

CFG = TrainConfig(lr=1e-3, kl_beta=0.1)  # kl_beta > 0: the reference (adapters disabled) is scored too
MICRO = 2  # 5 rows: rank 0 holds 2 (one micro-batch), rank 1 holds 3 (two); FSDP pads rank 0


def backend(fsdp: bool) -> HFBackend:
    torch.set_num_threads(1)
    return HFBackend(HFModel.tiny("tiny-random-llama", seed=0), CFG, micro_batch_size=MICRO, fsdp=fsdp)


def batch_from(path: Path) -> TrainBatch:
    trajs = read_groups(path)[0].trajectories
    r = np.array([t.reward for t in trajs])
    return TrainBatch(trajs, r - r.mean())


async def sample(model: HFModel) -> list[Trajectory]:
    out = []
    for p, text in enumerate(["What is 2+3?", "Name a colour."]):
        msgs: list[Any] = [{"role": "user", "content": text}]
        resp = await model.openai_client().chat.completions.create(
            model=model.name,
            messages=msgs,
            n=3,
            max_tokens=8,
            logprobs=True,
            seed=p,
        )
        out += [
            Trajectory(messages_and_choices=[*msgs, c], reward=float(i % 2))
            for i, c in enumerate(resp.choices)
        ]
    return out[:5]


def rank_main(batch_path: Path, out: Path) -> None:
    """One rank: join the group, shard, then rank 0 takes the step (the follower mirrors it) and saves."""
    from torch.distributed.tensor import DTensor

    info = dist_util.init_from_env()
    assert info is not None
    b = backend(fsdp=True)
    frozen = [p for p in b.model.model.parameters() if not p.requires_grad]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in frozen)
    if not info.is_main:
        assert dist_util.follow(b) == 1
        return
    b.train_step(batch_from(batch_path))
    dist_util.release_followers()
    full = sum(p.numel() for p in frozen)
    arrays: dict[str, Any] = {**b.model.adapter_state(), "_local": local, "_full": full}
    np.savez(out, **arrays)


def test_fsdp_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    sampler = HFModel.tiny("tiny-random-llama", seed=0)
    write_groups(tmp_path / "batch.jsonl", [TrajectoryGroup(trajectories=asyncio.run(sample(sampler)))])

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env["MASTER_ADDR"] = "127.0.0.1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]  # the store binds a port itself
    cmd += [__file__, str(tmp_path / "batch.jsonl"), str(tmp_path / "fsdp.npz")]
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(work.iterdir())  # no rank wrote anything but rank 0's result file

    single = backend(fsdp=False)
    assert not single.fsdp  # one process: nothing to shard
    single.train_step(batch_from(tmp_path / "batch.jsonl"))
    want = single.model.adapter_state()
    got = dict(np.load(tmp_path / "fsdp.npz"))
    assert got.pop("_local") < 0.6 * got.pop("_full")  # the frozen base weights were sharded over the ranks
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    assert max(float(np.abs(v).max()) for k, v in want.items() if "lora_B" in k) > 0  # the step moved LoRA B


def stand_in_vllm() -> Any:
    """A STAND-IN for a vLLM server (ASGI): the tiny base model's own app, plus ``/v1/load_lora_adapter`` (loads
    the adapter folder the trainer wrote) and ``/v1/unload_lora_adapter`` (nothing to do)."""
    model = HFModel.tiny("tiny-random-llama", seed=0)
    inner = model.app()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("_lora_adapter"):
            return await inner(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        if scope["path"] == "/v1/load_lora_adapter":
            model.load_adapter(json.loads(body)["lora_path"])
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def test_fsdp_experiment_under_torchrun_samples_on_vllm_and_trains_like_one_process(tmp_path: Path) -> None:
    def config(name: str, extra: str) -> Path:
        text = CONFIG.format(out=tmp_path / name, steps=1, progress="false") + extra
        text += f'[model.hf.vllm]\nbase_url = "{url}/v1"\nlora_dir = "{tmp_path / (name + "-loras")}"\n'
        (tmp_path / f"{name}.toml").write_text(text)
        return tmp_path / f"{name}.toml"

    work = tmp_path / "cwd"
    work.mkdir()
    with serve_in_thread(stand_in_vllm()) as url:
        cmd = torchrun("--config", str(config("fsdp", 'distributed = "fsdp"\n')), "--quiet")
        assert "HF backend on 2 ranks (FSDP, base weights sharded)" in run_ok(cmd, work, tmp_path)
        from palaestra.trainer.expconfig import load_config
        from palaestra.trainer.experiment import Experiment

        Experiment(load_config(config("single", "")), printer=None).run_sync()
    assert_same_lora(tmp_path / "single", tmp_path / "fsdp")
    assert_same_history(tmp_path / "single", tmp_path / "fsdp")
    assert files_under(tmp_path / "fsdp") == files_under(tmp_path / "single")
    assert files_under(tmp_path / "fsdp-loras") == files_under(tmp_path / "single-loras")  # rank 0 published
    assert files_under(work) == set()


def test_fsdp_experiment_without_vllm_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Sharded weights cannot sample on rank 0 alone: every rank says so in one line; no run folder is left."""
    (tmp_path / "f.toml").write_text(
        CONFIG.format(out=tmp_path / "f", steps=1, progress="false") + 'distributed = "fsdp"\n'
    )
    cmd = torchrun("--config", str(tmp_path / "f.toml"), "--quiet")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    for who in ("", "rank 1: "):
        assert f"palaestra train: error: {who}train.distributed = 'fsdp'" in proc.stderr, proc.stderr[-2000:]
    assert "[model.hf.vllm]" in proc.stderr and not (tmp_path / "f").exists()


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), Path(sys.argv[2]))
