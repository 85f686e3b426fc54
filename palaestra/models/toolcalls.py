"""Tool-call syntax of the embedded chat template (docs/tools.md): a ``Tools: name(p: type, q?: type); ...``
system turn, ``<call>NAME ARGS</call>`` blocks after an assistant message's content, results as ``tool`` turns.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.trajectories.types import field_of

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "TOOLS_PREFIX",
    "ParsedCall",
    "ParsedReply",
    "field_of",
    "parse_blocks",
    "parse_reply",
    "reply_message",
    "tool_calls_text",
    "tool_names",
    "tools_text",
]

CALL_OPEN = "<call>"
CALL_CLOSE = "</call>"
TOOLS_PREFIX = "Tools: "
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in a reply: the function name and the arguments' JSON text (verbatim)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedReply:
    """A reply that is a tool call: its text before the first call (None when empty) and the calls."""

    content: str | None
    calls: list[ParsedCall]


def _function_of(tool: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(tool, Mapping):
        raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
    kind = tool.get("type", "function")
    if kind != "function":
        raise ValueError(f"{where}.type {kind!r} is not supported (only 'function' tools)")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}.function must be an object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        msg = f"{where}.function.name must match {NAME_RE.pattern} (letters, digits, _ . -), got {name!r}"
        raise ValueError(msg)
    return fn


def _param_type(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        kind = "|".join(kind)
    return kind if isinstance(kind, str) and kind else "any"


def _signature(fn: Mapping[str, Any], where: str) -> str:
    params = {} if fn.get("parameters") is None else fn["parameters"]
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    props = params.get("properties") or {}
    required = params.get("required") or []
    if not isinstance(props, Mapping) or not isinstance(required, (list, tuple)):
        raise ValueError(f"{where}.function.parameters: 'properties' must be an object, 'required' a list")
    parts = [f"{key}{'' if key in required else '?'}: {_param_type(schema)}" for key, schema in props.items()]
    return f"{fn['name']}({', '.join(parts)})"


def tools_text(tools: Sequence[Any]) -> str:
    """The text of the leading ``Tools:`` system turn (ValueError naming ``tools[i]`` on a bad entry)."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    sigs = [_signature(_function_of(t, f"tools[{i}]"), f"tools[{i}]") for i, t in enumerate(tools)]
    return TOOLS_PREFIX + "; ".join(sigs)


def tool_names(tools: Sequence[Any]) -> list[str]:
    """Function names of a (valid) ``tools`` list."""
    return [str(_function_of(t, f"tools[{i}]")["name"]) for i, t in enumerate(tools)]


def tool_calls_text(tool_calls: Any, where: str = "tool_calls") -> str:
    """The rendered text of an assistant message's ``tool_calls`` (OpenAI dicts or client objects)."""
    if tool_calls is None:
        return ""
    if isinstance(tool_calls, (str, bytes, Mapping)) or not isinstance(tool_calls, Sequence):
        raise ValueError(f"{where} must be a list of tool calls, got {type(tool_calls).__name__}")
    out: list[str] = []
    for k, call in enumerate(tool_calls):
        w = f"{where}[{k}]"
        if not isinstance(call, Mapping) and not hasattr(call, "function"):
            raise ValueError(f"{w} must be an object with a 'function', got {type(call).__name__}")
        fn = field_of(call, "function")
        name = field_of(fn, "name") if fn is not None else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{w}.function.name must be a non-empty string")
        args = field_of(fn, "arguments")
        if args is None:
            args = "{}"
        elif isinstance(args, Mapping):
            try:
                args = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{w}.function.arguments is not JSON-serialisable ({exc})") from None
        elif not isinstance(args, str):
            raise ValueError(f"{w}.function.arguments must be a JSON string, got {type(args).__name__}")
        out.append(f"{CALL_OPEN}{name} {args}{CALL_CLOSE}")
    return "".join(out)


def parse_blocks(
    text: str,
    tags: tuple[str, str],
    read: Callable[[str, int], tuple[ParsedCall, int] | None],
    names: Collection[str] | None = None,
    *,
    ws: str = "",
) -> ParsedReply | None:
    """The calls of a reply that, from the first open tag on, is nothing but ``open call close`` blocks (each
    read by ``read(text, pos) -> (call, end)``) calling functions in ``names`` (when given); else None."""
    open_tag, close_tag = tags
    start = text.find(open_tag)
    if start < 0:
        return None
    calls: list[ParsedCall] = []
    pos = start
    while pos < len(text):
        if not text.startswith(open_tag, pos):
            return None
        got = read(text, _skip(text, pos + len(open_tag), ws))
        if got is None:
            return None
        call, pos = got
        pos = _skip(text, pos, ws)
        if not text.startswith(close_tag, pos) or (names is not None and call.name not in names):
            return None
        calls.append(call)
        pos = _skip(text, pos + len(close_tag), ws)
    return ParsedReply(text[:start].rstrip(ws) or None, calls)


def _skip(text: str, pos: int, chars: str) -> int:
    return len(text) - len(text[pos:].lstrip(chars))


def _read_call(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """``NAME {json}`` at ``pos``: the name, one space, a JSON object kept verbatim."""
    m = NAME_RE.match(text, pos)
    if m is None or not text.startswith(" {", m.end()):
        return None
    try:
        obj, end = _DECODER.raw_decode(text, m.end() + 1)
    except (ValueError, RecursionError):
        return None
    return (ParsedCall(m.group(), text[m.end() + 1 : end]), end) if isinstance(obj, dict) else None


def parse_reply(text: str, names: Collection[str] | None = None) -> ParsedReply | None:
    """The tool calls of a finished reply, or None when it is not (entirely) calls to functions in ``names``."""
    return parse_blocks(text, (CALL_OPEN, CALL_CLOSE), _read_call, names)


def reply_message(
    tokenizer: Any, sample: Any, index: int, names: Collection[str] | None
) -> tuple[dict[str, Any], str]:
    """The OpenAI assistant message and finish reason of choice ``index``; with ``names`` (the offered
    functions), a reply that ended its turn and that ``parse_tool_calls`` accepts becomes ``tool_calls``."""
    message: dict[str, Any] = {"role": "assistant", "content": sample.text, "refusal": None}
    ends = getattr(tokenizer, "end_ids", None) or (getattr(tokenizer, "end_id", None),)  # HF: several
    parsed = None
    if names is not None and sample.token_ids and sample.token_ids[-1] in ends:
        parsed = tokenizer.parse_tool_calls(sample.text, list(names))
    if parsed is None:
        return message, sample.finish_reason
    message["content"] = parsed.content
    message["tool_calls"] = [
        {
            "id": "call_" + hashlib.sha256(f"{sample.seed}:{index}:{k}".encode()).hexdigest()[:24],
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for k, c in enumerate(parsed.calls)
    ]
    return message, "tool_calls"
