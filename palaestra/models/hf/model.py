"""HFModel: a ``transformers`` causal LM with LoRA adapters (peft), served like the embedded policy.

Only the adapters are trainable; the reference policy of KL/DPO is the network with them disabled. With
``vllm=...`` rollouts go to vLLM servers, which get the adapters after each update.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from palaestra.models.hf.sampling import HFRowCache, check_cache_layers, context_length
from palaestra.models.hf.tiny import TINY_MODELS, build_char_tokenizer, tiny_config
from palaestra.models.hf.tokenize import ChatTokenizer
from palaestra.models.hf.vllm import VLLMLoRASync
from palaestra.models.served import ServedModel

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["DEFAULT_LORA", "SECTION_OPTIONS", "HFModel", "lora_config", "token_logprobs"]

# keys accepted in an experiment's ``[model.hf]`` table (HFModel.from_config_section)
SECTION_OPTIONS = frozenset({
    "lora", "device", "dtype", "seed", "chat_template", "trust_remote_code", "local_files_only", "device_map",
    "micro_batch_size", "max_batch_rows", "block_size", "served_name", "vllm",
})  # fmt: skip
DEFAULT_LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def device_and_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype: ``"auto"``/None picks cuda when available and bfloat16 where supported."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype is None or dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dev, dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return dev, _DTYPES[dtype]


def lora_config(lora: Any) -> Any:
    """A ``peft.LoraConfig`` from None (defaults), a dict (over :data:`DEFAULT_LORA`) or a LoraConfig."""
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    if lora is not None and not isinstance(lora, Mapping):
        raise TypeError(f"lora must be a peft.LoraConfig, a dict or None, got {type(lora).__name__}")
    opts = {**DEFAULT_LORA, **(lora or {})}
    for short in ("alpha", "dropout"):  # short names of lora_alpha and lora_dropout
        if short in opts:
            opts["lora_" + short] = opts.pop(short)
    return LoraConfig(task_type="CAUSAL_LM", **opts)


def token_logprobs(
    model: Any, ids: torch.Tensor, *, grad: bool, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logp[b, t] = log p(ids[b, t+1] | ids[b, :t+1])`` (B, T-1), float32 with a graph when ``grad``, and
    the entropies (no graph). The output layer runs only from column ``start`` on; earlier columns are 0."""
    start = min(max(start, 0), ids.shape[1] - 1)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - start).logits
        lsm = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # predictions of tokens start+1..T-1
        del logits  # the backward needs only lsm: at a real vocabulary each (B, T, V) copy is large
        logp = torch.nn.functional.pad(lsm.gather(-1, ids[:, start + 1 :, None]).squeeze(-1), (start, 0))
    with torch.no_grad():  # a row at a time, so no (B, T, V) temporaries
        ent = torch.nn.functional.pad(torch.stack([-(row.exp() * row).sum(-1) for row in lsm]), (start, 0))
    return logp, ent


