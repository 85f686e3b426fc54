"""Judge chaos run: a hybrid experiment whose RULER judge endpoint injects faults into 30% of its replies.

    python benchmarks/judge_chaos.py [--steps 100] [--fault-rate 0.3] [--model arith-base] [--quick]

The judge endpoint is a real HTTP server on 127.0.0.1 (``palaestra.testing.ScriptedServer``) playing
``chaos_script``: each request is, with probability ``--fault-rate``, one of HTTP 500, 429 with Retry-After,
a reply slower than the judge timeout, non-JSON text, missing / duplicate / unknown candidate ids, an
out-of-range or NaN score, or a harmless oddity (reordered entries, a fenced code block); otherwise a good
reply. Good replies score like a judge that knows arithmetic (about 0.9 for a correct answer, 0.1 otherwise),
so the policy can learn through the faults. The experiment (``palaestra.Experiment``, reward kind "judge")
trains the policy for ``--steps`` steps (stopping rules other than the step cap are off).

Printed figures: wall time; judge requests; faults served by kind and the counts the run recorded in
``history.jsonl`` and ``summary.json`` (they must match); groups dropped (never scored 0, never trained on)
and their fraction; saved trajectories whose reward is not the judge's score (must be 0); validation accuracy
at the start and the end. Exit code 1 if any check fails. Unless ``--no-baseline``, the same run without
faults follows, for comparison. ``--quick``: 10 steps of a tiny random model, no baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from palaestra.judges.faults import CHAOS_KINDS, EXPECTED_FAULT, chaos_script
from palaestra.testing import ScriptedServer
from palaestra.trainer.builders import build_reward
from palaestra.trainer.expconfig import config_from_dict
from palaestra.trainer.experiment import Experiment
from palaestra.trajectories.io import read_groups, read_jsonl

HARMLESS = {"good", "reordered", "code_fenced", "prose_wrapped"}


def tiny_model(path: Path) -> str:
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    tok = Tokenizer.default()
    TinyGPT(
        GPTConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64), tokenizer=tok, seed=0
    ).save(path)
    return str(path)


def knowing_chaos_script(args: argparse.Namespace) -> Any:
    """``chaos_script`` whose good replies score like a judge that knows arithmetic: about 0.9 for the strict
    verifier's correct answer, 0.1 otherwise (plus a small content-derived jitter, so scores stay relative)."""
    from palaestra.envs.verifier import get_verifier
    from palaestra.judges.faults import content_score
    from palaestra.judges.prompt import parse_request

    strict = get_verifier("arith-strict")
    local = threading.local()

    def score(messages: list[dict[str, Any]]) -> float:
        convo = [*getattr(local, "context", []), *messages]
        prompt = next((m.get("content") for m in convo if m.get("role") == "user"), "") or ""
        found = re.search(r"What is (\d+)([+-])(\d+)\?", str(prompt))
        answer = next((m.get("content") for m in reversed(convo) if m.get("role") == "assistant"), "") or ""
        expected = None
        if found:
            a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
            expected = str(a + b if op == "+" else a - b)
        right = (
            expected is not None and strict.score({"expected_answer": expected}, str(answer)).reward == 1.0
        )
        return (0.85 if right else 0.1) + 0.05 * content_score(messages)

    inner = chaos_script(
        args.fault_rate,
        seed=args.seed,
        kinds=(*CHAOS_KINDS, "slow"),
        score_fn=score,
        retry_after=args.backoff,
        delay=args.timeout * 2.5,
    )

    def script(request: dict[str, Any], n: int) -> Any:
        try:
            local.context = parse_request(request).context
        except ValueError:
            local.context = []
        return inner(request, n)

    script.counts = inner.counts  # type: ignore[attr-defined]
    return script


