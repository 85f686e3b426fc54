"""Pipelined training: steps/s and time to 0.75 greedy val accuracy for ``max_staleness`` 0 vs 1 vs 2.

    python benchmarks/pipeline.py                  # full: arith-base, 32 x 8 rollouts per step, until 0.75
    python benchmarks/pipeline.py --quick          # smoke: a few small steps per setting
    python benchmarks/pipeline.py --staleness 0 1 --steps 60 --csv out.csv

Each setting runs the same ``Experiment`` (the shipped ``arith-base`` policy, the strict verifier as the train
reward, lr 6e-4 cosine-annealed over ``--steps``, the same seed, scenarios and batch shape), stops at the first
validation with greedy accuracy >= ``--target`` (``--no-stop``: runs all steps), and differs only in
``[run] max_staleness``. With 0 the loop
is synchronous (rollouts, then update); with ``s`` the rollouts of the next ``s`` steps are generated on frozen
policy copies while the current update runs, in the same process (generation in the engine's thread, the numpy
update in a worker thread; both release the GIL in their kernels).

``--executor ray`` runs the rollouts (the OpenAI client's request building and response parsing, which hold
the GIL) in Ray worker processes against the policy served on 127.0.0.1; ``pip install palaestra[ray]``.

Printed per setting: training steps/s (wall time of the steps, validation EXCLUDED; the speed-up counting
validation time is printed too, since prefetched rollouts also overlap validation), the seconds (same clock)
to the first validation with greedy accuracy >= ``--target``, the measured staleness, and greedy val accuracy at
every validation step, so accuracy can be compared at equal steps. Target: >= 1.4x steps/s with
``max_staleness = 1`` on 2 cores and no loss of accuracy at equal steps. Timing needs a quiet machine. The
numpy policy's worker threads follow ``PALAESTRA_NUM_THREADS`` (default: up to 4, one per core here).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from palaestra.trainer.experiment import Experiment  # noqa: E402
from palaestra.trajectories.io import read_jsonl  # noqa: E402


def make_config(args: argparse.Namespace, staleness: int, out: Path) -> dict[str, Any]:
    return {
        "run": {
            "name": f"pipeline-s{staleness}",
            "seed": args.seed,
            "output_dir": str(out),
            "groups_per_step": args.groups,
            "group_size": args.group_size,
            "max_steps": args.steps,
            "samples_per_step": 0,
            "checkpoint_every": args.checkpoint_every,
            "max_staleness": staleness,
            "executor": args.executor,
            "workers": args.workers,
            "progress": False,
        },
        "model": {"name": "arith-base"},
        "env": {"name": "arithmetic", "max_tokens": 12},
        "reward": {"kind": "verifier", "verifier": "arith-strict"},
        "validation": {"every": args.eval_every, "max_examples": args.val_n, "sampled": False},
        "stopping": {
            "patience": 10_000,
            "target": None if args.no_stop else args.target,  # stop at the first validation >= target
            "hacking_window": None,
            "collapse_window": None,
        },
        # the recipe of benchmarks/time_to_accuracy.py: lr 6e-4, cosine-annealed over the run
        "train": {"lr": args.lr, "lr_schedule": "cosine", "seed": args.seed},
    }


def measure(args: argparse.Namespace, staleness: int, root: Path) -> dict[str, Any]:
    out = root / f"s{staleness}"
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    Experiment(make_config(args, staleness, out), printer=None).run_sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows = read_jsonl(out / "history.jsonl")
    val_so_far, clock = rows[0].get("val/seconds", 0.0), []
    for r in rows:  # the history clock minus validation time up to and including that row
        if r["step"] > 0:
            val_so_far += r.get("val/seconds", 0.0)
        clock.append(r["time"] - val_so_far)
    steps = rows[-1]["step"]
    train_s = clock[-1] - clock[0]
    loop_s = rows[-1]["time"] - rows[0]["time"]  # the whole loop after the base validation
    reached = next(
        (
            (r["step"], c - clock[0])
            for r, c in zip(rows, clock)
            if r.get("val/greedy_accuracy", -1.0) >= args.target
        ),
        None,
    )
    stale = [r.get("train/staleness_mean", 0.0) for r in rows[1:]]
    return {
        "staleness": staleness,
        "steps": steps,
        "train_s": train_s,
        "steps_per_s": steps / train_s if train_s > 0 else float("nan"),
        "loop_steps_per_s": steps / loop_s if loop_s > 0 else float("nan"),
        "reached": reached,
        "staleness_mean": sum(stale) / max(len(stale), 1),
        "wall_s": wall,
        "cpu_util": cpu / wall if wall > 0 else float("nan"),
        "acc": {r["step"]: r["val/greedy_accuracy"] for r in rows if "val/greedy_accuracy" in r},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few small steps per setting (smoke test)")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--steps", type=int, default=2000, help="max steps per setting (the lr anneals over them)"
    )
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--val-n", type=int, default=500)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument(
        "--no-stop", action="store_true", help="run every setting to --steps (default: stop at --target)"
    )
    ap.add_argument("--target", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--executor", choices=["local", "ray"], default="local", help="where rollouts run")
    ap.add_argument(
        "--workers", type=int, default=None, help="CPUs of the local Ray cluster (--executor ray)"
    )
    ap.add_argument("--csv", help="write per-validation accuracy rows here")
    ap.add_argument("--keep", help="keep the run folders under this directory")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.groups, args.group_size, args.eval_every, args.val_n = 4, 4, 4, 2, 20
    print(
        f"pipeline benchmark: arith-base, {args.groups}x{args.group_size} rollouts/step, {args.steps} steps, "
        f"val every {args.eval_every} on {args.val_n}, seed {args.seed}, executor {args.executor}; "
        f"{platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        results = [measure(args, s, root) for s in args.staleness]
    base = next((r for r in results if r["staleness"] == 0), results[0])
    print(
        f"\n{'max_staleness':>13} {'steps':>5} {'train s':>8} {'steps/s':>8} {'speed-up':>8} "
        f"{'lag':>5} {'cpu':>5} {'with val':>9}  time to {args.target:.2f} greedy val (train clock)"
    )
    for r in results:
        hit = f"{r['reached'][1]:.1f} s at step {r['reached'][0]}" if r["reached"] else "not reached"
        print(
            f"{r['staleness']:>13} {r['steps']:>5} {r['train_s']:>8.1f} {r['steps_per_s']:>8.3f} "
            f"{r['steps_per_s'] / base['steps_per_s']:>7.2f}x {r['staleness_mean']:>5.2f} "
            f"{r['cpu_util']:>5.2f} {r['loop_steps_per_s'] / base['loop_steps_per_s']:>8.2f}x  {hit}"
        )
    steps = sorted(set().union(*(r["acc"] for r in results)))
    print("\ngreedy val accuracy at equal steps")
    print(f"{'step':>5} " + " ".join(f"{'s=' + str(r['staleness']):>7}" for r in results))
    for k in steps:
        print(f"{k:>5} " + " ".join(f"{r['acc'].get(k, float('nan')):>7.3f}" for r in results))
    one = next((r for r in results if r["staleness"] == 1), None)
    if one is not None and base["staleness"] == 0:
        ratio = one["steps_per_s"] / base["steps_per_s"]
        loop = one["loop_steps_per_s"] / base["loop_steps_per_s"]
        print(
            f"\nspeed-up with max_staleness=1: {ratio:.2f}x steps/s (target >= 1.4x); {loop:.2f}x counting "
            "validation time (prefetched rollouts also run during validation, which the train clock excludes)"
        )
    if args.quick:
        print("(--quick: a smoke test of the script; its timings are warm-up dominated, not a measurement)")
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["max_staleness", "step", "greedy_accuracy", "steps_per_s"])
            for r in results:
                for k, a in sorted(r["acc"].items()):
                    w.writerow([r["staleness"], k, a, r["steps_per_s"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
