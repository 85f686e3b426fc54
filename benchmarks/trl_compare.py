"""palaestra's framework path vs TRL's GRPOTrainer: per-step wall and CPU time on the same model and batch.

    python benchmarks/trl_compare.py            # full: SFT'd base (cached), 3 warm-up + 20 measured steps
    python benchmarks/trl_compare.py --quick    # smoke run: a barely trained base, 1 warm-up + 3 measured steps
    python benchmarks/trl_compare.py --profile  # also a cProfile of each side (top functions printed)

The model is ``tiny-llama-64`` (palaestra.models.hf.tiny: a 2-layer, width-64 Llama with a character tokenizer,
built from a config, nothing downloaded; a STAND-IN, not a real LLM), SFT'd on the arithmetic task to a weak
base by :func:`palaestra.trainer.hf_pretrain.build_hf_arith_base` and saved as a transformers folder. Both
sides load that folder, wrap it in the same LoRA adapters and train it with GRPO on the same prompts:

* **palaestra**, the framework path a user runs: ``Experiment`` with ``[model] backend = "hf"`` (the policy's
  real ``openai`` client -> in-process OpenAI-compatible server and batching engine -> ``gather_trajectory_
  groups`` -> strict verifier -> ``GRPOTrainer`` / ``HFBackend`` update), with its run folder, history,
  samples and checkpoints at their defaults;
* **TRL** ``GRPOTrainer`` (``--trl-version``, 1.16.0 by default) in its own virtual environment
  (``--venv``, default ``~/.cache/palaestra-bench/trl-<version>``): created on first use with ``pip install
  trl==<version>`` on top of this interpreter's packages (a ``.pth`` file), so torch, transformers and peft
  are the very same installs on both sides and palaestra's own dependencies do not grow. Generation through
  ``transformers`` ``generate`` (no vLLM), reward = the same strict verifier as a TRL reward function.

Matched settings (printed): prompts per step, generations per prompt, max completion tokens, temperature 1
(no top-k/top-p), AdamW with the same lr (constant), betas, eps, weight decay 0, gradient clip 1.0, one
optimiser step per batch (gradient accumulation 1, one iteration), token-mean clipped surrogate with clip
0.2 / 0.28 (TRL ``loss_type="dapo"``), group-std advantages, no KL (beta 0, no reference model), float32, no
gradient checkpointing (TRL's default is on), no zero-std group filtering on either side, the same torch
threads. Each side runs in its own fresh subprocess, one after the other. The prompts of step k are the ones
``Experiment.examples_for_step(k)`` gives, fed to TRL in that order (``shuffle_dataset=False``).

Timing: a step's wall and process-CPU time is the interval between the ends of consecutive steps (so it
includes everything each framework does per step: logging, history, checkpoints); the first ``--warmup``
steps are not measured, nor palaestra's last step (it runs the final validation). Printed per side: median
and mean wall and CPU ms per step, rollout+scoring vs update ms, completion tokens per step; then the ratio
palaestra/TRL (< 1: palaestra faster). If the TRL environment cannot be created (no network), the TRL side is
skipped with a line saying so (exit 0 with ``--quick``, 2 otherwise).
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
def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The matched settings both sides run with (also written to each worker's spec)."""
    return {
        "groups": args.groups,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "lr": args.lr,
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
        },
        "model": {
            "backend": "hf",
            "name": str(base),
            "hf": {
                "lora": {"r": s["lora_r"], "lora_alpha": s["lora_alpha"], "target_modules": "all-linear"},
                "device": "cpu",
                "dtype": "float32",
            },
        },
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


