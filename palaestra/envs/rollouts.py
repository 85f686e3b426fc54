"""Rollout functions for the shipped environments, using only ``model.name`` and ``model.openai_client()``. API
errors propagate: a failed rollout is recorded by its group as an exception, never scored 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

from palaestra.envs.game2048 import PENALISED_ENDS, Game2048, turn_prompt
from palaestra.envs.game2048 import system_prompt as game_system_prompt
from palaestra.trajectories.protocols import ChatModel
from palaestra.trajectories.types import Trajectory


async def request_choices(
    model: ChatModel,
    messages: list[dict[str, Any]],
    n: int | None = None,
    *,
    temperature: float,
    max_tokens: int,
    seed: int | None = None,
    logprobs: bool = True,
    **extra: Any,
) -> tuple[list[Choice], ChatCompletion]:
    """``(choices sorted by index, response)`` of one chat-completions request (fields that are None are not sent);
    RuntimeError when the endpoint returns no choice, or not ``n`` of them.

    The client's own ``post`` plus a pydantic ``ChatCompletion`` validation rather than ``create``: the same
    objects for about half the client CPU (benchmarks/RESULTS.md, time_to_accuracy)."""
    body: dict[str, Any] = {"model": model.name, "messages": messages, "n": n, "temperature": temperature}
    body.update(max_tokens=max_tokens, logprobs=logprobs, seed=seed, **extra)
    body = {k: v for k, v in body.items() if v is not None}
    data = await model.openai_client().post("/chat/completions", body=body, cast_to=object)
    if not isinstance(data, dict):
        raise RuntimeError(f"model {model.name!r} replied with {type(data).__name__}, not a JSON object")
    try:
        response = ChatCompletion.model_validate(data)
    except ValidationError:
        response = ChatCompletion.construct(**data)
    choices = sorted(response.choices or [], key=lambda c: c.index)
    if not choices or (n is not None and len(choices) != n):
        raise RuntimeError(f"model {model.name!r} returned {len(choices)} choices, asked for {n or 1}")
    return choices, response


async def single_turn_rollout(
    model: ChatModel,
    example: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int | None = None,
    system_prompt: str | None = None,
) -> Trajectory:
    """One chat turn on an arithmetic-style example (user message ``example["prompt"]``); the reward is left at 0
    for a :class:`~palaestra.envs.verifier.VerifierReward` to fill in."""
    messages, meta = single_turn_start(model, example, temperature, max_tokens, seed, system_prompt)
    traj = Trajectory(messages_and_choices=list(messages), metadata=meta)
    (choice, *_), _ = await request_choices(
        model, messages, temperature=temperature, max_tokens=max_tokens, seed=seed
    )
    traj.messages_and_choices.append(choice)
    return traj.finish()


def single_turn_start(
    model: ChatModel,
    example: Mapping[str, Any],
    temperature: float,
    max_tokens: int,
    seed: int | None,
    system_prompt: str | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    prompt = example.get("prompt") if isinstance(example, Mapping) else None
    if not isinstance(prompt, str):
        raise ValueError(f"example field 'prompt' must be a string, got {type(prompt).__name__}")
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages: list[dict[str, Any]] = [*system, {"role": "user", "content": prompt}]
    meta = {"example_id": str(example.get("id")), "model": model.name, "temperature": float(temperature)}
    return messages, {**meta, "max_tokens": max_tokens, "seed": seed}


async def single_turn_group_rollout(
    model: ChatModel,
    example: Mapping[str, Any],
    n: int,
    *,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int | None = None,
    system_prompt: str | None = None,
) -> list[Trajectory]:
    """``n`` attempts at one example from ONE request with ``n`` choices: choice ``i`` is trajectory ``i``
    (``metadata["choice_index"]``); ``metadata["policy"]`` is the response's ``system_fingerprint``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    messages, meta = single_turn_start(model, example, temperature, max_tokens, seed, system_prompt)
    choices, response = await request_choices(
        model, messages, n, temperature=temperature, max_tokens=max_tokens, seed=seed
    )
    return trajectories_from_choices(messages, {**meta, "policy": response.system_fingerprint}, choices)


def trajectories_from_choices(
    messages: list[dict[str, Any]], metadata: Mapping[str, Any], choices: list[Any]
) -> list[Trajectory]:
    """One finished trajectory per choice: the prompt messages, the Choice, ``metadata`` + ``choice_index``."""
    return [
        Trajectory(messages_and_choices=[*messages, c], metadata={**metadata, "choice_index": i}).finish()
        for i, c in enumerate(choices)
    ]


async def rollout_2048(
    model: ChatModel,
    scenario: Mapping[str, Any],
    *,
    max_turns: int = 64,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int | None = None,
) -> Trajectory:
    """Play one 2048 game on ``scenario``, at most ``max_turns`` replies; turn ``t`` samples with ``seed + t``."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    game = Game2048.from_scenario(scenario)
    system = {"role": "system", "content": game_system_prompt(game.target)}
    user = {"role": "user", "content": turn_prompt(game, 1)}
    meta = {"scenario_id": game.scenario_id, "game_seed": game.seed, "target": game.target}
    traj = Trajectory(messages_and_choices=[system, user], metadata={**meta, "model": model.name})
    turns = 0
    while not game.done and turns < max_turns:
        turn_seed = None if seed is None else seed + turns
        (choice, *_), _ = await request_choices(
            model, traj.messages(), temperature=temperature, max_tokens=max_tokens, seed=turn_seed
        )
        traj.messages_and_choices.append(choice)
        turns += 1
        reply = choice.message.content or ""
        result = game.play(reply)
        if result.move is None:
            traj.log(f"turn {turns}: invalid reply {reply[:80]!r}")
        elif not result.changed:
            traj.log(f"turn {turns}: move {result.move!r} does not change the board")
        if not game.done:
            traj.messages_and_choices.append({"role": "user", "content": turn_prompt(game, turns + 1)})
    game.end("max_turns")  # a game that already ended keeps its reason
    traj.reward = game.reward()
    board = {"max_tile": game.max_tile, "board_sum": game.board_sum, "score": game.score, "moves": game.moves}
    traj.metrics.update(board, turns=turns, won=game.won, invalid_move=game.end_reason in PENALISED_ENDS)
    traj.metadata.update(end_reason=game.end_reason, final_board=game.render())
    return traj.finish()
