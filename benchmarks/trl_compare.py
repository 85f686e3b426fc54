"""palaestra's framework path vs TRL's GRPOTrainer: per-step wall and CPU time on the same model and batch.

    python benchmarks/trl_compare.py                  # full: both models, 3 warm-up + 20 measured steps each
    python benchmarks/trl_compare.py --model hf       # (a) only;  --model embedded: (b) only
    python benchmarks/trl_compare.py --quick          # smoke run: barely trained HF base, 1 + 3 steps
    python benchmarks/trl_compare.py --profile        # also a cProfile of each side (every thread, CPU clock)

Two models, both tiny STAND-INS (nothing downloaded), each trained with GRPO on the same prompts by both sides:

* **(a) hf**: ``tiny-llama-64`` (palaestra.models.hf.tiny: a 2-layer, width-64 Llama with a character
  tokenizer, built from a config), SFT'd on arithmetic to a weak base by
  :func:`palaestra.trainer.pretrain.build_hf_arith_base` (cached under ``~/.cache/palaestra-bench``) and
  saved as a transformers folder; both sides load that folder and train the same LoRA adapters;
* **(b) embedded**: the shipped numpy ``arith-base``; TRL trains the same weights converted to a transformers
  GPT-2 (:func:`embedded_as_gpt2`: the architecture maps exactly, with a ReLU MLP and a bias on the head; the
  worker prints the largest logit difference to the numpy forward); all weights train on both sides.

The sides:

* **palaestra**, the framework path a user runs: ``Experiment`` (the policy's real ``openai`` client ->
  in-process OpenAI-compatible server and batching engine -> ``gather_trajectory_groups`` -> strict verifier
  -> ``GRPOTrainer`` update), with its run folder, history, samples and checkpoints at their defaults;
* **TRL** ``GRPOTrainer`` (``--trl-version``, 1.16.0 by default) in its own virtual environment
  (``--venv``, default ``~/.cache/palaestra-bench/trl-<version>``): created on first use with ``pip install
  trl==<version>`` on top of this interpreter's packages (a ``.pth`` file), so torch, transformers and peft
  are the very same installs on both sides and palaestra's own dependencies do not grow. Generation through
  ``transformers`` ``generate`` (no vLLM), reward = the same strict verifier as a TRL reward function.

Matched settings (printed): prompts per step, generations per prompt, max completion tokens, temperature 1
(no top-k/top-p), Adam(W) with the same constant lr, betas, eps, weight decay 0, gradient clip 1.0, one
optimiser step per batch (gradient accumulation 1, one iteration), token-mean clipped surrogate with clip
0.2 / 0.28 (TRL ``loss_type="dapo"``), group-std advantages, no KL (beta 0, no reference model), float32, no
gradient checkpointing (TRL's default is on), no zero-std group filtering on either side, the same torch and
BLAS threads (``--threads``). Each side runs in its own fresh subprocess, ``--rounds`` times (default 2), the
sides taking turns so that a slow spell of a shared machine falls on all of them; a side's measured steps are
pooled over its runs. The prompts of step k are the ones ``Experiment.examples_for_step(k)`` gives, fed to TRL in
that order.

Timing: a step's wall and process-CPU time is the interval between the ends of consecutive steps (so it
includes everything each framework does per step: logging, history, checkpoints, garbage collection); the
first ``--warmup`` steps are not measured, nor palaestra's last step (it runs the final validation). Printed
per side: median and mean wall and CPU ms per step, rollout vs the rest, completion tokens per step; the CPU
split (palaestra: the event loop, where the openai client, server, gather and run folder run, vs the
generation and update threads; TRL: generation and scoring vs the rest); then the ratio palaestra/TRL (< 1:
palaestra faster). CPU time is the fairer figure on a busy machine.

More cores (``--rollout-processes N``, default 2; 0: off): for (b), palaestra runs again with ``[run]
rollout_processes = N`` (each step's rollouts in N worker processes on the live weights; the same samples) and
its update on N threads, and TRL again with N torch threads: both sides on N cores; both ratios are printed; the CPU of a palaestra step then counts the worker
processes too (read from /proc). (a) has no such row: rollout processes serve the embedded policy only.

If the TRL environment cannot be created (no network), the TRL side is skipped with a line saying so (exit 0 with ``--quick``, 2 otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
CACHE = Path(os.environ.get("PALAESTRA_BENCH_CACHE", Path.home() / ".cache" / "palaestra-bench"))
ARCH = "tiny-llama-64"


# ---------------------------------------------------------------------------------------------- settings
def settings(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The matched settings both sides run with for model ``kind`` (also written to each worker's spec)."""
    d = DEFAULTS[kind]

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return d[name] if value is None else value

    return {
        "model": kind,
        "groups": pick("groups"),
        "group_size": pick("group_size"),
        "max_tokens": pick("max_tokens"),
        "temperature": 1.0,
        "lr": pick("lr"),
        "betas": [0.9, 0.99],
        "adam_eps": 1e-8,
        "weight_decay": 0.0,
        "clip_norm": 1.0,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "lora_r": args.lora_r,
        "lora_alpha": 2 * args.lora_r,
        "threads": args.threads,
        "seed": args.seed,
        "warmup": args.warmup,
        "steps": args.steps,
    }


