"""Run every benchmark of the project and write ``benchmarks/RESULTS.md``: each one's printed figures, how it
was run (quick or full flags, exit status, wall time), the machine and the date.

    python benchmarks/report.py                       # every benchmark with its --quick flags
    python benchmarks/report.py --full                # every benchmark with its full flags (long)
    python benchmarks/report.py --full judge_chaos kill_resume   # those two full, the rest quick
    python benchmarks/report.py --only judge_chaos --full judge_chaos   # refresh one section

Each benchmark runs as its own subprocess (``python benchmarks/<name>.py ...``) from the repository root, one
after another (so timings do not compete), with a per-benchmark timeout. Its stdout and stderr are kept
verbatim in the report; a benchmark whose optional dependencies are missing (``hf_step`` needs torch,
transformers and peft) or whose script is absent is listed as skipped, with the reason. The results are also
kept as JSON in a comment at the end of ``RESULTS.md``; with ``--only`` the other benchmarks keep their
previous sections. Exit code 1 when any benchmark that ran failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Bench:
    """One benchmark script: its flags in each mode, optional imports it needs, a timeout."""

    name: str
    what: str
    quick: tuple[str, ...] = ("--quick",)
    full: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    timeout: float = 900.0
    headline: tuple[str, ...] = ()  # regexes of lines worth repeating in the summary table
    script: str = ""  # benchmarks/<script>.py when not <name>.py (the same script with other flags)
    gpu: bool = False  # needs a CUDA GPU: skipped (with the reason) where torch sees none


def long_time_to_accuracy(name: str, path: str, what: str) -> Bench:
    """A 360 s ``time_to_accuracy`` run on rollout path ``path`` (no per-step comparison): time to 0.75 and 0.80."""
    csv = f"{{tmp}}/{name}.csv"
    return Bench(
        name,
        what,
        quick=("--quick", "--path", path, "--csv", csv),
        full=(
            *("--path", path, "--seconds", "360", "--compare-steps", "0", "--experiment-steps", "0"),
            *("--csv", csv),
        ),
        timeout=1800.0,
        headline=(r".*(reached|target|final|best).*",),
        script="time_to_accuracy",
    )


BENCHMARKS: tuple[Bench, ...] = (
    Bench(
        "demo",
        "the default palaestra demo: learned judge arith-rm, strict-verifier validation, test-split table",
        quick=(),  # the default demo in both modes: its figures are the README's
        full=(),
        timeout=900.0,
        headline=(r"^\s+(base|restored best|last step): test.*", r"^stop:.*", r"^demo command: wall.*"),
    ),
    Bench(
        "gather_overhead",
        "gather_trajectory_groups vs raw asyncio.gather; import time",
        headline=(r"^ratio palaestra/raw.*", r"^import palaestra.*"),
    ),
    Bench(
        "embedded_policy",
        "numpy policy train step and generation (torch CPU comparison when installed)",
        quick=("--quick", "--no-server"),
        full=("--no-server",),
        headline=(r".*train step.*", r".*ratio.*"),
    ),
    Bench(
        "server_throughput",
        "chat-completions tokens/s of the embedded server, 64 clients",
        headline=(r"^\s*(in_process|http|http_rollouts|http_light)\s.*", r"^\s*server tokens/s vs raw.*"),
    ),
    Bench(
        "server_abuse",
        "a good client's p50/p99 latency alone and under abuse (big bodies, prompts, disconnects, slow bodies)",
        headline=(
            r"^\s*(alone|big_bodies|many_prompts|disconnects|slow_bodies|heavy_load)\s.*",
            r"^\s*worst p99/alone.*",
        ),
        timeout=600.0,
    ),
    Bench("verifier", "strict verifier scores/s", headline=(r"^strict\s+arith-strict.*", r"^target.*")),
    Bench(
        "judge",
        "RULER group judge: calls and prompt tokens per group vs per-trajectory judging",
        headline=(r"^prefix dedup saves.*",),
    ),
    Bench(
        "time_to_accuracy",
        "verifier-trained GRPO from arith-base: val accuracy vs wall time",
        quick=("--quick", "--csv", "{tmp}/tta.csv"),
        full=("--csv", "{tmp}/tta.csv"),
        timeout=1800.0,
        headline=(r".*(reached|target|final|best).*",),
    ),
    Bench(
        "time_to_accuracy_gc",
        "the per-step comparison of time_to_accuracy without frozen_heap: the full garbage collections it avoids",
        quick=("--quick", "--no-frozen-heap", "--csv", "{tmp}/tta_gc.csv"),
        full=(
            *("--seconds", "0", "--compare-steps", "40", "--experiment-steps", "0", "--no-frozen-heap"),
            *("--csv", "{tmp}/tta_gc.csv"),
        ),
        headline=(r"^ *(raw|framework.*): .*garbage.*",),
        script="time_to_accuracy",
    ),
    Bench(
        "isa_compare",
        "the train step and framework/raw per-step figures again with AVX-512 switched off (an emulation, same machine)",
        full=(),
        timeout=900.0,
        headline=(r"^train step CPU ms, numpy.*", r"^framework ms CPU.*", r"^(native|avx2-only): ratio.*"),
    ),
    long_time_to_accuracy(
        "time_to_accuracy_long",
        "processes",
        "the same GRPO run with its rollouts in 2 worker processes and a 360 s budget: time to 0.75 and 0.80",
    ),
    long_time_to_accuracy(
        "time_to_accuracy_long_raw",
        "raw",
        "time_to_accuracy_long's run with EmbeddedModel.generate called directly (the raw path, no client, server "
        "or gather): what the framework path's time to 0.75 and 0.80 compares with",
    ),
    Bench(
        "time_to_accuracy_calc",
        "GRPO on the multi-turn calculator env from calc-base: val accuracy and tool use vs wall time",
        quick=("--quick", "--csv", "{tmp}/tta_calc.csv"),
        full=("--csv", "{tmp}/tta_calc.csv"),
        timeout=1800.0,
        headline=(r".*(reached|target|final|best).*",),
    ),
    Bench(
        "tool_costs_calc",
        "calculator with a tool cost: tool use on easy vs hard problems before/after, per-turn vs final credit",
        quick=("--quick", "--csv", "{tmp}/tool_costs.csv"),
        full=("--csv", "{tmp}/tool_costs.csv"),
        timeout=900.0,
        headline=(r"^(no cost|cost in final reward|cost per turn|verdict).*",),
    ),
    Bench(
        "hf_step",
        "HF backend (torch + peft): LoRA train step and generation tokens/s",
        needs=("torch", "transformers", "peft"),
        headline=(r".*tok(ens)?/s.*", r".*pick at vocab.*", r".*head memory.*"),
    ),
    Bench(
        "hf_learns",
        "HF path learns: tiny Llama SFT'd on arithmetic to a weak base, then GRPO (LoRA) raises greedy val",
        needs=("torch", "transformers", "peft"),
        timeout=1800.0,
        headline=(r"^hf learns:.*", r"^(sft|grpo): .*(wall|cpu).*"),
    ),
    Bench(
        "hf_learns_cuda",
        "the same HF learning check with its GRPO phase on a CUDA GPU (device auto: bfloat16); SFT stays on CPU",
        quick=("--quick", "--device", "cuda", "--dtype", "auto"),
        full=("--device", "cuda", "--dtype", "auto"),
        needs=("torch", "transformers", "peft"),
        timeout=1800.0,
        headline=(r"^hf learns:.*", r"^(sft|grpo): .*(wall|cpu).*"),
        script="hf_learns",
        gpu=True,
    ),
    Bench(
        "trl_compare",
        "palaestra's framework path vs TRL's GRPOTrainer (own venv, pip install trl): ms per step on the same "
        "model, prompts and settings ((a) a tiny Llama, LoRA; (b) arith-base, its weights as a GPT-2 for TRL)",
        needs=("torch", "transformers", "peft"),
        timeout=1800.0,
        headline=(r"^ratio palaestra/TRL.*", r"^SKIPPED.*"),
    ),
    Bench(
        "report_render",
        "HTML run report: size and render time for a synthetic run",
        quick=("--quick", "--no-browser"),
        full=("--no-browser",),
        headline=(r".*(report|render).*",),
    ),
    Bench(
        "pipeline",
        "pipelined training: steps/s and time to 0.75 greedy val, max_staleness 0 vs 1 (process workers)",
        full=("--staleness", "0", "1", "--worker", "process"),
        timeout=3600.0,
        headline=(r"^\s+[012]\s+\d+\s.*", r"^\s+[012]\s+(-|process\d*|thread)\s+\d.*", r"^speed-up.*"),
    ),
    Bench(
        "judge_chaos",
        "hybrid run with 30% judge faults: every fault counted, no group scored 0",
        headline=(r"^groups dropped.*", r"^RESULT.*"),
    ),
    Bench(
        "kill_resume",
        "SIGKILL palaestra train at random moments and resume: nothing lost",
        timeout=1800.0,
        headline=(r"^final weights.*", r"^kills:.*", r"^RESULT.*"),
    ),
    Bench(
        "stopping_alarm",
        "reward-hacking alarm: false alarms where hacking is impossible, detection delay on hacked runs",
        full=("--demo",),
        timeout=1800.0,
        headline=(r"^simulated: .*", r"^real .*"),
    ),
)


@dataclass
class Outcome:
    """What one benchmark run gave (kept in the report's data comment, so that a partial re-run can merge)."""

    name: str
    mode: str
    date: str = ""
    machine: str = ""
    command: list[str] = field(default_factory=list)
    status: str = "skipped"  # ok | failed (exit N) | timeout | skipped
    reason: str = ""
    seconds: float = 0.0
    output: str = ""

    @property
    def bench(self) -> Bench:
        return next(b for b in BENCHMARKS if b.name == self.name)

    def headlines(self) -> list[str]:
        lines = []
        for pattern in self.bench.headline:
            rx = re.compile(pattern, re.IGNORECASE)
            found = [ln.strip() for ln in self.output.splitlines() if rx.match(ln)]
            lines += found[-2:]
        return list(dict.fromkeys(lines))[:4]


def machine() -> dict[str, str]:
    """CPU model, cores, OS, python, numpy (and torch when installed, and the GPU torch sees)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    import numpy

    info["numpy"] = numpy.__version__
    if importlib.util.find_spec("torch") is not None:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in info.items())


def run_one(bench: Bench, mode: str, tmp: Path, info: dict[str, str]) -> Outcome:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = Outcome(bench.name, mode, date=now, machine=machine_line(info))
    script = HERE / f"{bench.script or bench.name}.py"
    if not script.exists():
        out.reason = f"benchmarks/{script.name} is not in this checkout"
        return out
    missing = [m for m in bench.needs if importlib.util.find_spec(m) is None]
    if missing:
        out.reason = f"optional dependencies not installed: {', '.join(missing)}"
        return out
    if bench.gpu and not _has_cuda():
        out.reason = "needs a CUDA GPU; torch sees none here"
        return out
    flags = bench.quick if mode == "quick" else bench.full
    out.command = ["python", str(script.relative_to(ROOT)), *(f.format(tmp=tmp) for f in flags)]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    }
    load = f" (load average at start {os.getloadavg()[0]:.2f})" if hasattr(os, "getloadavg") else ""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *out.command[1:]],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=bench.timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out.seconds = time.perf_counter() - t0
        out.status = "timeout"
        out.reason = f"killed after {bench.timeout:.0f} s"
        out.output = _text(exc.stdout) + _text(exc.stderr)
        return out
    out.seconds = time.perf_counter() - t0
    out.status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    out.output = done.stdout + (("\n[stderr]\n" + done.stderr) if done.stderr.strip() else "")
    out.reason = load.strip(" ()")
    return out


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def render(outcomes: Sequence[Outcome], info: dict[str, str]) -> str:
    dates = sorted(o.date for o in outcomes if o.date)
    span = dates[0] if dates and dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}" if dates else "-"
    lines = [
        "# Benchmark results",
        "",
        f"Written by `python benchmarks/report.py` ({span}). Each section is the benchmark's own printed output, "
        "verbatim. `quick` = the script's `--quick` smoke flags (small sizes, seconds); `full` = its default "
        "flags. Figures are only comparable on the same machine; a section run on another machine than the "
        "one below says so.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        "",
        "## Summary",
        "",
        "| benchmark | mode | status | seconds | date | headline |",
        "|---|---|---|---:|---|---|",
    ]
    for o in outcomes:
        head = "<br>".join(h.replace("|", "\\|") for h in o.headlines())
        if o.status == "skipped":
            head = o.reason.replace("|", "\\|")
        lines.append(
            f"| [{o.name}](#{o.name.replace('_', '-')}) | {o.mode} | {o.status} | {o.seconds:.1f} | {o.date} | "
            f"{head} |"
        )
    here = machine_line(info)
    for o in outcomes:
        lines += ["", f"## {o.name.replace('_', '-')}", "", f"{o.bench.what}.", ""]
        if o.status == "skipped":
            lines.append(f"Skipped: {o.reason}.")
            continue
        where = "" if o.machine == here else f"; machine: {o.machine}"
        lines += [
            f"`{' '.join(o.command)}` ({o.mode}, {o.status}, {o.seconds:.1f} s, {o.date}"
            f"{', ' + o.reason if o.reason else ''}{where})",
            "",
            "```text",
            o.output.rstrip()[-12000:] or "(no output)",
            "```",
        ]
    return "\n".join(lines) + "\n"


DATA_MARK = "<!-- report.py data: "


def load_previous(path: Path) -> dict[str, Outcome]:
    """Outcomes of an earlier run (the JSON comment at the end of the report), by benchmark name; empty when
    absent or unreadable."""
    import json

    try:
        text = path.read_text()
        raw = text[text.rindex(DATA_MARK) + len(DATA_MARK) : text.rindex(" -->")]
        rows = json.loads(raw)["outcomes"]
        known = {b.name for b in BENCHMARKS}
        return {r["name"]: Outcome(**r) for r in rows if r.get("name") in known}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--full",
        nargs="*",
        default=None,
        metavar="NAME",
        help="full flags: for every benchmark (no names) or only for the named ones",
    )
    ap.add_argument("--quick", action="store_true", help="quick flags for every benchmark (the default)")
    ap.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these; the other sections keep their last results"
    )
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="the markdown report to write")
    args = ap.parse_args(argv)
    names = [b.name for b in BENCHMARKS]
    for name in (args.only or []) + (args.full or []):
        if name not in names:
            ap.error(f"unknown benchmark {name!r}; known: {', '.join(names)}")
    if args.quick and args.full is not None:
        ap.error("--quick and --full exclude each other")
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    full = set(names) if args.full == [] else set(args.full or [])

    import json
    from dataclasses import asdict

    from palaestra.trajectories.io import atomic_write_text

    info = machine()
    results = load_previous(args.out) if args.only else {}
    with tempfile.TemporaryDirectory(prefix="palaestra-bench-") as tmp:
        for bench in chosen:
            mode = "full" if bench.name in full else "quick"
            print(f"[{bench.name}] {mode} ...", end=" ", flush=True)
            outcome = run_one(bench, mode, Path(tmp), info)
            print(f"{outcome.status} ({outcome.seconds:.1f} s) {outcome.reason}".rstrip(), flush=True)
            results[bench.name] = outcome
    ordered = [results[n] for n in names if n in results]
    data = json.dumps({"outcomes": [asdict(o) for o in ordered]}).replace(
        "--", "-\\u002d"
    )  # "--" ends a comment
    atomic_write_text(args.out, render(ordered, info) + f"\n{DATA_MARK}{data} -->\n")
    print(f"wrote {args.out}")
    ran = {b.name for b in chosen}
    return 1 if any(o.status not in ("ok", "skipped") for o in ordered if o.name in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
