"""Character-level tokenizer and chat template of the embedded policy: a vocabulary that is data (saved in
every checkpoint), greedy word tokens, ``<|role|>content<|end|>`` turns and the assistant mask. The default
vocabulary, the template's rules and its tool syntax (:mod:`palaestra.models.toolcalls`) are in docs/tools.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.models.toolcalls import ParsedReply, field_of, parse_reply, tool_calls_text, tools_text

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS: tuple[str, ...] = tuple(f"<|{name}|>" for name in ("pad", "unk", *ROLES, "end"))
WORD_TOKENS: tuple[str, ...] = ("What is ", "? Reply with one line: Final: <int>", "Final: ")
_ROLE_ALIASES = {"developer": "system"}


def is_special(token: str) -> bool:
    """True for vocabulary entries of the form ``<|name|>``."""
    return len(token) > 4 and token.startswith("<|") and token.endswith("|>")


def default_vocab() -> list[str]:
    """The default vocabulary: specials, newline, printable ASCII, word tokens."""
    return [*SPECIAL_TOKENS, "\n", *(chr(c) for c in range(32, 127)), *WORD_TOKENS]


@dataclass(frozen=True)
class Rendered:
    """Token ids of a rendered conversation and which of them the assistant produced."""

    ids: list[int]
    assistant_mask: list[bool]


class Tokenizer:
    """Vocabulary-driven character tokenizer with greedy word tokens (rules: docs/tools.md, "Vocabulary")."""

    def __init__(self, vocab: Sequence[str]) -> None:
        vocab = list(vocab)
        if len(set(vocab)) != len(vocab):
            dupes = sorted({t for t in vocab if vocab.count(t) > 1})
            raise ValueError(f"tokenizer vocab has duplicate entries: {dupes!r}")
        for tok in vocab:
            if not isinstance(tok, str) or not tok:
                raise ValueError(f"tokenizer vocab entries must be non-empty strings, got {tok!r}")
        if missing := [s for s in SPECIAL_TOKENS if s not in vocab]:
            raise ValueError(f"tokenizer vocab lacks required special tokens {missing!r}")
        self.vocab: list[str] = vocab
        self._index: dict[str, int] = {t: i for i, t in enumerate(vocab)}
        self.special_ids: frozenset[int] = frozenset(i for i, t in enumerate(vocab) if is_special(t))
        self._chars: dict[str, int] = {t: i for i, t in enumerate(vocab) if len(t) == 1}
        self._words: dict[str, list[tuple[str, int]]] = {}  # first character -> word tokens, longest first
        for t, i in sorted(self._index.items(), key=lambda ti: -len(ti[0])):
            if len(t) > 1 and not is_special(t):
                self._words.setdefault(t[0], []).append((t, i))
        self.pad_id, self.unk_id, self.end_id = (self._index[t] for t in ("<|pad|>", "<|unk|>", "<|end|>"))
        self._role_ids = {role: self._index[f"<|{role}|>"] for role in ROLES}
        self.system_id, self.user_id, self.assistant_id, self.tool_id = (self._role_ids[r] for r in ROLES)

    @classmethod
    def default(cls) -> Tokenizer:
        """Tokenizer over :func:`default_vocab`."""
        return cls(default_vocab())

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and other.vocab == self.vocab

    def __hash__(self) -> int:
        return hash(tuple(self.vocab))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        """Text -> ids. Word tokens are matched greedily, longest first; unknown characters -> ``<|unk|>``."""
        out: list[int] = []
        i, n = 0, len(text)
        chars, words, unk = self._chars, self._words, self.unk_id
        while i < n:
            c = text[i]
            for tok, tid in words.get(c, ()):
                if text.startswith(tok, i):
                    out.append(tid)
                    i += len(tok)
                    break
            else:  # no word token starts here: one character
                out.append(chars.get(c, unk))
                i += 1
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Ids -> text; special tokens (``<|...|>``) are dropped when ``skip_special``."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < len(self.vocab)), None)
        if bad is not None:
            raise ValueError(f"token id {bad} out of range for vocab of size {len(self.vocab)}")
        skip = self.special_ids if skip_special else frozenset()
        return "".join(self.vocab[i] for i in ids if i not in skip)

    def token_str(self, token_id: int) -> str:
        """Vocabulary string of one id."""
        return self.decode([token_id], skip_special=False)

    def id_of(self, token: str) -> int:
        """Exact vocabulary lookup (inverse of :meth:`token_str`); KeyError if absent."""
        if token not in self._index:
            raise KeyError(f"{token!r} is not in the tokenizer vocabulary")
        return self._index[token]

    def render(
        self,
        messages: Sequence[Mapping[str, Any] | Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rendered:
        """Render OpenAI-style messages with the chat template (docs/tools.md), tools first if any."""
        turns = [("system", tools_text(tools))] if tools else []  # (role, text)
        for n, msg in enumerate(messages):
            role = field_of(msg, "role")
            if not isinstance(role, str):
                raise ValueError(f"messages[{n}].role must be a string, got {role!r}")
            role = _ROLE_ALIASES.get(role, role)
            if role not in self._role_ids:
                raise ValueError(f"messages[{n}].role {role!r} is not one of {[*ROLES, 'developer']}")
            text = content_text(field_of(msg, "content"), where=f"messages[{n}].content")
            if role == "assistant":
                text += tool_calls_text(field_of(msg, "tool_calls"), where=f"messages[{n}].tool_calls")
            turns.append((role, text))
        ids: list[int] = []
        mask: list[bool] = []
        for role, text in turns:
            body = self.encode(text)
            ids += [self._role_ids[role], *body, self.end_id]
            mask += [False] + [role == "assistant"] * (len(body) + 1)  # a role token is not output
        if add_generation_prompt:
            ids.append(self.assistant_id)
            mask.append(False)
        return Rendered(ids=ids, assistant_mask=mask)

    def parse_tool_calls(self, text: str, names: Sequence[str] | None = None) -> ParsedReply | None:
        """The tool calls of a finished assistant reply (None if it is plain content); see ``toolcalls``."""
        return parse_reply(text, names)


def content_text(content: Any, *, where: str = "content") -> str:
    """Text of an OpenAI message content: str, None, or a list of content parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for k, part in enumerate(content):
            ptype, text = field_of(part, "type"), field_of(part, "text")
            if ptype not in ("text", None) or not isinstance(text, str):
                raise ValueError(f"{where}[{k}]: only text content parts are supported, got type {ptype!r}")
            parts.append(text)
        return "".join(parts)
    raise ValueError(
        f"{where} must be a string, null or a list of content parts, got {type(content).__name__}"
    )
