"""The HF path learns: SFT a tiny Llama on arithmetic to a weak base, then GRPO raises its greedy val accuracy.

    python benchmarks/hf_learns.py            # full: the figures of docs/scaling.md ("the HF path learns")
    python benchmarks/hf_learns.py --quick    # a short smoke run (a few SFT and GRPO steps; no claim)
    python benchmarks/hf_learns.py --device cuda --dtype auto   # the GRPO phase on a GPU (SFT stays on CPU)

1. ``build_hf_arith_base`` (palaestra.trainer.pretrain): ``tiny-llama-64``, a 2-layer width-64 Llama
   built from a config (the model is a STAND-IN: tiny, randomly initialised, character tokenizer; nothing is
   downloaded), full fine-tuning on the shipped arithmetic train split until greedy accuracy on 200 val
   problems reaches the target (strict verifier); written as a transformers folder.
2. ``Experiment(grpo_config(folder, ...))``: the same experiment config a user writes (``[model] backend =
   "hf"``, ``name = <folder>``), LoRA adapters, strict-verifier rewards, the OpenAI-compatible in-process
   server for rollouts, greedy validation on 200 val problems.

Printed: base and final greedy val accuracy (the run's own validation, step 0 and the last step), the gain in
points, wall and CPU seconds of each phase, and the machine. Seeded (``--seed``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps of each phase (smoke run, no claim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target", type=float, default=0.3, help="SFT stops at this greedy accuracy (200 val rows)"
    )
    p.add_argument("--grpo-steps", type=int, default=60)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no spinning on a shared machine)"
    )
    p.add_argument("--device", default="cpu", help="where the GRPO phase runs: cpu, cuda, auto")
    p.add_argument("--dtype", default="float32", help="GRPO phase dtype: float32, bfloat16, auto")
    p.add_argument(
        "--out", type=Path, default=None, help="keep the base and the run here (default: a temp dir)"
    )
    args = p.parse_args(argv)

    import torch

    from palaestra.trainer.experiment import Experiment
    from palaestra.trainer.pretrain import build_hf_arith_base, grpo_config

    torch.set_num_threads(args.threads)
    print(
        f"machine: {platform.node()} | {platform.machine()} | {os.cpu_count()} CPUs | torch {torch.__version__} "
        f"({torch.get_num_threads()} threads) | {dt.datetime.now().isoformat(timespec='seconds')}"
    )
    print("model: tiny-llama-64, a tiny randomly initialised stand-in built from a config (no download)")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        w0, c0 = time.perf_counter(), time.process_time()
        sft_steps = 60 if args.quick else 3000
        card = build_hf_arith_base(
            out, args.seed, target=args.target, max_steps=sft_steps, say=lambda s: print(s, flush=True)
        )
        w1, c1 = time.perf_counter(), time.process_time()
        print(
            f"sft: {card['steps']} steps, val greedy {card['val_accuracy_greedy']:.3f} on {card['data']['val_rows']}"
            f" rows, wall {w1 - w0:.1f} s, cpu {c1 - c0:.1f} s"
        )
        steps = 2 if args.quick else args.grpo_steps
        cfg = grpo_config(
            out / card["name"],
            out / "grpo",
            seed=args.seed,
            steps=steps,
            val_every=1 if args.quick else 10,
            val_rows=20 if args.quick else 200,
            device=args.device,
            dtype=args.dtype,
        )
        summary = Experiment(cfg, printer=None).run_sync()
        w2, c2 = time.perf_counter(), time.process_time()
        rows = [json.loads(x) for x in (out / "grpo" / "history.jsonl").read_text().splitlines()]
        vals = [(r["step"], r["val/greedy_accuracy"]) for r in rows if "val/greedy_accuracy" in r]
        base, last = vals[0][1], vals[-1][1]
        print("grpo val greedy by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in vals))
        print(
            f"grpo: {summary['steps']} steps of {cfg['run']['groups_per_step']}x{cfg['run']['group_size']} "
            f"rollouts on {args.device} ({args.dtype}), wall {w2 - w1:.1f} s, cpu {c2 - c1:.1f} s"
        )
        print(
            f"hf learns: greedy val accuracy (first {cfg['validation']['max_examples']} val rows) "
            f"{base:.3f} -> {last:.3f} ({100 * (last - base):+.1f} points)"
            + (" [--quick smoke run: too short to learn, not the figure]" if args.quick else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
