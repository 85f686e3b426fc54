"""``palaestra demo``: the README's main command: train with a judge, stop on verifier validation, then measure
base, restored-best and last-step policies on the test split, which no decision used."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from palaestra.models.reward_model import load_reward_model
from palaestra.trajectories.runs import add_options, args_of, write_json

TEST_SPLIT = "test"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="train the embedded arithmetic policy with a judge, stop on validation")
    task = "arithmetic (arith-base, single turn) or calculator (calc-base, multi-turn tool use)"
    judge = "learned: the reward model arith-rm (default); simulated: a lab instrument, hidden gold = the verifier"
    mcp = (
        "calculator: offer the calc tool of this MCP server (a stdio command, e.g. "
        "'python examples/mcp_calc_server.py', or an http://.../mcp URL)"
    )
    add_options(
        p,
        ("--outdir", None, "run folder (default: runs/demo-<time>)"),
        ("--task", "arithmetic", task, {"choices": ["arithmetic", "calculator"]}),
        ("--judge", "learned", judge, {"choices": ["learned", "simulated"]}),
        ("--reward-model", "arith-rm", "--judge learned: shipped name or .npz path"),
        ("--seed", 0, "random seed"),
        ("--max-steps", None, "cap on training steps", {"type": int}),
        ("--quick", False, "small settings for a smoke test (CI)"),
        ("--quiet", False, "print only the banner and the final table"),
        ("--yes", False, "confirm a run planning many real judge calls"),
        ("--mcp", None, mcp),
        ("--judge-model", None, "use a real RULER judge with this model name"),
        ("--judge-base-url", None, "OpenAI-compatible base URL of the judge"),
        ("--judge-api-key-env", "OPENAI_API_KEY", "env var holding the judge's key"),
    )
    p.set_defaults(func=run_demo)


def _reward(args: argparse.Namespace) -> dict[str, Any]:
    if args.judge_model:
        return {"kind": "judge", **args_of(args, "judge_model", "judge_base_url", "judge_api_key_env")}
    if args.judge == "simulated" or args.task == "calculator":
        # A lab instrument: hidden gold = the strict verifier, Gaussian noise, scores quantised to 5 levels.
        return {
            "kind": "simulated_judge",
            "simulated": {"gold": "arith-strict", "noise": 0.05, "quantize": 5},
        }
    return {
        "kind": "learned_judge",
        "learned": {"model": args.reward_model},
        "judge_cache": "off",  # training never repeats a group; the cache would only cost writes
    }


def demo_config(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's experiment config (a plain dict, validated by ExperimentConfig)."""
    quick = bool(args.quick)
    reward = _reward(args)

    def run(name: str, groups: int, steps: int, **more: int) -> dict[str, Any]:
        return {
            "name": name,
            "seed": args.seed,
            "output_dir": args.outdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}",
            "groups_per_step": groups,
            "group_size": 8,
            "max_steps": args.max_steps or steps,
            "samples_per_step": 16,
            "progress": not args.quiet,
            **more,
        }

    arith = {
        "model": {"name": "arith-base"},
        "env": {"name": "arithmetic", "max_tokens": 12},
        "reward": reward,
    }
    if args.task == "calculator":
        mcp = {"mcp": args.mcp, "mcp_tools": "calc"} if args.mcp else {}
        return {
            "run": run("demo-calculator", 8 if quick else 16, 4 if quick else 60),
            "model": {"name": "calc-base"},
            "env": {"name": "calculator", "max_tokens": 24, "options": {"max_turns": 3, **mcp}},
            "reward": reward,
            "validation": {"every": 2 if quick else 5, "max_examples": 50 if quick else 200},
            "train": {"lr": 2e-4},
            "stopping": {"patience": 4, "target": 0.95},
        }
    if reward["kind"] == "simulated_judge":
        return {
            "run": run(
                "demo-simulated",
                8 if quick else 32,
                6 if quick else 1200,
                checkpoint_every=1 if quick else 10,
            ),
            **arith,
            "validation": {"every": 3 if quick else 50, "max_examples": 100 if quick else 500},
            "stopping": {"patience": 6, "target": 0.9, "warmup": 0 if quick else 400},
        }
    # The learned judge (and a real judge): small steps, frequent validation, early stopping. The step count
    # is fixed by the config (never by the clock), so a run is reproducible on any machine.
    return {
        "run": run("demo", 4 if quick else 16, 6 if quick else 60, checkpoint_every=1 if quick else 4),
        **arith,
        "validation": {"every": 2, "max_examples": 50 if quick else 200, "sampled": False},
        "train": {"lr": 1e-4},
        "stopping": {"patience": 8, "target": 0.9},
    }


