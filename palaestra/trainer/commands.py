"""CLI: ``palaestra train --config exp.toml`` and ``palaestra train --resume RUN``. A user's error is one line
on stderr with exit code 2 (``PALAESTRA_TRACEBACK=1``: the traceback), and a new run that fails before its first
step leaves no run folder behind."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="run an experiment from a TOML config (Loop C), or resume one")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="experiment TOML file (a new run; its run folder must not hold one)")
    src.add_argument("--resume", metavar="RUN", help="run folder to continue from its latest checkpoint")
    p.add_argument("--output-dir", help="override run.output_dir (with --config only)")
    p.add_argument(  # bounds: checked with the config's own (the error names the flag)
        "--max-steps",
        type=int,
        help="override run.max_steps; with --resume, extends a run that stopped on its step budget",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.add_argument("--yes", action="store_true", help="confirm more judge calls than reward.max_judge_calls")
    p.set_defaults(func=_train)


def _fail(text: str) -> int:
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    print(f"palaestra train: error: {first}", file=sys.stderr)
    return 2


def _is_user_error(exc: BaseException) -> bool:
    """Errors a user can fix (input, endpoints, files), reported in one line; anything else is a bug."""
    names = {c.__name__ for c in type(exc).__mro__}
    known = {"GatherError", "JudgeError", "APIError", "MissingLogprobsError", "UnknownModelError"}
    return isinstance(exc, (KeyError, ValueError, OSError)) or bool(names & known)  # DataError: a ValueError


def _train(args: argparse.Namespace) -> int:
    from palaestra.trainer.distributed import exit_rank, init_from_env

    dist = init_from_env()  # under torchrun: rank 0 runs the experiment, the other ranks only train
    code = _train_rank(args, dist)
    if dist is not None:
        exit_rank(code)  # every rank leaves the group together and ends here
    return code


def _train_rank(args: argparse.Namespace, dist: Any) -> int:
    from palaestra.trainer.distributed import follow_command
    from palaestra.trainer.expconfig import config_from_dict, load_config
    from palaestra.trainer.experiment import Experiment
    from palaestra.trainer.runfolder import RunFolder
    from palaestra.trainer.stopping import stop_exit_code
    from palaestra.trajectories.io import DataError

    follower = f"rank {dist.rank}: " if dist is not None and not dist.is_main else ""
    fresh: RunFolder | None = None  # a new run's folder, removed if it fails before its first step
    existing: set[str] | None = None  # what the output folder held before (None: it did not exist)
    try:
        if follower:
            return follow_command(args)
        if args.resume:
            if args.output_dir:
                return _fail(
                    "--output-dir cannot be used with --resume: a run continues in its own folder "
                    f"({args.resume}); copy the folder first to continue it elsewhere"
                )
            if not (Path(args.resume) / "config.json").is_file():
                raise DataError("not a run folder (no config.json)", path=args.resume)
            exp = Experiment.resume(args.resume, max_steps=args.max_steps, yes=args.yes)
            if args.quiet:
                exp.config.run.progress = False
        else:
            cfg = load_config(args.config)
            given = {"output_dir": args.output_dir or None, "max_steps": args.max_steps}
            overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
            if args.quiet:
                overrides["progress"] = False
            if overrides:  # validated like the file itself (one source of truth for each bound)
                data = cfg.model_dump(mode="json", exclude_unset=True)  # unset fields keep their defaults
                data.setdefault("run", {}).update(overrides)
                flags = " ".join(f"--{k.replace('_', '-')}" for k in overrides if k != "progress")
                cfg = config_from_dict(data, source=f"{args.config}{' with ' + flags if flags else ''}")
            folder = RunFolder(cfg.output_path())
            if folder.holds_run():
                raise DataError(
                    "already holds a run; continue it with `palaestra train --resume "
                    f"{folder.root}`, or choose another run.output_dir (--output-dir)",
                    path=folder.root,
                )
            fresh = folder
            existing = {p.name for p in folder.root.iterdir()} if folder.root.is_dir() else None
            exp = Experiment(cfg, yes=args.yes)
        summary = exp.run_sync()
    except Exception as exc:
        if not _is_user_error(exc) or os.environ.get("PALAESTRA_TRACEBACK"):
            raise
        if fresh is not None and not fresh.has_trained() and "in use by another" not in str(exc):
            fresh.remove_unfinished(existing)
        return _fail(follower + str(exc))
    print(summary_table(summary))
    code = stop_exit_code(summary["stop"]["reason"])
    if code:
        print(
            f"palaestra train: stopped: {summary['stop']['message']} "
            f"(continue with `palaestra train --resume {summary['run']}`)",
            file=sys.stderr,
        )
    return code


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table ``palaestra train`` prints (the same facts as summary.json, readable)."""
    from palaestra.trainer.runfolder import count_text

    def acc(value: Any) -> str:
        return "-" if value is None else f"{float(value):.3f}"

    stop, base, best = summary.get("stop") or {}, summary.get("base_val") or {}, summary.get("best_val") or {}
    faults = summary.get("faults") or {}
    rows = {
        "steps": f"{summary.get('steps')}  ({summary.get('wall_seconds', 0.0):.1f} s)",
        "stop": f"{stop.get('reason')} at step {stop.get('step')}: {stop.get('message')}",
    }
    for key, label in (("greedy_accuracy", "greedy"), ("sampled_accuracy", "sampled")):
        if key in base or key in best:
            rows[f"val {label}"] = (
                f"base {acc(base.get(key))} -> best {acc(best.get(key))} at step {best.get('step', '-')}"
            )
    rows["weights"] = "best validated (restored)" if summary.get("restored_best") else "final"
    total = faults.get("groups_total")
    if total:
        rows["groups dropped"] = (
            f"{count_text(faults.get('groups_dropped', 0))} of {count_text(total)}; rollout exceptions "
            f"{count_text(faults.get('rollout_exceptions', 0))}"
        )
    usage = summary.get("judge_usage") or {}
    if usage.get("calls"):
        tokens = sum(usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens"))
        rows["judge calls"] = count_text(usage["calls"]) + (
            f" ({count_text(tokens)} tokens)" if tokens else ""
        )
    if summary.get("curves"):
        rows["curves"] = str(summary["curves"])
    rows["run folder"] = str(summary.get("run"))
    width = max(map(len, rows))
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items())
