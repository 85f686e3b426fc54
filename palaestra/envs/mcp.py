"""Tools from any Model Context Protocol server (stdio or streamable HTTP, extra ``palaestra[mcp]``) for the policy
(docs/tools.md). The connection lives in a background task of the event loop that opened it (the SDK's
transports must be entered and left in one task); calls may come from any task of that loop."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

from palaestra.trajectories.types import field_of

_MAX_RESULT_CHARS = 2000


class MCPError(RuntimeError):
    """The MCP server could not be started, reached or listed."""


def openai_tool(tool: Any) -> dict[str, Any]:
    """One MCP tool (SDK object or dict with ``name``, ``description``, ``inputSchema``) in the OpenAI
    ``tools`` schema; a missing or non-object input schema becomes an object without properties."""
    name = field_of(tool, "name")
    if not isinstance(name, str) or not name:
        raise MCPError(f"MCP tool without a name: {tool!r}")
    schema = field_of(tool, "inputSchema", "input_schema")
    if not isinstance(schema, Mapping) or schema.get("type", "object") != "object":
        schema = {"type": "object", "properties": {}}
    fn: dict[str, Any] = {"name": name, "parameters": dict(schema)}
    desc = field_of(tool, "description")
    if isinstance(desc, str) and desc:
        fn["description"] = desc
    return {"type": "function", "function": fn}


def _result_text(result: Any) -> str:
    """The text parts of an MCP result joined by newlines (structured content as JSON when there is no text)."""
    parts: list[str] = []
    for item in field_of(result, "content") or []:
        text = field_of(item, "text")
        parts.append(text if isinstance(text, str) else f"[{field_of(item, 'type') or 'non-text'} content]")
    if not parts:
        structured = field_of(result, "structuredContent", "structured_content")
        if structured is not None:
            parts.append(json.dumps(structured, separators=(",", ":")))
    text = "\n".join(parts)
    return text if len(text) <= _MAX_RESULT_CHARS else text[:_MAX_RESULT_CHARS] + "..."


class MCPTools:
    """Tools of one MCP server (an async context manager): ``command``, a stdio server to start (a leading
    ``python`` is this interpreter), or ``url``, a streamable HTTP endpoint; ``timeout``: seconds per tool call;
    ``connect_timeout``: seconds to start, initialise and list the tools."""

    def __init__(
        self,
        command: str | Sequence[str] | None = None,
        *,
        url: str | None = None,
        timeout: float = 10.0,
        connect_timeout: float = 30.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ValueError("MCPTools: give exactly one of command (stdio) or url (streamable HTTP)")
        argv = shlex.split(command) if isinstance(command, str) else list(command or [])
        if command is not None and not argv:
            raise ValueError("MCPTools: command is empty")
        if not timeout > 0 or not connect_timeout > 0:
            raise ValueError("MCPTools: timeout and connect_timeout must be > 0")
        if argv and argv[0] in ("python", "python3"):  # the interpreter running palaestra (its venv)
            argv[0] = sys.executable
        self.argv, self.url = argv, url
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self.tools: list[dict[str, Any]] = []
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop: asyncio.Event | None = None

    def __repr__(self) -> str:
        where = self.url or " ".join(self.argv)
        return f"MCPTools({where!r}, tools={self.names})"

    @property
    def connected(self) -> bool:
        """True while the session is open in the running event loop."""
        task = self._task
        if task is None or task.done() or self._session is None:
            return False
        try:
            return task.get_loop() is asyncio.get_running_loop()
        except RuntimeError:
            return False

    @property
    def names(self) -> list[str]:
        """Names of the listed tools."""
        return [t["function"]["name"] for t in self.tools]

    async def start(self) -> MCPTools:
        """Start (stdio) or reach (HTTP) the server, initialise the session and list its tools."""
        if self._task is not None:
            return self
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise MCPError("MCP tools need the mcp SDK: pip install 'palaestra[mcp]'") from None
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._stop = asyncio.Event()
        self._task = loop.create_task(self._run())
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.connect_timeout)
        except BaseException as exc:
            await self._end(grace=0)  # not aclose()'s grace period: it would stretch connect_timeout by 10 s
            if isinstance(exc, MCPError) or not isinstance(exc, Exception):  # e.g. a cancellation: as it is
                raise
            if isinstance(exc, asyncio.TimeoutError):
                raise MCPError(f"{self!r}: no answer within {self.connect_timeout:g} s") from None
            raise MCPError(f"{self!r}: could not connect: {type(exc).__name__}: {exc}") from exc
        return self

    async def _run(self) -> None:
        from mcp import ClientSession

        assert self._ready is not None and self._stop is not None
        try:
            async with AsyncExitStack() as stack:
                if self.url is not None:
                    try:
                        from mcp.client.streamable_http import streamable_http_client as http_client
                    except ImportError:  # mcp 1.x
                        from mcp.client.streamable_http import (  # type: ignore[attr-defined,no-redef]
                            streamablehttp_client as http_client,
                        )
                    streams = await stack.enter_async_context(http_client(self.url))
                else:
                    from mcp.client.stdio import StdioServerParameters, stdio_client

                    params = StdioServerParameters(command=self.argv[0], args=self.argv[1:])
                    streams = await stack.enter_async_context(stdio_client(params))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                listed = await session.list_tools()
                self.tools = [openai_tool(t) for t in listed.tools]
                self._session = session
                if not self._ready.done():
                    self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # reported to start(); after that the calls see a closed session
            if not self._ready.done():
                self._ready.set_exception(exc if isinstance(exc, Exception) else MCPError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._session = None

    async def aclose(self) -> None:
        """Close the session (and stop a stdio server); safe to call twice."""
        await self._end(grace=10.0)

    async def _end(self, *, grace: float) -> None:
        """End the connection task: ask it to stop and give it ``grace`` seconds to close the session (0: a
        start that failed, cancelled at once), then cancel it and wait until it is gone, stdio server included."""
        task, self._task = self._task, None
        if task is None:
            return
        try:
            if grace and self._stop is not None:
                self._stop.set()
                await asyncio.wait({task}, timeout=grace)  # never raises the task's exception
        finally:
            task.cancel()  # a no-op once it has ended
        await asyncio.wait({task})
        for fut in (task, self._ready):  # exceptions retrieved, so asyncio does not warn about them
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()

    async def __aenter__(self) -> MCPTools:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def call(self, name: str | None, arguments: Any) -> str:
        """Run one tool call through MCP; the result text, or ``error: <why>`` (never raises)."""
        if self._session is None:
            return "error: the MCP server is not connected"
        if name not in self.names:
            return f"error: no tool named {str(name)[:40]!r}; tools: {', '.join(self.names)}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return f"error: arguments are not JSON ({exc.msg})"
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return "error: arguments must be a JSON object"
        try:
            result = await asyncio.wait_for(self._session.call_tool(name, dict(arguments)), self.timeout)
        except asyncio.TimeoutError:
            return f"error: tool {name} timed out after {self.timeout:g} s"
        except Exception as exc:  # protocol or transport failure: the policy sees it as the tool's answer
            return f"error: {(str(exc) or type(exc).__name__)[:200]}"
        text = _result_text(result)
        return f"error: {text or 'the tool failed'}" if field_of(result, "isError", "is_error") else text

    async def tool_messages(self, tool_calls: Sequence[Any] | None) -> list[dict[str, Any]]:
        """One ``tool`` message per call of a Choice's ``message.tool_calls`` (in order)."""
        out = []
        for call in tool_calls or []:
            fn = field_of(call, "function")
            text = await self.call(field_of(fn, "name"), field_of(fn, "arguments"))
            out.append({"role": "tool", "tool_call_id": field_of(call, "id"), "content": text})
        return out