# ---------------------------------------------------------------------------------------------- workers
def palaestra_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the palaestra side (in its own process) and return its per-step timings."""
    import torch

    torch.set_num_threads(spec["settings"]["threads"])
    from palaestra.trainer.experiment import Experiment

    marks: list[tuple[str, float, float, float]] = []

    def printer(text: str) -> None:  # called once per step on the event loop, after history and checkpoint
        marks.append((text, time.perf_counter(), time.process_time(), time.thread_time()))

    cfg = palaestra_config(spec["settings"], Path(spec["base"]), Path(spec["out"]), spec["total"])
    exp = Experiment(cfg, printer=printer)
    with thread_profile(spec.get("profile")):
        summary = exp.run_sync()
    history = [json.loads(x) for x in (Path(spec["out"]) / "history.jsonl").read_text().splitlines() if x]
    steps = [r for r in history if r.get("step", 0) >= 1]
    start = next((i for i, m in enumerate(marks) if m[0].startswith("step 0")), None)
    if start is not None and len(marks) - start - 1 == len(steps):
        per_step = intervals([(w, c) for _, w, c, _ in marks[start:]])
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
    say(f"creating the TRL environment {venv} (pip install trl=={version}) ...")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
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
        tail = (pip.stderr or pip.stdout).strip().splitlines()[-3:]
        return None, "pip install failed: " + " | ".join(tail)
    got = subprocess.run(probe, capture_output=True, text=True)
    if got.returncode != 0 or got.stdout.strip() != version:
        return None, f"trl does not import in {venv}: {got.stderr.strip().splitlines()[-1:]}"
    return py, f"created {venv}"


# ---------------------------------------------------------------------------------------------- parent
def build_base(args: argparse.Namespace, tmp: Path, say: Any) -> tuple[Path, dict[str, Any]]:
    """The SFT'd base folder (cached in full mode: keyed by seed, target and step cap)."""
    import torch

    from palaestra.trainer.hf_pretrain import CARD_FILE, build_hf_arith_base

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


def run_worker(python: Path, side: str, spec: dict[str, Any], tmp: Path, threads: int) -> dict[str, Any]:
    spec_path, out_path = tmp / f"{side}-spec.json", tmp / f"{side}-result.json"
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


def summarise(res: dict[str, Any], skip: int, n: int) -> dict[str, float]:
    """Median/mean of the measured steps (``skip`` warm-up steps, then ``n``)."""
    steps = res["per_step"][skip : skip + n]
    wall = [w for w, _ in steps]
    cpu = [c for _, c in steps]

    def part(key: str) -> float:
        vals = [v for v in res[key][skip : skip + n] if v is not None]
        return statistics.mean(vals) if vals else float("nan")

    return {
        "n": len(steps),
        "wall_med": statistics.median(wall) if wall else float("nan"),
        "wall_mean": statistics.mean(wall) if wall else float("nan"),
        "cpu_med": statistics.median(cpu) if cpu else float("nan"),
        "cpu_mean": statistics.mean(cpu) if cpu else float("nan"),
        "rollout": part("rollout_s"),
        "loop_cpu": part("loop_cpu"),
        "rollout_cpu": part("rollout_cpu"),
        "tokens": part("completion_tokens"),
    }


