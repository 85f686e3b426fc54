"""CLI subcommands of the measurement harness: eval, inspect, select, gate, validate-scorer.

Heavy imports stay inside the command functions. Exit codes: 0 success (gate: PROMOTE; validate-scorer: no
mismatch), 1 gate REJECT / validate-scorer mismatches, 2 unusable input (``DataError`` or ``ValueError``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["register"]


def _fail(command: str, exc: Exception) -> int:
    print(f"palaestra {command}: error: {exc}", file=sys.stderr)
    return 2


def _cmd_eval(args: argparse.Namespace) -> int:
    from palaestra.evals import evaluate

    if (args.completions is None) == (args.model is None):
        return _fail(
            "eval", ValueError("give exactly one of --completions (frozen) or --model (live sampling)")
        )
    try:
        if args.completions is not None:
            run = evaluate.evaluate_completions(
                args.dataset, args.completions, args.outdir, scorer=args.scorer, knob=args.knob
            )
        else:
            import asyncio

            run = asyncio.run(
                evaluate.evaluate_model(
                    args.dataset,
                    args.model,
                    args.outdir,
                    samples=args.samples,
                    temperature=args.temperature,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    scorer=args.scorer,
                    base_url=args.base_url,
                    concurrency=args.concurrency,
                    knob=args.knob,
                    progress=sys.stderr.isatty(),
                )
            )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        return _fail("eval", exc)
    except Exception as exc:  # a failed sampling request (GatherError): report, no traceback
        if type(exc).__name__ != "GatherError":
            raise
        return _fail("eval", RuntimeError(str(exc).splitlines()[0]))
    s = run.summary
    print(
        f"eval: n={s['n']} pass_rate={s['pass_rate']:.4f} mean_reward={s['mean_reward']:.4f} "
        f"suspect={s['suspect']} -> {run.outdir}"
    )
    print("  by category: " + ", ".join(f"{k} {v}" for k, v in s["counts_by_category"].items()))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from palaestra.evals.inspect import inspect_run

    if args.run and args.run_opt and args.run != args.run_opt:
        return _fail("inspect", ValueError(f"two runs given: {args.run} and --run {args.run_opt}"))
    args.run = args.run or args.run_opt
    if not args.run:
        return _fail("inspect", ValueError("give the run folder: palaestra inspect RUN"))
    try:
        text = inspect_run(args.run, only_fails=args.only_fails, top_k=args.top_k, show=args.show)
    except ValueError as exc:
        return _fail("inspect", exc)
    sys.stdout.write(text)
    return 0


def _cmd_select(args: argparse.Namespace) -> int:
    from palaestra.evals.select import select_best

    try:
        run = select_best(
            args.dataset,
            args.samples,
            args.outdir,
            n=args.n,
            scorer=args.scorer,
            selector=args.selector,
            knob=args.knob,
        )
    except ValueError as exc:
        return _fail("select", exc)
    s = run.summary
    at_n = f" pass@{s['N']}={s['pass@N']:.4f}" if s["N"] > 1 else ""
    print(
        f"select: ids={s['n_ids']} N={s['N']} pass@1={s['pass@1']:.4f}{at_n} "
        f"best-of-N pass_rate={s['pass_rate']:.4f} -> {run.outdir}"
    )
    return 0


def _cmd_gate(args: argparse.Namespace) -> int:
    from palaestra.evals.gate import format_gate, gate

    try:
        result = gate(args.baseline, args.candidate, args.min_delta, args.metric)
    except ValueError as exc:
        return _fail("gate", exc)
    print(format_gate(result, args.baseline, args.candidate))
    return result.exit_code


def _cmd_validate(args: argparse.Namespace) -> int:
    from palaestra.evals.scorers import get_scorer
    from palaestra.evals.validate import validate_scorer

    try:
        verifier = get_scorer(args.scorer)
        dataset = None
        if args.dataset:
            from palaestra.evals.evaluate import load_dataset

            dataset = load_dataset(args.dataset).by_id()
        report = validate_scorer(verifier, args.golden, dataset=dataset, outcome_field=args.outcome_field)
    except ValueError as exc:
        return _fail("validate-scorer", exc)
    print(report.format())
    return 0 if report.ok else 1


def _add_common(p: argparse.ArgumentParser, scorer_help: str) -> None:
    p.add_argument("--scorer", default="arith-strict", help=scorer_help)
    p.add_argument("--knob", default=None, help="what this run changed (for the README run note)")


def register(sub: Any) -> None:
    """Add the harness subcommands to the CLI's subparsers."""
    scorer_help = (
        "verifier name (arith-strict, arith-naive-TEACHING-ONLY) or module:attr (default arith-strict)"
    )

    p = sub.add_parser("eval", help="Loop A: score frozen completions (or live samples of a model)")
    p.add_argument("--dataset", required=True, help="dataset JSONL {id, prompt, expected_answer}")
    p.add_argument("--completions", default=None, help="completions JSONL {id, completion, sample?}")
    p.add_argument(
        "--model", default=None, help="sample live: embedded model name or .npz path (or remote name)"
    )
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for --model (key from env)")
    p.add_argument("--samples", type=int, default=1, help="samples per example with --model (default 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="run seed for live sampling (default 0)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent requests when sampling")
    p.add_argument("--outdir", required=True)
    _add_common(p, scorer_help)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser(
        "inspect", help="failures of a run grouped by taxonomy category and outcome, with examples"
    )
    p.add_argument("run", nargs="?", help="run folder (eval or select), as for show and report")
    p.add_argument("--run", dest="run_opt", metavar="RUN", help="the same, as an option (older spelling)")
    p.add_argument("--only-fails", action="store_true", help="leave accepted results out")
    p.add_argument("--top-k", type=int, default=5, help="outcomes to list (most frequent first)")
    p.add_argument("--show", type=int, default=2, help="examples per outcome and per category")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("select", help="Loop B: best-of-N over samples; pass@1 and pass@N")
    p.add_argument("--dataset", required=True)
    p.add_argument("--samples", required=True, help="samples JSONL {id, completion, sum_logprob?, sample?}")
    p.add_argument("--n", type=int, required=True, help="use the first N samples per id")
    p.add_argument("--selector", default=None, help="verifier that ranks the samples (default: the scorer)")
    p.add_argument("--outdir", required=True)
    _add_common(p, scorer_help)
    p.set_defaults(func=_cmd_select)

    p = sub.add_parser("gate", help="PROMOTE or REJECT a candidate run against a baseline (Locked Room)")
    p.add_argument("--baseline", required=True, help="baseline run folder")
    p.add_argument("--candidate", required=True, help="candidate run folder")
    p.add_argument(
        "--min-delta", type=float, required=True, help="smallest improvement of the metric to promote"
    )
    p.add_argument("--metric", default="pass_rate", help="summary.json key to compare (default pass_rate)")
    p.set_defaults(func=_cmd_gate)

    p = sub.add_parser("validate-scorer", help="run a scorer on golden sets; non-zero exit on any mismatch")
    p.add_argument("--dataset", default=None, help="dataset JSONL supplying prompt/expected_answer by id")
    p.add_argument(
        "--golden", action="append", default=None, help="golden JSONL (repeatable; default: the shipped sets)"
    )
    p.add_argument("--scorer", default="arith-strict", help=scorer_help)
    p.add_argument(
        "--outcome-field", default=None, help="golden field the outcome must equal, e.g. strict_outcome"
    )
    p.set_defaults(func=_cmd_validate)
