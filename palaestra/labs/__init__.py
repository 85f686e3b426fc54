"""Labs: small, exact experiments that make one RL mechanism visible at a time (``palaestra lab ...``).

Each lab is one module with a Python API (a ``run_*_lab`` function returning a result object with the
numbers) and a ``register_lab(labsub)`` function adding its ``palaestra lab <name>`` parser. Every lab writes
its run folder through :class:`palaestra.labs.common.LabRun` (manifest.json, data, summary.md, README.md,
plot).

Lab modules are imported when the CLI builds its parser: keep their top-level imports to the standard library,
numpy and ``palaestra.labs.common``; import trainers, models, judges and matplotlib inside functions.
"""

from __future__ import annotations

import argparse
import importlib

# ``palaestra lab <name>`` subcommands, in --help order. To add a lab, create its module with
# ``register_lab(labsub)`` and list it here.
LAB_MODULES: tuple[str, ...] = (
    "palaestra.labs.bandit",
    "palaestra.labs.two_step",
    "palaestra.labs.kl",
    "palaestra.labs.goodhart",
    "palaestra.labs.selection",
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``lab`` command and one subcommand per lab module."""
    p = sub.add_parser(
        "lab",
        help="mechanism microscopes: bandit, two-step credit, KL trade-off, ...",
        description="Small exact labs; each writes --outdir with manifest.json, data, summary.md and a plot.",
    )
    labsub = p.add_subparsers(dest="lab", metavar="LAB")
    for name in LAB_MODULES:
        importlib.import_module(name).register_lab(labsub)
    p.set_defaults(func=lambda args: _no_lab(p))


def _no_lab(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2
