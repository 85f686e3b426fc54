"""The default ``palaestra demo`` (learned judge arith-rm, strict-verifier validation), run as a user runs it:
prints its banner and final table (test-split accuracy of base, restored-best and last-step policies, the
judge's mean reward at each, stop reason and step), then wall and CPU time of the whole command, and the
judge-reward and validation curves from the run's ``demo.json``.

    python benchmarks/demo.py            # the default demo (what the README quotes)
    python benchmarks/demo.py --quick    # the CI smoke settings
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo"
        cmd = [
            sys.executable,
            "-m",
            "palaestra",
            "demo",
            "--quiet",
            "--outdir",
            str(out),
            "--seed",
            str(args.seed),
        ]
        if args.quick:
            cmd.append("--quick")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, text=True, capture_output=True)
        wall = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(proc.stdout, end="")
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        report = json.loads((out / "demo.json").read_text())
    print()
    print(f"demo command: wall {wall:.1f} s, CPU {usage.ru_utime + usage.ru_stime:.1f} s (user + system)")
    for label, entry in report["test"].items():
        print(
            f"test ({entry['n']} rows) {label}: greedy accuracy {entry['test_accuracy']:.3f}, "
            f"judge mean reward {entry.get('judge_mean_reward', float('nan')):.3f}"
        )
    stop = report["stop"]
    print(f"stop: {stop['reason']} at step {stop['step']}, best val step {stop.get('best_step')} restored")
    print("val greedy accuracy by step: " + ", ".join(f"{s}:{v:.3f}" for s, v in report["val_curve"]))
    print(
        "judge mean reward by step:   " + ", ".join(f"{s}:{v:.3f}" for s, v in report["judge_reward_curve"])
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
