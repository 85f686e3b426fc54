"""CLI subcommands for watching runs: ``palaestra show`` (rollouts in the terminal) and ``palaestra report``
(one self-contained HTML file). Exit codes: 0 success, 2 unusable input (named file:line or flag)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["register"]


def _fail(command: str, exc: Exception) -> int:
    print(f"palaestra {command}: error: {exc}", file=sys.stderr)
    return 2


def _cmd_show(args: argparse.Namespace) -> int:
    from palaestra.evals import show
    from palaestra.evals.runs import load_run

    try:
        view = load_run(args.run)
        steps = show.parse_steps(args.step, view) if args.step is not None else None
        if args.diff is not None:
            a, b = (show.parse_steps(x, view) for x in args.diff)
            if len(a) != 1 or len(b) != 1:
                raise ValueError("--diff takes two single steps, e.g. --diff 0 last")
            text = show.format_diff(
                view,
                a[0],
                b[0],
                source=args.source[0] if args.source else None,
                outcomes=args.outcome,
                categories=args.category,
                limit=args.limit,
            )
            sys.stdout.write(text)
            return 0
        order, k = (
            ("top", args.top)
            if args.top is not None
            else (("bottom", args.bottom) if args.bottom is not None else ("file", None))
        )
        if args.json:
            rows = show.select(
                view.rollouts(steps=steps, sources=args.source),
                outcomes=args.outcome,
                categories=args.category,
                example_id=args.id,
                order=order,
                k=k,
            )
            sys.stdout.write(show.json_lines(rows if args.limit <= 0 else rows[: args.limit]))
            return 0
        sys.stdout.write(
            show.show_text(
                view,
                steps=steps,
                sources=args.source,
                outcomes=args.outcome,
                categories=args.category,
                example_id=args.id,
                order=order,
                k=k,
                limit=args.limit,
                max_chars=args.max_chars,
                color=sys.stdout.isatty() and not os.environ.get("NO_COLOR"),
            )
        )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        return _fail("show", exc)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from palaestra.evals.report import write_report

    try:
        path = write_report(
            args.run,
            args.out,
            max_rollouts=args.max_rollouts,
            max_chars=args.max_chars,
            page_size=args.page_size,
        )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        return _fail("report", exc)
    size = path.stat().st_size
    print(f"report: {path} ({size / 1024:.0f} KiB; open it in a browser, no server needed)")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``show`` and ``report`` to the ``palaestra`` command line."""
    p = sub.add_parser(
        "show",
        help="print a run's rollouts readably (filter by step/outcome/category, top/bottom K, diff steps)",
        description="Print the rollouts of a run folder (train, eval, select or lab): messages, tool calls, "
        "reward, outcome, taxonomy category, advantage when stored. Invisible characters show as escapes.",
    )
    p.add_argument("run", help="run folder")
    p.add_argument("--step", help="step(s): N, N,M, A-B, first, last (train runs)")
    p.add_argument(
        "--source",
        action="append",
        choices=["train", "val", "eval", "select", "lab"],
        help="rollout source (repeatable): train samples, val rows, eval/select results, lab rows",
    )
    p.add_argument("--outcome", action="append", help="outcome code, e.g. wrong_answer (repeatable)")
    p.add_argument(
        "--category",
        action="append",
        help="taxonomy category: ok, model_math, model_format, data_invalid, verifier_suspect, "
        "unmapped (repeatable)",
    )
    p.add_argument("--id", help="only this example id")
    rank = p.add_mutually_exclusive_group()
    rank.add_argument("--top", type=_positive, metavar="K", help="the K highest-reward rollouts")
    rank.add_argument("--bottom", type=_positive, metavar="K", help="the K lowest-reward rollouts")
    rank.add_argument(
        "--diff",
        nargs=2,
        metavar=("STEP_A", "STEP_B"),
        help="how the outputs of the same prompts changed between two steps",
    )
    p.add_argument(
        "--limit", type=int, default=20, help="print at most this many (0 = all; default %(default)s)"
    )
    p.add_argument(
        "--max-chars",
        type=int,
        default=2000,
        help="cut each message after this many characters (0 = never; default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the selected rollouts as JSON lines")
    p.set_defaults(func=_cmd_show)

    r = sub.add_parser(
        "report",
        help="write one self-contained report.html for a run (curves, breakdown, rollout browser)",
        description="Write one HTML file (no server, no network) with the run's locked-room facts, curves, "
        "outcome/category breakdown per step and a rollout browser with the filters of 'palaestra show'.",
    )
    r.add_argument("run", help="run folder")
    r.add_argument("--out", help="output file (default RUN/report.html)")
    r.add_argument(
        "--max-rollouts",
        type=int,
        default=3000,
        help="embed at most this many rollouts, shared evenly across steps (default %(default)s)",
    )
    r.add_argument(
        "--max-chars", type=int, default=4000, help="cut each embedded message (default %(default)s)"
    )
    r.add_argument("--page-size", type=_positive, default=50, help="rollouts per page (default %(default)s)")
    r.set_defaults(func=_cmd_report)
