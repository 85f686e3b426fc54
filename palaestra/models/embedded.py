"""EmbeddedModel: a trainable TinyGPT policy served in-process through an OpenAI-compatible API (README).

The trainer updates ``model.gpt.params`` in place holding ``model.lock``, then calls ``bump_step``. Do not hold
``model.lock`` while awaiting a generation: the pass waits for the lock and the await waits for the pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from palaestra.models.sampling import TinyGPTCache
from palaestra.models.served import ServedModel
from palaestra.models.tinygpt import TinyGPT
from palaestra.models.tokenizer import Tokenizer


class EmbeddedModel(ServedModel):
    """A TinyGPT policy with a name, a policy version (``step``) and an in-process OpenAI-compatible server."""

    def __init__(
        self,
        gpt: TinyGPT,
        *,
        name: str = "embedded",
        step: int = 0,
        card: Mapping[str, Any] | None = None,
        max_batch_rows: int = 1024,
        gather_yields: int = 2,
        batch_wait_s: float = 0.005,
    ) -> None:
        self._serve(name, step, card, max_batch_rows, gather_yields, batch_wait_s)
        self.gpt = gpt

    def __repr__(self) -> str:
        return f"EmbeddedModel(name={self.name!r}, step={self.step}, params={self.gpt.n_params})"

    @property
    def tokenizer(self) -> Tokenizer:
        return self.gpt.tokenizer

    @property
    def block_size(self) -> int:
        """Context length (prompt + completion tokens)."""
        return self.gpt.config.block_size

    def row_cache(self) -> TinyGPTCache:
        """The numpy KV cache of one generation pass, with room for rows joining later."""
        spare_rows = max(16, self.max_batch_rows // 4)
        return TinyGPTCache(self.gpt, spare_rows=spare_rows, spare_slots=self.block_size)

    def save(self, path: str | os.PathLike[str], *, optimizer: Any = None) -> None:
        """Write an ``.npz`` checkpoint (weights, config, vocab; name, step and card in its metadata)."""
        with self.lock:
            meta = {**self.gpt.meta, "palaestra": {"name": self.name, "step": self.step, "card": self.card}}
            self.gpt.save(path, optimizer=optimizer, meta=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, name: str | None = None, **kwargs: Any) -> EmbeddedModel:
        """Load a checkpoint; the card is ``<path>.json`` beside it if present, else the one saved inside."""
        path = Path(path)
        gpt = TinyGPT.load(path)
        raw = gpt.meta.get("palaestra")
        info: dict[str, Any] = raw if isinstance(raw, dict) else {}
        card, beside = info.get("card"), path.with_suffix(".json")
        if beside.is_file():  # a malformed card raises naming the file
            try:
                card = json.loads(beside.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{beside}: unreadable model card ({exc})") from exc
            if not isinstance(card, dict):
                raise ValueError(f"{beside}: a model card must be a JSON object, got {type(card).__name__}")
        step = info.get("step", 0)
        step = step if isinstance(step, int) else 0
        card = card if isinstance(card, dict) else {}
        return cls(gpt, name=name or info.get("name") or path.stem, step=step, card=card, **kwargs)


__all__ = ["EmbeddedModel"]
