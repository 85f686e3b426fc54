"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Any local Ray cluster a test starts binds to 127.0.0.1 only (read by ray at import; see trajectories/executors)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small randomly initialised TinyGPT checkpoint (fast to run; accuracy ~0)."""
    from palaestra.models.tinygpt import GPTConfig, TinyGPT
    from palaestra.models.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64)
    path = tmp_path_factory.mktemp("models") / "tiny.npz"
    TinyGPT(cfg, tokenizer=tok, seed=0).save(path)
    return path
