"""``palaestra demo``: the README's main command.

Offline, on the embedded default: a hybrid experiment that trains the shipped ``arith-base`` policy with a
*judge's* relative rewards (a simulated judge: a lab instrument with hidden gold = the strict verifier, plus
noise) and stops on *strict-verifier* validation accuracy. ``--judge-model/--judge-base-url/--judge-api-key-env``
switch the train reward to a real RULER judge on any OpenAI-compatible endpoint; nothing else changes.

``--task calculator`` runs the agentic variant: the shipped ``calc-base`` plays multi-turn calculator episodes
(a ``calc`` tool through the OpenAI tools API), is trained on the same kind of judge rewards, and stops on
strict-verifier validation of whole episodes; the table adds how often the tool was used correctly.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="train the embedded arithmetic policy with a judge, stop on validation")
    p.add_argument("--outdir", default=None, help="run folder (default: runs/demo-<time>)")
    p.add_argument(
        "--task",
        choices=["arithmetic", "calculator"],
        default="arithmetic",
        help="arithmetic (arith-base, single turn) or calculator (calc-base, multi-turn tool use)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="cap on training steps")
    p.add_argument("--quick", action="store_true", help="small settings for a smoke test (CI)")
    p.add_argument(
        "--mcp",
        default=None,
        help="calculator: take the tools from this MCP server (a stdio command, e.g. "
        "'python examples/mcp_calc_server.py', or an http://.../mcp URL); its calc tool is offered",
    )
    p.add_argument("--judge-model", help="use a real RULER judge with this model name")
    p.add_argument("--judge-base-url", help="OpenAI-compatible base URL of the judge")
    p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="env var holding the judge's key")
    p.set_defaults(func=run_demo)


def demo_config(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's experiment config (a plain dict, validated by ExperimentConfig)."""
    outdir = args.outdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    quick = bool(args.quick)
    # A simulated judge (a lab instrument): hidden gold = the strict verifier, Gaussian noise, scores quantised
    # to 5 levels so that equally good answers can tie (a tie carries no gradient instead of amplified noise).
    reward: dict[str, Any] = {
        "kind": "simulated_judge",
        "simulated": {"gold": "arith-strict", "noise": 0.05, "quantize": 5},
    }
    if args.judge_model:
        reward = {
            "kind": "judge",
            "judge_model": args.judge_model,
            "judge_base_url": args.judge_base_url,
            "judge_api_key_env": args.judge_api_key_env,
        }
    if getattr(args, "task", "arithmetic") == "calculator":
        return {
            "run": {
                "name": "demo-calculator",
                "seed": args.seed,
                "output_dir": outdir,
                "groups_per_step": 8 if quick else 16,
                "group_size": 8,
                "max_steps": args.max_steps or (4 if quick else 60),
                "samples_per_step": 16,
            },
            "model": {"name": "calc-base"},
            "env": {
                "name": "calculator",
                "max_tokens": 24,
                "options": {"max_turns": 3}
                if not getattr(args, "mcp", None)
                else {"max_turns": 3, "mcp": args.mcp, "mcp_tools": "calc"},
            },
            "reward": reward,
            "validation": {"every": 2 if quick else 5, "max_examples": 50 if quick else 200},
            "train": {"lr": 2e-4},
            "stopping": {"patience": 4, "target": 0.95},
        }
    return {
        "run": {
            "name": "demo",
            "seed": args.seed,
            "output_dir": outdir,
            "groups_per_step": 8 if quick else 32,
            "group_size": 8,
            "max_steps": args.max_steps or (6 if quick else 1200),
            "samples_per_step": 16,
            "checkpoint_every": 1 if quick else 10,
        },
        "model": {"name": "arith-base"},
        "env": {"name": "arithmetic", "max_tokens": 12},
        "reward": reward,
        "validation": {"every": 3 if quick else 50, "max_examples": 100 if quick else 500},
        # The lr peaks early and anneals over the run (TrainConfig's cosine schedule); validation dips before it
        # climbs, so stopping (plateau and the reward-hacking alarm) only starts after a warmup.
        "stopping": {"patience": 6, "target": 0.9, "warmup": 0 if quick else 400},
    }


def run_demo(args: argparse.Namespace) -> int:
    from palaestra.trainer.experiment import Experiment

    cfg = demo_config(args)
    what = (
        "calc-base on multi-turn calculator episodes" if cfg["model"]["name"] == "calc-base" else "arith-base"
    )
    print(
        f"palaestra demo: training {what} with a {cfg['reward']['kind'].replace('_', ' ')}, "
        f"stopping on strict-verifier validation accuracy -> {cfg['run']['output_dir']}"
    )
    summary = Experiment(cfg).run_sync()
    base, best = summary["base_val"], summary["best_val"]
    rows = [
        ("base val accuracy (greedy)", f"{base.get('greedy_accuracy', float('nan')):.3f}"),
        (
            "best val accuracy (greedy)",
            f"{best.get('greedy_accuracy', float('nan')):.3f} at step {best.get('step')}",
        ),
        *(
            [
                (
                    "tool used correctly (greedy)",
                    f"{base['greedy_tool_correct']:.3f} -> {best.get('greedy_tool_correct', float('nan')):.3f}",
                )
            ]
            if "greedy_tool_correct" in base
            else []
        ),
        ("steps", str(summary["steps"])),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
        ("stop reason", f"{summary['stop']['reason']}"),
        ("curves", summary["curves"]),
        ("run folder", summary["run"]),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return 0
