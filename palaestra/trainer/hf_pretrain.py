"""SFT of a tiny HF Llama on the arithmetic task: the weak base that shows the HF path learns.

:func:`build_hf_arith_base` builds ``tiny-llama-64`` (a 2-layer, width-64 Llama with the character tokenizer
of :mod:`palaestra.models.hf.tiny`; built from a config, nothing downloaded) and trains **all** its weights on
the demonstrations of the embedded arith-base recipe (:data:`palaestra.trainer.pretrain.ARITH`: the shipped
train split, the prompt as user turn, ``Final: <answer>`` as reply), rendered with the model's chat template.
Training stops as soon as greedy accuracy on the first ``eval_rows`` validation problems, scored by the
strict verifier (``arith-strict``), reaches the target: a weak base, as arith-base is for the embedded policy.
The result is a transformers folder (``save_pretrained`` weights and tokenizer, plus ``palaestra-card.json``)
that an experiment names as its model (``[model] backend = "hf"``, ``name = "<folder>"``); GRPO then trains
LoRA adapters on it through :class:`~palaestra.trainer.hf_backend.HFBackend`.

Training is the one SFT loop, :func:`palaestra.trainer.sft.sft`, over :class:`TorchPolicy` (the model as a
:class:`~palaestra.trainer.update.TrainablePolicy`, torch Adam): the loss is the mean negative log-likelihood
of the reply tokens and the closing end token. Every random choice follows ``seed``; torch runs on the
threads it is given, so the same seed gives the same weights on the same machine and torch build.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.models.hf.sampling import generate
from palaestra.models.hf.tokenize import ChatTokenizer
from palaestra.trainer.hf_backend import TorchPolicy
from palaestra.trainer.pretrain import ARITH, base_card
from palaestra.trainer.sft import sft
from palaestra.trajectories.runs import write_json

__all__ = [
    "ARCHITECTURE",
    "CARD_FILE",
    "TorchPolicy",
    "build_hf_arith_base",
    "greedy_accuracy",
    "grpo_config",
]

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
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup: int = 50,
    eval_every: int = 25,
    eval_rows: int = 200,
    name: str = "hf-arith-base",
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """SFT ``tiny-llama-64`` on arithmetic (module docstring) and write the folder ``out_dir/name``; returns
    its card (also written there as ``palaestra-card.json``, with the final greedy accuracy on all of val).
    ``say`` receives a progress line per validation check."""
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf.tiny import build_char_tokenizer, tiny_config

    hf_tok = build_char_tokenizer()
    tok = ChatTokenizer(hf_tok)
    cfg = tiny_config(ARCHITECTURE, len(hf_tok))
    cfg.pad_token_id, cfg.eos_token_id = hf_tok.pad_token_id, hf_tok.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        train, val = ARITH.files.load("train"), ARITH.files.load("val")
        probe = val[:eval_rows]
        t0 = time.perf_counter()

        def probe_metrics() -> dict[str, float]:
            acc = greedy_accuracy(model, tok, probe)
            if say is not None:
                say(f"sft: val greedy {acc:.3f} on {len(probe)} rows ({time.perf_counter() - t0:.0f} s)")
            return {"accuracy": acc}

        history = sft(
            TorchPolicy(model),
            tok,
            ARITH.examples(train, seed),
            steps=max_steps,
            batch_size=batch_size,
            lr=lr,
            warmup=warmup,
            seed=seed,
            eval_fn=probe_metrics,
            eval_every=eval_every,
            stop_when=lambda met: met["accuracy"] >= target,
        )
        seconds = time.perf_counter() - t0
    folder = Path(out_dir) / name
    model.save_pretrained(str(folder))
    hf_tok.save_pretrained(str(folder))
    last = history[-1] if history else {}
    settings = {"batch_size": batch_size, "lr": lr, "warmup": warmup, "eval_every": eval_every}
    stop = {"eval_rows": len(probe), "stop_at_val_greedy": target, "max_steps": max_steps}
    card = base_card(
        name,
        seed,
        history,
        {**settings, **stop, "trained": "all weights (full fine-tuning)"},
        ARITH.files,
        (len(train), len(val)),
        seconds,
        architecture=ARCHITECTURE,
        probe_accuracy_greedy=last.get("accuracy"),
        val_accuracy_greedy=greedy_accuracy(model, tok, val),
        n_params=sum(p.numel() for p in model.parameters()),
        torch_threads=torch.get_num_threads(),
    )
    write_json(folder / CARD_FILE, card)
    return card


def grpo_config(
    base: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 40,
    groups_per_step: int = 16,
    group_size: int = 8,
    lr: float = 1e-3,
    lora_r: int = 16,
    val_every: int = 20,
    val_rows: int = 200,
) -> dict[str, Any]:
    """The experiment (as a dict for :class:`~palaestra.trainer.experiment.Experiment`) that trains the base
    folder ``base`` with GRPO on arithmetic: HF backend, LoRA adapters, strict-verifier rewards, greedy
    validation on the first ``val_rows`` val problems every ``val_every`` steps; runs all ``steps``."""
    return {
        "run": {
            "name": "hf-learns",
            "seed": seed,
            "output_dir": str(out_dir),
            "groups_per_step": groups_per_step,
            "group_size": group_size,
            "max_steps": steps,
            "progress": False,
            "samples_per_step": 2,
            "checkpoint_every": steps,
        },
        "model": {
            "backend": "hf",
            "name": str(base),
            "hf": {"lora": {"r": lora_r, "lora_alpha": 2 * lora_r}, "device": "cpu", "dtype": "float32"},
        },
        "env": {"name": "arithmetic", "max_tokens": _MAX_NEW, "temperature": 1.0},
        "reward": {"kind": "verifier", "verifier": "arith-strict"},
        "validation": {"every": val_every, "max_examples": val_rows, "sampled": False},
        "train": {"lr": lr, "seed": seed},
        "stopping": {
            "patience": steps + 1,
            "hacking_window": None,
            "collapse_window": None,
            "restore_best": False,
        },
    }
