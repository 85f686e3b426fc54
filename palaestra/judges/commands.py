"""``palaestra judge-audit``: audit a judge on trajectory groups from a JSONL file and gate on the result.
Exit status: 0 when every configured gate passes, 1 when one fails, 2 on bad input."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
from pathlib import Path
from typing import Any

# free at CLI start-up: importing this module has already imported the palaestra.judges package
from palaestra.judges.audit import DEFAULT_GATES, audit_judge, prior_reward, strip_padding
from palaestra.judges.base import JudgeConfigError, trajectory_key
from palaestra.judges.prompt import DEFAULT_RUBRIC
from palaestra.judges.ruler import RulerJudge
from palaestra.judges.simulated import SimulatedJudge
from palaestra.trajectories.io import DataError, read_groups
from palaestra.trajectories.scripted_server import ScriptedServer

SIM_KNOBS = ("noise", "position_bias", "length_bias", "format_bias", "quantize")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``judge-audit`` subcommand."""
    p = sub.add_parser(
        "judge-audit",
        help="measure a group judge (stability, order and length bias, gold agreement, protocol health)",
        description="Run a judge on groups from a JSONL file (one TrajectoryGroup per line) and write a JSON "
        "report; exits 1 when a configured gate fails.",
    )
    p.add_argument("--groups", required=True, help="JSONL file of trajectory groups (palaestra write_groups)")
    p.add_argument("--out", required=True, help="where to write the JSON report")
    p.add_argument("--judge-model", help="judge model name at the endpoint")
    p.add_argument("--judge-base-url", help="OpenAI-compatible base URL of the judge")
    p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable with the key")
    p.add_argument("--rubric-file", help="text file with the grading standards (default: built-in rubric)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--judge-timeout", type=float, default=60.0, help="deadline of one whole judge call (s)")
    p.add_argument("--judge-max-retries", type=int, default=3)
    sim_help = "a simulated judge whose gold is the file's rewards"
    p.add_argument("--simulated", action="store_true", help=sim_help)
    http_help = "with --simulated: audit the real RulerJudge on it (HTTP)"
    p.add_argument("--simulated-http", action="store_true", help=http_help)
    for knob in SIM_KNOBS[:-1]:  # the simulated judge's defects, e.g. --sim-position-bias 0.3
        p.add_argument(f"--sim-{knob.replace('_', '-')}", type=float, default=0.0)
    p.add_argument("--sim-quantize", type=int, default=None)
    gold_help = "gold for the agreement measure: the rewards in the file (default) or none"
    p.add_argument("--gold", choices=("reward", "none"), default="reward", help=gold_help)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--permutations", type=int, default=3)
    p.add_argument("--no-padding", action="store_true", help="skip the padded-answer test")
    p.add_argument("--max-groups", type=int, default=None, help="audit only the first N groups")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    gate_help = "a pass/fail gate, e.g. order_tau_min=0.7 (repeatable); 'default' adds all defaults"
    p.add_argument("--gate", action="append", default=[], metavar="NAME=VALUE", help=gate_help)
    p.set_defaults(func=run_judge_audit)


def parse_gates(items: list[str]) -> dict[str, float]:
    """``["default", "order_tau_min=0.8"]`` -> gate thresholds (later items win)."""
    gates: dict[str, float] = {}
    for item in items:
        if item == "default":
            gates.update(DEFAULT_GATES)
            continue
        name, sep, value = item.partition("=")
        if not sep or name not in DEFAULT_GATES:
            raise DataError(
                f"--gate {item!r}: expected NAME=VALUE with NAME one of {', '.join(DEFAULT_GATES)}"
            )
        try:
            gates[name] = float(value)
        except ValueError:
            raise DataError(f"--gate {item!r}: {value!r} is not a number") from None
    return gates


def _simulated(args: argparse.Namespace, groups: list[Any]) -> Any:
    table = {trajectory_key(t.messages(), t.tools): prior_reward(t) for g in groups for t in g.trajectories}

    def file_reward(traj: Any, example: Any = None) -> float:
        return table.get(trajectory_key(strip_padding(traj.messages()), traj.tools), prior_reward(traj))

    return SimulatedJudge(file_reward, seed=args.seed, **{k: getattr(args, f"sim_{k}") for k in SIM_KNOBS})