def experiment_config(args: argparse.Namespace, out: Path, base_url: str) -> dict[str, Any]:
    return {
        "run": {
            "name": "judge-chaos",
            "seed": args.seed,
            "output_dir": str(out),
            "groups_per_step": args.groups,
            "group_size": args.group_size,
            "max_steps": args.steps,
            "samples_per_step": args.groups * args.group_size,
            "progress": False,
        },
        "model": {"name": args.model},
        "env": {"max_tokens": 12},
        "reward": {
            "kind": "judge",
            "judge_model": "chaos-judge",
            "judge_base_url": base_url,
            "judge_api_key_env": "PALAESTRA_BENCH_UNSET_KEY",
            "judge_timeout": args.timeout,
            "judge_max_retries": args.retries,
        },
        "validation": {"every": max(1, args.steps // 4), "max_examples": args.val_examples, "sampled": False},
        "stopping": {"patience": 10_000, "hacking_window": None, "collapse_window": None},  # run every step
    }


async def run_and_close(exp: Experiment, judge: Any) -> dict[str, Any]:
    """Run the experiment, then close the judge's HTTP client on the same event loop (the experiment does
    not, and a client left open is closed at garbage collection, on a loop that is gone)."""
    try:
        return await exp.run()
    finally:
        client = getattr(judge, "_client", None)
        if client is not None:
            await client.close()


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / "run"
    script = knowing_chaos_script(args)
    t0 = time.perf_counter()
    with ScriptedServer(script) as server:
        cfg = experiment_config(args, out, server.base_url)
        judge = build_reward(config_from_dict(cfg), out)
        judge.backoff = args.backoff  # no config knob for the judge's backoff (RulerJudge default 0.5 s)
        summary = asyncio.run(run_and_close(Experiment(cfg, reward=judge, printer=None), judge))
        requests = server.calls
    wall = time.perf_counter() - t0

    served: Counter[str] = script.counts  # type: ignore[attr-defined]
    expected: Counter[str] = Counter()
    for kind, n in served.items():
        if kind not in HARMLESS:
            expected[EXPECTED_FAULT[kind]] += n
    rows = read_jsonl(out / "history.jsonl")[1:]
    in_history: Counter[str] = Counter()
    for r in rows:
        for k, v in r.items():
            if k.startswith("judge/fault_"):
                in_history[k.removeprefix("judge/fault_")] += int(v)
    saved = json.loads((out / "summary.json").read_text())
    in_summary = Counter(
        {k.removeprefix("fault_"): int(v) for k, v in saved["judge_usage"].items() if k.startswith("fault_")}
    )
    not_judge_score = zero = trained_groups = 0
    for r in rows:
        for g in read_groups(out / "samples" / f"step_{r['step']:06d}.jsonl"):
            trained_groups += 1
            for t in g.trajectories:
                not_judge_score += t.reward != t.metrics.get("judge_score")
                zero += t.reward == 0.0
    dropped = int(saved["faults"].get("groups_dropped", 0))
    total = int(saved["faults"].get("groups_total", 0))
    checks = {
        "completed all steps": summary["steps"] == args.steps,
        "faults in history == served": in_history == expected,
        "faults in summary == served": in_summary == expected,
        "judge requests in history == served": sum(r.get("judge/calls", 0) for r in rows) == requests,
        "dropped == judge unscored": dropped == judge.usage.unscored,
        "trained groups == total - dropped": trained_groups == total - dropped,
        "every reward is the judge's score": not_judge_score == 0,
    }
    return {
        "benchmark": "judge_chaos",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "steps": summary["steps"],
        "groups_per_step": args.groups,
        "group_size": args.group_size,
        "model": Path(args.model).name,
        "fault_rate": args.fault_rate,
        "wall_seconds": wall,
        "judge_requests": requests,
        "served": dict(served),
        "faults_served": dict(expected),
        "faults_history": dict(in_history),
        "faults_summary": dict(in_summary),
        "fault_fraction": sum(expected.values()) / max(1, requests),
        "groups_dropped": dropped,
        "groups_total": total,
        "groups_dropped_fraction": saved["groups_dropped_fraction"],
        "zero_rewards_saved": zero,
        "rewards_not_judge_score": not_judge_score,
        "val_start": saved["base_val"].get("greedy_accuracy"),
        "val_end": rows[-1].get("val/greedy_accuracy") if rows else None,
        "checks": checks,
        "ok": all(checks.values()),
    }


def print_report(rep: dict[str, Any]) -> None:
    print(f"# judge chaos  {rep['date']}  {rep['machine']}")
    print(
        f"run: {rep['steps']} steps x {rep['groups_per_step']} groups x {rep['group_size']} rollouts, "
        f"model {rep['model']}, fault rate {rep['fault_rate']:.0%}, wall {rep['wall_seconds']:.1f}s"
    )
    print(f"judge requests: {rep['judge_requests']}  (faults: {rep['fault_fraction']:.1%} of requests)")
    print(f"{'fault':<16}{'served':>8}{'history':>9}{'summary':>9}")
    for kind in sorted(set(rep["faults_served"]) | set(rep["faults_history"])):
        print(
            f"{kind:<16}{rep['faults_served'].get(kind, 0):>8}{rep['faults_history'].get(kind, 0):>9}"
            f"{rep['faults_summary'].get(kind, 0):>9}"
        )
    print(
        f"groups dropped: {rep['groups_dropped']} of {rep['groups_total']} "
        f"({rep['groups_dropped_fraction']:.1%}); rewards that are not the judge's score: "
        f"{rep['rewards_not_judge_score']}; crashes: 0"
    )
    if rep["val_start"] is not None:
        print(f"val greedy accuracy: {rep['val_start']:.3f} -> {rep['val_end']:.3f}")
    if "baseline" in rep:
        b = rep["baseline"]
        print(
            f"same run without faults: val {b['val_start']:.3f} -> {b['val_end']:.3f}, "
            f"{b['judge_requests']} judge requests, wall {b['wall_seconds']:.1f}s"
        )
    for name, ok in rep["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print("RESULT: " + ("ok" if rep["ok"] else "FAILED"))


def main(argv: Sequence[str] | None = None) -> int:
    logging.getLogger("palaestra.judges").setLevel(
        logging.ERROR
    )  # one warning per dropped group: counted below
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--groups", type=int, default=16, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--fault-rate", type=float, default=0.3)
    ap.add_argument(
        "--retries", type=int, default=2, help="judge retries per group (reward.judge_max_retries)"
    )
    ap.add_argument("--timeout", type=float, default=0.4, help="judge timeout, seconds")
    ap.add_argument("--backoff", type=float, default=0.02, help="judge backoff and Retry-After, seconds")
    ap.add_argument("--model", default="arith-base")
    ap.add_argument("--val-examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="10 steps, 2x4 rollouts, a tiny random model")
    ap.add_argument("--no-baseline", action="store_true", help="skip the same run without faults")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="palaestra-judge-chaos-") as tmp:
        if args.quick:
            args.steps, args.groups, args.group_size, args.val_examples = 10, 2, 4, 10
            args.model = tiny_model(Path(tmp) / "tiny.npz")
            args.no_baseline = True
        rep = run(args, Path(tmp) / "chaos")
        if not args.no_baseline:  # the same run, no faults: what the faults cost in learning
            clean = run(argparse.Namespace(**{**vars(args), "fault_rate": 0.0}), Path(tmp) / "clean")
            rep["baseline"] = {
                k: clean[k] for k in ("wall_seconds", "judge_requests", "val_start", "val_end")
            }
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