def row(label: str, m: dict[str, float]) -> str:
    ms = 1000.0
    return (
        f"{label:<22} {m['wall_med'] * ms:8.1f} {m['wall_mean'] * ms:8.1f} {m['cpu_med'] * ms:8.1f} "
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: barely trained base, 1 + 3 steps")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 20; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (default 3; quick 1)")
    p.add_argument("--groups", type=int, default=16, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="generations per prompt")
    p.add_argument("--max-tokens", type=int, default=10, help="max completion tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch (and BLAS) threads on both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target", type=float, default=0.3, help="the base's SFT stops at this greedy val accuracy"
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
    venv = args.venv or CACHE / f"trl-{args.trl_version}"
    s = settings(args)
    total = args.warmup + args.steps + 1  # + palaestra's last step, which runs the final validation

    def say(text: str) -> None:
        print(text, flush=True)

    print(
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
        t0 = time.perf_counter()
        base, card = build_base(args, tmp, say)
        say(
            f"model: {ARCH}, a tiny randomly initialised STAND-IN built from a config (no download), SFT'd "
            f"{card.get('steps')} steps on arithmetic: greedy val {card.get('val_accuracy_greedy', float('nan')):.3f}"
            + (
                f" (cached in {card['cached']})"
                if "cached" in card
                else f" ({time.perf_counter() - t0:.0f} s)"
            )
        )
        from palaestra.trainer.experiment import Experiment

        probe = Experiment(palaestra_config(s, base, tmp / "probe", total), printer=None)
        examples = [probe.examples_for_step(k) for k in range(1, total + 1)]
        spec = {"settings": s, "base": str(base), "total": total, "examples": examples}
        say(
            f"settings (both sides): {s['groups']} prompts/step x {s['group_size']} generations = "
            f"{s['groups'] * s['group_size']} completions, max {s['max_tokens']} completion tokens, temperature "
            f"{s['temperature']} (no top-k/top-p); LoRA r={s['lora_r']} alpha={s['lora_alpha']} all-linear, "
            f"float32, CPU, {s['threads']} torch thread(s)\n"
            f"  AdamW lr {s['lr']} constant, betas {tuple(s['betas'])}, eps {s['adam_eps']}, weight decay 0, grad "
            f"clip {s['clip_norm']}; one optimiser step per batch (grad accumulation 1, 1 iteration)\n"
            f"  loss: clipped surrogate {s['clip_low']}/{s['clip_high']}, token mean (TRL loss_type dapo), group "
            "std advantages, KL beta 0 (no reference), no zero-std filtering; reward: strict arithmetic verifier\n"
            f"  steps: {args.warmup} warm-up + {args.steps} measured (palaestra runs one more: its final "
            "validation, not measured); same prompts per step on both sides"
        )
        results: dict[str, dict[str, Any]] = {}
        pdir = CACHE / "trl-compare-profiles"
        if args.profile:
            pdir.mkdir(parents=True, exist_ok=True)
        prof = str(pdir / "palaestra.prof") if args.profile else None
        if args.only != "trl":
            pspec = {**spec, "out": str(tmp / "run"), "profile": prof}
            results["palaestra"] = run_worker(Path(sys.executable), "palaestra", pspec, tmp, args.threads)
        if trl_py is not None:
            tspec = {**spec, "out": str(tmp / "trl"), "profile": str(pdir / "trl.prof") if prof else None}
            results["trl"] = run_worker(trl_py, "trl", tspec, tmp, args.threads)
        say("")
        if "palaestra" in results:
            r = results["palaestra"]
            say(
                "palaestra: framework path (Experiment, backend hf: openai client -> in-process server -> gather -> "
                "strict verifier -> HFBackend update), run folder, history, samples, checkpoints at defaults"
                + ("" if r["cpu_known"] else "; CPU time unavailable (progress lines not recognised)")
            )
        if "trl" in results:
            r = results["trl"]
            say(
                f"TRL {r['trl_version']} GRPOTrainer: transformers generate (no vLLM), gradient checkpointing "
                f"{r['gradient_checkpointing']}, bf16 {r['bf16']}, logging every {r['logging_steps']} steps, no "
                f"saving; {r['trainable_params']} trainable (LoRA) parameters"
            )
        vers = {side: r["versions"] for side, r in results.items()}
        say(
            "versions: "
            + "; ".join(f"{k}: " + ", ".join(f"{a} {b}" for a, b in v.items()) for k, v in vers.items())
        )
        say(
            f"\n{'ms per step':<22} {'wall med':>8} {'mean':>8} {'cpu med':>8} {'mean':>8} {'rollout':>9} "
            f"{'rest':>8} {'tokens':>8}"
        )
        summ = {side: summarise(r, args.warmup, args.steps) for side, r in results.items()}
        labels = {"palaestra": "palaestra framework", "trl": "TRL GRPOTrainer"}
        for side, m in summ.items():
            say(row(labels[side], m))
        say(
            "(rollout = wall ms of sampling + scoring, rest = wall ms of the rest of the step (means); tokens = "
            f"completion tokens per step; {args.steps} steps after {args.warmup} warm-up)"
        )
        if "palaestra" in summ and summ["palaestra"]["loop_cpu"] == summ["palaestra"]["loop_cpu"]:
            m = summ["palaestra"]
            say(
                f"palaestra CPU ms per step (mean): {m['loop_cpu'] * 1000:.1f} on the event loop (openai client, "
                f"in-process server, gather, verifier, run folder), {(m['cpu_mean'] - m['loop_cpu']) * 1000:.1f} in "
                "other threads (batched generation, logprobs, backward, AdamW)"
            )
        if "trl" in summ:
            m = summ["trl"]
            say(
                f"TRL CPU ms per step (mean): {m['rollout_cpu'] * 1000:.1f} generating and scoring, "
                f"{(m['cpu_mean'] - m['rollout_cpu']) * 1000:.1f} the rest (logprobs, backward, AdamW, logging)"
            )
        if len(summ) == 2:
            a, b = summ["palaestra"], summ["trl"]
            verdict = "palaestra faster" if a["wall_med"] < b["wall_med"] else "TRL faster"
            say(
                f"ratio palaestra/TRL per step: wall {a['wall_med'] / b['wall_med']:.2f} (median; mean "
                f"{a['wall_mean'] / b['wall_mean']:.2f}), cpu {a['cpu_med'] / b['cpu_med']:.2f} (median; mean "
                f"{a['cpu_mean'] / b['cpu_mean']:.2f}): {verdict}"
                + (" [--quick smoke run: few steps, not the figure]" if args.quick else "")
            )
        if prof is not None:
            for side in results:
                if (pdir / f"{side}.prof").exists():
                    print_profile(str(pdir / f"{side}.prof"), side, 30)
            print(f"\nprofiles kept in {pdir} (python -m pstats FILE)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
