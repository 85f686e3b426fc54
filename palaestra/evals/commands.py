"""CLI subcommands of the measurement harness (eval, inspect, select, gate, validate-scorer) and of watching
runs (show, report). Exit codes: 0 success (gate: PROMOTE), 1 gate REJECT or validate-scorer mismatches,
2 unusable input (named file:line or flag)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

from palaestra.evals import evaluate, show
from palaestra.evals.inputs import get_scorer, load_dataset, validate_scorer
from palaestra.evals.manifest import format_gate, gate
from palaestra.evals.report import write_report
from palaestra.evals.runs import SOURCES, load_run
from palaestra.trajectories.gather import GatherError
from palaestra.trajectories.io import DataError
from palaestra.trajectories.runs import add_options, args_of

Command = Callable[[argparse.Namespace], int]


def _guarded(name: str, command: Command) -> Command:
    """``command``, with unusable input (and a failed sampling request) reported on stderr as exit code 2; a
    DataError goes on to ``cli.main``, which shows its traceback under ``PALAESTRA_TRACEBACK=1``."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except DataError:
            raise
        except (ValueError, KeyError, FileNotFoundError) as exc:
            error = str(exc)
        except GatherError as exc:  # a failed sampling request: its first line, no traceback
            error = str(exc).splitlines()[0]
        print(f"palaestra {name}: error: {error}", file=sys.stderr)
        return 2

    return run


_EVAL_FLAGS = ("samples", "temperature", "max_tokens", "seed", "scorer", "base_url", "concurrency", "knob")


def _cmd_eval(args: argparse.Namespace) -> int:
    if (args.completions is None) == (args.model is None):
        raise ValueError("give exactly one of --completions (frozen) or --model (live sampling)")
    if args.completions is not None:
        run = evaluate.evaluate_completions(
            args.dataset, args.completions, args.outdir, scorer=args.scorer, knob=args.knob
        )
    else:
        live = evaluate.evaluate_model(
            args.dataset, args.model, args.outdir, progress=sys.stderr.isatty(), **args_of(args, *_EVAL_FLAGS)
        )
        run = asyncio.run(live)
    s = run.summary
    print(
        f"eval: n={s['n']} pass_rate={s['pass_rate']:.4f} mean_reward={s['mean_reward']:.4f} "
        f"suspect={s['suspect']} -> {run.outdir}"
    )
    print("  by category: " + ", ".join(f"{k} {v}" for k, v in s["counts_by_category"].items()))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.run and args.run_opt and args.run != args.run_opt:
        raise ValueError(f"two runs given: {args.run} and --run {args.run_opt}")
    if not (args.run or args.run_opt):
        raise ValueError("give the run folder: palaestra inspect RUN")
    run = args.run or args.run_opt
    sys.stdout.write(show.inspect_run(run, **args_of(args, "only_fails", "top_k", "show")))
    return 0


def _cmd_select(args: argparse.Namespace) -> int:
    flags = args_of(args, "n", "scorer", "selector", "knob")
    run = evaluate.select_best(args.dataset, args.samples, args.outdir, **flags)
    s = run.summary
    at_n = f" pass@{s['N']}={s['pass@N']:.4f}" if s["N"] > 1 else ""
    print(
        f"select: ids={s['n_ids']} N={s['N']} pass@1={s['pass@1']:.4f}{at_n} "
        f"best-of-N pass_rate={s['pass_rate']:.4f} -> {run.outdir}"
    )
    return 0


def _cmd_gate(args: argparse.Namespace) -> int:
    result = gate(args.baseline, args.candidate, args.min_delta, args.metric)
    print(format_gate(result, args.baseline, args.candidate))
    return result.exit_code


def _cmd_validate(args: argparse.Namespace) -> int:
    verifier = get_scorer(args.scorer)
    dataset = load_dataset(args.dataset).by_id() if args.dataset else None
    report = validate_scorer(verifier, args.golden, dataset=dataset, outcome_field=args.outcome_field)
    print(report.format())
    return 0 if report.ok else 1


def _cmd_show(args: argparse.Namespace) -> int:
    """Print the rollouts of a run folder (train, eval, select or lab): messages, tool calls, reward, outcome,
    taxonomy category, advantage when stored. Invisible characters show as escapes."""
    view = load_run(args.run)
    steps = show.parse_steps(args.step, view) if args.step is not None else None
    filters: dict[str, Any] = {"outcomes": args.outcome, "categories": args.category}
    if args.diff is not None:
        a, b = (show.parse_steps(x, view) for x in args.diff)
        if len(a) != 1 or len(b) != 1:
            raise ValueError("--diff takes two single steps, e.g. --diff 0 last")
        source = args.source[0] if args.source else None
        sys.stdout.write(show.format_diff(view, a[0], b[0], source=source, limit=args.limit, **filters))
        return 0
    order = "top" if args.top is not None else "bottom" if args.bottom is not None else "file"
    filters.update(example_id=args.id, order=order, k=args.top or args.bottom)
    if args.json:
        rows = show.select(view.rollouts(steps=steps, sources=args.source), **filters)
        sys.stdout.write(show.json_lines(rows if args.limit <= 0 else rows[: args.limit]))
        return 0
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    flags = args_of(args, "limit", "max_chars")
    sys.stdout.write(show.show_text(view, steps=steps, sources=args.source, color=color, **flags, **filters))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    """Write one HTML file (no server, no network) with the run's locked-room facts, curves, outcome/category
    breakdown per step and a rollout browser with the filters of 'palaestra show'."""
    path = write_report(args.run, args.out, **args_of(args, "max_rollouts", "max_chars", "page_size"))
    print(f"report: {path} ({path.stat().st_size / 1024:.0f} KiB; open it in a browser, no server needed)")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


