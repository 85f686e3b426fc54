"""Hybrid experiment: train with a judge's rewards, stop on verifier accuracy on held-out validation.

    python examples/hybrid_train_judge_stop_val.py                      # offline: simulated judge
    python examples/hybrid_train_judge_stop_val.py --judge-model gpt-4o-mini \\
        --judge-base-url https://api.openai.com/v1 --judge-api-key-env OPENAI_API_KEY

The judge gives *relative* rewards inside each group (Loop C's training signal); the strict verifier measures
greedy accuracy on the validation split every ``--val-every`` steps, and that number alone decides when to
stop: ``target_reached`` (accuracy >= ``--target``), ``plateau`` (``--patience`` checks without a new best),
``reward_hacking`` (accuracy falls while the judge's reward rises) or ``max_steps``. The best validated
weights are kept in ``checkpoints/best.npz``.

Offline the judge is a simulated one (hidden gold = the strict verifier, plus noise): a lab instrument that
runs in seconds. ``--judge-model/--judge-base-url`` switch to a real RULER judge; nothing else changes.
The same run from a TOML file: ``palaestra train --config exp.toml`` (see docs/guide.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from palaestra.trainer.experiment import Experiment


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The experiment config as a plain dict (the same keys as the TOML file)."""
    reward: dict[str, Any] = {"kind": "simulated_judge", "simulated": {"gold": "arith-strict", "noise": 0.1}}
    if args.judge_model:
        reward = {
            "kind": "judge",
            "judge_model": args.judge_model,
            "judge_base_url": args.judge_base_url,
            "judge_api_key_env": args.judge_api_key_env,
        }
    return {
        "run": {
            "name": "hybrid",
            "seed": args.seed,
            "output_dir": args.outdir,
            "groups_per_step": args.groups,
            "group_size": args.group_size,
            "max_steps": args.max_steps,
        },
        "model": {"name": args.model},
        "env": {"name": "arithmetic", "max_tokens": 12},
        "reward": reward,
        "validation": {
            "every": args.val_every,
            "max_examples": args.val_examples,
            "verifier": "arith-strict",
        },
        "stopping": {"target": args.target, "patience": args.patience},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outdir", default="runs/hybrid-example", help="run folder (resumed if it exists)")
    parser.add_argument("--model", default="arith-base", help="embedded policy to train (name or .npz)")
    parser.add_argument("--judge-model", help="real RULER judge model (default: simulated judge)")
    parser.add_argument("--judge-base-url", help="OpenAI-compatible base URL of the judge")
    parser.add_argument(
        "--judge-api-key-env", default="OPENAI_API_KEY", help="env var holding the judge's key"
    )
    parser.add_argument("--target", type=float, default=0.5, help="stop when val accuracy reaches this")
    parser.add_argument("--patience", type=int, default=5, help="validation checks without improvement")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--val-examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small settings (CI)")
    args = parser.parse_args()
    if args.quick:
        args.max_steps, args.groups, args.group_size, args.val_every, args.val_examples = 4, 4, 4, 2, 50
    summary = Experiment(config(args)).run_sync()
    stop, base, best = summary["stop"], summary["base_val"], summary["best_val"]
    print()
    print(f"stop reason: {stop['reason']} at step {stop['step']} ({stop['message']})")
    print(
        f"val accuracy (greedy): base {base['greedy_accuracy']:.3f} -> best {best['greedy_accuracy']:.3f} "
        f"at step {best['step']} (kept in checkpoints/best.npz)"
    )
    print(f"run folder: {summary['run']} (README.md, history.jsonl, samples/, val/, curves)")


if __name__ == "__main__":
    main()
