"""EmbeddedBackend: trains an :class:`~palaestra.models.embedded.EmbeddedModel` (numpy TinyGPT) in place, each
Adam step under ``model.lock`` so a rollout never sees half-updated weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from palaestra.models.embedded import EmbeddedModel
from palaestra.models.tinygpt import TinyGPT, checked_params
from palaestra.trainer.config import TrainConfig
from palaestra.trainer.sft import TinyGPTPolicy
from palaestra.trainer.tokenize import PackedBatch
from palaestra.trainer.update import PolicyBackend

__all__ = ["EmbeddedBackend"]


class EmbeddedBackend(PolicyBackend, TinyGPTPolicy):
    """:class:`~palaestra.trainer.backend.Backend` for an in-process numpy policy (Adam over its weights)."""

    STATE_FORMAT = "palaestra.embedded_backend/1"

    def __init__(self, model: EmbeddedModel, config: TrainConfig | None = None) -> None:
        max_len = model.gpt.config.block_size + 1  # the last token is only a target
        PolicyBackend.__init__(self, model, config, max_len)
        TinyGPTPolicy.__init__(self, model.gpt, lock=model.lock)
        self.reference: TinyGPT | None = self._snapshot() if self.config.needs_reference else None

    def _snapshot(self) -> TinyGPT:
        with self.model.lock:
            params = {k: v.copy() for k, v in self.gpt.params.items()}
        return TinyGPT(self.gpt.config, params=params, tokenizer=self.gpt.tokenizer)

    def reference_logprobs(self, packed: PackedBatch) -> np.ndarray:
        """Logprobs of the packed rows under the frozen copy of the weights (taken now if none was kept)."""
        if self.reference is None:
            self.reference = self._snapshot()
        return self.reference.logprobs_of(packed.ids)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Weights, Adam state, reference weights (if kept), RNG state, update counter and ``model.step``."""
        with self.model.lock:
            out = {"param/" + name: p.copy() for name, p in self.gpt.params.items()}
            out.update({"optim/" + k: np.array(v, copy=True) for k, v in self.optimizer.state_dict().items()})
            out["policy_step"] = np.array(self.model.step, dtype=np.int64)
        if self.reference is not None:
            out.update({"ref/" + name: p.copy() for name, p in self.reference.params.items()})
        return self._state(out)

    def load_state_dict(self, state: Mapping[str, Any], *, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict` in place; ``weights_only=True``: the weights alone (``model.step`` bumped)."""
        self._check_format(state)
        params = self.gpt.params
        loaded = checked_params(
            {name: p.shape for name, p in params.items()},
            {k[6:]: v for k, v in state.items() if k.startswith("param/")},
            self.gpt.config.dtype,
            "backend state parameters",
        )
        with self.model.lock:
            if not weights_only:
                self.optimizer.load_state_dict({k[6:]: state[k] for k in state if k.startswith("optim/")})
                self.model.step = int(np.asarray(state["policy_step"]))
            for name, p in params.items():
                p[...] = loaded[name]
        if weights_only:
            self.model.bump_step()
            return
        ref = {k[4:]: np.asarray(state[k]).copy() for k in state if k.startswith("ref/")}
        self.reference = TinyGPT(self.gpt.config, params=ref, tokenizer=self.gpt.tokenizer) if ref else None
        self._load_counters(state)
