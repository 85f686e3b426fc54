"""Registry of the models shipped with palaestra: ``load("arith-base")`` returns a fresh trainable copy.

A shipped model is ``palaestra/models/weights/<name>.npz`` (a TinyGPT checkpoint) with an optional JSON card
``<name>.json`` beside it. ``load`` also takes a path to any ``.npz`` checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from palaestra.models.embedded import EmbeddedModel

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


class UnknownModelError(KeyError):
    """No shipped model has this name; the message lists the available ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


def available() -> list[str]:
    """Names of the shipped models, sorted."""
    if not WEIGHTS_DIR.is_dir():
        return []
    # ``*-rm.npz`` are reward models (palaestra.models.reward_model), not policies
    return sorted(p.stem for p in WEIGHTS_DIR.glob("*.npz") if p.is_file() and not p.stem.endswith("-rm"))


def path_of(name: str) -> Path:
    """Checkpoint path of a shipped model (:class:`UnknownModelError`, listing the names, if unknown)."""
    path = WEIGHTS_DIR / f"{name}.npz"
    if "/" in name or os.sep in name or not path.is_file():
        names = available()
        listing = ", ".join(names) if names else "none are installed"
        raise UnknownModelError(
            f"unknown model {name!r}; available models: {listing} (or pass a path to an .npz checkpoint)"
        )
    return path


def _looks_like_path(name_or_path: str | os.PathLike[str]) -> bool:
    if isinstance(name_or_path, os.PathLike):
        return True
    s = str(name_or_path)
    return s.endswith(".npz") or "/" in s or os.sep in s


def load(name_or_path: str | os.PathLike[str], *, name: str | None = None, **kwargs: Any) -> EmbeddedModel:
    """A new, independent, trainable :class:`EmbeddedModel`.

    ``name_or_path`` is a shipped model name (see :func:`available`) or a path to a ``.npz`` checkpoint.
    ``name`` overrides the served model name (default: the shipped name, or the name saved in the
    checkpoint, or the file stem). Extra keyword arguments go to :class:`EmbeddedModel` (``max_batch_rows``).
    """
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such checkpoint file")
        return EmbeddedModel.load(path, name=name, **kwargs)
    shipped = str(name_or_path)
    return EmbeddedModel.load(path_of(shipped), name=name or shipped, **kwargs)


__all__ = ["WEIGHTS_DIR", "UnknownModelError", "available", "load", "path_of"]
