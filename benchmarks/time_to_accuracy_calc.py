"""Time to accuracy on the calculator task: GRPO from the shipped calc-base on multi-turn tool-use episodes.

    python benchmarks/time_to_accuracy_calc.py [--seconds 60] [--groups 16] [--group-size 8] [--lr 2e-4]
                                               [--val-n 200] [--eval-every 5] [--tool-cost 0] [--csv out.csv]
                                               [--shuffle-rewards] [--cost-per-turn] [--turn-credit returns]
                                               [--compare-costs] [--arms none,final,turn] [--easy-share 0.5]
                                               [--quick]

Each step: ``--groups`` train problems (seeded draw; ``--easy-share F``: a share F of them easy, the rest
hard), one ``calculator_group_rollout`` each (the first reply of all ``--group-size`` episodes from one
chat-completions request with ``n`` choices, then every episode goes on by itself: tool calls through the
OpenAI tools API of the model's in-process client, results from the exact ``calc`` tool, at most
``--max-turns`` replies), reward = strict ``Final: <int>`` verifier on the last reply minus ``--tool-cost`` per
call, one ``GRPOTrainer.step``. Every ``--eval-every`` steps: greedy and
temperature-1 episodes on the first ``--val-n`` val problems (``evaluate_calculator``), reporting accuracy and
the fraction of episodes that used the tool (``tool_use``) and used it correctly (``tool_ok``: a call
returned the expected answer). ``rl_s`` counts rollouts + updates and EXCLUDES validation; ``wall_s``
includes it. ``--shuffle-rewards`` permutes rewards across the batch each step (control: must not learn).

Tool costs and per-turn credit: ``--tool-cost C`` subtracts C per call from the final reward;
``--cost-per-turn`` records it instead as the per-turn reward of the calling turn, which only per-turn credit
(``--turn-credit returns`` or ``turn_group``) sees. Validation also reports greedy tool use and accuracy by
difficulty (``use_easy``/``use_hard``, ``acc_easy``/``acc_hard``: easy = the ``add`` family) and sampled tool
use by difficulty (``s_use_easy``/``s_use_hard``: temperature 1, one seeded episode per problem).
``--compare-costs`` trains the ``--arms`` from calc-base on the same seed and budget (default all four: no cost;
cost in the final reward; cost per turn with final-reward credit; cost per turn with per-turn credit
``returns``), and prints tool use by difficulty before and after, each arm's accuracy minus the no-cost arm's,
and a verdict line per costed arm (easy and hard tool use against the no-cost arm's, accuracy within 2 points).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.envs.calculator import calculator_group_rollout, evaluate_calculator
from palaestra.envs.calculator_data import difficulty_of, load_split
from palaestra.models.registry import load
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.loop import GRPOTrainer
from palaestra.trajectories.types import TrajectoryGroup

COLUMNS = (
    "step",
    "rl_s",
    "wall_s",
    "greedy",
    "sampled",
    "tool_use",
    "tool_ok",
    "calls",
    "use_easy",
    "use_hard",
    "acc_easy",
    "acc_hard",
    "s_use_easy",
    "s_use_hard",
    "train_reward",
)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = load(args.model)
    trainer = GRPOTrainer(model, TrainConfig(lr=args.lr, seed=args.seed, turn_credit=args.turn_credit))
    train, val = load_split("train"), load_split("val")[: args.val_n]
    easy = [r for r in train if difficulty_of(r.get("family")) == "easy"]
    hard = [r for r in train if difficulty_of(r.get("family")) == "hard"]
    rows: list[dict[str, Any]] = []
    rl_s, last_reward = 0.0, float("nan")
    t_wall = time.perf_counter()

    async def validate(step: int) -> None:
        res = await evaluate_calculator(model, val, seed=10_000, max_turns=args.max_turns)
        row = {
            "step": step,
            "rl_s": round(rl_s, 2),
            "wall_s": round(time.perf_counter() - t_wall, 2),
            "greedy": res["greedy_accuracy"],
            "sampled": res["sampled_accuracy"],
            "tool_use": res["greedy_tool_use"],
            "tool_ok": res["greedy_tool_correct"],
            "calls": res["greedy_tool_calls"],
            "use_easy": res.get("greedy_tool_use_easy", float("nan")),
            "use_hard": res.get("greedy_tool_use_hard", float("nan")),
            "acc_easy": res.get("greedy_accuracy_easy", float("nan")),
            "acc_hard": res.get("greedy_accuracy_hard", float("nan")),
            "s_use_easy": res.get("sampled_tool_use_easy", float("nan")),
            "s_use_hard": res.get("sampled_tool_use_hard", float("nan")),
            "train_reward": last_reward,
        }
        rows.append(row)
        print(
            " ".join(f"{row[c]:>8.3f}" if isinstance(row[c], float) else f"{row[c]:>8}" for c in COLUMNS),
            flush=True,
        )

    async def collect(step: int) -> list[TrajectoryGroup]:
        rng = np.random.default_rng([args.seed, step])
        if args.easy_share is None:
            examples = [train[int(i)] for i in rng.choice(len(train), size=args.groups, replace=False)]
        else:  # a fixed share of easy problems per step, the rest hard
            k = round(args.easy_share * args.groups)
            examples = [easy[int(i)] for i in rng.choice(len(easy), size=k, replace=False)]
            examples += [hard[int(i)] for i in rng.choice(len(hard), size=args.groups - k, replace=False)]
        groups = await asyncio.gather(
            *(
                calculator_group_rollout(
                    model,
                    ex,
                    args.group_size,
                    temperature=1.0,
                    max_tokens=24,
                    seed=args.seed * 1_000_003 + step * 1_000 + g,
                    max_turns=args.max_turns,
                    tool_cost=args.tool_cost,
                    cost_per_turn=args.cost_per_turn,
                )
                for g, ex in enumerate(examples)
            )
        )
        out = [TrajectoryGroup(list(g)) for g in groups]
        if args.shuffle_rewards:
            flat = [t for g in out for t in g.trajectories]
            for t, r in zip(flat, rng.permutation([t.reward for t in flat])):
                t.reward = float(r)
        return out

    print(" ".join(f"{c:>8}" for c in COLUMNS))
    await validate(0)
    step = 0
    t_clock = time.perf_counter()
    while rl_s + (time.perf_counter() - t_clock) < args.seconds and step < args.max_steps:
        step += 1
        result = await trainer.step(await collect(step))
        last_reward = result.metrics["reward_mean"]
        if step % args.eval_every == 0:
            rl_s += time.perf_counter() - t_clock
            await validate(step)
            t_clock = time.perf_counter()
    rl_s += time.perf_counter() - t_clock
    if rows[-1]["step"] != step:
        await validate(step)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="calc-base", help="shipped model name or .npz path")
    p.add_argument("--seconds", type=float, default=60.0, help="RL time budget (validation excluded)")
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--groups", type=int, default=16, help="problems per step")
    p.add_argument("--group-size", type=int, default=8, help="episodes per problem")
    p.add_argument("--max-turns", type=int, default=3, help="assistant replies per episode")
    p.add_argument("--tool-cost", type=float, default=0.0, help="reward cost per tool call")
    p.add_argument(
        "--cost-per-turn",
        action="store_true",
        help="record the cost as a per-turn reward, not in the final one",
    )
    p.add_argument(
        "--turn-credit", choices=("final", "returns", "turn_group"), default="final", help="per-turn credit"
    )
    p.add_argument(
        "--compare-costs",
        action="store_true",
        help="train the --arms from the same base and seed and compare tool use by difficulty",
    )
    p.add_argument(
        "--arms",
        default="none,final,turn-final,turn",
        help="--compare-costs arms: none (no cost), final (cost in the final reward), turn-final (cost per "
        "turn, final-reward credit), turn (cost per turn, per-turn returns credit); first must be none",
    )
    p.add_argument(
        "--easy-share",
        type=float,
        default=None,
        help="share of easy problems among each step's groups (default: draw from the train split as it is)",
    )
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--shuffle-rewards", action="store_true", help="control: permute rewards across the batch")
    p.add_argument("--val-n", type=int, default=200, help="validation problems (first N of val)")
    p.add_argument("--eval-every", type=int, default=5, help="validate every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--csv", type=Path, default=None, help="CSV output (default: time_to_accuracy_calc.csv here)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 3 steps, 4x4, 40 val problems")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.max_steps, args.groups, args.group_size = 5.0, 3, 4, 4
        args.val_n, args.eval_every = 40, 3
    print(
        f"time_to_accuracy_calc: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} "
        f"python {platform.python_version()} numpy {np.__version__} on {platform.machine()} "
        f"({os.cpu_count()} cpus); model {args.model}; {args.groups}x{args.group_size} episodes per step; "
        f"tool cost {args.tool_cost}; easy share {args.easy_share or 'as in train'}; budget {args.seconds:.0f} s RL time (validation excluded); val n={args.val_n}"
    )
    if args.compare_costs:
        return compare_costs(args)
    rows = asyncio.run(run(args))
    out = args.csv or Path("time_to_accuracy_calc.csv")
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        w.writeheader()
        w.writerows(rows)
    base, best = rows[0], max(rows, key=lambda r: r["greedy"])
    hit = next((r for r in rows if r["greedy"] >= base["greedy"] + 0.20), None)
    print(
        f"greedy {base['greedy']:.3f} -> best {best['greedy']:.3f} at rl_s {best['rl_s']:.1f} (step {best['step']}); "
        f"tool used correctly {base['tool_ok']:.3f} -> {best['tool_ok']:.3f}; "
        + (f"+0.20 reached at rl_s {hit['rl_s']:.1f}" if hit else "+0.20 not reached")
        + f"; CSV: {out}"
    )
    return 0


#: --arms key -> (label, tool cost (None: --tool-cost), cost_per_turn, turn_credit)
ARMS = {
    "none": ("no cost", 0.0, False, "final"),
    "final": ("cost in final reward", None, False, "final"),
    "turn-final": ("cost per turn, final credit", None, True, "final"),
    "turn": ("cost per turn, per-turn credit", None, True, "returns"),
}


def compare_costs(args: argparse.Namespace) -> int:
    """``--compare-costs``: the arms of ``--arms`` (module docstring) on the same seed and budget."""
    cost = args.tool_cost or 0.1
    keys = [k.strip() for k in args.arms.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ARMS]
    if unknown or not keys or keys[0] != "none":
        raise SystemExit(
            f"--arms: a comma list starting with 'none', from {', '.join(ARMS)}; got {args.arms!r}"
        )
    results = []
    for label, arm_cost, per_turn, credit in (ARMS[k] for k in keys):
        arm = argparse.Namespace(**vars(args))
        arm.tool_cost = cost if arm_cost is None else arm_cost
        arm.cost_per_turn, arm.turn_credit = per_turn, credit
        print(
            f"\n== arm: {label} (tool cost {arm.tool_cost}, cost_per_turn {per_turn}, turn_credit {credit})"
        )
        rows = asyncio.run(run(arm))
        results.append((label, arm, rows))
    out = args.csv or Path("time_to_accuracy_calc_costs.csv")
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["arm", "tool_cost", "cost_per_turn", "turn_credit", *COLUMNS])
        w.writeheader()
        for label, arm, rows in results:
            for r in rows:
                w.writerow(
                    {
                        "arm": label,
                        "tool_cost": arm.tool_cost,
                        "cost_per_turn": arm.cost_per_turn,
                        "turn_credit": arm.turn_credit,
                        **r,
                    }
                )
    ref = results[0][2][-1]["greedy"]
    print(f"\ntool use by difficulty (greedy, val n={args.val_n}; easy = add family), tool cost {cost}:")
    head = ("arm", "use_easy", "use_hard", "s_use_easy", "s_use_hard", "acc_easy", "acc_hard", "greedy")
    print(f"{head[0]:<32}" + "".join(f"{h:>14}" for h in head[1:]) + f"{'vs_no_cost':>12}")
    for label, _, rows in results:
        a, b = rows[0], rows[-1]
        cells = [f"{a[k]:.3f}->{b[k]:.3f}" for k in head[1:]]
        print(f"{label:<32}" + "".join(f"{c:>14}" for c in cells) + f"{b['greedy'] - ref:>+12.3f}")
    free = results[0][2][-1]
    for label, _, rows in results[1:]:
        b = rows[-1]
        gap = b["greedy"] - ref
        print(
            f"verdict {label}: easy tool use {b['use_easy']:.3f} (sampled {b['s_use_easy']:.3f}) vs "
            f"{free['use_easy']:.3f} ({free['s_use_easy']:.3f}) without cost, hard {b['use_hard']:.3f} "
            f"({b['s_use_hard']:.3f}) vs {free['use_hard']:.3f} ({free['s_use_hard']:.3f}); "
            f"accuracy {b['greedy']:.3f} vs {ref:.3f} "
            f"({100 * gap:+.1f} points: {'within' if abs(gap) <= 0.02 + 1e-9 else 'NOT within'} 2)"
        )
    print(f"CSV: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