def banner(cfg: dict[str, Any]) -> str:
    """What the run trains with and what validates it, in plain words."""
    r, v, run = cfg["reward"], cfg["validation"], cfg["run"]
    kind = r["kind"]
    if kind == "learned_judge":
        judge = (
            f"the learned judge {r['learned']['model']}: a small reward model trained on preferences of an "
            "imperfect annotator (noisy about correctness, and it likes answers that show their work, which the "
            "strict verifier rejects): it can be fooled, and the table below shows by what; rewards are relative "
            "within each group"
        )
    elif kind == "simulated_judge":
        judge = (
            "a SIMULATED judge (lab instrument): its hidden gold is the strict verifier plus noise, so train "
            "reward and validation are nearly the same signal"
        )
    else:
        judge = (
            f"the RULER judge {r.get('judge_model')} at {r.get('judge_base_url') or 'the default endpoint'}"
        )
    policy = (
        "calc-base on multi-turn calculator episodes" if cfg["model"]["name"] == "calc-base" else "arith-base"
    )
    return (
        f"palaestra demo: training {policy} ({run['max_steps']} steps max, {run['groups_per_step']}x"
        f"{run['group_size']} rollouts per step) with rewards from {judge}.\n"
        f"Validation: the strict verifier arith-strict, greedy, on {v['max_examples']} val examples every "
        f"{v['every']} steps; it decides when to stop and which checkpoint is kept. Final accuracy: the "
        f"{TEST_SPLIT} split, never used for any decision.\n-> {run['output_dir']}"
    )


def fooled(
    examples: list[dict[str, Any]], completions: list[str], correct: list[bool], scores: list[float]
) -> dict[str, Any]:
    """Wrong answers (strict verifier) the judge rates above even (absolute reward > 0.5): how many, and the
    highest-rated one, so the table shows what the policy learned to feed the judge."""
    if not (wrong := [(s, i) for i, (ok, s) in enumerate(zip(correct, scores)) if not ok and s > 0.5]):
        return {"count": 0, "example": None}
    score, i = max(wrong)
    example = {"prompt": examples[i]["prompt"], "completion": completions[i], "judge": score}
    return {"count": len(wrong), "example": example}


def test_table(
    run_dir: Path, cfg: dict[str, Any], *, limit: int | None, scorer: Any = None
) -> dict[str, dict[str, Any]]:
    """Greedy accuracy on the test split of the base policy, the restored best and the last step's weights,
    with the judge's mean absolute reward ``sigmoid(raw)`` on the same completions (when ``scorer`` is given)."""
    from palaestra.envs.registry import get_env
    from palaestra.judges.learned import sigmoid
    from palaestra.models.registry import load
    from palaestra.trainer.checkpoints import load_checkpoint
    from palaestra.trainer.expconfig import config_from_dict
    from palaestra.trainer.loop import GRPOTrainer
    from palaestra.trainer.validation import evaluate_accuracy

    examples = list(get_env(cfg["env"]["name"]).load_split(TEST_SPLIT))[: limit or None]
    max_tokens = int(cfg["env"]["max_tokens"])
    base = load(cfg["model"]["name"])
    best = load(run_dir / "model.npz")
    last = load(cfg["model"]["name"])
    state = load_checkpoint(run_dir / "checkpoints" / "latest.npz")["trainer"]
    GRPOTrainer(last, config_from_dict(cfg).train).load_state_dict(state, weights_only=True)
    out: dict[str, dict[str, Any]] = {}
    for label, model in (("base", base), ("restored best", best), ("last step", last)):
        acc = evaluate_accuracy(model, examples, greedy=True, samples=0, max_tokens=max_tokens, seed=0)
        res = asyncio.run(acc)
        entry: dict[str, Any] = {"test_accuracy": res.greedy, "n": len(examples)}
        if scorer is not None:
            texts = [r.get("greedy_completion", "") for r in res.rows]
            correct = [float(r.get("greedy_reward") or 0.0) > 0.5 for r in res.rows]
            scores = [
                sigmoid(scorer.score_texts(str(ex["prompt"]), [t])[0]) for ex, t in zip(examples, texts)
            ]
            entry["judge_mean_reward"] = sum(scores) / len(scores) if scores else float("nan")
            entry["judge_fooled"] = fooled(examples, texts, correct, scores)
        out[label] = entry
    return out


