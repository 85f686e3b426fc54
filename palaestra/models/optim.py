"""Adam with decoupled weight decay and global grad-norm clipping, over a dict of numpy params."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np


class Adam:
    """Adam over ``params`` (updated in place; ``lr`` may change between steps). Weight decay applies to
    matrices only (ndim >= 2); ``clip_norm`` None or 0: no clipping; a non-finite norm skips the update."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_norm: float | None = 1.0,
    ) -> None:
        if lr < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or eps <= 0 or weight_decay < 0:
            raise ValueError(
                f"invalid Adam hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}"
            )
        self.params = dict(params)
        self.lr, self.eps, self.weight_decay = float(lr), float(eps), float(weight_decay)
        self.betas = (float(betas[0]), float(betas[1]))
        self.clip_norm = float(clip_norm) if clip_norm else None
        ends = list(itertools.accumulate((p.size for p in self.params.values()), initial=0))
        self._slices = {name: slice(a, b) for name, a, b in zip(self.params, ends, ends[1:])}
        dtype = next(iter(self.params.values())).dtype if self.params else np.dtype(np.float32)
        self._m = np.zeros(ends[-1], dtype)  # moments of all params in one flat buffer each
        self._v = np.zeros(ends[-1], dtype)
        self.t = 0

    def step(self, grads: Mapping[str, np.ndarray]) -> float:
        """One update; returns the pre-clipping global gradient norm."""
        if missing := [n for n in self.params if n not in grads]:
            raise ValueError(f"Adam.step: gradients missing for {missing}")
        g = np.concatenate([np.asarray(grads[n], self._m.dtype).reshape(-1) for n in self.params])
        if g.size != self._m.size:
            raise ValueError(f"Adam.step: gradient sizes ({g.size}) do not match the params ({self._m.size})")
        norm = float(np.sqrt(np.square(g).sum()))  # no BLAS call: no thread stalls
        if not np.isfinite(norm):
            return norm
        if self.clip_norm is not None and norm > self.clip_norm:
            g *= self.clip_norm / (norm + 1e-6)
        b1, b2 = self.betas
        self.t += 1
        self._m *= b1
        self._m += (1.0 - b1) * g
        self._v *= b2
        g *= g
        g *= 1.0 - b2
        self._v += g
        step_size = self.lr / (1.0 - b1**self.t)
        denom = np.sqrt(self._v / (1.0 - b2**self.t))
        denom += self.eps
        upd = self._m / denom
        upd *= step_size
        decay = self.lr * self.weight_decay
        for name, p in self.params.items():
            if decay and p.ndim >= 2:
                p *= 1.0 - decay
            p -= upd[self._slices[name]].reshape(p.shape)
        return norm

    def state_dict(self) -> dict[str, np.ndarray | int]:
        """``{"step": t, "m/<name>": array, "v/<name>": array}`` (numpy arrays and ints only)."""
        out: dict[str, np.ndarray | int] = {"step": int(self.t)}
        for name, p in self.params.items():
            for kind, buf in (("m", self._m), ("v", self._v)):
                out[f"{kind}/{name}"] = buf[self._slices[name]].reshape(p.shape).copy()
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray | int]) -> None:
        """Restore a :meth:`state_dict` (shapes must match the params)."""
        if "step" not in state:
            raise ValueError("Adam state has no 'step'")
        for name, p in self.params.items():
            for kind, buf in (("m", self._m), ("v", self._v)):
                key = f"{kind}/{name}"
                if key not in state:
                    raise ValueError(f"Adam state lacks {key!r}")
                arr = np.asarray(state[key])
                if arr.shape != p.shape:
                    raise ValueError(f"Adam state {key!r} has shape {arr.shape}, param is {p.shape}")
                buf[self._slices[name]] = arr.reshape(-1)
        self.t = int(np.asarray(state["step"]))
