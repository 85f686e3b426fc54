"""2048 rules, determinism and reward; rollouts against a real OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.game2048 import (
    DIRECTIONS,
    Game2048,
    episode_reward,
    make_scenarios,
    parse_move,
    slide_row_left,
)
from palaestra.envs.rollouts import rollout_2048, single_turn_rollout
from palaestra.envs.verifier import VerifierReward
from palaestra.trajectories import TrajectoryGroup

# ---------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("row", "expected", "points"),
    [
        ([0, 0, 0, 0], [0, 0, 0, 0], 0),
        ([2, 0, 0, 2], [4, 0, 0, 0], 4),
        ([2, 2, 2, 2], [4, 4, 0, 0], 8),
        ([4, 4, 4, 0], [8, 4, 0, 0], 8),
        ([2, 2, 4, 4], [4, 8, 0, 0], 12),
        ([4, 2, 2, 0], [4, 4, 0, 0], 4),  # the new 4 does not merge again in the same move
        ([2, 4, 8, 16], [2, 4, 8, 16], 0),
        ([0, 8, 0, 8], [16, 0, 0, 0], 16),
    ],
)
def test_slide_row_left(row: list[int], expected: list[int], points: int) -> None:
    assert slide_row_left(row) == (expected, points)


def _game(board: list[list[int]], target: int = 2048, seed: int = 0) -> Game2048:
    game = Game2048(seed, target=target)
    game.board = [list(r) for r in board]
    return game


BOARD = [[2, 0, 2, 4], [0, 0, 0, 0], [2, 0, 0, 0], [4, 4, 8, 8]]


@pytest.mark.parametrize(
    ("direction", "expected"),
    [
        ("left", [[4, 4, 0, 0], [0, 0, 0, 0], [2, 0, 0, 0], [8, 16, 0, 0]]),
        ("right", [[0, 0, 4, 4], [0, 0, 0, 0], [0, 0, 0, 2], [0, 0, 8, 16]]),
        ("up", [[4, 4, 2, 4], [4, 0, 8, 8], [0, 0, 0, 0], [0, 0, 0, 0]]),
        ("down", [[0, 0, 0, 0], [0, 0, 0, 0], [4, 0, 2, 4], [4, 4, 8, 8]]),
    ],
)
def test_moves_in_every_direction_then_one_spawn(direction: str, expected: list[list[int]]) -> None:
    game = _game(BOARD)
    result = game.step(direction)
    assert result.changed and not result.done
    diff = [(r, c) for r in range(4) for c in range(4) if game.board[r][c] != expected[r][c]]
    assert len(diff) == 1, "exactly one new tile"
    r, c = diff[0]
    assert expected[r][c] == 0 and game.board[r][c] in (2, 4)
    assert game.board_sum == sum(map(sum, BOARD)) + game.board[r][c]  # merges conserve the sum
    assert game.moves == 1 and game.score == result.points


def test_same_seed_same_game_and_seeds_differ() -> None:
    def play(seed: int) -> list[str]:
        game = Game2048(seed)
        boards = [game.render()]
        rng = random.Random(99)
        while not game.done and len(boards) < 40:
            game.step(rng.choice(game.legal_moves()))
            boards.append(game.render())
        return boards

    assert play(7) == play(7)
    assert len({play(s)[0] for s in range(20)}) > 10
    assert Game2048(7).board == Game2048.from_scenario({"id": "x", "seed": 7, "target": 128}).board


def test_random_legal_play_until_lost_keeps_invariants() -> None:
    game = Game2048(3, target=2048)
    rng = random.Random(3)
    assert sum(v > 0 for row in game.board for v in row) == 2
    while not game.done:
        before = game.board_sum
        result = game.step(rng.choice(game.legal_moves()))
        assert result.changed
        assert game.board_sum - before in (2, 4)
    assert game.end_reason == "lost"
    assert game.legal_moves() == [] and all(all(row) for row in game.board)
    expected = math.log2(game.max_tile) / math.log2(2048)
    assert game.reward() == pytest.approx(expected)
    with pytest.raises(RuntimeError, match="over"):
        game.step("left")


def test_win_invalid_and_noop_end_the_episode_with_documented_rewards() -> None:
    won = _game([[4, 4, 0, 0], [0] * 4, [0] * 4, [0] * 4], target=8)
    assert won.play("left").done and won.end_reason == "won"
    assert won.reward() == pytest.approx(1.0 + 1.0)

    noop = _game([[2, 4, 0, 0], [0] * 4, [0] * 4, [0] * 4], target=128)
    result = noop.play("LEFT")
    assert (result.move, result.changed, noop.end_reason) == ("left", False, "noop_move")
    assert noop.reward() == pytest.approx(math.log2(4) / 7 - 1.0)

    bad = _game(BOARD, target=128)
    assert bad.play("go left please").move is None and bad.end_reason == "invalid_move"
    assert bad.reward() == pytest.approx(3 / 7 - 1.0)
    assert bad.board == BOARD  # an invalid move changes nothing


def test_episode_reward_formula() -> None:
    assert episode_reward(2, 128, won=False, penalised=False) == pytest.approx(1 / 7)
    assert episode_reward(128, 128, won=True, penalised=False) == pytest.approx(2.0)
    assert episode_reward(512, 128, won=True, penalised=False) == pytest.approx(2.0)  # progress clipped at 1
    assert episode_reward(64, 128, won=False, penalised=True) == pytest.approx(6 / 7 - 1)


@pytest.mark.parametrize(
    ("reply", "move"),
    [
        ("left", "left"),
        ("  Up\n", "up"),
        ("RIGHT", "right"),
        ("<move>down</move>", "down"),
        ("<MOVE> left </MOVE>", "left"),
        ("<think>hmm, up?</think>\nleft", "left"),
        ("", None),
        ("left right", None),
        ("<move>left</move> <move>up</move>", None),
        ("move left", None),
        ("left.", None),
        ("<move>north</move>", None),
        ("<think>left", None),
        ("ｌｅｆｔ", None),
        ("le\u200bft", None),
        ("<move>left", None),
        (None, None),
        ("lef\u0074", "left"),
    ],
)
def test_parse_move_is_exact(reply: Any, move: str | None) -> None:
    assert parse_move(reply) == move


def test_render_and_scenarios() -> None:
    game = _game([[2, 0, 0, 1024], [0] * 4, [0, 16, 0, 0], [0] * 4])
    assert (
        game.render() == "   2    .    . 1024\n   .    .    .    .\n   .   16    .    .\n   .    .    .    ."
    )
    scenarios = make_scenarios(5, seed=1, target=64)
    assert scenarios == make_scenarios(5, seed=1, target=64)
    assert [s["id"] for s in scenarios] == [f"2048-{i:04d}" for i in range(5)]
    assert len({s["seed"] for s in scenarios}) == 5 and all(s["target"] == 64 for s in scenarios)
    for bad, field in [
        ({"seed": "1"}, "seed"),
        ({"seed": 1, "target": 100}, "target"),
        ({"seed": 1, "target": 4}, "target"),
        ({"seed": 1, "id": 3}, "id"),
        ({"seed": 1, "id": None}, "id"),
        ({"seed": 1, "id": 0}, "id"),
        ([], "mapping"),
    ]:
        with pytest.raises(ValueError, match=field):
            Game2048.from_scenario(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- a real OpenAI-compatible server


class ScriptedServer:
    """A stdlib HTTP server on 127.0.0.1 answering /v1/chat/completions with ``policy(request) -> text``."""

    def __init__(self, policy: Callable[[dict[str, Any]], str]) -> None:
        self.policy = policy
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                text = outer.policy(body)
                tokens = [text[i : i + 2] for i in range(0, len(text), 2)]
                payload = {
                    "id": f"chatcmpl-{len(outer.requests)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": text},
                            "logprobs": {
                                "content": [
                                    {
                                        "token": t,
                                        "logprob": -0.5,
                                        "bytes": list(t.encode()),
                                        "top_logprobs": [],
                                    }
                                    for t in tokens
                                ]
                            },
                        }
                    ],
                    "usage": {
                        "prompt_tokens": 1,
                        "completion_tokens": len(tokens),
                        "total_tokens": 1 + len(tokens),
                    },
                }
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


class LocalModel:
    """ChatModel-like: a name and an AsyncOpenAI client pointed at the local server."""

    def __init__(self, base_url: str, name: str = "scripted-policy") -> None:
        self.name = name
        self._client = AsyncOpenAI(base_url=base_url, api_key="test-key", max_retries=0, timeout=10)

    def openai_client(self) -> AsyncOpenAI:
        return self._client


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[dict[str, Any]], str]], ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(policy: Callable[[dict[str, Any]], str]) -> ScriptedServer:
        servers.append(ScriptedServer(policy))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _board_from_prompt(text: str) -> list[list[int]]:
    rows = text.split("Board:\n", 1)[1].split("\nYour move?", 1)[0].splitlines()
    return [[0 if cell == "." else int(cell) for cell in row.split()] for row in rows]


def greedy_policy(request: dict[str, Any]) -> str:
    """Reads the board from the last user message and answers the first legal move (a real little agent)."""
    game = _game(_board_from_prompt(request["messages"][-1]["content"]))
    return f"<move>{game.legal_moves()[0]}</move>"


async def test_rollout_2048_scripted_replies_until_invalid(serve: Any) -> None:
    replies = iter(["left", "<move>UP</move>", "sideways"])
    server = serve(lambda req: next(replies))
    model = LocalModel(server.base_url)
    scenario = {"id": "g-1", "seed": 11, "target": 128}
    traj = await rollout_2048(model, scenario, max_turns=10, temperature=0.7, seed=5)

    choices = traj.choices()
    assert [c.message.content for c in choices] == ["left", "<move>UP</move>", "sideways"]
    assert all(isinstance(c, Choice) and c.logprobs and c.logprobs.content for c in choices)
    assert traj.metadata["end_reason"] == "invalid_move"
    assert traj.metrics["turns"] == 3 and traj.metrics["invalid_move"] is True

    replay = Game2048.from_scenario(scenario)  # same seed + same moves -> same game
    first_board = replay.render()
    replay.step("left")
    replay.step("up")
    assert traj.metadata["final_board"] == replay.render()
    assert traj.reward == pytest.approx(math.log2(replay.max_tile) / 7 - 1.0)

    assert len(server.requests) == 3
    first = server.requests[0]
    assert first["model"] == "scripted-policy" and first["logprobs"] is True and first["temperature"] == 0.7
    assert [r["seed"] for r in server.requests] == [5, 6, 7]
    assert first_board in first["messages"][1]["content"]
    assert [len(r["messages"]) for r in server.requests] == [2, 4, 6]  # the whole chat is resent each turn
    messages = traj.messages()
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


async def test_rollout_2048_plays_to_max_turns_and_to_a_win(serve: Any) -> None:
    server = serve(greedy_policy)
    model = LocalModel(server.base_url)
    capped = await rollout_2048(model, {"id": "g-2", "seed": 4, "target": 2048}, max_turns=6)
    assert capped.metadata["end_reason"] == "max_turns"
    assert capped.metrics["turns"] == capped.metrics["moves"] == 6
    assert 0 < capped.reward < 1

    won = await rollout_2048(model, {"id": "g-3", "seed": 4, "target": 16}, max_turns=200)
    assert won.metadata["end_reason"] == "won" and won.metrics["won"] is True
    assert won.metrics["max_tile"] == 16 and won.reward == pytest.approx(2.0)
    again = await rollout_2048(model, {"id": "g-3", "seed": 4, "target": 16}, max_turns=200)
    assert again.metadata["final_board"] == won.metadata["final_board"]  # deterministic given the seed
    assert again.metrics["turns"] == won.metrics["turns"]


def blundering_policy(request: dict[str, Any]) -> str:
    """Answers a move that does not change the board whenever there is one, else the first legal move."""
    game = _game(_board_from_prompt(request["messages"][-1]["content"]))
    legal = game.legal_moves()
    return next((d for d in DIRECTIONS if d not in legal), legal[0])


async def test_rollout_2048_logs_and_penalises_a_move_that_changes_nothing(serve: Any) -> None:
    server = serve(blundering_policy)
    traj = await rollout_2048(
        LocalModel(server.base_url), {"id": "g-4", "seed": 3, "target": 128}, max_turns=50
    )
    assert traj.metadata["end_reason"] == "noop_move" and traj.metrics["invalid_move"] is True
    turns = traj.metrics["turns"]
    last = traj.choices()[-1].message.content
    assert traj.logs[-1] == f"turn {turns}: move {last!r} does not change the board"
    assert traj.metrics["moves"] == turns - 1  # every earlier reply moved tiles
    assert traj.reward == pytest.approx(math.log2(traj.metrics["max_tile"]) / 7 - 1.0)


async def test_rollout_2048_surfaces_server_errors(serve: Any) -> None:
    server = serve(greedy_policy)
    model = LocalModel(server.base_url.replace("/v1", "/nope"))
    with pytest.raises(Exception, match="404"):
        await rollout_2048(model, {"id": "g-4", "seed": 1})
    with pytest.raises(ValueError, match="max_turns"):
        await rollout_2048(model, {"id": "g-4", "seed": 1}, max_turns=0)


async def test_single_turn_rollout_then_verifier_reward(serve: Any) -> None:
    def answer(request: dict[str, Any]) -> str:
        prompt = request["messages"][-1]["content"]
        a, b = prompt.removeprefix("What is ").split("?")[0].split("+")
        return f"Final: {int(a) + int(b)}" if request.get("seed") != 3 else "Final: 0"

    server = serve(answer)
    model = LocalModel(server.base_url)
    example = {
        "id": "arith-add-40-02",
        "prompt": "What is 40+2? Reply with one line: Final: <int>",
        "expected_answer": "42",
    }
    group = TrajectoryGroup(
        [
            single_turn_rollout(model, example, seed=s, system_prompt="Be exact." if s else None)
            for s in range(4)
        ]
    )
    await group
    assert len(group) == 4 and not group.exceptions
    await VerifierReward(StrictFinalVerifier()).score_group(group, example)
    assert sorted(group.rewards()) == [0.0, 1.0, 1.0, 1.0]
    for traj in group:
        assert traj.metadata["example_id"] == "arith-add-40-02"
        assert traj.metadata["model"] == "scripted-policy"
        assert traj.choices()[0].logprobs is not None
    assert all(r["logprobs"] is True and r["max_tokens"] == 16 for r in server.requests)
    assert sorted(len(r["messages"]) for r in server.requests) == [1, 2, 2, 2]
    with pytest.raises(ValueError, match="prompt"):
        await single_turn_rollout(model, {"id": "x"})