def run_judge_audit(args: argparse.Namespace) -> int:
    """Body of ``palaestra judge-audit``."""
    gates = parse_gates(args.gate)
    # (``--concurrency 0`` would wait forever; ``--sim-quantize`` is the number of score levels)
    least = {"repeats": 1, "permutations": 2, "concurrency": 1, "max_groups": 1, "judge_max_retries": 0}
    for name, low in {**least, "sim_quantize": 2}.items():
        if (value := getattr(args, name)) is not None and value < low:
            raise DataError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if not (args.judge_timeout > 0 and math.isfinite(args.judge_timeout)):
        raise DataError(f"--judge-timeout must be a finite number of seconds > 0, got {args.judge_timeout}")
    groups = read_groups(args.groups)[: args.max_groups]  # None: all of them
    if not groups:
        raise DataError("no groups to audit", path=args.groups)
    rubric = DEFAULT_RUBRIC
    if args.rubric_file:
        path = Path(args.rubric_file)
        if not path.exists():
            raise DataError("rubric file not found", path=path)
        rubric = path.read_text(encoding="utf-8")
    ruler: dict[str, Any] = {"api_key_env": args.judge_api_key_env, "rubric": rubric, "seed": args.seed}
    ruler.update(temperature=args.temperature, max_retries=args.judge_max_retries, timeout=args.judge_timeout)
    if not args.simulated and not args.judge_model:
        raise DataError("give --judge-model (and usually --judge-base-url), or --simulated")

    async def run(judge: Any) -> Any:
        try:
            opts: dict[str, Any] = {k: getattr(args, k) for k in ("repeats", "permutations", "seed")}
            opts.update(gold=None if args.gold == "none" else "reward", padding=not args.no_padding)
            return await audit_judge(judge, groups, gates=gates, max_concurrency=args.concurrency, **opts)
        finally:
            await judge.aclose()  # the HTTP client (and any cache) this command's judge opened

    try:
        with contextlib.ExitStack() as stack:
            judge: Any
            if args.simulated and not args.simulated_http:
                judge = _simulated(args, groups)
            else:
                base_url, model = args.judge_base_url, args.judge_model
                if args.simulated:
                    server = stack.enter_context(ScriptedServer(_simulated(args, groups).as_script()))
                    base_url, model = server.base_url, "simulated"
                judge = RulerJudge(model, base_url=base_url, **ruler)  # JudgeConfigError now: no key
            report = asyncio.run(run(judge))
    except JudgeConfigError as exc:
        print(f"palaestra judge-audit: error: {exc}", file=sys.stderr)
        return 2
    report.write(args.out)
    _print_summary(report, args.out)
    return 0 if report.passed else 1


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def _print_summary(report: Any, out: str) -> None:
    proto = report.protocol
    lines = [
        f"judge {report.judge.get('kind')}:{report.judge.get('model')} on {report.groups} groups "
        f"({proto['calls']} calls, {proto['prompt_tokens']} prompt tokens)",
        f"  repeat tau {_fmt(report.repeat['kendall_tau'])}   "
        f"order tau {_fmt(report.order['kendall_tau'])}   "
        f"top-1 {_fmt(report.order['top1_stability'])}   slot spread {_fmt(report.order['slot_spread'])}",
        f"  padded preference {_fmt(report.padding['padded_preference'])}   "
        f"pair accuracy {_fmt((report.gold or {}).get('pair_accuracy'))}   "
        f"malformed rate {_fmt(proto['malformed_rate'])}   unscored rate {_fmt(proto['unscored_rate'])}",
    ]
    for g in report.gates:
        status = {True: "pass", False: "FAIL", None: "not measured"}[g["passed"]]
        lines.append(f"  gate {g['name']} {g['threshold']}: {_fmt(g['value'])} {status}")
    lines.append(f"report: {out}  ->  {'PASSED' if report.passed else 'FAILED'}")
    print("\n".join(lines), file=sys.stdout)