def palaestra_config(s: dict[str, Any], base: Path, out: Path, total: int) -> dict[str, Any]:
    """The experiment a user would write for this run (framework defaults for what the comparison leaves)."""
    return {
        "run": {
            "name": "trl-compare",
            "seed": s["seed"],
            "output_dir": str(out),
            "groups_per_step": s["groups"],
            "group_size": s["group_size"],
            "max_steps": total,
            "rollout_processes": s.get("rollout_processes", 0),
        },
        "model": {
            "backend": "hf",
            "name": str(base),
            "hf": {
                "lora": {"r": s["lora_r"], "lora_alpha": s["lora_alpha"], "target_modules": "all-linear"},
                "device": "cpu",
                "dtype": "float32",
            },
        }
        if s["model"] == "hf"
        else {"backend": "embedded", "name": str(base)},
        "env": {"name": "arithmetic", "max_tokens": s["max_tokens"], "temperature": s["temperature"]},
        "reward": {"kind": "verifier", "verifier": "arith-strict"},
        # validation only at step 0 and at the (unmeasured) last step, on a few rows
        "validation": {"every": total + 1, "max_examples": 16, "sampled": False},
        "train": {
            "lr": s["lr"],
            "lr_schedule": "constant",
            "betas": s["betas"],
            "adam_eps": s["adam_eps"],
            "weight_decay": s["weight_decay"],
            "clip_norm": s["clip_norm"],
            "clip_low": s["clip_low"],
            "clip_high": s["clip_high"],
            "kl_beta": 0.0,
            "agg": "token_mean",
            "advantage_mode": "grpo",
            "negative_advantage_scale": 1.0,
            "drop_zero_std": False,
            "update_epochs": 1,
            "seed": s["seed"],
        },
        "stopping": {
            "patience": total + 1,
            "hacking_window": None,
            "collapse_window": None,
            "restore_best": False,
        },
    }


def thread_env(threads: int) -> dict[str, str]:
    n = str(threads)
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "PALAESTRA_NUM_THREADS": n,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def intervals(marks: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, cpu) of each step from the (wall, cpu) clock readings at the start and at each step's end."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)]


@contextlib.contextmanager
def thread_profile(path: str | None) -> Iterator[None]:
    """cProfile the block in this thread AND in every thread started meanwhile (the update and the batching
    engine run in worker threads), timed by each thread's CPU clock; the merged stats go to ``path``."""
    if path is None:
        yield
        return
    import cProfile
    import pstats
    import threading

    profilers = [cProfile.Profile(time.thread_time)]
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        profilers.append(prof)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    profilers[0].enable()
    try:
        yield
    finally:
        profilers[0].disable()
        threading.Thread.run = original  # type: ignore[method-assign]
        stats = pstats.Stats(profilers[0])
        for prof in profilers[1:]:
            with contextlib.suppress(TypeError, ValueError):  # a thread that recorded nothing
                stats.add(prof)
        stats.dump_stats(path)


