"""One training loop, two reward sources: a verifier or an LLM judge, switched by ``--reward``.

    python examples/verifier_vs_judge.py --reward verifier
    python examples/verifier_vs_judge.py --reward judge                       # offline judge (see below)
    python examples/verifier_vs_judge.py --reward judge --judge-model gpt-4o-mini \\
        --judge-base-url https://api.openai.com/v1 --judge-api-key-env OPENAI_API_KEY

The loop is written out (no Experiment): each step samples ``--groups`` questions x ``--group-size`` answers
from the embedded policy, scores every group with ``reward.score_group(group, example)`` (the one protocol
verifiers and judges share), and takes one GRPO step. Every ``--val-every`` steps it measures strict-verifier
accuracy on validation questions: whatever the train reward, that is how the run is judged.

``--reward verifier`` scores with the strict ``Final: <int>`` verifier (absolute 0/1 rewards).
``--reward judge`` scores with a RULER judge (relative scores within each group, one request per group).
Without ``--judge-base-url`` the judge endpoint is a local ``ScriptedServer`` playing a simulated judge
(it recomputes the answer from the question and adds noise), so the real ``RulerJudge`` code runs over real
HTTP, offline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

from palaestra import Trajectory, TrajectoryGroup, gather_trajectory_groups
from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split
from palaestra.envs.rollouts import single_turn_rollout
from palaestra.envs.verifier import VerifierReward
from palaestra.models.registry import load
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.loop import GRPOTrainer
from palaestra.trainer.validation import evaluate_accuracy

STRICT = StrictFinalVerifier()
_QUESTION = re.compile(r"What is (\d+)([+-])(\d+)\?")


def gold_from_question(traj: Trajectory, example: Mapping[str, Any] | None) -> float:
    """The simulated judge's hidden truth: recompute the answer from the question, score with the verifier."""
    question = next(m["content"] for m in traj.messages() if m["role"] == "user")
    a, op, b = _QUESTION.search(question).groups()  # type: ignore[union-attr]
    expected = str(int(a) + int(b) if op == "+" else int(a) - int(b))
    return STRICT.score({"expected_answer": expected}, traj.last_assistant_text() or "").reward


@contextlib.contextmanager
def make_reward(args: argparse.Namespace) -> Iterator[Any]:
    """The train reward named by ``--reward``; both kinds implement ``await score_group(group, example)``."""
    if args.reward == "verifier":
        yield VerifierReward(STRICT)
        return
    from palaestra.judges.ruler import RulerJudge

    if args.judge_base_url:
        yield RulerJudge(
            args.judge_model, base_url=args.judge_base_url, api_key_env=args.judge_api_key_env, seed=args.seed
        )
        return
    from palaestra.judges.simulated import SimulatedJudge
    from palaestra.testing import ScriptedServer

    simulated = SimulatedJudge(gold_from_question, noise=0.1, seed=args.seed)
    with ScriptedServer(simulated.as_script(), model="simulated-judge") as server:
        yield RulerJudge("simulated-judge", base_url=server.base_url, seed=args.seed)


async def train(args: argparse.Namespace, reward: Any) -> None:
    model = load(args.model)
    trainer = GRPOTrainer(model, TrainConfig(lr=args.lr, seed=args.seed))
    train_split, val = load_split("train"), load_split("val")[: args.val_examples]
    rng = random.Random(args.seed)

    async def val_accuracy() -> float:
        result = await evaluate_accuracy(model, val, max_tokens=args.max_tokens, seed=args.seed)
        return float(result.greedy or 0.0)

    base = await val_accuracy()
    print(f"reward: {args.reward} ({type(reward).__name__}); step 0: val accuracy (greedy) {base:.3f}")
    dropped = 0
    for step in range(1, args.steps + 1):
        examples = rng.sample(train_split, args.groups)

        async def score(
            group: TrajectoryGroup, examples: list[dict[str, Any]] = examples
        ) -> TrajectoryGroup | None:
            nonlocal dropped
            scored = await reward.score_group(group, examples[int(group.metadata["index"])])
            dropped += scored is None  # a judge that failed drops the group; it never scores it 0
            return scored

        groups = await gather_trajectory_groups(
            (
                TrajectoryGroup(
                    (
                        single_turn_rollout(model, ex, max_tokens=args.max_tokens, seed=rng.randrange(2**31))
                        for _ in range(args.group_size)
                    ),
                    metadata={"index": g, "example_id": ex["id"], "judge_salt": f"{args.seed}:{step}:{g}"},
                )
                for g, ex in enumerate(examples)
            ),
            after_each=score,
            max_exceptions=0.1,
            progress=False,
        )
        result = await trainer.step(groups)
        strict = sum(
            STRICT.score(ex, t.last_assistant_text() or "").reward
            for ex, g in zip(examples, groups)
            for t in g
        )
        line = (
            f"step {step:>3}: train reward {result.metrics['reward_mean']:.3f}  strict accuracy of the same "
            f"samples {strict / max(sum(len(g) for g in groups), 1):.3f}"
        )
        if step % args.val_every == 0 or step == args.steps:
            line += f"  | val accuracy {await val_accuracy():.3f}"
        print(line)
    text = f"done: base val {base:.3f}; groups dropped by the reward {dropped}"
    usage = getattr(reward, "usage", None)
    if usage is not None:
        text += (
            f"; judge: {usage.calls} calls for {usage.groups} groups, {usage.prompt_tokens} prompt + "
            f"{usage.completion_tokens} completion tokens, {usage.unscored} unscored"
        )
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", choices=("verifier", "judge"), default="verifier", help="the one switch")
    parser.add_argument(
        "--judge-model", default="gpt-4o-mini", help="judge model name (with --judge-base-url)"
    )
    parser.add_argument("--judge-base-url", help="OpenAI-compatible judge endpoint (default: offline)")
    parser.add_argument(
        "--judge-api-key-env", default="OPENAI_API_KEY", help="env var holding the judge's key"
    )
    parser.add_argument("--model", default="arith-base", help="embedded policy to train (name or .npz)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--val-examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small settings (CI)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.groups, args.group_size, args.val_every, args.val_examples = 3, 4, 4, 3, 50
    with make_reward(args) as reward:
        asyncio.run(train(args, reward))


if __name__ == "__main__":
    main()
