"""Labs: small, exact experiments that make one RL mechanism visible at a time (``palaestra lab``, docs/labs.md)."""

from __future__ import annotations

import argparse
import importlib

# The lab modules behind ``palaestra lab <name>``, in --help order (each has ``register_lab(labsub)``).
LAB_MODULES: tuple[str, ...] = ("bandit", "two_step", "kl", "goodhart", "selection")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``lab`` command and one subcommand per lab module."""
    p = sub.add_parser(
        "lab",
        help="mechanism microscopes: bandit, two-step credit, KL trade-off, ...",
        description="Small exact labs; each writes --outdir with manifest.json, data, summary.md and a plot.",
    )
    labsub = p.add_subparsers(dest="lab", metavar="LAB")
    for name in LAB_MODULES:
        importlib.import_module(f"palaestra.labs.{name}").register_lab(labsub)
    p.set_defaults(func=lambda args: p.print_help() or 2)  # no lab named: help, exit 2
