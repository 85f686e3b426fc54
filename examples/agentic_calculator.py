"""Agentic RL on a CPU: the embedded policy learns when and how to call a calculator tool.

    python examples/agentic_calculator.py                  # offline: GRPO on calc-base (~30 s on 2 cores)
    python examples/agentic_calculator.py --quick          # a few steps (smoke test)
    python examples/agentic_calculator.py --tool-cost 0.05 # each call costs reward: calls must be worth it
    python examples/agentic_calculator.py --base-url http://127.0.0.1:8000/v1 --model my-model \
        [--api-key-env KEY]

The rollout is ``palaestra.envs.calculator.calculator_rollout``: it offers one ``calc`` tool through the
OpenAI tools API (``tools=[...]``), appends each ``Choice`` and one ``{"role": "tool", ...}`` result per
call, and stops at the first reply without tool calls (or after ``--max-turns``). The reward is the strict
``Final: <int>`` verifier on the last assistant message, minus ``--tool-cost`` per call.

Offline, the shipped ``calc-base`` (which calls the tool on some problems and guesses on the others) is
trained with GRPO through ``palaestra.Experiment``; the script prints a transcript before and after, and
validation accuracy next to the fraction of episodes that used the tool correctly. With ``--base-url`` the
very same rollout runs against your endpoint (vLLM, OpenAI, Ollama, ``palaestra serve --model calc-base``):
the script evaluates that model on a few problems (remote models are not trained here).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from typing import Any

from palaestra.envs.calculator import calculator_rollout, evaluate_calculator
from palaestra.envs.calculator_data import load_split


def transcript(traj: Any) -> str:
    lines = []
    for m in traj.messages():
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = ", ".join(
                f"{c['function']['name']}({c['function']['arguments']})" for c in m["tool_calls"]
            )
            lines.append(f"    assistant -> {calls}")
        else:
            lines.append(f"    {m['role']:<9} {m.get('content')}")
    lines.append(
        f"    reward {traj.reward:.2f} ({traj.metadata['outcome']}, {traj.metrics['tool_calls']} tool calls)"
    )
    return "\n".join(lines)


async def show(model: Any, examples: list[dict[str, Any]], title: str, max_turns: int) -> None:
    print(f"\n{title}")
    for ex in examples:
        traj = await calculator_rollout(model, ex, temperature=0.0, max_turns=max_turns)
        print(transcript(traj))


def report(res: dict[str, Any], label: str) -> None:
    print(
        f"  {label:<6} greedy accuracy {res['greedy_accuracy']:.3f}  "
        f"sampled {res.get('sampled_accuracy', 0):.3f}  "
        f"tool used {res['greedy_tool_use']:.3f}  tool used correctly {res['greedy_tool_correct']:.3f}"
    )


async def remote(args: argparse.Namespace) -> int:
    from palaestra.models.remote import RemoteModel

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    model = RemoteModel(args.model, base_url=args.base_url, api_key=key or "none")
    val = load_split("val")[: 4 if args.quick else 20]
    await show(model, val[:2], f"episodes of {args.model} at {args.base_url}", args.max_turns)
    res = await evaluate_calculator(model, val, seed=args.seed, max_turns=args.max_turns, max_concurrency=8)
    print(f"\n{args.model} on {len(val)} calculator problems:")
    report(res, "model")
    return 0


def train(args: argparse.Namespace) -> int:
    from palaestra.models.registry import load
    from palaestra.trainer.experiment import Experiment

    quick = args.quick
    outdir = args.outdir or tempfile.mkdtemp(prefix="agentic-calculator-")
    options: dict[str, Any] = {"max_turns": args.max_turns, "tool_cost": args.tool_cost}
    cfg = {
        "run": {
            "name": "agentic-calculator",
            "seed": args.seed,
            "output_dir": outdir,
            "groups_per_step": 8 if quick else 16,
            "group_size": 8,
            "max_steps": args.steps or (4 if quick else 30),
            "samples_per_step": 8,
        },
        "model": {"name": "calc-base"},
        "env": {"name": "calculator", "max_tokens": 24, "options": options},
        "reward": {"kind": "rollout"},  # keep the rollout's reward: verifier minus the tool cost
        "validation": {"every": 2 if quick else 5, "max_examples": 50 if quick else 200},
        "train": {"lr": 2e-4},
        "stopping": {"patience": 4, "target": 0.95},
    }
    model = load("calc-base")
    demo = [r for r in load_split("val") if r["family"] != "mul"][:2]  # families the base tends to guess
    asyncio.run(show(model, demo, "calc-base before training:", args.max_turns))
    print(f"\ntraining calc-base with GRPO on the calculator environment -> {outdir}")
    summary = Experiment(cfg, model=model).run_sync()
    asyncio.run(show(model, demo, "after training (best validated weights):", args.max_turns))
    print()
    report(summary["base_val"], "base")
    report(summary["best_val"], "best")
    print(f"  {summary['steps']} steps, {summary['wall_seconds']:.1f} s, stop: {summary['stop']['reason']}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps / problems (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 30, --quick 4)")
    p.add_argument("--max-turns", type=int, default=3, help="assistant replies per episode")
    p.add_argument("--tool-cost", type=float, default=0.0, help="reward cost per tool call")
    p.add_argument("--outdir", default=None, help="run folder (default: a temporary folder)")
    p.add_argument("--base-url", help="evaluate a model behind this OpenAI-compatible endpoint instead")
    p.add_argument("--model", default="calc-base", help="model name at --base-url")
    p.add_argument("--api-key-env", default=None, help="env var holding the endpoint's API key")
    args = p.parse_args()
    if args.base_url:
        return asyncio.run(remote(args))
    return train(args)


if __name__ == "__main__":
    raise SystemExit(main())
