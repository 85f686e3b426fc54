"""Layer 2: policies. The embedded numpy GPT (tokenizer, sampler, OpenAI-compatible server), remote endpoints,
and the optional HF backend (``palaestra.models.hf``, needs the ``hf`` extra)."""

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.registry import available, load
from palaestra.models.remote import RemoteModel

__all__ = ["EmbeddedModel", "RemoteModel", "available", "load"]