SCORER_HELP = "verifier name (arith-strict, arith-naive-TEACHING-ONLY) or module:attr (default arith-strict)"


def register(sub: Any) -> None:
    """Add the harness and run-watching subcommands to the CLI's subparsers."""

    def add(name: str, command: Command, help: str, run: str | None = None) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=command.__doc__)
        p.set_defaults(func=_guarded(name, command))
        if run is not None:  # the run folder, as a positional argument
            p.add_argument("run", help=run)
        return p

    def loop(name: str, command: Command, help: str) -> argparse.ArgumentParser:  # Loop A or B
        p = add(name, command, help)
        p.add_argument("--dataset", required=True, help="dataset JSONL {id, prompt, expected_answer}")
        p.add_argument("--outdir", required=True)
        p.add_argument("--scorer", default="arith-strict", help=SCORER_HELP)
        p.add_argument("--knob", help="what this run changed (for the README run note)")
        return p

    p = loop("eval", _cmd_eval, help="Loop A: score frozen completions (or live samples of a model)")
    p.add_argument("--completions", help="completions JSONL {id, completion, sample?}")
    p.add_argument("--model", help="sample live: embedded model name or .npz path (or remote name)")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for --model (key from env)")
    p.add_argument("--samples", type=int, default=1, help="samples per example with --model (default 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="run seed for live sampling (default 0)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent requests when sampling")

    p = add(
        "inspect", _cmd_inspect, "failures of a run grouped by taxonomy category and outcome, with examples"
    )
    p.add_argument("run", nargs="?", help="run folder (eval or select), as for show and report")
    p.add_argument("--run", dest="run_opt", metavar="RUN", help="the same, as an option (older spelling)")
    p.add_argument("--only-fails", action="store_true", help="leave accepted results out")
    p.add_argument("--top-k", type=int, default=5, help="outcomes to list (most frequent first)")
    p.add_argument("--show", type=int, default=2, help="examples per outcome and per category")

    p = loop("select", _cmd_select, help="Loop B: best-of-N over samples; pass@1 and pass@N")
    p.add_argument("--samples", required=True, help="samples JSONL {id, completion, sum_logprob?, sample?}")
    p.add_argument("--n", type=int, required=True, help="use the first N samples per id")
    p.add_argument("--selector", help="verifier that ranks the samples (default: the scorer)")

    p = add("gate", _cmd_gate, help="PROMOTE or REJECT a candidate run against a baseline (Locked Room)")
    p.add_argument("--baseline", required=True, help="baseline run folder")
    p.add_argument("--candidate", required=True, help="candidate run folder")
    p.add_argument(
        "--min-delta", type=float, required=True, help="smallest improvement of the metric to promote"
    )
    p.add_argument("--metric", default="pass_rate", help="summary.json key to compare (default pass_rate)")

    p = add("validate-scorer", _cmd_validate, "run a scorer on golden sets; non-zero exit on any mismatch")
    p.add_argument("--dataset", help="dataset JSONL supplying prompt/expected_answer by id")
    p.add_argument("--golden", action="append", help="golden JSONL (repeatable; default: the shipped sets)")
    p.add_argument("--scorer", default="arith-strict", help=SCORER_HELP)
    p.add_argument("--outcome-field", help="golden field the outcome must equal, e.g. strict_outcome")

    show_help = "print a run's rollouts readably (filter by step/outcome/category, top/bottom K, diff steps)"
    p = add("show", _cmd_show, show_help, run="run folder")
    categories = "ok, model_math, model_format, data_invalid, verifier_suspect, unmapped"
    sources = "rollout source (repeatable): train samples, val rows, eval/select results, lab rows"
    add_options(
        p,
        ("--step", None, "step(s): N, N,M, A-B, first, last (train runs)"),
        ("--source", None, sources, {"action": "append", "choices": SOURCES}),
        ("--outcome", None, "outcome code, e.g. wrong_answer (repeatable)", {"action": "append"}),
        ("--category", None, f"taxonomy category: {categories} (repeatable)", {"action": "append"}),
        ("--id", None, "only this example id"),
        ("--limit", 20, "print at most this many (0 = all; default %(default)s)"),
        ("--max-chars", 2000, "cut each message after this many characters (0 = never; default %(default)s)"),
        ("--json", False, "print the selected rollouts as JSON lines"),
    )
    rank = p.add_mutually_exclusive_group()
    rank.add_argument("--top", type=_positive, metavar="K", help="the K highest-reward rollouts")
    rank.add_argument("--bottom", type=_positive, metavar="K", help="the K lowest-reward rollouts")
    diff_help = "how the outputs of the same prompts changed between two steps"
    rank.add_argument("--diff", nargs=2, metavar=("STEP_A", "STEP_B"), help=diff_help)

    report_help = "write one self-contained report.html for a run (curves, breakdown, rollout browser)"
    p = add("report", _cmd_report, report_help, run="run folder")
    max_rollouts = "embed at most this many rollouts, shared evenly across steps (default %(default)s)"
    add_options(
        p,
        ("--out", None, "output file (default RUN/report.html)"),
        ("--max-rollouts", 3000, max_rollouts),
        ("--max-chars", 4000, "cut each embedded message (default %(default)s)"),
        ("--page-size", 50, "rollouts per page (default %(default)s)", {"type": _positive}),
    )