class HFModel(ServedModel):
    """A LoRA-wrapped causal LM served in-process like the embedded model. ``micro_batch_size``: rows per
    forward/backward in training (None: the whole minibatch)."""

    backend_kind = "hf"  # GRPOTrainer picks palaestra.trainer.hf_backend.HFBackend for this model
    base_url = "http://hf.palaestra.invalid/v1"

    def __init__(
        self,
        model: Any,
        tokenizer: ChatTokenizer,
        *,
        name: str,
        step: int = 0,
        device: torch.device | str = "cpu",
        block_size: int | None = None,
        card: Mapping[str, Any] | None = None,
        micro_batch_size: int | None = None,
        max_batch_rows: int = 256,
        vllm: VLLMLoRASync | None = None,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        if not hasattr(model, "disable_adapter"):
            raise TypeError("HFModel needs a peft model (use from_pretrained/from_config, which add LoRA)")
        if vllm is None:
            check_cache_layers(model)
        self._serve(name, step, card, max_batch_rows, gather_yields=2, batch_wait_s=0.005)
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.block_size = context_length(model, block_size)
        self.micro_batch_size = micro_batch_size
        self.vllm = vllm
        self.model.eval()

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | os.PathLike[str],
        *,
        lora: Any = None,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype | None = "auto",
        name: str | None = None,
        chat_template: str | None = None,
        trust_remote_code: bool = False,
        local_files_only: bool | None = None,
        device_map: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> HFModel:
        """Load a model and its tokenizer (a local folder or a hub name) and add fresh LoRA adapters.
        ``device_map="auto"`` spreads a large model over the visible GPUs; otherwise it goes to ``device``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev, dt = device_and_dtype(device, dtype)
        hub: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if local_files_only is not None:
            hub["local_files_only"] = local_files_only
        tok = AutoTokenizer.from_pretrained(str(path_or_name), **hub)
        base = AutoModelForCausalLM.from_pretrained(str(path_or_name), dtype=dt, device_map=device_map, **hub)
        if device_map is None:
            base = base.to(dev)
        shown = name or Path(str(path_or_name)).name
        return cls._wrap(base, tok, lora, dev, shown, chat_template, {"source": str(path_or_name)}, **kwargs)

    @classmethod
    def from_config(
        cls,
        config: Any,
        tokenizer: Any,
        *,
        lora: Any = None,
        seed: int = 0,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = "float32",
        name: str = "hf-random",
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> HFModel:
        """A randomly initialised model (``torch.manual_seed(seed)``) from a transformers config and a
        tokenizer object; nothing is downloaded."""
        from transformers import AutoModelForCausalLM

        dev, dt = device_and_dtype(device, dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            base = AutoModelForCausalLM.from_config(config, dtype=dt).to(dev)
        card = {"source": "random", "seed": seed, "architecture": type(base).__name__}
        return cls._wrap(base, tokenizer, lora, dev, name, chat_template, card, seed=seed, **kwargs)

    @classmethod
    def tiny(
        cls, name: str = "tiny-random-llama", *, seed: int = 0, served_name: str | None = None, **kwargs: Any
    ) -> HFModel:
        """A shipped tiny random model by name (:mod:`palaestra.models.hf.tiny`)."""
        tok = build_char_tokenizer()
        cfg = tiny_config(name, len(tok))
        cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
        return cls.from_config(cfg, tok, seed=seed, name=served_name or name, **kwargs)

    @classmethod
    def _wrap(
        cls,
        base: Any,
        tok: Any,
        lora: Any,
        device: torch.device,
        name: str,
        chat_template: str | None,
        card: dict[str, Any],
        seed: int = 0,
        **kwargs: Any,
    ) -> HFModel:
        from peft import get_peft_model

        base.requires_grad_(False)
        gen_eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        vocab_size = int(base.get_output_embeddings().weight.shape[0])
        chat = ChatTokenizer(tok, vocab_size=vocab_size, chat_template=chat_template, extra_end_ids=extra)
        lc = lora_config(lora)
        targets = lc.target_modules
        lora_card = {"r": lc.r, "lora_alpha": lc.lora_alpha, "lora_dropout": lc.lora_dropout}
        lora_card["target_modules"] = targets if isinstance(targets, str) else sorted(targets or [])
        card = {**card, "lora": lora_card}
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecations raised inside peft
            torch.manual_seed(seed)
            peft_model = get_peft_model(base, lc)
        return cls(peft_model, chat, name=name, device=device, card=card, **kwargs)

    @classmethod
    def from_config_section(cls, name: str, options: Mapping[str, Any]) -> HFModel:
        """Build from an experiment's ``[model]`` section: a tiny model name or a path/hub name, and the
        ``model.hf`` options (:data:`SECTION_OPTIONS`)."""
        opts = dict(options)
        if unknown := sorted(set(opts) - SECTION_OPTIONS):
            allowed = ", ".join(sorted(SECTION_OPTIONS))
            raise ValueError(f"field 'model.hf.{unknown[0]}': unknown option; allowed: {allowed}")
        vllm = opts.pop("vllm", None)
        if vllm is not None:
            if not isinstance(vllm, Mapping):
                raise ValueError("field 'model.hf.vllm': expected a table (base_url, lora_dir, lora_name)")
            try:
                opts["vllm"] = VLLMLoRASync(**dict(vllm))
            except TypeError as exc:
                raise ValueError(f"field 'model.hf.vllm': {exc}") from None
        served = opts.pop("served_name", None)
        if name in TINY_MODELS:
            for key in ("trust_remote_code", "local_files_only", "device_map"):
                opts.pop(key, None)
            return cls.tiny(name, served_name=served, **opts)
        opts.pop("seed", None)
        return cls.from_pretrained(name, name=served, **opts)

    def __repr__(self) -> str:
        return f"HFModel(name={self.name!r}, step={self.step}, device={self.device}, lora={self.n_trainable})"

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters by name (the only ones the backend updates)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @property
    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters().values())

    def adapter_state(self) -> dict[str, np.ndarray]:
        """LoRA weights as float32 numpy arrays (lossless for bf16/fp16), keyed by parameter name."""
        with self.lock:
            params = self.trainable_parameters()
            return {n: p.detach().float().cpu().numpy().copy() for n, p in params.items()}

    def load_adapter_state(self, state: Mapping[str, Any]) -> None:
        """Copy LoRA weights in place (names and shapes must match :meth:`adapter_state`)."""
        params = self.trainable_parameters()
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or extra:
            raise ValueError(f"adapter state: missing {missing[:3]}, unexpected {extra[:3]}")
        with self.lock, torch.no_grad():
            for n, p in params.items():
                arr = np.asarray(state[n])
                if tuple(arr.shape) != tuple(p.shape):
                    raise ValueError(
                        f"adapter state {n!r}: shape {arr.shape}, the model expects {tuple(p.shape)}"
                    )
                p.copy_(torch.from_numpy(arr.astype(np.float32)).to(p.device, p.dtype))

    def save_adapter(self, path: str | os.PathLike[str]) -> Path:
        """Write the adapters in peft's format (loadable by ``PeftModel.from_pretrained`` and vLLM)."""
        out = Path(path)
        with self.lock:
            self.model.save_pretrained(str(out))
        return out

    def load_adapter(self, path: str | os.PathLike[str]) -> None:
        """Load adapter weights written by :meth:`save_adapter` into the current adapters."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        file = Path(path) / "adapter_model.safetensors"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no adapter weights")
        with self.lock:
            res = set_peft_model_state_dict(self.model, load_file(str(file)))
        if bad := [k for k in getattr(res, "unexpected_keys", []) if "lora" in k]:
            raise ValueError(f"{file}: unexpected adapter keys {bad[:3]}")

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """The reference policy: the network with the adapters disabled (holds :attr:`lock`)."""
        with self.lock, self.model.disable_adapter():
            yield self.model

    def after_update(self) -> None:
        """Called by the backend after each update: pushes the adapters to vLLM when configured."""
        if self.vllm is not None:
            self.vllm.publish(self, self.step)

    @torch.no_grad()
    def logprobs_of(self, ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``log p(ids[t+1] | ids[:t+1])`` for each sequence (float32 forward; one row at a time)."""
        with self.lock:
            rows = [torch.as_tensor([list(seq)], device=self.device) for seq in ids]
            return [token_logprobs(self.model, x, grad=False)[0][0].double().cpu().numpy() for x in rows]

    def row_cache(self) -> HFRowCache:
        return HFRowCache(self.model, self.tokenizer, device=self.device, block_size=self.block_size)

    def openai_client(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` bound in-process to :meth:`app`, or to the vLLM servers (the first call
        then pushes the current adapters, blocking)."""
        if self.vllm is not None:
            if not self.vllm.published:  # the server must know the adapter before the first rollout
                self.vllm.publish(self, self.step)
            return self.vllm.remote(self).openai_client()
        return super().openai_client()
