"""Labs: small, exact experiments that make one RL mechanism visible at a time (``palaestra lab``, docs/labs.md)."""

from __future__ import annotations

import argparse
import importlib

from palaestra.trajectories.runs import add_options

# The lab modules behind ``palaestra lab <name>``, in --help order; each has a docstring (the description), ``HELP``,
# ``OPTIONS`` (:func:`add_options` tuples, after --outdir, --seed, --no-plot, --quiet) and ``command(args)``.
LAB_MODULES: tuple[str, ...] = ("bandit", "two_step", "kl", "goodhart", "selection")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``lab`` command and one subcommand per lab module."""
    p = sub.add_parser(
        "lab",
        help="mechanism microscopes: bandit, two-step credit, KL trade-off, ...",
        description="Small exact labs; each writes --outdir with manifest.json, data, summary.md and a plot.",
    )
    labsub = p.add_subparsers(dest="lab", metavar="LAB")
    for module in LAB_MODULES:
        lab = importlib.import_module(f"palaestra.labs.{module}")
        name = module.replace("_", "-")
        q = labsub.add_parser(name, help=lab.HELP, description=lab.__doc__)
        q.add_argument("--outdir", default=f"runs/lab-{name}", help="run folder (default: %(default)s)")
        if not any(option[0] == "--seed" for option in lab.OPTIONS):  # kl's --seed has its own meaning
            q.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
        q.add_argument("--no-plot", action="store_true", help="do not draw plots")
        q.add_argument("--quiet", action="store_true", help="print only the run folder")
        add_options(q, *lab.OPTIONS)
        q.set_defaults(func=lab.command)
    p.set_defaults(func=lambda args: p.print_help() or 2)  # no lab named: help, exit 2
