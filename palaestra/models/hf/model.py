"""HFModel: a ``transformers`` causal LM with LoRA adapters (peft), served like the embedded policy.

::

    model = HFModel.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct", lora={"r": 16}, device="cuda")
    model = HFModel.tiny("tiny-random-llama")            # built in code, for tests (no download)
    client = model.openai_client()                        # same in-process OpenAI-compatible app as embedded
    out = await client.chat.completions.create(model=model.name, messages=[...], logprobs=True)

Only the LoRA adapters are trainable (the base weights are frozen); the reference policy of KL/DPO is the same
network with the adapters disabled (:meth:`HFModel.reference`). The trainer-side backend lives in
:mod:`palaestra.trainer.hf_backend` (this package must not import the trainer). Every completion names its
policy version in ``system_fingerprint`` (``"<name>@step<k>"``), as for embedded models. With ``vllm=...``
rollouts go to a vLLM server instead and the adapters are pushed to it after each update
(:mod:`palaestra.models.hf.vllm`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from palaestra.models.engine import EngineStats, Sample, SamplingParams, choice_seeds, prepare_params
from palaestra.models.hf.options import SECTION_OPTIONS, lora_config, resolve_device, resolve_dtype
from palaestra.models.hf.sampling import Generation, generate
from palaestra.models.hf.tokenize import ChatTokenizer

if TYPE_CHECKING:
    from fastapi import FastAPI
    from openai import AsyncOpenAI

    from palaestra.models.hf.vllm import VLLMLoRASync

__all__ = ["HFModel", "token_logprobs"]

_BASE_URL = "http://hf.palaestra.invalid/v1"


def token_logprobs(model: Any, ids: torch.Tensor, *, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logp[b, t] = log p(ids[b, t+1] | ids[b, :t+1])`` (B, T-1), float32 with a graph when ``grad``, and
    the entropies of those next-token distributions (B, T-1, no graph) under the causal LM ``model``."""
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
        lsm = torch.log_softmax(logits, dim=-1)
        logp = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        ent = -(lsm.exp() * lsm).sum(-1)
    return logp, ent


