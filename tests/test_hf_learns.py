"""The HF path learns (issue 19, item 6): a tiny Llama, SFT'd on arithmetic to a weak base, gets better at
the task by GRPO through the HF backend and the same experiment config a user writes.

One seeded run on CPU (about two CPU-minutes on one thread): ``build_hf_arith_base`` (full fine-tuning of
``tiny-llama-64``, built from a config, nothing downloaded, until greedy accuracy on 200 val problems reaches
0.3), then ``Experiment(grpo_config(...))`` with ``[model] backend = "hf"`` naming the saved folder: LoRA
adapters, strict-verifier rewards, rollouts through the OpenAI-compatible in-process server. The figures of a
longer run are printed by ``benchmarks/hf_learns.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

pytestmark = pytest.mark.hf


def test_sft_then_grpo_raises_greedy_val_accuracy(tmp_path: Path) -> None:
    from palaestra.trainer.experiment import Experiment
    from palaestra.trainer.pretrain import CARD_FILE, build_hf_arith_base, grpo_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic kernels, no thread spinning on a busy CI machine
    try:
        card = build_hf_arith_base(tmp_path, seed=0, target=0.3)
        folder = tmp_path / card["name"]
        assert json.loads((folder / CARD_FILE).read_text())["steps"] == card["steps"] < 2000  # stopped early
        assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()

        cfg = grpo_config(folder, tmp_path / "grpo", seed=0, steps=40, val_every=20)
        assert cfg["model"]["backend"] == "hf" and cfg["reward"]["verifier"] == "arith-strict"
        summary = Experiment(cfg, printer=None).run_sync()
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 40 and summary["stop"]["reason"] == "max_steps"
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "history.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val/greedy_accuracy"] for r in rows if "val/greedy_accuracy" in r}
    base, last = vals[0], vals[40]
    assert 0.2 <= base <= 0.45, f"the SFT base is not weak: greedy val {base}"
    assert last - base >= 0.10, f"GRPO did not raise greedy val accuracy by 10 points: {base} -> {last}"
    assert rows[-1]["policy_version"] == 40  # 40 LoRA updates through HFBackend
