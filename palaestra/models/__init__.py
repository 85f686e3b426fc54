"""Layer 2: policies. The embedded numpy GPT (tokenizer, sampler, OpenAI-compatible server), remote endpoints,
and the optional HF backend (``palaestra.models.hf``, needs the ``hf`` extra)."""

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.registry import available, load
from palaestra.models.remote import RemoteModel


def create_app(models: object) -> object:
    """The OpenAI-compatible ASGI app serving ``models`` (see :func:`palaestra.models.server.create_app`)."""
    from palaestra.models.server import create_app as _create_app

    return _create_app(models)  # type: ignore[arg-type]


__all__ = ["EmbeddedModel", "RemoteModel", "available", "create_app", "load"]
