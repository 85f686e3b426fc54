"""MCP environments against the real example MCP server (examples/mcp_calc_server.py), started as a
subprocess over stdio and over streamable HTTP on 127.0.0.1: listing, calls, stateful tool, timeouts and
errors, and calculator episodes whose tool calls run through MCP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from palaestra.envs.calculator import calculator_group_rollout, close_mcp_tools
from palaestra.envs.mcp import MCPError, MCPTools, openai_tool
from palaestra.models.registry import load
from palaestra.models.remote import RemoteModel

ROOT = Path(__file__).resolve().parents[1]
SERVER = [sys.executable, str(ROOT / "examples" / "mcp_calc_server.py")]
EXAMPLE = {
    "id": "t1",
    "prompt": "What is 81*92? Reply with one line: Final: <int>",
    "expected_answer": "7452",
    "family": "mul",
}


def test_openai_tool_schema() -> None:
    t = openai_tool({"name": "f", "description": "d", "inputSchema": {"type": "object", "properties": {}}})
    assert t == {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
    }
    assert openai_tool({"name": "g"})["function"]["parameters"] == {"type": "object", "properties": {}}
    with pytest.raises(MCPError):
        openai_tool({"description": "no name"})


async def _exercise(tools: MCPTools) -> None:
    assert tools.names == ["calc", "remember", "recall", "wait"]
    calc = tools.tools[0]["function"]
    assert calc["parameters"]["properties"]["expression"]["type"] == "string"
    assert calc["parameters"]["required"] == ["expression"] and "exactly" in calc["description"]
    assert await tools.call("calc", '{"expression": "81*92"}') == "7452"
    assert await tools.call("calc", {"expression": "1/0"}) == "error: division by zero"
    assert await tools.call("remember", {"key": "k", "value": "v1"}) == "stored k"
    assert await tools.call("recall", '{"key": "k"}') == "v1"  # state kept between calls
    missing = await tools.call("recall", {"key": "nope"})
    assert missing.startswith("error:") and "no note under 'nope'" in missing  # a tool error (isError)
    assert (await tools.call("nothere", "{}")).startswith("error: no tool named 'nothere'")
    assert (await tools.call("calc", "not json")).startswith("error: arguments are not JSON")
    t0 = time.monotonic()
    assert (
        await tools.call("wait", {"seconds": 30}) == f"error: tool wait timed out after {tools.timeout:g} s"
    )
    assert time.monotonic() - t0 < 10
    assert await tools.call("calc", {"expression": "2**10"}) == "1024"  # the session survives a timeout
    msgs = await tools.tool_messages(
        [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression":"3*4"}'}}]
    )
    assert msgs == [{"role": "tool", "tool_call_id": "c1", "content": "12"}]


async def test_stdio_server_listing_calls_timeouts_errors() -> None:
    async with MCPTools(SERVER, timeout=1.0) as tools:
        await _exercise(tools)
    assert await tools.call("calc", {"expression": "1+1"}) == "error: the MCP server is not connected"


async def test_unstartable_server_is_a_clear_error() -> None:
    with pytest.raises(MCPError):
        await MCPTools([sys.executable, "-c", "import sys; sys.exit(3)"], connect_timeout=10).start()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give exactly one of command"),
        ({"command": "python x.py", "url": "http://127.0.0.1:1/mcp"}, "give exactly one of command"),
        ({"command": "   "}, "command is empty"),
        ({"command": []}, "command is empty"),
        ({"command": "python x.py", "timeout": 0}, "timeout and connect_timeout must be > 0"),
        (
            {"url": "http://127.0.0.1:1/mcp", "connect_timeout": -1.0},
            "timeout and connect_timeout must be > 0",
        ),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MCPTools(**kwargs)


async def test_a_server_that_never_answers_fails_within_connect_timeout() -> None:
    # it reads stdin until EOF and never answers the MCP handshake
    silent = MCPTools([sys.executable, "-c", "import sys; sys.stdin.read()"], connect_timeout=0.3)
    assert not silent.connected
    await silent.aclose()  # never started: nothing to close, no error
    t0 = time.monotonic()
    with pytest.raises(MCPError, match=r"no answer within 0\.3 s"):
        await silent.start()
    assert time.monotonic() - t0 < 5.0  # connect_timeout bounds the failure (it used to take 10 s more)
    assert not silent.connected


async def test_cancelling_a_start_cancels_it_and_stops_the_server() -> None:
    silent = MCPTools([sys.executable, "-c", "import sys; sys.stdin.read()"], connect_timeout=30)
    starting = asyncio.ensure_future(silent.start())
    await asyncio.sleep(0.2)
    starting.cancel()
    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):  # not turned into an MCPError
        await starting
    assert time.monotonic() - t0 < 5.0 and not silent.connected


def test_a_session_belongs_to_its_event_loop_and_odd_arguments_are_tool_errors() -> None:
    loop = asyncio.new_event_loop()
    try:
        tools = loop.run_until_complete(MCPTools(SERVER, timeout=5.0).start())
        assert not tools.connected  # asked outside any running event loop

        async def inside() -> None:
            assert tools.connected
            assert await tools.call("remember", {"key": "k", "value": "kept"}) == "stored k"
            assert await tools.start() is tools  # a second start keeps the session (and the server's state)
            assert await tools.call("recall", {"key": "k"}) == "kept"
            no_args = await tools.call(
                "calc", None
            )  # no arguments: {} is sent and the tool says what is missing
            assert no_args.startswith("error: ") and "expression" in no_args and "Field required" in no_args
            assert await tools.call("calc", "[1, 2]") == "error: arguments must be a JSON object"
            assert await tools.call("calc", {"expression": "6*7"}) == "42"
            await tools.aclose()
            await tools.aclose()  # twice is fine
            assert not tools.connected

        loop.run_until_complete(inside())
    finally:
        loop.close()


async def test_a_lost_http_server_is_the_tool_answer_not_an_exception() -> None:
    with _serving_http() as (url, proc):
        async with MCPTools(url=url, timeout=5.0) as tools:
            assert await tools.call("calc", {"expression": "2+2"}) == "4"
            proc.terminate()
            proc.wait(10)
            lost = await tools.call("calc", {"expression": "2+2"})
    assert lost.startswith("error: ") and len(lost) <= len("error: ") + 200


def test_structured_only_results_are_shown_as_json() -> None:
    from palaestra.envs.mcp import _result_text

    assert _result_text({"content": [], "structuredContent": {"value": 42, "unit": "m"}}) == (
        '{"value":42,"unit":"m"}'
    )
    assert _result_text({"content": [{"type": "text", "text": "7"}], "structuredContent": {"v": 7}}) == "7"
    assert _result_text({"content": [], "structuredContent": None}) == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serving_http() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The example server over streamable HTTP on a free loopback port: (its URL, its process)."""
    port = _free_port()
    proc = subprocess.Popen(
        [*SERVER, "--http", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("the MCP HTTP server did not start")
        yield f"http://127.0.0.1:{port}/mcp", proc
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def http_server() -> Iterator[str]:
    with _serving_http() as (url, _):
        yield url


async def test_streamable_http_server(http_server: str) -> None:
    async with MCPTools(url=http_server, timeout=1.0) as tools:
        await _exercise(tools)


async def test_calculator_episodes_call_tools_through_mcp() -> None:
    model = load("calc-base")
    try:
        trajs = await calculator_group_rollout(
            model, EXAMPLE, 4, seed=0, mcp=" ".join(SERVER), mcp_tools="calc", temperature=0.0
        )
        direct = await calculator_group_rollout(model, EXAMPLE, 4, seed=0, temperature=0.0)
    finally:
        await close_mcp_tools()
    assert trajs[0].tools is not None and [t["function"]["name"] for t in trajs[0].tools] == ["calc"]
    used = [t for t in trajs if t.metrics["used_tool"]]
    assert used, "calc-base calls the tool on a hard problem"
    results = [m["content"] for t in used for m in t.messages() if m["role"] == "tool"]
    assert results and all(r == "7452" or r.startswith("error:") for r in results) and "7452" in results
    # the MCP calc answers as the built-in one: same rewards, same tool results
    assert [t.reward for t in trajs] == [t.reward for t in direct]
    assert [[m.get("content") for m in t.messages() if m["role"] == "tool"] for t in trajs] == [
        [m.get("content") for m in t.messages() if m["role"] == "tool"] for t in direct
    ]


async def test_naming_a_tool_the_server_lacks_is_a_clear_error() -> None:
    model = RemoteModel(
        "m", base_url="http://127.0.0.1:9/v1", api_key="k"
    )  # never asked: the check comes first
    try:
        with pytest.raises(
            ValueError, match=r"mcp_tools: the MCP server has no tool \['nope'\]; it has \['calc',"
        ):
            await calculator_group_rollout(
                model, EXAMPLE, 2, seed=0, mcp=" ".join(SERVER), mcp_tools="calc, nope"
            )
    finally:
        await close_mcp_tools()


def test_shared_connection_per_event_loop() -> None:
    from palaestra.envs.calculator import mcp_tools

    async def once() -> tuple[str, bool]:
        tools = await mcp_tools("python " + SERVER[1], 5.0)
        return await tools.call("calc", {"expression": "6*7"}), tools.connected

    # each asyncio.run has its own loop: the connection of a closed loop is never reused
    assert asyncio.run(once()) == ("42", True)
    assert asyncio.run(once()) == ("42", True)