def run_demo(args: argparse.Namespace) -> int:
    from palaestra.trainer.experiment import Experiment

    cfg = demo_config(args)
    print(banner(cfg), flush=True)
    t0 = time.perf_counter()
    exp = Experiment(cfg, yes=args.yes)
    summary = exp.run_sync()
    run_dir = Path(summary["run"])
    learned = cfg["reward"]["kind"] == "learned_judge"
    scorer = load_reward_model(cfg["reward"]["learned"]["model"]) if learned else None
    arith = cfg["model"]["name"] == "arith-base"
    table = test_table(run_dir, cfg, limit=200 if args.quick else None, scorer=scorer) if arith else {}
    wall = time.perf_counter() - t0
    history = exp.folder.read_history()
    curve = [
        (int(r["step"]), r["judge/absolute_sum"] / r["judge/absolute_n"])
        for r in history
        if r.get("judge/absolute_n")
    ]
    base, best, stop = summary["base_val"], summary["best_val"], summary["stop"]
    report = {
        "judge": cfg["reward"]["kind"],
        "reward_model": cfg["reward"].get("learned", {}).get("model"),
        "reward_model_fingerprint": getattr(scorer, "fingerprint", None),
        "test_split": TEST_SPLIT,
        "test": table,
        "stop": stop,
        "steps": summary["steps"],
        "best_val_step": best.get("step"),
        "best_val_greedy_accuracy (selection)": best.get("greedy_accuracy"),
        "base_val_greedy_accuracy": base.get("greedy_accuracy"),
        "judge_reward_curve": curve,
        "val_curve": [
            (int(r["step"]), r["val/greedy_accuracy"]) for r in history if "val/greedy_accuracy" in r
        ],
        "train_seconds": summary["wall_seconds"],
        "wall_seconds": wall,
        "curves": summary["curves"],
    }
    write_json(run_dir / "demo.json", report)  # atomic, secrets scrubbed
    nan = float("nan")
    rows: dict[str, Any] = {}  # the final table, in print order
    for label, entry in table.items():
        judge = (
            f", judge mean reward {entry['judge_mean_reward']:.3f}" if "judge_mean_reward" in entry else ""
        )
        rows[f"{label}: {TEST_SPLIT} accuracy (greedy)"] = f"{entry['test_accuracy']:.3f}{judge}"
    rows["best val accuracy (selection)"] = (
        f"{best.get('greedy_accuracy', nan):.3f} at step {best.get('step')} "
        f"(base {base.get('greedy_accuracy', nan):.3f})"
    )
    last = table.get("last step", {}).get("judge_fooled")
    if last is not None:
        ex = last["example"]
        rows[f"judge fooled at the last step ({TEST_SPLIT})"] = (
            f"{last['count']} of {table['last step']['n']} wrong answers rated above even"
            + (f", e.g. {ex['completion']!r} to {ex['prompt'].split('?')[0] + '?'!r}" if ex else "")
        )
    if "greedy_tool_correct" in base:
        rows["tool used correctly (greedy)"] = (
            f"{base['greedy_tool_correct']:.3f} -> {best.get('greedy_tool_correct', nan):.3f}"
        )
    if curve:
        peak = int(best.get("step") or 0)
        start = [(s, v) for s, v in curve if s <= max(peak, curve[0][0])][-1]
        if curve[-1][0] > start[0]:
            rows["judge reward after the val peak"] = (
                f"{start[1]:.3f} at step {start[0]} -> {curve[-1][1]:.3f} at step {curve[-1][0]} "
                f"(val peak at step {peak})"
            )
    rows["stop"] = f"{stop['reason']} at step {stop['step']} (best step {stop.get('best_step')} restored)"
    rows["wall time"] = f"{wall:.1f} s (training {summary['wall_seconds']:.1f} s)"
    rows["curves"] = summary["curves"]
    rows["run folder"] = summary["run"]
    width = max(map(len, rows))
    print()
    for k, v in rows.items():
        print(f"  {k:<{width}}  {v}")
    from palaestra.trainer.stopping import stop_exit_code

    return stop_exit_code(stop["reason"])  # 3 when the judge was unavailable: palaestra train --resume