# ---------------------------------------------------------------------------------------------- option (b)
def embedded_as_gpt2(name: str) -> tuple[Any, Any, float]:
    """The shipped embedded model ``name`` as a transformers GPT-2 with the very same weights, its tokenizer as
    a ``PreTrainedTokenizerFast`` with the same ids and chat template, and the largest |logit difference| to
    the numpy forward on a few rendered prompts (a check that the mapping is exact).

    TinyGPT is a pre-LN GPT-2 shape (learned positions, fused QKV, LayerNorm eps 1e-5, untied head) with a ReLU
    MLP (GPT-2's ``activation_function="relu"``) and a bias on its head (the head is replaced by a
    ``Linear`` with bias). Dropout is 0."""
    import numpy as np
    import torch
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from palaestra.envs.arithmetic_data import load_split
    from palaestra.models.registry import load
    from palaestra.models.tokenizer import is_special

    emb = load(name)
    gpt, tok = emb.gpt, emb.tokenizer
    c = gpt.config
    cfg = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.d_model,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=c.d_ff,
        activation_function="relu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.assistant_id,
        eos_token_id=tok.end_id,
        pad_token_id=tok.pad_id,
    )
    model = GPT2LMHeadModel(cfg)
    model.lm_head = torch.nn.Linear(c.d_model, c.vocab_size, bias=True)
    P = {k: torch.from_numpy(np.asarray(v, dtype=np.float32).copy()) for k, v in gpt.params.items()}
    state = {"transformer.wte.weight": P["wte"], "transformer.wpe.weight": P["wpe"]}
    for i in range(c.n_layer):
        h = f"transformer.h.{i}."
        state |= {
            h + "ln_1.weight": P[f"h{i}.ln1.g"],
            h + "ln_1.bias": P[f"h{i}.ln1.b"],
            h + "attn.c_attn.weight": P[f"h{i}.attn.w_qkv"],  # Conv1D: (in, out), x @ W as in numpy
            h + "attn.c_attn.bias": P[f"h{i}.attn.b_qkv"],
            h + "attn.c_proj.weight": P[f"h{i}.attn.w_o"],
            h + "attn.c_proj.bias": P[f"h{i}.attn.b_o"],
            h + "ln_2.weight": P[f"h{i}.ln2.g"],
            h + "ln_2.bias": P[f"h{i}.ln2.b"],
            h + "mlp.c_fc.weight": P[f"h{i}.mlp.w1"],
            h + "mlp.c_fc.bias": P[f"h{i}.mlp.b1"],
            h + "mlp.c_proj.weight": P[f"h{i}.mlp.w2"],
            h + "mlp.c_proj.bias": P[f"h{i}.mlp.b2"],
        }
    state |= {
        "transformer.ln_f.weight": P["lnf.g"],
        "transformer.ln_f.bias": P["lnf.b"],
        "lm_head.weight": P["head.w"].T.contiguous(),
        "lm_head.bias": P["head.b"],
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("attn.bias") and not k.endswith("masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"GPT-2 mapping: missing {missing}, unexpected {unexpected}")
    model.eval()

    # the tokenizer: specials are added tokens; text splits into word tokens (longest first) or characters
    vocab = {t: i for i, t in enumerate(tok.vocab)}
    specials = [t for t in tok.vocab if is_special(t)]
    words = sorted((t for t in tok.vocab if len(t) > 1 and not is_special(t)), key=len, reverse=True)
    pattern = "|".join([*(_re_escape(w) for w in words), r"[\s\S]"])
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    raw.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|end|>",
        additional_special_tokens=[t for t in specials if t not in ("<|pad|>", "<|unk|>", "<|end|>")],
    )
    hf_tok.chat_template = (
        "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
    )
    worst = 0.0
    for ex in load_split("val")[:8]:
        msgs = [{"role": "user", "content": ex["prompt"]}]
        ids = tok.render(msgs, add_generation_prompt=True).ids
        hf_ids: Any = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(hf_ids, "keys"):  # a BatchEncoding in recent transformers
            hf_ids = hf_ids["input_ids"]
        if list(hf_ids) != list(ids):
            raise RuntimeError(f"tokenizer mapping differs on {ex['prompt']!r}: {list(hf_ids)} vs {ids}")
        want = gpt.forward_logits(np.asarray([ids]))
        with torch.no_grad():
            got = model(input_ids=torch.tensor([ids])).logits.numpy()
        worst = max(worst, float(np.abs(got.reshape(want.shape) - want).max()))
    if not worst < 1e-3:
        raise RuntimeError(f"GPT-2 mapping: logits differ from the numpy model's by {worst:.2e}")
    return model, hf_tok, worst


def _re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ---------------------------------------------------------------------------------------------- workers
def palaestra_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the palaestra side (in its own process) and return its per-step timings."""
    import torch

    torch.set_num_threads(spec["settings"]["threads"])
    from server_throughput import proc_cpu_s  # this script's folder is on sys.path

    from palaestra.trainer.experiment import Experiment

    marks: list[tuple[str, float, float, float]] = []
    workers_cpu: list[float] = []  # CPU seconds of the rollout worker processes so far, at each mark

    def printer(text: str) -> None:  # called once per step on the event loop, after history and checkpoint
        proc = getattr(getattr(exp, "_pipe", None), "_proc", None)
        workers_cpu.append(proc_cpu_s(*proc.pids) if proc is not None else 0.0)
        marks.append((text, time.perf_counter(), time.process_time(), time.thread_time()))

    cfg = palaestra_config(spec["settings"], Path(spec["base"]), Path(spec["out"]), spec["total"])
    exp = Experiment(cfg, printer=printer)
    with thread_profile(spec.get("profile")):
        summary = exp.run_sync()
    history = [json.loads(x) for x in (Path(spec["out"]) / "history.jsonl").read_text().splitlines() if x]
    steps = [r for r in history if r.get("step", 0) >= 1]
    start = next((i for i, m in enumerate(marks) if m[0].startswith("step 0")), None)
    if start is not None and len(marks) - start - 1 == len(steps):
        # CPU of a step: this process's and the rollout worker processes' (rollout_processes > 0)
        per_step = intervals([(w, c + k) for (_, w, c, _), k in zip(marks[start:], workers_cpu[start:])])
        loop_cpu: list[float | None] = [b[3] - a[3] for a, b in itertools.pairwise(marks[start:])]
        cpu_known = True
    else:  # the progress lines changed shape: fall back to the history's wall clock (no CPU time)
        times = [history[0]["time"]] + [r["time"] for r in steps]
        per_step = [(b - a, float("nan")) for a, b in itertools.pairwise(times)]
        loop_cpu = [None] * len(per_step)
        cpu_known = False
    return {
        "side": "palaestra",
        "steps_run": summary["steps"],
        "per_step": per_step,
        "cpu_known": cpu_known,
        "rollout_s": [r.get("train/rollout_seconds") for r in steps],
        "loop_cpu": loop_cpu,
        "rollout_cpu": [None] * len(per_step),
        "workers_cpu": [b - a for a, b in itertools.pairwise(workers_cpu[start or 0 :])],
        "rollouts_in": exp._pipe.worker if exp._pipe is not None else "?",
        "completion_tokens": [r.get("train/tokens") for r in steps],
        "reward_mean": [r.get("train/reward_mean") for r in steps],
        "threads": torch.get_num_threads(),
        "versions": versions(),
    }


def trl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run TRL's GRPOTrainer (in the TRL environment's interpreter) and return its per-step timings."""
    import torch

    s = spec["settings"]
    torch.set_num_threads(s["threads"])
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from palaestra.envs.arithmetic import StrictFinalVerifier

    verifier = StrictFinalVerifier()

    def strict_reward(completions: list[Any], example: list[str], **_: Any) -> list[float]:
        out = []
        for comp, ex in zip(completions, example):
            text = comp[-1]["content"] if isinstance(comp, list) else comp
            out.append(float(verifier.score(json.loads(ex), text).reward))
        return out

    rows = [
        {"prompt": [{"role": "user", "content": ex["prompt"]}], "example": json.dumps(ex)}
        for step in spec["examples"]
        for ex in step
    ]
    marks: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append((time.perf_counter(), time.process_time()))

    batch = s["groups"] * s["group_size"]
    config = GRPOConfig(
        output_dir=spec["out"],
        per_device_train_batch_size=batch,
        num_generations=s["group_size"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=s["max_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=s["betas"][0],
        adam_beta2=s["betas"][1],
        adam_epsilon=s["adam_eps"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["clip_norm"],
        beta=0.0,
        epsilon=s["clip_low"],
        epsilon_high=s["clip_high"],
        loss_type="dapo",
        scale_rewards="group",
        max_steps=spec["total"],
        shuffle_dataset=False,
        seed=s["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    logit_diff = None
    if s["model"] == "embedded":  # (b): the numpy model's weights in a GPT-2, trained in full
        model, tok, logit_diff = embedded_as_gpt2(spec["base"])
        lora = None
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(spec["base"])
        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=s["lora_r"],
            lora_alpha=s["lora_alpha"],
            lora_dropout=0.0,
            target_modules="all-linear",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[strict_reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
        callbacks=[StepClock()],
    )
    gen_s: list[float] = []
    gen_cpu: list[float] = []
    tokens: list[float] = []
    rewards: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(*a: Any, **kw: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = inner(*a, **kw)
        gen_s.append(time.perf_counter() - t0)
        gen_cpu.append(time.process_time() - c0)
        tokens.append(float(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed
    with thread_profile(spec.get("profile")):
        trainer.train()
    rewards = [float(x) for x in trainer._metrics["train"].get("reward", [])]
    per_step = intervals(marks)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {
        "side": "trl",
        "trl_version": trl.__version__,
        "steps_run": int(trainer.state.global_step),
        "per_step": per_step,
        "cpu_known": True,
        "rollout_s": gen_s,
        "loop_cpu": [None] * len(per_step),
        "rollout_cpu": gen_cpu,
        "completion_tokens": tokens,
        "reward_mean": rewards,
        "threads": torch.get_num_threads(),
        "trainable_params": trainable,
        "logging_steps": config.logging_steps,
        "gradient_checkpointing": config.gradient_checkpointing,
        "bf16": config.bf16,
        "versions": versions(),
        **({"logit_diff": logit_diff} if logit_diff is not None else {}),
    }


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "trl"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


# ---------------------------------------------------------------------------------------------- the TRL venv
def trl_python(venv: Path, version: str, say: Any) -> tuple[Path | None, str]:
    """The interpreter of a venv holding ``trl==version`` over this interpreter's packages; (None, reason)
    when it cannot be made."""
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import trl; print(trl.__version__)"]
    if py.exists():
        got = subprocess.run(probe, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == version:
            return py, f"reused {venv}"
    marker = venv / ".palaestra-trl-bench"
    if venv.exists() and any(venv.iterdir()) and not marker.exists():
        return None, f"{venv} exists and was not made by this benchmark (not touched; pass another --venv)"
    say(f"creating the TRL environment {venv} (pip install trl=={version}) ...")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
        marker.write_text("made by benchmarks/trl_compare.py; safe to delete\n")
        here = sysconfig.get_paths()["purelib"]
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        # this interpreter's packages (torch, transformers, peft, accelerate) after the venv's own
        (Path(site) / "_palaestra_base.pth").write_text(f"import site; site.addsitedir({here!r})\n")
        pip = subprocess.run(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", f"trl=={version}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if pip.returncode != 0:
        tail = (pip.stderr or pip.stdout).strip().splitlines()[-1:]
        return None, "pip install failed: " + " | ".join(tail)[:300]
    got = subprocess.run(probe, capture_output=True, text=True)
    if got.returncode != 0 or got.stdout.strip() != version:
        return None, f"trl does not import in {venv}: {got.stderr.strip().splitlines()[-1:]}"
    return py, f"created {venv}"


# ---------------------------------------------------------------------------------------------- parent
def build_base(args: argparse.Namespace, tmp: Path, say: Any) -> tuple[Path, dict[str, Any]]:
    """The SFT'd base folder (cached in full mode: keyed by seed, target and step cap)."""
    import torch

    from palaestra.trainer.pretrain import CARD_FILE, build_hf_arith_base

    torch.set_num_threads(args.threads)
    if args.quick:
        where, target, steps = tmp, 1.0, args.sft_steps or 60
    else:
        steps = args.sft_steps or 3000
        where = CACHE / f"trl-compare-base-s{args.seed}-t{args.target}-n{steps}"
        target = args.target
        card_path = where / "hf-arith-base" / CARD_FILE
        if card_path.exists():
            return card_path.parent, {**json.loads(card_path.read_text()), "cached": str(where)}
    card = build_hf_arith_base(where, args.seed, target=target, max_steps=steps, eval_every=50)
    return where / card["name"], card


def run_worker(
    python: Path, side: str, spec: dict[str, Any], tmp: Path, threads: int, name: str = ""
) -> dict[str, Any]:
    name = name or side
    spec_path, out_path = tmp / f"{name}-spec.json", tmp / f"{name}-result.json"
    spec_path.write_text(json.dumps({**spec, "result": str(out_path)}))
    done = subprocess.run(
        [str(python), str(Path(__file__).resolve()), "--worker", side, str(spec_path)],
        cwd=ROOT,
        env={**os.environ, **thread_env(threads)},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not out_path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"the {side} worker failed (exit {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def summarise(runs: list[dict[str, Any]], skip: int, n: int) -> dict[str, float]:
    """Median/mean of the measured steps (``skip`` warm-up steps, then ``n``) of one side's runs, pooled."""
    steps = [x for res in runs for x in res["per_step"][skip : skip + n]]
    wall = [w for w, _ in steps]
    cpu = [c for _, c in steps]

    def part(key: str) -> float:
        vals = [v for res in runs if key in res for v in res[key][skip : skip + n] if v is not None]
        return statistics.mean(vals) if vals else float("nan")

    return {
        "n": len(steps),
        "wall_med": statistics.median(wall) if wall else float("nan"),
        "wall_mean": statistics.mean(wall) if wall else float("nan"),
        "cpu_med": statistics.median(cpu) if cpu else float("nan"),
        "cpu_mean": statistics.mean(cpu) if cpu else float("nan"),
        "rollout": part("rollout_s"),
        "loop_cpu": part("loop_cpu"),
        "workers_cpu": part("workers_cpu"),
        "rollout_cpu": part("rollout_cpu"),
        "tokens": part("completion_tokens"),
    }


def row(label: str, m: dict[str, float]) -> str:
    ms = 1000.0
    return (
        f"{label:<28} {m['wall_med'] * ms:8.1f} {m['wall_mean'] * ms:8.1f} {m['cpu_med'] * ms:8.1f} "
        f"{m['cpu_mean'] * ms:8.1f} {m['rollout'] * ms:9.1f} {(m['wall_mean'] - m['rollout']) * ms:8.1f} "
        f"{m['tokens']:8.0f}"
    )


def print_profile(path: str, side: str, top: int) -> None:
    import io
    import pstats

    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(path, stream=buf).sort_stats(key).print_stats(top)
        lines = buf.getvalue().splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls")), 0)
        print(f"\n{side} profile (whole run, sorted by {key}, top {top}):")
        print("\n".join(lines[at : at + top + 1]))


DEFAULTS = {  # per model: prompts/step, generations/prompt, max completion tokens, lr
    "hf": {"groups": 16, "group_size": 8, "max_tokens": 10, "lr": 1e-3},
    "embedded": {"groups": 32, "group_size": 8, "max_tokens": 8, "lr": 6e-4},  # time_to_accuracy's batch
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: barely trained HF base, 1 + 3 steps")
    p.add_argument(
        "--model",
        choices=("hf", "embedded", "both"),
        default="both",
        help="hf: the tiny Llama through the HF backend; embedded: arith-base (numpy) vs its GPT-2 copy",
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 20; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (default 3; quick 1)")
    p.add_argument("--groups", type=int, default=None, help="prompts per step (hf 16, embedded 32)")
    p.add_argument("--group-size", type=int, default=None, help="generations per prompt (8)")
    p.add_argument("--max-tokens", type=int, default=None, help="max completion tokens (hf 10, embedded 8)")
    p.add_argument("--lr", type=float, default=None, help="constant lr (hf 1e-3, embedded 6e-4)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (HF model; the embedded one trains all)")
    p.add_argument("--threads", type=int, default=1, help="torch (and BLAS) threads on both sides")
    p.add_argument(
        "--rollout-processes",
        type=int,
        default=2,
        help="(b): also palaestra with [run] rollout_processes = N, and TRL with N torch threads (0: neither)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="runs of each side, taking turns; pooled (default 2; quick 1)",
    )
    p.add_argument(
        "--target", type=float, default=0.3, help="the HF base's SFT stops at this greedy val accuracy"
    )
    p.add_argument("--sft-steps", type=int, default=None, help="SFT step cap (default 3000; quick 60)")
    p.add_argument("--trl-version", default="1.16.0")
    p.add_argument("--venv", type=Path, default=None, help="the TRL environment (created when missing)")
    p.add_argument("--only", choices=("palaestra", "trl"), default=None, help="run one side only")
    p.add_argument("--profile", action="store_true", help="cProfile each side's run and print the top")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        side, spec_path = args.worker
        spec = json.loads(Path(spec_path).read_text())
        result = palaestra_worker(spec) if side == "palaestra" else trl_worker(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return 0

    args.steps = args.steps or (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.rounds = max(1, args.rounds or (1 if args.quick else 2))
    venv = args.venv or CACHE / f"trl-{args.trl_version}"

    def say(text: str) -> None:
        print(text, flush=True)

    say(
        f"machine: {platform.node()} | {platform.machine()} | {os.cpu_count()} CPUs | "
        f"{dt.datetime.now().isoformat(timespec='seconds')}" + (" | --quick smoke run" if args.quick else "")
    )
    with tempfile.TemporaryDirectory(prefix="trl-compare-") as tmp_name:
        tmp = Path(tmp_name)
        trl_py: Path | None = None
        if args.only != "palaestra":
            trl_py, how = trl_python(venv, args.trl_version, say)
            if trl_py is None:
                say(f"SKIPPED the TRL side: could not make a TRL {args.trl_version} environment ({how})")
                if args.only == "trl" or not args.quick:
                    return 2
            else:
                say(f"TRL environment: {how}")
        for kind in ("hf", "embedded") if args.model == "both" else (args.model,):
            compare(kind, args, tmp / kind, trl_py, say)
    return 0


def compare(kind: str, args: argparse.Namespace, tmp: Path, trl_py: Path | None, say: Any) -> None:
    """One model's comparison: build or name the base, run each side in its own process, print the table."""
    tmp.mkdir(parents=True)
    s = settings(args, kind)
    total = args.warmup + args.steps + 1  # + palaestra's last step, which runs the final validation
    say("")
    if kind == "hf":
        t0 = time.perf_counter()
        base, card = build_base(args, tmp, say)
        say(
            f"== (a) model: {ARCH}, a tiny randomly initialised STAND-IN built from a config (no download), "
            f"SFT'd {card.get('steps')} steps on arithmetic: greedy val "
            f"{card.get('val_accuracy_greedy', float('nan')):.3f}"
            + (
                f" (cached in {card['cached']})"
                if "cached" in card
                else f" ({time.perf_counter() - t0:.0f} s)"
            )
        )
        base_name = str(base)
        trained = f"LoRA r={s['lora_r']} alpha={s['lora_alpha']} all-linear"
        path = (
            "backend hf: openai client -> in-process server -> gather -> strict verifier -> HFBackend update"
        )
    else:
        base_name = "arith-base"
        say(
            "== (b) model: arith-base, the shipped embedded numpy GPT (a tiny STAND-IN), and for TRL the same "
            "weights as a transformers GPT-2 (ReLU MLP, head with bias; logits checked equal below)"
        )
        trained = "all weights (full fine-tuning)"
        path = "backend embedded: openai client -> in-process server -> gather -> strict verifier -> numpy update"
    from palaestra.trainer.experiment import Experiment

    probe = Experiment(palaestra_config(s, Path(base_name), tmp / "probe", total), printer=None)
    examples = [probe.examples_for_step(k) for k in range(1, total + 1)]
    spec = {"settings": s, "base": base_name, "total": total, "examples": examples}
    say(
        f"settings (both sides): {s['groups']} prompts/step x {s['group_size']} generations = "
        f"{s['groups'] * s['group_size']} completions, max {s['max_tokens']} completion tokens, temperature "
        f"{s['temperature']} (no top-k/top-p); {trained}; float32, CPU, {s['threads']} torch/BLAS thread(s)\n"
        f"  Adam(W) lr {s['lr']} constant, betas {tuple(s['betas'])}, eps {s['adam_eps']}, weight decay 0, grad "
        f"clip {s['clip_norm']}; one optimiser step per batch (grad accumulation 1, 1 iteration)\n"
        f"  loss: clipped surrogate {s['clip_low']}/{s['clip_high']}, token mean (TRL loss_type dapo), group "
        "std advantages, KL beta 0 (no reference), no zero-std filtering; reward: strict arithmetic verifier\n"
        f"  steps: {args.warmup} warm-up + {args.steps} measured (palaestra runs one more: its final "
        "validation, not measured); same prompts per step on both sides"
    )
    runs: dict[str, list[dict[str, Any]]] = {}  # side -> its runs, one per round
    pdir = CACHE / "trl-compare-profiles"
    if args.profile:
        pdir.mkdir(parents=True, exist_ok=True)
    prof = {
        side: str(pdir / f"{kind}-{side}.prof") if args.profile else None for side in ("palaestra", "trl")
    }
    n = args.rollout_processes if kind == "embedded" else 0  # only the embedded policy has rollout workers
    sides: list[tuple[str, Path, str, dict[str, Any], int]] = []  # (side, python, worker, spec, threads)
    if args.only != "trl":
        pspec = {**spec, "profile": prof["palaestra"]}
        sides.append(("palaestra", Path(sys.executable), "palaestra", pspec, args.threads))
        if n > 0:  # n cores: the rollouts in n worker processes and the update on n threads, like TRL's n
            nspec = {**spec, "settings": {**s, "rollout_processes": n, "threads": n}}
            sides.append(("palaestra_n", Path(sys.executable), "palaestra", nspec, n))
    if trl_py is not None:
        sides.append(("trl", trl_py, "trl", {**spec, "profile": prof["trl"]}, args.threads))
        if n > 0 and n != args.threads:  # TRL given the same number of cores: n torch threads
            sides.append(("trl_n", trl_py, "trl", {**spec, "settings": {**s, "threads": n}}, n))
    for r in range(args.rounds):  # the sides take turns: a slow spell of a shared machine falls on all
        for side, python, worker, sspec, threads in sides:
            out = {**sspec, "out": str(tmp / f"{side}-{r}")}
            runs.setdefault(side, []).append(run_worker(python, worker, out, tmp, threads, f"{side}-{r}"))
    results = {side: rs[0] for side, rs in runs.items()}  # settings, versions: the same in every round
    if kind == "hf" and args.rollout_processes > 0 and args.only != "trl":
        say(
            "palaestra with rollout processes: not run for (a): [run] rollout_processes applies to the embedded "
            "policy only (an HFModel runs its rollouts in the training process)"
        )
    if "palaestra" in results:
        r = results["palaestra"]
        say(
            f"palaestra: the framework path (Experiment, {path}), run folder, history, samples, checkpoints at "
            "defaults" + ("" if r["cpu_known"] else "; CPU time unavailable (progress lines not recognised)")
        )
    if "trl" in results:
        r = results["trl"]
        say(
            f"TRL {r['trl_version']} GRPOTrainer: transformers generate (no vLLM), gradient checkpointing "
            f"{r['gradient_checkpointing']}, bf16 {r['bf16']}, logging every {r['logging_steps']} steps, no "
            f"saving; {r['trainable_params']} trainable parameters"
            + (
                f"; max |logit difference| to the numpy model {r['logit_diff']:.1e}"
                if "logit_diff" in r
                else ""
            )
        )
    vers = {side: r["versions"] for side, r in results.items() if side in ("palaestra", "trl")}
    say(
        "versions: "
        + "; ".join(f"{k}: " + ", ".join(f"{a} {b}" for a, b in v.items()) for k, v in vers.items())
    )
    say(
        f"\n{'ms per step':<28} {'wall med':>8} {'mean':>8} {'cpu med':>8} {'mean':>8} {'rollout':>9} "
        f"{'rest':>8} {'tokens':>8}"
    )
    summ = {side: summarise(rs, args.warmup, args.steps) for side, rs in runs.items()}
    labels = {
        "palaestra": "palaestra framework",
        "palaestra_n": f"palaestra, {n} procs+threads",
        "trl": "TRL GRPOTrainer",
        "trl_n": f"TRL, {n} torch threads",
    }
    for side, m in summ.items():
        say(row(labels[side], m))
    say(
        "(rollout = wall ms of sampling + scoring, rest = wall ms of the rest of the step (means); tokens = "
        f"completion tokens per step; {args.steps} steps after {args.warmup} warm-up, in each of {args.rounds} "
        "run(s) per side, the sides taking turns)"
    )
    if "palaestra" in summ and summ["palaestra"]["loop_cpu"] == summ["palaestra"]["loop_cpu"]:
        m = summ["palaestra"]
        say(
            f"palaestra CPU ms per step (mean): {m['loop_cpu'] * 1000:.1f} on the event loop (openai client, "
            f"in-process server, gather, verifier, run folder), {(m['cpu_mean'] - m['loop_cpu']) * 1000:.1f} in "
            "other threads (batched generation, logprobs, backward, Adam)"
        )
    if "palaestra_n" in summ:
        m, where = summ["palaestra_n"], results["palaestra_n"]["rollouts_in"]
        say(
            f"palaestra with {n} rollout processes (rollouts ran: {where}): CPU ms per step (mean) "
            f"{m['cpu_mean'] * 1000:.1f} in all, of which {m['workers_cpu'] * 1000:.1f} in the worker processes "
            f"(/proc, 10 ms ticks), {m['loop_cpu'] * 1000:.1f} on the trainer's event loop"
        )
    if "trl" in summ:
        m = summ["trl"]
        say(
            f"TRL CPU ms per step (mean): {m['rollout_cpu'] * 1000:.1f} generating and scoring, "
            f"{(m['cpu_mean'] - m['rollout_cpu']) * 1000:.1f} the rest (logprobs, backward, AdamW, logging)"
        )
    if "palaestra" in summ and "trl" in summ:
        a, b = summ["palaestra"], summ["trl"]
        rw, rc = a["wall_med"] / b["wall_med"], a["cpu_med"] / b["cpu_med"]
        say(
            f"ratio palaestra/TRL per step ({kind}): wall {rw:.2f} (median; mean {a['wall_mean'] / b['wall_mean']:.2f}),"
            f" cpu {rc:.2f} (median; mean {a['cpu_mean'] / b['cpu_mean']:.2f}): "
            f"{'palaestra' if rw < 1 else 'TRL'} faster per wall second, {'palaestra' if rc < 1 else 'TRL'} faster "
            "per CPU second" + (" [--quick smoke run: few steps, not the figure]" if args.quick else "")
        )
    if "palaestra_n" in summ and "trl" in summ:
        a = summ["palaestra_n"]
        for key, who in (("trl", f"TRL at {args.threads} thread(s)"), ("trl_n", f"TRL with {n} threads")):
            if key in summ:
                b = summ[key]
                say(
                    f"ratio palaestra/TRL per step ({kind}; palaestra on {n} cores: {n} rollout processes and {n} update threads, vs {who}): wall "
                    f"{a['wall_med'] / b['wall_med']:.2f} (median; mean {a['wall_mean'] / b['wall_mean']:.2f}), "
                    f"cpu {a['cpu_mean'] / b['cpu_mean']:.2f} (mean; all processes): "
                    f"{'palaestra' if a['wall_med'] < b['wall_med'] else 'TRL'} faster per wall second"
                )
    for side in results:
        path_ = prof.get(side)
        if path_ is not None and Path(path_).exists():
            print_profile(path_, f"{kind} {side}", 30)
            say(f"profile kept: {path_} (python -m pstats FILE)")


if __name__ == "__main__":
    raise SystemExit(main())
