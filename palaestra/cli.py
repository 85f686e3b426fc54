"""The ``palaestra`` command line: each subcommand is added by a ``register(sub)`` beside the code it drives. A
:class:`~palaestra.trajectories.io.DataError` is one line and exit code 2 (``PALAESTRA_TRACEBACK=1``: raised)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from palaestra import __version__
from palaestra.trajectories.io import DataError
from palaestra.trajectories.runs import set_command_line

# In the order of their commands in --help.
COMMAND_MODULES: tuple[str, ...] = (
    "palaestra.demo",
    "palaestra.trainer.commands",
    "palaestra.evals.commands",
    "palaestra.judges.commands",
    "palaestra.models.commands",
    "palaestra.trainer.pretrain",
    "palaestra.trainer.reward_modeling",
    "palaestra.labs",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="palaestra", description="palaestra: reinforcement learning of LLM agents (CPU to GPU)."
    )
    parser.add_argument("--version", action="version", version=f"palaestra {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``palaestra`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    set_command_line(["palaestra", *argv])
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # a reader that left shows here, not as a traceback when Python exits
        return code
    except BrokenPipeError:  # `palaestra ... | head`: the reader left; stop quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit goes nowhere
        return 141
    except DataError as exc:
        if os.environ.get("PALAESTRA_TRACEBACK"):
            raise
        print(f"palaestra {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
