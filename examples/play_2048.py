"""Multi-turn rollouts on 2048 with any OpenAI-compatible chat model.

    python examples/play_2048.py                                   # offline, embedded arith-base
    python examples/play_2048.py --base-url http://127.0.0.1:8000/v1 --model my-model --api-key-env KEY

Each game is one trajectory: the system message states the rules, then every turn sends the board and the
model answers with a move (``up``/``down``/``left``/``right``, or ``<move>up</move>``). The episode ends on a
win, a loss, an invalid or no-op reply (penalised), or ``--max-turns``. Games are grouped (``--group-size``
plays of the same seeded board) exactly as a trainer would need them, and the groups are written to
``--out``. Reward: progress towards the target tile, +1 for a win, -1 for an invalid move (see
``palaestra.envs.game2048``).

Offline the player is an untrained embedded TinyGPT (the shipped ``arith-base`` knows only arithmetic and
its 64-token context cannot even hold the rules): it replies with noise and nearly every game ends at its
first reply with an invalid move. That is expected; the script reports the invalid-move rate so you can
watch it fall on a model that can play.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from typing import Any

from palaestra import TrajectoryGroup, gather_trajectory_groups, write_groups
from palaestra.envs.game2048 import make_scenarios
from palaestra.envs.rollouts import rollout_2048

UNTRAINED = "untrained-tiny"


def load_model(args: argparse.Namespace) -> Any:
    """A remote model, a shipped embedded one, or (default offline) an untrained embedded TinyGPT.

    The shipped ``arith-base`` has a 64-token context, too short for the rules and a board (~520 tokens), so
    the offline default is a randomly initialised TinyGPT with a 2048-token context: a policy that has
    learned nothing, over the same OpenAI-compatible API a trained one would use.
    """
    if args.base_url:
        from palaestra.models.remote import RemoteModel

        return RemoteModel(args.model, base_url=args.base_url, api_key_env=args.api_key_env)
    from palaestra.models.embedded import EmbeddedModel
    from palaestra.models.registry import load
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    if args.model != UNTRAINED:
        return load(args.model)
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=2048, d_model=32, n_layer=1, n_head=2, d_ff=64)
    return EmbeddedModel(TinyGPT(cfg, tokenizer=tok, seed=args.seed), name=UNTRAINED)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint (default: the embedded model)")
    parser.add_argument(
        "--model", default=UNTRAINED, help=f"model name; offline: {UNTRAINED} or a shipped model"
    )
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the key (if any)")
    parser.add_argument("--games", type=int, default=8, help="distinct seeded boards")
    parser.add_argument("--group-size", type=int, default=4, help="plays of each board")
    parser.add_argument("--target", type=int, default=128, help="tile that wins")
    parser.add_argument("--max-turns", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the groups to this JSONL file")
    parser.add_argument("--quick", action="store_true", help="small settings (CI)")
    args = parser.parse_args()
    if args.quick:
        args.games, args.group_size, args.max_turns = 2, 2, 8
    model = load_model(args)
    scenarios = make_scenarios(args.games, seed=args.seed, target=args.target)
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(
                (
                    rollout_2048(
                        model,
                        sc,
                        max_turns=args.max_turns,
                        temperature=args.temperature,
                        max_tokens=args.max_tokens,
                        seed=args.seed * 10_000 + 100 * g + i,
                    )
                    for i in range(args.group_size)
                ),
                metadata={"scenario_id": sc["id"]},
            )
            for g, sc in enumerate(scenarios)
        ),
        max_concurrency=args.concurrency,
        max_exceptions=args.games * args.group_size,  # report failures below instead of aborting
        progress=False,
    )
    trajs = [t for g in groups for t in g]
    n = max(len(trajs), 1)
    ends = Counter(str(t.metadata.get("end_reason")) for t in trajs)
    tiles = Counter(int(t.metrics["max_tile"]) for t in trajs)
    replies = sum(int(t.metrics["turns"]) for t in trajs)
    invalid = sum(bool(t.metrics["invalid_move"]) for t in trajs)
    failed = sum(len(g.exceptions) for g in groups)
    print(f"model {model.name}: {len(trajs)} games on {len(groups)} boards ({failed} failed rollouts)")
    if failed:
        first_error = next(e for g in groups for e in g.exceptions)
        print(f"first failure: {first_error.type}: {first_error.message[:200]}")
    wins = sum(bool(t.metrics["won"]) for t in trajs)
    moves = sum(int(t.metrics["moves"]) for t in trajs) / n
    print(f"mean reward {sum(t.reward for t in trajs) / n:.3f}   wins {wins}   mean moves {moves:.1f}")
    print(
        f"invalid-move rate: {invalid}/{len(trajs)} games ended on an invalid or no-op reply "
        f"({invalid / n:.0%}); {invalid}/{replies} replies"
    )
    print(f"end reasons: {dict(sorted(ends.items()))}   max tiles: {dict(sorted(tiles.items()))}")
    if trajs:
        first = trajs[0]
        print("first game, last exchange:")
        for m in first.messages()[-2:]:
            print(f"  {m['role']:>9}: {str(m.get('content'))[:120]!r}")
    if args.out:
        write_groups(args.out, groups)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
