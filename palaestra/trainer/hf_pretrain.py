"""SFT of a tiny HF Llama (built from a config, nothing downloaded) on the arithmetic task: the weak base that
shows the HF path learns, and :func:`grpo_config`, the experiment that trains it (docs/scaling.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.models.hf.sampling import generate
from palaestra.models.hf.tokenize import ChatTokenizer
from palaestra.trainer.hf_backend import TorchPolicy
from palaestra.trainer.pretrain import ARITH, pretrain
from palaestra.trajectories.runs import write_json

ARCHITECTURE = "tiny-llama-64"  # the tiny.py spec the base is built from
CARD_FILE = "palaestra-card.json"
_MAX_NEW = 10  # "Final: -99" and the end token


def greedy_accuracy(
    model: Any, tok: ChatTokenizer, rows: Sequence[Mapping[str, Any]], *, batch: int = 250
) -> float:
    """Share of ``rows`` whose greedy reply the strict verifier accepts (arith-strict)."""
    verifier = StrictFinalVerifier()
    hits = 0
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        prompts = [tok.render([{"role": "user", "content": r["prompt"]}]).ids for r in part]
        gens = generate(  # greedy; the sampler runs under torch.no_grad
            model,
            tok,
            prompts,
            max_new_tokens=[_MAX_NEW] * len(part),
            temperature=[0.0] * len(part),
            top_p=[1.0] * len(part),
            seeds=[0] * len(part),
            device=next(model.parameters()).device,
        )
        hits += sum(verifier.score(r, g.text).reward == 1.0 for r, g in zip(part, gens))
    return hits / max(len(rows), 1)


def build_hf_arith_base(
    out_dir: str | Path,
    seed: int = 0,
    *,
    target: float = 0.3,
    max_steps: int = 2000,
    eval_every: int = 25,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """SFT all weights of ``tiny-llama-64`` until greedy val accuracy reaches ``target``; write it and its card."""
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf.tiny import build_char_tokenizer, tiny_config

    hf_tok = build_char_tokenizer()
    tok = ChatTokenizer(hf_tok)
    cfg = tiny_config(ARCHITECTURE, len(hf_tok))
    cfg.pad_token_id, cfg.eos_token_id = hf_tok.pad_token_id, hf_tok.eos_token_id
    recipe = dataclasses.replace(
        ARITH,
        name="hf-arith-base",
        metrics=lambda model, rows, **kw: {"accuracy": greedy_accuracy(model, tok, rows)},
        batch_size=64,
        lr=3e-3,
        warmup=50,
        eval_every=eval_every,
        eval_rows=200,
        stop_rule=lambda target, n: {
            "eval_rows": n,
            "stop_at_val_greedy": target,
            "max_steps": max_steps,
            "trained": "all weights (full fine-tuning)",
        },
    )

    def facts(history: Any, val: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {
            "architecture": ARCHITECTURE,
            "probe_accuracy_greedy": history[-1].get("accuracy") if history else None,
            "val_accuracy_greedy": greedy_accuracy(model, tok, val),
            "n_params": sum(p.numel() for p in model.parameters()),
            "torch_threads": torch.get_num_threads(),
        }

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        policy = TorchPolicy(model)
        card = pretrain(
            recipe, policy, model, tok, seed, max_steps=max_steps, target=target, facts=facts, say=say
        )
    folder = Path(out_dir) / recipe.name
    model.save_pretrained(str(folder))
    hf_tok.save_pretrained(str(folder))
    write_json(folder / CARD_FILE, card)
    return card


def grpo_config(
    base: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 40,
    val_every: int = 20,
    val_rows: int = 200,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """The experiment config that trains the base folder ``base`` with GRPO and LoRA on arithmetic for all
    ``steps`` on ``device`` in ``dtype`` (``"auto"``: a GPU in bfloat16 when there is one)."""
    return {
        "run": {
            "name": "hf-learns",
            "seed": seed,
            "output_dir": str(out_dir),
            "groups_per_step": 16,
            "group_size": 8,
            "max_steps": steps,
            "progress": False,
            "samples_per_step": 2,
            "checkpoint_every": steps,
        },
        "model": {
            "backend": "hf",
            "name": str(base),
            "hf": {"lora": {"r": 16, "lora_alpha": 32}, "device": device, "dtype": dtype},
        },
        "env": {"name": "arithmetic", "max_tokens": _MAX_NEW, "temperature": 1.0},
        "reward": {"kind": "verifier", "verifier": "arith-strict"},
        "validation": {"every": val_every, "max_examples": val_rows, "sampled": False},
        "train": {"lr": 1e-3, "seed": seed},
        "stopping": {
            "patience": steps + 1,
            "hacking_window": None,
            "collapse_window": None,
            "restore_best": False,
        },
    }
