"""Pipelined training: steps/s and time to 0.75 greedy val accuracy for ``max_staleness`` 0 vs 1 vs 2.

    python benchmarks/pipeline.py                  # full: arith-base, 32 x 8 rollouts per step, until 0.75
    python benchmarks/pipeline.py --quick          # smoke: a few small steps per setting
    python benchmarks/pipeline.py --staleness 0 1 --steps 60 --csv out.csv
    python benchmarks/pipeline.py --worker process  # only the worker process (default: process and thread)
    python benchmarks/pipeline.py --staleness 0 1 --sync-process  # also s=0 with its rollouts in processes

Each setting runs the same ``Experiment`` (the shipped ``arith-base`` policy, the strict verifier as the train
reward, lr 6e-4 cosine-annealed over ``--steps``, the same seed, scenarios and batch shape), stops at the first
validation with greedy accuracy >= ``--target`` (``--no-stop``: runs all steps), and differs only in
``[run] max_staleness`` and ``[run] rollout_processes``. With 0 the loop is synchronous (rollouts, then update);
with ``s`` the rollouts of the next ``s`` steps are generated on frozen policy copies while the current update
runs: in a worker process (``--worker process``: generation, the in-process server, the OpenAI client and the
rollout function use a second core) or on a thread of the training process (``--worker thread``: overlaps only
where numpy kernels release the GIL).

``--executor ray`` runs the rollouts (the OpenAI client's request building and response parsing, which hold
the GIL) in Ray worker processes against the policy served on 127.0.0.1; ``pip install palaestra[ray]``.

Printed per setting: training steps/s (wall time of the steps, validation EXCLUDED; the speed-up counting
validation time is printed too, since prefetched rollouts also overlap validation), the seconds (same clock)
to the first validation with greedy accuracy >= ``--target``, the measured staleness, and greedy val accuracy at
every validation step, so accuracy can be compared at equal steps. Target: >= 1.4x steps/s with
``max_staleness = 1`` on 2 cores and no loss of accuracy at equal steps. Timing needs a quiet machine. The
numpy policy's worker threads follow ``PALAESTRA_NUM_THREADS`` (default: up to 4, one per core here).

CPU-time figures (less sensitive to other load than wall time): per training step without validation, the CPU
seconds of the training process and of the rollout worker process; ``cpu est.`` is the speed-up those imply on
two otherwise idle cores, ``cpu/step at s=0 / max(train cpu/step, worker cpu/step / processes, all cpu/step /
cores)`` (the busier process, or all the work spread over the cores, is the critical path; for the thread
worker everything is the training process's). ``others`` is the average number of
cores busy with other programs during the setting (system CPU time from /proc/stat minus this benchmark's).
On a loaded machine wall-time speed-ups say little: a setting with more runnable threads or processes simply
gets a larger share of the contended cores. The process worker's first step includes the workers' start-up
(a spawned interpreter importing palaestra), which ``--quick`` runs are too short to amortise.
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

from server_throughput import proc_cpu_s  # noqa: E402

from palaestra.trainer.experiment import Experiment  # noqa: E402
from palaestra.trainer.pipeline import RolloutPipeline  # noqa: E402
from palaestra.trajectories.io import read_jsonl  # noqa: E402


def _system_busy() -> float:
    """CPU seconds all programs on this machine have used (Linux /proc/stat; 0.0 elsewhere)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
        ticks = [int(x) for x in first[1:]]
        return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def make_config(
    args: argparse.Namespace, staleness: int, out: Path, worker: str = "process"
) -> dict[str, Any]:
    return {
        "run": {
            "name": f"pipeline-s{staleness}-{worker}",
            "seed": args.seed,
            "output_dir": str(out),
            "groups_per_step": args.groups,
            "group_size": args.group_size,
            "max_steps": args.steps,
            "samples_per_step": 0,
            "checkpoint_every": args.checkpoint_every,
            "max_staleness": staleness,
            # the process worker: --processes (default 2); the thread worker and "-": in the training process
            "rollout_processes": (args.processes or 2) if worker == "process" else 0,
            "executor": args.executor,
            "workers": args.workers,
            "progress": True,  # the per-step line is where the CPU clocks are read (nothing is printed)
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


def measure(args: argparse.Namespace, staleness: int, worker: str, root: Path) -> dict[str, Any]:
    out = root / f"s{staleness}-{worker}"
    marks: list[tuple[float, float, float]] = []  # (own cpu, worker cpu, wall) at each step's line
    exp: Experiment

    def on_line(line: str) -> None:
        pipe: RolloutPipeline | None = getattr(exp, "_pipe", None)
        proc = getattr(pipe, "_proc", None)
        pids = proc.pids if proc is not None else []
        marks.append((time.process_time(), proc_cpu_s(*pids), time.perf_counter()))

    exp = Experiment(make_config(args, staleness, out, worker), printer=on_line)
    t0 = time.perf_counter()
    cpu0, busy0, load0 = time.process_time(), _system_busy(), os.getloadavg()[0]
    children0 = os.times().children_user + os.times().children_system
    exp.run_sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    cpu += os.times().children_user + os.times().children_system - children0  # the joined worker's
    others = max(0.0, (_system_busy() - busy0 - cpu) / wall) if wall > 0 else float("nan")
    worker_used = {"inline": "-"}.get(exp._pipe.worker, exp._pipe.worker) if exp._pipe else worker
    n_proc = 0
    if worker_used == "process":
        n_proc = int(exp.config.run.processes)
        worker_used = f"process{n_proc}" if n_proc > 1 else "process"
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
    # per-step clocks over steps without validation (step k's interval is from line k-1 to line k; step 1,
    # which includes the warm-up, is left out)
    validated = {r["step"] for r in rows if "val/greedy_accuracy" in r}
    own, other, walls = [], [], []
    for k in range(2, len(marks)):  # marks[0]: the base validation's line; marks[k]: step k's
        if k in validated:
            continue
        own.append(marks[k][0] - marks[k - 1][0])
        other.append(marks[k][1] - marks[k - 1][1])
        walls.append(marks[k][2] - marks[k - 1][2])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "staleness": staleness,
        "worker": worker_used,
        "cpu_train": mean(own),
        "cpu_worker": mean(other),
        "processes": n_proc,
        "wall_step": mean(walls),
        "others": others,
        "load": (load0, os.getloadavg()[0]),
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
    ap.add_argument(
        "--worker",
        nargs="+",
        choices=["process", "thread"],
        default=["process", "thread"],
        help="where prefetched rollouts run, for each max_staleness > 0: worker processes or a thread",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=None,
        help="[run] rollout_processes of the process worker (default 2)",
    )
    ap.add_argument(
        "--sync-process",
        action="store_true",
        help="also max_staleness 0 with its rollouts in --processes worker processes (rollout_processes)",
    )
    ap.add_argument("--executor", choices=["local", "ray"], default="local", help="where rollouts run")
    ap.add_argument(
        "--workers", type=int, default=None, help="CPUs of the local Ray cluster (--executor ray)"
    )
    ap.add_argument("--csv", help="write per-validation accuracy rows here")
    ap.add_argument("--keep", help="keep the run folders under this directory")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.groups, args.group_size, args.eval_every, args.val_n = 5, 4, 4, 4, 20
    print(
        f"pipeline benchmark: arith-base, {args.groups}x{args.group_size} rollouts/step, {args.steps} steps, "
        f"val every {args.eval_every} on {args.val_n}, seed {args.seed}, executor {args.executor}; "
        f"{platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        sync = ["-", *(["process"] if args.sync_process else [])]
        settings = [(s, w) for s in args.staleness for w in (args.worker if s > 0 else sync)]
        results = [measure(args, s, w, root) for s, w in settings]
    base = next((r for r in results if r["staleness"] == 0 and r["worker"] == "-"), results[0])
    print(
        f"\n{'max_staleness':>13} {'steps':>5} {'train s':>8} {'steps/s':>8} {'speed-up':>8} "
        f"{'lag':>5} {'cores':>5} {'with val':>9} {'worker':>7}  time to {args.target:.2f} greedy val (train clock)"
    )
    for r in results:
        hit = f"{r['reached'][1]:.1f} s at step {r['reached'][0]}" if r["reached"] else "not reached"
        print(
            f"{r['staleness']:>13} {r['steps']:>5} {r['train_s']:>8.1f} {r['steps_per_s']:>8.3f} "
            f"{r['steps_per_s'] / base['steps_per_s']:>7.2f}x {r['staleness_mean']:>5.2f} "
            f"{r['cpu_util']:>5.2f} {r['loop_steps_per_s'] / base['loop_steps_per_s']:>8.2f}x {r['worker']:>7}  {hit}"
        )
    base_cpu = base["cpu_train"] + base["cpu_worker"]
    cores = os.cpu_count() or 1

    def critical(r: dict[str, Any]) -> float:
        """Seconds per step two idle cores would need at best: the busier process, or all the work shared."""
        per_worker = r["cpu_worker"] / max(r["processes"], 1)
        return float(max(r["cpu_train"], per_worker, (r["cpu_train"] + r["cpu_worker"]) / cores))

    print(
        f"\nCPU time per training step (steps without validation)\n{'max_staleness':>13} {'worker':>7} "
        f"{'wall/step':>9} {'train cpu':>9} {'wkr cpu':>8} {'cpu est.':>8} {'others':>6} {'load':>9}"
    )
    for r in results:
        print(
            f"{r['staleness']:>13} {r['worker']:>7} {r['wall_step']:>9.3f} {r['cpu_train']:>9.3f} "
            f"{r['cpu_worker']:>8.3f} {base_cpu / critical(r) if critical(r) > 0 else float('nan'):>7.2f}x "
            f"{r['others']:>6.2f} {r['load'][0]:>4.1f}-{r['load'][1]:<4.1f}"
        )
    steps = sorted(set().union(*(r["acc"] for r in results)))
    print("\ngreedy val accuracy at equal steps")
    labels = [f"s={r['staleness']}" + ("" if r["worker"] == "-" else f"/{r['worker']}") for r in results]
    print(f"{'step':>5} " + " ".join(f"{label:>10}" for label in labels))
    for k in steps:
        print(f"{k:>5} " + " ".join(f"{r['acc'].get(k, float('nan')):>10.3f}" for r in results))
    for one in (r for r in results if r["staleness"] == 1 or (r is not base and r["staleness"] == 0)):
        if base["staleness"] != 0:
            break
        ratio = one["steps_per_s"] / base["steps_per_s"]
        loop = one["loop_steps_per_s"] / base["loop_steps_per_s"]
        print(
            f"\nspeed-up with max_staleness={one['staleness']} ({one['worker']} worker): {ratio:.2f}x steps/s"
            f"{' (target >= 1.4x)' if one['staleness'] == 1 else ''}; "
            f"{loop:.2f}x counting validation time (prefetched rollouts also run during validation, which the "
            f"train clock excludes); CPU-time estimate {base_cpu / critical(one):.2f}x"
        )
    if args.quick:
        print("(--quick: a smoke test of the script; its timings are warm-up dominated, not a measurement)")
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["max_staleness", "worker", "step", "greedy_accuracy", "steps_per_s"])
            for r in results:
                for k, a in sorted(r["acc"].items()):
                    w.writerow([r["staleness"], r["worker"], k, a, r["steps_per_s"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
