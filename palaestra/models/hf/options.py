"""Options of :class:`~palaestra.models.hf.model.HFModel`: device, dtype, LoRA settings, config keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DEFAULT_LORA", "SECTION_OPTIONS", "lora_config", "resolve_device", "resolve_dtype"]

# keys accepted in an experiment's ``[model.hf]`` table (HFModel.from_config_section)
SECTION_OPTIONS = frozenset(
    {
        "lora",
        "device",
        "dtype",
        "seed",
        "chat_template",
        "trust_remote_code",
        "local_files_only",
        "device_map",
        "micro_batch_size",
        "max_batch_rows",
        "block_size",
        "served_name",
        "vllm",
    }
)
DEFAULT_LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None: cuda if available, else cpu."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/None: bfloat16 on a GPU that supports it, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def lora_config(lora: Any) -> Any:
    """A ``peft.LoraConfig`` from None (defaults), a dict (over :data:`DEFAULT_LORA`) or a LoraConfig."""
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    opts = dict(DEFAULT_LORA)
    if lora is not None:
        if not isinstance(lora, Mapping):
            raise TypeError(f"lora must be a peft.LoraConfig, a dict or None, got {type(lora).__name__}")
        opts.update(lora)
        if "alpha" in opts:
            opts["lora_alpha"] = opts.pop("alpha")
        if "dropout" in opts:
            opts["lora_dropout"] = opts.pop("dropout")
    return LoraConfig(task_type="CAUSAL_LM", **opts)
