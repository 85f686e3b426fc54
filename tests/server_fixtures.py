"""Helpers for the server tests: a tiny embedded model and a real uvicorn server on 127.0.0.1 in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What is 12+7? Reply with one line: Final: <int>"}]


def tiny_model(seed: int = 1, end_bias: float = 0.0, name: str = "tiny", **kwargs: Any) -> EmbeddedModel:
    """A random 1-layer TinyGPT (48-token context) served as ``name``."""
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=48, d_model=32, n_layer=1, n_head=2, d_ff=64)
    gpt = TinyGPT(cfg, tokenizer=tok, seed=seed)
    gpt.params["head.b"][tok.end_id] += end_bias
    return EmbeddedModel(gpt, name=name, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1 (a free port) in a daemon thread; yields the base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True, name="test-uvicorn")
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        httpx.get(base + "/health", timeout=5).raise_for_status()
        yield base
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def holding_weights(model: EmbeddedModel, then: Callable[[], Any] | None = None) -> Iterator[threading.Event]:
    """A trainer in another thread holds ``model.lock`` (as an update does) from entry until the yielded event
    is set (at the latest on exit), then runs ``then`` still holding it; the thread is joined on exit."""
    held, release = threading.Event(), threading.Event()

    def trainer() -> None:
        with model.lock:
            held.set()
            release.wait(20)
            if then is not None:
                then()

    t = threading.Thread(target=trainer)
    t.start()
    held.wait(5)
    try:
        yield release
    finally:
        release.set()
        t.join()
