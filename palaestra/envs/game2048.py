"""2048 on a 4x4 board: a small deterministic multi-turn environment. Scenario, board text, move format, episode
end and reward are specified in docs/environments.md, "2048"; the reward is :func:`episode_reward`."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.envs.arithmetic import answer_region

SIZE = 4
DEFAULT_TARGET = 128
WIN_BONUS = 1.0
INVALID_PENALTY = 1.0
DIRECTIONS = ("up", "down", "left", "right")
_MOVE = re.compile(
    r"(up|down|left|right)|<move>[ \t]*(up|down|left|right)[ \t]*</move>", re.IGNORECASE | re.ASCII
)
PENALISED_ENDS = ("invalid_move", "noop_move")


def parse_move(reply: Any) -> str | None:
    """The direction a reply names (lower case), or None unless it is exactly one move (docs/environments.md)."""
    if not isinstance(reply, str):
        return None
    text = answer_region(reply)
    match = _MOVE.fullmatch(text) if text is not None and text.isascii() else None
    return None if match is None else (match.group(1) or match.group(2)).lower()


def slide_row_left(row: list[int]) -> tuple[list[int], int]:
    """Slide one row to the left with 2048 merging (each tile at most once, from the leading edge: ``[4, 4, 4, 0]``
    gives ``[8, 4, 0, 0]``); returns ``(new_row, points)`` (sum of merged tiles)."""
    tiles = [v for v in row if v]
    out: list[int] = []
    points = 0
    while tiles:
        tile = tiles.pop(0)
        if tiles and tiles[0] == tile:  # merge with the next tile, which is then used up
            tile += tiles.pop(0)
            points += tile
        out.append(tile)
    return out + [0] * (len(row) - len(out)), points


def _move_board(board: list[list[int]], direction: str) -> tuple[list[list[int]], int]:
    """The board after sliding in ``direction`` (no spawn) and the points scored."""
    if direction in ("up", "down"):
        moved, points = _move_board([list(c) for c in zip(*board)], "left" if direction == "up" else "right")
        return [list(c) for c in zip(*moved)], points  # transposed back
    flip = direction == "right"  # slide the mirrored row left, then mirror it back
    slid = [slide_row_left(row[::-1] if flip else row) for row in board]
    return [new[::-1] if flip else new for new, _ in slid], sum(points for _, points in slid)


def episode_reward(max_tile: int, target: int, *, won: bool, penalised: bool) -> float:
    """``min(1, log2(max_tile)/log2(target)) + WIN_BONUS*won - INVALID_PENALTY*penalised``."""
    progress = 0.0 if max_tile < 2 else min(1.0, math.log2(max_tile) / math.log2(target))
    return progress + (WIN_BONUS if won else 0.0) - (INVALID_PENALTY if penalised else 0.0)


@dataclass(frozen=True)
class StepResult:
    """What one reply did: the parsed move (None if invalid), whether the board changed, points, end state."""

    move: str | None
    changed: bool
    points: int
    done: bool
    end_reason: str | None


class Game2048:
    """One seeded 2048 game. ``step(direction)`` plays a move; ``play(reply)`` parses a reply and plays it."""

    def __init__(self, seed: int, *, target: int = DEFAULT_TARGET, scenario_id: str = "") -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"2048 scenario field 'seed' must be an int, got {seed!r}")
        if isinstance(target, bool) or not isinstance(target, int) or target < 8 or target & (target - 1):
            raise ValueError(f"2048 scenario field 'target' must be a power of two >= 8, got {target!r}")
        if not isinstance(scenario_id, str):
            raise ValueError(f"2048 scenario field 'id' must be a string, got {scenario_id!r}")
        self.scenario_id, self.seed, self.target = scenario_id or f"2048-seed{seed}", seed, target
        self._rng = random.Random(seed)
        self.board: list[list[int]] = [[0] * SIZE for _ in range(SIZE)]
        self.score = 0  # sum of merged tiles, as in the original game
        self.moves = 0  # moves that changed the board
        self.done = False
        self.end_reason: str | None = None
        self._spawn()
        self._spawn()

    @classmethod
    def from_scenario(cls, scenario: Mapping[str, Any]) -> Game2048:
        """Build a game from ``{"id", "seed", "target"}``; a bad field raises ValueError naming it."""
        if not isinstance(scenario, Mapping):
            raise ValueError(f"2048 scenario must be a mapping, got {type(scenario).__name__}")
        target = scenario.get("target", DEFAULT_TARGET)
        return cls(scenario.get("seed"), target=target, scenario_id=scenario.get("id", ""))  # type: ignore[arg-type]

    def _spawn(self) -> None:
        # called on the empty board and after a move that changed it, which always leaves a cell empty
        empty = [(r, c) for r in range(SIZE) for c in range(SIZE) if not self.board[r][c]]
        r, c = empty[self._rng.randrange(len(empty))]
        self.board[r][c] = 4 if self._rng.random() < 0.1 else 2

    @property
    def max_tile(self) -> int:
        """Largest tile on the board."""
        return max(max(row) for row in self.board)

    @property
    def board_sum(self) -> int:
        """Sum of all tiles."""
        return sum(sum(row) for row in self.board)

    @property
    def won(self) -> bool:
        """True once a tile has reached the target."""
        return self.max_tile >= self.target

    def legal_moves(self) -> list[str]:
        """Directions that would change the board."""
        return [d for d in DIRECTIONS if _move_board(self.board, d)[0] != self.board]

    def render(self) -> str:
        """The board as text: 4 lines, cells right-aligned to width 4, ``.`` for empty."""
        return "\n".join(" ".join((str(v) if v else ".").rjust(4) for v in row) for row in self.board)

    def end(self, reason: str) -> None:
        """End the episode (e.g. ``max_turns`` from the rollout); the first reason given is kept."""
        if not self.done:
            self.done, self.end_reason = True, reason

    def step(self, direction: str | None) -> StepResult:
        """Play ``direction``; None or a no-op ends the episode with the penalty. Spawns after a real move."""
        if self.done:
            raise RuntimeError(f"the game is over ({self.end_reason}); no more moves")
        if direction not in DIRECTIONS:
            self.end("invalid_move")
            return StepResult(None, False, 0, True, self.end_reason)
        moved, points = _move_board(self.board, direction)
        if moved == self.board:
            self.end("noop_move")
            return StepResult(direction, False, 0, True, self.end_reason)
        self.board = moved
        self.score += points
        self.moves += 1
        self._spawn()
        if self.won:
            self.end("won")
        elif not self.legal_moves():
            self.end("lost")
        return StepResult(direction, True, points, self.done, self.end_reason)

    def play(self, reply: str) -> StepResult:
        """Parse an agent's reply with :func:`parse_move` and play it."""
        return self.step(parse_move(reply))

    def reward(self) -> float:
        """The episode reward so far (:func:`episode_reward`)."""
        return episode_reward(
            self.max_tile, self.target, won=self.won, penalised=self.end_reason in PENALISED_ENDS
        )


def system_prompt(target: int = DEFAULT_TARGET) -> str:
    """The rules and the reply format, as told to the agent."""
    return (
        f"You are playing 2048 on a 4x4 board. Each turn you see the board ('.' is an empty cell). "
        f"Sliding moves every tile as far as it goes; two equal tiles that meet merge into their sum. "
        f"After each move a new 2 or 4 appears. Goal: make a {target} tile. "
        f"Reply with exactly one word: up, down, left or right (or <move>left</move>). "
        f"Any other reply, or a move that does not change the board, ends the game with a penalty."
    )


def turn_prompt(game: Game2048, turn: int) -> str:
    """The user message for one turn: turn number, board, and the question."""
    return f"Turn {turn}. Board:\n{game.render()}\nYour move?"


def make_scenarios(n: int, *, seed: int = 0, target: int = DEFAULT_TARGET) -> list[dict]:
    """``n`` scenarios with game seeds drawn from ``random.Random(seed)`` (deterministic)."""
    rng = random.Random(seed)
    return [{"id": f"2048-{i:04d}", "seed": rng.randrange(2**31), "target": target} for i in range(n)]
