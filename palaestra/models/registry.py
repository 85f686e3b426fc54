"""Registry of the models shipped in ``palaestra/models/weights/``: ``<name>.npz`` (a TinyGPT checkpoint, or a
reward model for ``*-rm`` names) with an optional JSON card ``<name>.json`` beside it. ``load("arith-base")``
returns a fresh trainable copy; ``load`` also takes a path to any ``.npz`` checkpoint."""

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


def available(*, reward_models: bool = False) -> list[str]:
    """Names of the shipped policies (with ``reward_models``: of the shipped ``*-rm`` reward models), sorted."""
    return sorted(p.stem for p in WEIGHTS_DIR.glob("*.npz") if p.stem.endswith("-rm") == reward_models)


def path_of(name: str, *, reward_models: bool = False) -> Path:
    """Checkpoint path of a shipped model (:class:`UnknownModelError`, listing the names, if unknown)."""
    path = WEIGHTS_DIR / f"{name}.npz"
    if "/" in name or os.sep in name or not path.is_file():
        listing = ", ".join(available(reward_models=reward_models)) or "none are installed"
        msg = f"unknown model {name!r}; available models: {listing} (or pass a path to an .npz checkpoint)"
        raise UnknownModelError(msg)
    return path


def checkpoint(
    name_or_path: str | os.PathLike[str], *, reward_models: bool = False
) -> tuple[Path, str | None]:
    """The file of a shipped model name or of a path (``FileNotFoundError`` when a path is not a file), and the
    shipped name (None for a path)."""
    s = str(name_or_path)
    if isinstance(name_or_path, os.PathLike) or s.endswith(".npz") or "/" in s or os.sep in s:
        if not Path(s).is_file():
            raise FileNotFoundError(f"{s}: no such checkpoint file")
        return Path(s), None
    return path_of(s, reward_models=reward_models), s


def load(name_or_path: str | os.PathLike[str], *, name: str | None = None, **kwargs: Any) -> EmbeddedModel:
    """A new, independent, trainable :class:`EmbeddedModel` of a shipped model name or an ``.npz`` path;
    ``name`` overrides the served name, other keyword arguments go to :class:`EmbeddedModel`."""
    path, shipped = checkpoint(name_or_path)
    return EmbeddedModel.load(path, name=name or shipped, **kwargs)


__all__ = ["WEIGHTS_DIR", "UnknownModelError", "available", "checkpoint", "load", "path_of"]
