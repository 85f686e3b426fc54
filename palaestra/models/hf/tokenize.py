"""Chat templates and tokenisation for HF tokenizers (no torch needed).

``render`` applies the tokenizer's own chat template to text, then encodes it without extra special tokens, as
vLLM does; tools sent to a template that never reads ``tools`` are refused rather than dropped. Token strings
are the raw tokens (``"Ġhello"``); ids beyond the tokenizer's vocabulary are written ``"token_id:<id>"`` (as
vLLM's ``--return-tokens-as-token-ids``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.models.tokenizer import content_text
from palaestra.models.toolcalls import NAME_RE, ParsedCall, ParsedReply, parse_blocks

__all__ = ["ChatTokenizer", "Rendered"]

TOKEN_ID_PREFIX = "token_id:"
HERMES_TAGS = ("<tool_call>", "</tool_call>")
_TOOLS_VAR = re.compile(r"\btools\b")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its ``text`` and token ``ids``."""

    text: str
    ids: list[int]


def _clean_message(msg: Any, i: int) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it: text content, tool-call arguments parsed from JSON."""
    if not isinstance(msg, Mapping):
        dump = getattr(msg, "model_dump", None)
        if dump is None:
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        msg = dump(exclude_none=True)
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{i}]: missing field 'role'")
    out = dict(msg)
    content = msg.get("content")
    out["content"] = None if content is None else content_text(content, where=f"messages[{i}].content")
    if msg.get("tool_calls"):
        out["tool_calls"] = [{**tc, "function": dict(tc.get("function") or {})} for tc in msg["tool_calls"]]
        for fn in (call["function"] for call in out["tool_calls"]):
            args = fn.get("arguments")
            if isinstance(args, str):  # an invalid string is kept: the template renders what the model wrote
                with contextlib.suppress(json.JSONDecodeError):
                    fn["arguments"] = json.loads(args) if args.strip() else {}
    return out


class ChatTokenizer:
    """A ``transformers`` tokenizer seen through palaestra's tokenizer interface (``vocab_size``: the model's
    output size); ``tool_call_tags``: the Hermes tags when the template writes them, else None."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        vocab_size: int | None = None,
        chat_template: str | None = None,
        extra_end_ids: Sequence[int] = (),
    ) -> None:
        self.hf = hf_tokenizer
        if chat_template is not None:
            self.hf.chat_template = chat_template
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; pass chat_template=... (a Jinja template string)"
            )
        names = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
        names += [None] * (int(vocab_size or 0) - len(names))  # ids beyond the tokenizer's
        self.vocab: list[str] = [
            t if isinstance(t, str) else f"{TOKEN_ID_PREFIX}{i}" for i, t in enumerate(names)
        ]
        self._ids = {t: i for i, t in enumerate(self.vocab)}
        eos = self.hf.eos_token_id
        self.end_ids = frozenset(int(x) for x in (eos, *extra_end_ids) if x is not None)
        if not self.end_ids:
            raise ValueError("the tokenizer has no eos token; pass extra_end_ids=[...]")
        self.end_id = int(eos) if eos is not None else min(self.end_ids)
        pad = self.hf.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.end_id
        self.special_ids: frozenset[int] = frozenset(int(i) for i in self.hf.all_special_ids)
        template = str(self.hf.chat_template)
        self.takes_tools = _TOOLS_VAR.search(template) is not None
        hermes = self.takes_tools and HERMES_TAGS[0] in template
        self.tool_call_tags: tuple[str, str] | None = HERMES_TAGS if hermes else None

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __repr__(self) -> str:
        return f"ChatTokenizer({type(self.hf).__name__}, vocab={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return [int(i) for i in self.hf.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of token ids (special tokens dropped by default; ids unknown to the tokenizer too)."""
        n = len(self.hf)
        return str(self.hf.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special))

    def token_str(self, token_id: int) -> str:
        return self.vocab[int(token_id)]

    def id_of(self, token: str) -> int:
        """Id of a token string from :attr:`vocab` or ``"token_id:<id>"`` (KeyError if unknown)."""
        if token in self._ids:
            return self._ids[token]
        rest = token.removeprefix(TOKEN_ID_PREFIX)
        if rest != token and rest.isdigit() and int(rest) < self.vocab_size:
            return int(rest)
        raise KeyError(token)

    def render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rendered:
        """Text and ids of ``messages`` under the chat template (a template error becomes ``ValueError``)."""
        msgs = [_clean_message(m, i) for i, m in enumerate(messages)]
        if tools and not self.takes_tools:
            raise ValueError("tools: this model's chat template does not take tools (it never reads 'tools')")
        try:
            text = self.hf.apply_chat_template(
                msgs,
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except MemoryError:  # an Exception too, but not a bad request
            raise
        except Exception as exc:  # jinja2 TemplateError and friends: a bad request, not a crash
            raise ValueError(f"chat template: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise ValueError("chat template: apply_chat_template(tokenize=False) did not return text")
        return Rendered(text=text, ids=self.encode(text))

    @property
    def call_open(self) -> str | None:
        """The tag that opens a tool call in a reply (None when replies are not parsed for calls)."""
        return self.tool_call_tags[0] if self.tool_call_tags else None

    def parse_tool_calls(self, text: str, names: Collection[str] | None = None) -> ParsedReply | None:
        """The tool calls of a finished reply that is, from its first open tag on, nothing but blocks calling
        offered functions (``names``); else None."""
        if self.tool_call_tags is None:
            return None
        return parse_blocks(text, self.tool_call_tags, _read_json_call, names, ws=" \t\r\n")


def _read_json_call(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """``{"name": ..., "arguments": {...}}`` at ``pos`` (or ``parameters``; absent means ``{}``)."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None or not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, separators=(",", ":"), ensure_ascii=False)), end
