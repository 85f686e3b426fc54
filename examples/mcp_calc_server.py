"""A small MCP server for palaestra's calculator task: the exact ``calc`` tool plus a stateful notepad.

Tools:

* ``calc(expression)``: palaestra's bounded, exact integer evaluator (``error: ...`` text on bad input);
* ``remember(key, value)`` / ``recall(key)``: a notepad kept for the life of the server process (a stateful
  tool: ``recall`` of a key never stored is a tool error);
* ``wait(seconds)``: sleeps, then answers ``done`` (for trying per-call timeouts).

Run it over stdio (what ``palaestra demo --task calculator --mcp "python examples/mcp_calc_server.py"``
starts) or over streamable HTTP on 127.0.0.1::

    python examples/mcp_calc_server.py                 # stdio
    python examples/mcp_calc_server.py --http --port 8765   # http://127.0.0.1:8765/mcp
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from palaestra.envs.calc_eval import run_calc

try:
    from mcp.server.mcpserver import MCPServer as _Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as _Server  # type: ignore[no-redef]
    from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]


def build_server(host: str = "127.0.0.1", port: int = 8765) -> _Server:
    """The server with its four tools."""
    try:
        server = _Server("palaestra-calc", host=host, port=port)  # type: ignore[call-arg]
    except TypeError:
        server = _Server("palaestra-calc")
    notes: dict[str, str] = {}

    @server.tool()
    def calc(expression: str) -> str:
        """Evaluate an integer arithmetic expression exactly: + - * / // % ** and parentheses."""
        return run_calc({"expression": expression})

    @server.tool()
    def remember(key: str, value: str) -> str:
        """Store a note under a key (kept while the server runs)."""
        notes[key] = value
        return f"stored {key}"

    @server.tool()
    def recall(key: str) -> str:
        """The note stored under a key."""
        if key not in notes:
            raise ToolError(f"no note under {key!r}")  # a tool error: the client gets isError
        return notes[key]

    @server.tool()
    async def wait(seconds: float) -> str:
        """Sleep for a number of seconds (at most 60), then answer done."""
        await asyncio.sleep(max(0.0, min(float(seconds), 60.0)))
        return "done"

    return server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    server = build_server(port=args.port)
    if args.http:
        try:
            server.run("streamable-http", host="127.0.0.1", port=args.port)  # type: ignore[call-arg]
        except TypeError:  # mcp 1.x: host and port were given to the constructor
            server.run("streamable-http")
    else:
        server.run()


if __name__ == "__main__":
    main()