class HFModel:
    """A LoRA-wrapped causal LM with a name, a policy version and an in-process OpenAI-compatible server.

    Build one with :meth:`from_pretrained`, :meth:`from_config` or :meth:`tiny`. ``micro_batch_size`` (rows
    per forward/backward in training; None = the whole minibatch) is read by the HF backend.
    ``max_batch_rows``, ``gather_yields`` and ``batch_wait_s`` tune the batching engine as for
    :class:`~palaestra.models.embedded.EmbeddedModel`.
    """

    backend_kind = "hf"  # GRPOTrainer picks palaestra.trainer.hf_backend.HFBackend for this model

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
        gather_yields: int = 2,
        batch_wait_s: float = 0.005,
        vllm: VLLMLoRASync | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"model name must be a non-empty string without spaces, got {name!r}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        if not hasattr(model, "disable_adapter"):
            raise TypeError("HFModel needs a peft model (use from_pretrained/from_config, which add LoRA)")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.step = int(step)
        self.device = torch.device(device)
        cfg = model.config
        self.block_size = int(block_size or getattr(cfg, "max_position_embeddings", 2048))
        self.card: dict[str, Any] = dict(card or {})
        self.micro_batch_size = micro_batch_size
        self.lock = threading.RLock()
        self.max_batch_rows = int(max_batch_rows)
        self.gather_yields = int(gather_yields)
        self.batch_wait_s = float(batch_wait_s)
        self.stats = EngineStats()
        self.vllm = vllm
        from palaestra.models.engine import EngineSet
        from palaestra.models.hf.serving import HFBatchEngine

        self._engines = EngineSet(self, HFBatchEngine)  # type: ignore[arg-type]
        self._app: FastAPI | None = None
        self._client: AsyncOpenAI | None = None
        self._init_lock = threading.Lock()
        self.model.eval()

    # ------------------------------------------------------------------ construction
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
        """Load a model and its tokenizer (a local folder or a hub name; ``HF_HUB_OFFLINE=1`` forbids
        downloads) and add fresh LoRA adapters. ``device_map="auto"`` spreads a large model over the visible
        GPUs (accelerate); otherwise the model goes to ``device``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
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
        tokenizer object; nothing is downloaded. Used by the tests."""
        from transformers import AutoModelForCausalLM

        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            base = AutoModelForCausalLM.from_config(config, dtype=dt)
        base = base.to(dev)
        card = {"source": "random", "seed": seed, "architecture": type(base).__name__}
        return cls._wrap(base, tokenizer, lora, dev, name, chat_template, card, seed=seed, **kwargs)

    @classmethod
    def tiny(
        cls, name: str = "tiny-random-llama", *, seed: int = 0, served_name: str | None = None, **kwargs: Any
    ) -> HFModel:
        """A shipped tiny random model by name (see :mod:`palaestra.models.hf.tiny`), served as
        ``served_name`` (default: its name)."""
        from palaestra.models.hf.tiny import build_char_tokenizer, tiny_config

        tok = build_char_tokenizer()
        cfg = tiny_config(name, len(tok))
        cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
        kwargs.setdefault("device", "cpu")
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

        for p in base.parameters():
            p.requires_grad_(False)
        gen_eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        vocab_size = int(base.get_output_embeddings().weight.shape[0])
        chat = ChatTokenizer(tok, vocab_size=vocab_size, chat_template=chat_template, extra_end_ids=extra)
        lc = lora_config(lora)
        targets = lc.target_modules
        card = {
            **card,
            "lora": {
                "r": lc.r,
                "lora_alpha": lc.lora_alpha,
                "lora_dropout": lc.lora_dropout,
                "target_modules": targets if isinstance(targets, str) else sorted(targets or []),
            },
        }
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecations raised inside peft
            torch.manual_seed(seed)
            peft_model = get_peft_model(base, lc)
        return cls(peft_model, chat, name=name, device=device, card=card, **kwargs)

    @classmethod
    def from_config_section(cls, name: str, options: Mapping[str, Any]) -> HFModel:
        """Build from an experiment's ``[model]`` section: ``name`` is a tiny model name (built in code) or a
        path/hub name; ``options`` is ``model.hf`` (keys below; an unknown key raises naming it)."""
        from palaestra.models.hf.tiny import TINY_MODELS

        opts = dict(options)
        unknown = sorted(set(opts) - SECTION_OPTIONS)
        if unknown:
            allowed = ", ".join(sorted(SECTION_OPTIONS))
            raise ValueError(f"field 'model.hf.{unknown[0]}': unknown option; allowed: {allowed}")
        vllm = opts.pop("vllm", None)
        if vllm is not None:
            from palaestra.models.hf.vllm import VLLMLoRASync

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

    # ------------------------------------------------------------------ identity and weights
    def __repr__(self) -> str:
        return f"HFModel(name={self.name!r}, step={self.step}, device={self.device}, lora={self.n_trainable})"

    @property
    def fingerprint(self) -> str:
        """``"<name>@step<step>"``: the ``system_fingerprint`` of completions produced now."""
        return f"{self.name}@step{self.step}"

    def bump_step(self) -> int:
        """Advance the policy version by one (after a weight update) and return it."""
        with self.lock:
            self.step += 1
            return self.step

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters by name (the only ones the backend updates)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @property
    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters().values())

    def adapter_state(self) -> dict[str, np.ndarray]:
        """LoRA weights as float32 numpy arrays (lossless for bf16/fp16), keyed by parameter name."""
        with self.lock:
            return {
                n: p.detach().float().cpu().numpy().copy() for n, p in self.trainable_parameters().items()
            }

    def load_adapter_state(self, state: Mapping[str, Any]) -> None:
        """Copy LoRA weights in place (names and shapes must match :meth:`adapter_state`)."""
        params = self.trainable_parameters()
        missing = sorted(set(params) - set(state))
        extra = sorted(set(state) - set(params))
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
        """Write the adapters in peft's format (``adapter_config.json`` + safetensors): loadable by
        ``PeftModel.from_pretrained`` and by vLLM's ``/v1/load_lora_adapter``."""
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
        bad = [k for k in getattr(res, "unexpected_keys", []) if "lora" in k]
        if bad:
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

    # ------------------------------------------------------------------ scoring and sampling
    @torch.no_grad()
    def logprobs_of(self, ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``log p(ids[t+1] | ids[:t+1])`` for each sequence (float32 forward; one row at a time)."""
        with self.lock:
            return [
                token_logprobs(self.model, torch.as_tensor([list(seq)], device=self.device), grad=False)[0][0]
                .cpu()
                .numpy()
                .astype(np.float64)
                for seq in ids
            ]

    def generate_ids(self, prompts: Sequence[Sequence[int]], **kwargs: Any) -> list[Generation]:
        """Sample from token-id prompts (:func:`palaestra.models.hf.sampling.generate`; holds the lock)."""
        with self.lock:
            return generate(self.model, self.tokenizer, prompts, device=self.device, **kwargs)

    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Sample]:
        """Low level: queue one prompt (one choice per seed) on this event loop's batching engine."""
        return await self._engines.get().submit(prompt_ids, params, seeds)

    def render(self, messages: Sequence[Any], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids of a conversation under the chat template, ending with the generation prompt."""
        return self.tokenizer.render(messages, add_generation_prompt=True, tools=tools).ids

    async def generate(
        self,
        messages: Sequence[Any],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | None = 16,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        logprobs: bool = True,
        top_logprobs: int = 0,
    ) -> list[Sample] | list[list[Sample]]:
        """Sample ``n`` completions without HTTP, batched with concurrent requests (same contract as
        :meth:`palaestra.models.embedded.EmbeddedModel.generate`)."""
        import asyncio

        if isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        first = messages[0]
        single = isinstance(first, Mapping) or hasattr(first, "role")
        convs = [messages] if single else list(messages)
        jobs = []
        for c, conv in enumerate(convs):
            prompt = self.render(conv)
            params = prepare_params(
                prompt_len=len(prompt),
                block_size=self.block_size,
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop=stop,
                logprobs=True,
                top_logprobs=top_logprobs,
            )
            jobs.append(self.submit(prompt, params, choice_seeds(seed, n, salt=c)))
        results = list(await asyncio.gather(*jobs))
        if not logprobs:
            for samples in results:
                for s in samples:
                    s.logprobs, s.top_logprobs = [], []
        return results[0] if single else results

    # ------------------------------------------------------------------ serving
    def app(self) -> FastAPI:
        """The shared OpenAI-compatible FastAPI app serving this model (cached)."""
        with self._init_lock:
            if self._app is None:
                from palaestra.models.hf.serving import create_hf_app

                self._app = create_hf_app(self)
            return self._app

    def openai_client(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` bound in-process to :meth:`app` (no port), or to the vLLM server when
        the model was built with ``vllm=...`` (the first call then pushes the current adapters, blocking)."""
        if self.vllm is not None:
            if not self.vllm.published:  # the server must know the adapter before the first rollout
                self.vllm.publish(self, self.step)
            return self.vllm.remote(self).openai_client()
        app = self.app()
        with self._init_lock:
            if self._client is None:
                import httpx
                import openai

                http = httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url=_BASE_URL, timeout=httpx.Timeout(None)
                )
                self._client = openai.AsyncOpenAI(
                    api_key="embedded", base_url=_BASE_URL, http_client=http, max_retries=0, timeout=None
                )
            return self._client
