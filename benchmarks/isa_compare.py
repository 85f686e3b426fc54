"""The same figures with AVX-512 switched off: how much of a slower machine is the instruction set?

    python benchmarks/isa_compare.py [--quick]

Issue 19 reports an AVX2-only 2-core machine (no AVX-512) on which numpy and torch train steps ran about 2.6x
slower than on the AVX-512 machine that wrote RESULTS.md, and Python-heavy serving fell about 4x per CPU-second.
No such machine is available here, so this script EMULATES the instruction-set half of the difference on this
machine: it runs two benchmarks twice in fresh subprocesses, once as is ("native") and once with every library
told to stop at AVX2 ("avx2-only"):

* ``NPY_DISABLE_CPU_FEATURES``: numpy's own SIMD loops dispatch no AVX-512 target;
* ``OPENBLAS_CORETYPE=Haswell``: OpenBLAS (numpy's BLAS; built DYNAMIC_ARCH) uses its AVX2 kernels;
* ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2``: torch's kernels likewise.

The clock, caches, memory and Python interpreter stay this machine's, so this is not the other machine: a ratio
near 1 here means the slowdown seen there comes from the machine itself (clock, memory, a noisy neighbour), not
from missing AVX-512, and that ratios measured here (framework/raw, numpy/torch) should carry over.

Measured, per environment: the embedded policy's train step (numpy and torch CPU time per step at one thread,
``embedded_policy.py --json``) and the framework vs raw per-step comparison of ``time_to_accuracy.py`` (no
time-to-accuracy run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AVX2_ONLY = {
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
    "OPENBLAS_CORETYPE": "Haswell",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
PATH_NAMES = {"raw": "raw", "framework": "framework", "processes": "framework, rollouts in 2 processes"}


def _run(script: str, flags: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, str(HERE / script), *flags],
        env={**os.environ, **env, "PYTHONPATH": str(HERE.parent)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} {' '.join(flags)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def simd(env: dict[str, str]) -> str:
    """numpy's SIMD dispatch targets in use under ``env`` (what the switch actually did)."""
    code = (
        "import numpy._core._multiarray_umath as m; "
        "print(' '.join(t for t in m.__cpu_dispatch__ if m.__cpu_features__.get(t)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or done.stderr.strip()[-200:]


def measure(env: dict[str, str], quick: bool) -> dict[str, Any]:
    pol = json.loads(_run("embedded_policy.py", ["--quick", "--no-server", "--json"], env))
    steps = "3" if quick else "20"
    flags = ["--max-steps", "0", "--seconds", "0", "--compare-steps", steps, "--experiment-steps", "0"]
    flags += ["--rollout-processes", "2"]  # the processes row's label (PATH_NAMES)
    flags += ["--val-n", "20", "--csv", os.devnull]
    if quick:
        flags += ["--groups", "8", "--group-size", "4"]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "compare.json"
        _run("time_to_accuracy.py", [*flags, "--compare-json", str(result)], env)
        times = json.loads(result.read_text())
    paths = {PATH_NAMES[k]: (v["wall_ms"], v["cpu_ms"]) for k, v in times.items() if k in PATH_NAMES}
    return {"policy": pol, "paths": paths}


def train_cpu_ms(pol: dict[str, Any]) -> dict[str, float]:
    """numpy and torch CPU ms per train step at one thread from embedded_policy's JSON."""
    for row in pol.get("train_step", []):
        if int(row.get("threads", 0)) == 1:
            return {k: float(row[f"{k}_cpu_ms"]) for k in ("numpy", "torch") if f"{k}_cpu_ms" in row}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 compared steps of 8x4 (seconds)")
    args = ap.parse_args()
    envs = {"native": {}, "avx2-only": AVX2_ONLY}
    print("instruction-set emulation on this machine (same clock, caches and interpreter; see the docstring)")
    for name, env in envs.items():
        print(f"  {name:10s} numpy SIMD targets: {simd(env)}")
    res = {name: measure(env, args.quick) for name, env in envs.items()}
    print(f"\n{'figure':44s} {'native':>10s} {'avx2-only':>10s} {'ratio':>7s}")
    rows: list[tuple[str, float, float]] = []
    nat, emu = (train_cpu_ms(res[n]["policy"]) for n in envs)
    rows += [(f"train step CPU ms, {k}, 1 thread", nat[k], emu[k]) for k in nat if k in emu]
    for path, (wall, cpu) in res["native"]["paths"].items():
        if path in res["avx2-only"]["paths"]:
            rows += [(f"{path} ms CPU per step", cpu, res["avx2-only"]["paths"][path][1])]
            rows += [(f"{path} ms wall per step", wall, res["avx2-only"]["paths"][path][0])]
    for label, a, b in rows:
        print(f"{label:44s} {a:10.1f} {b:10.1f} {b / a:7.2f}x")
    for name in envs:
        p = res[name]["paths"]
        if "raw" in p and "framework" in p:
            print(f"{name}: ratio framework/raw per step: {p['framework'][1] / p['raw'][1]:.2f} CPU")
        for path in [k for k in p if "processes" in k and "raw" in p]:
            print(f"{name}: ratio {path}/raw per step: {p[path][0] / p['raw'][0]:.2f} wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
