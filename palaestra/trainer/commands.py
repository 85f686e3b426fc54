"""CLI: ``palaestra train --config exp.toml`` and ``palaestra train --resume RUN``."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="run an experiment from a TOML config (Loop C), or resume one")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="experiment TOML file")
    src.add_argument("--resume", metavar="RUN", help="run folder to continue from its latest checkpoint")
    p.add_argument("--output-dir", help="override run.output_dir")
    p.add_argument("--max-steps", type=int, help="override run.max_steps")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from palaestra.trainer.expconfig import load_config
    from palaestra.trainer.experiment import Experiment

    if args.resume:
        exp = Experiment.resume(args.resume)
        if args.max_steps:
            exp.config.run.max_steps = args.max_steps
    else:
        cfg = load_config(args.config)
        if args.output_dir:
            cfg.run.output_dir = args.output_dir
        if args.max_steps:
            cfg.run.max_steps = args.max_steps
        if args.quiet:
            cfg.run.progress = False
        exp = Experiment(cfg)
    summary = exp.run_sync()
    print(
        json.dumps(
            {k: summary[k] for k in ("run", "steps", "stop", "base_val", "best_val")}, indent=2, default=str
        )
    )
    return 0
