"""The HF backend's model side: ``transformers`` causal LMs with LoRA adapters (``pip install palaestra[hf]``).

Importing this package does not import torch; the names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from palaestra.models.hf.tiny import TINY_MODELS

if TYPE_CHECKING:
    from palaestra.models.hf.model import HFModel
    from palaestra.models.hf.tokenize import ChatTokenizer
    from palaestra.models.hf.vllm import VLLMLoRASync

__all__ = ["TINY_MODEL_NAMES", "ChatTokenizer", "HFModel", "VLLMLoRASync"]

TINY_MODEL_NAMES = tuple(TINY_MODELS)  # the tiny models built in code (light: tiny.py imports no torch)

_LAZY = {"HFModel": "model", "ChatTokenizer": "tokenize", "VLLMLoRASync": "vllm"}  # name -> its module here


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.models.hf' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as exc:
        if exc.name in ("torch", "transformers", "peft", "tokenizers", "safetensors"):
            raise ImportError(
                f"palaestra.models.hf.{name} needs the hf extra: pip install 'palaestra[hf]' ({exc})"
            ) from exc
        raise
