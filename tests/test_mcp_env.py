"""MCP environments against the real example MCP server (examples/mcp_calc_server.py), started as a
subprocess over stdio and over streamable HTTP on 127.0.0.1: listing, calls, stateful tool, timeouts and
errors, and calculator episodes whose tool calls run through MCP."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from palaestra.envs.calculator import calculator_group_rollout, close_mcp_tools
from palaestra.envs.mcp import MCPError, MCPTools, openai_tool
from palaestra.models.registry import load

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_server() -> Iterator[str]:
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
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


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


def test_shared_connection_per_event_loop() -> None:
    from palaestra.envs.calculator import mcp_tools

    async def once() -> tuple[str, bool]:
        tools = await mcp_tools("python " + SERVER[1], 5.0)
        return await tools.call("calc", {"expression": "6*7"}), tools.connected

    # each asyncio.run has its own loop: the connection of a closed loop is never reused
    assert asyncio.run(once()) == ("42", True)
    assert asyncio.run(once()) == ("42", True)
