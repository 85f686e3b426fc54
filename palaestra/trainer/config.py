"""TrainConfig: every knob of a policy update, tuned for the embedded arithmetic policy (docs/guide.md, 4)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from palaestra.trainer.advantages import AdvantageMode, PairStrategy, TurnCredit
from palaestra.trainer.losses import AggMode

Objective = Literal["grpo", "dpo"]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class TrainConfig(BaseModel):
    """Hyper-parameters of :class:`palaestra.trainer.GRPOTrainer` and its backend (unknown fields: error)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    lr: float = Field(6e-4, gt=0.0, description="Peak Adam learning rate (the schedule scales it: lr_at).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.99), description="Adam (beta1, beta2), each in [0, 1).")
    adam_eps: float = Field(1e-8, gt=0.0, description="Adam denominator epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay on matrices (not biases).")
    clip_norm: float | None = Field(1.0, ge=0.0, description="Global gradient-norm clip (None or 0: off).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="constant, or linear/cosine decay to lr * lr_min_ratio over decay_steps."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    decay_steps: int | None = Field(2000, ge=1, description="Steps of the linear/cosine decay (required).")
    lr_min_ratio: float = Field(0.05, ge=0.0, le=1.0, description="Final lr of a decay, as a fraction of lr.")
    advantage_mode: AdvantageMode = Field("grpo", description="Advantage: grpo, batch_std, dr_grpo or rloo.")
    advantage_eps: float = Field(1e-4, ge=0.0, description="Added to the std in grpo / batch_std advantages.")
    drop_zero_std: bool = Field(True, description="DAPO dynamic filtering: drop groups of equal rewards.")
    negative_advantage_scale: float = Field(0.25, ge=0.0, description="Negative-advantage scale (1: GRPO).")
    turn_credit: TurnCredit = Field("final", description="Per-turn credit: final, returns or turn_group.")
    turn_discount: float = Field(1.0, ge=0.0, le=1.0, description="Discount of later turns' rewards.")
    on_token_drift: Literal["split", "raise"] = Field(
        "split", description="A turn whose prompt does not extend the tokens before: own row, or raise."
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower ratio clip: rho >= 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0.0, description="Upper ratio clip: rho <= 1 + clip_high.")
    kl_beta: float = Field(0.0, ge=0.0, description="Weight of the k3 KL to the initial policy (0: none).")
    agg: AggMode = Field("token_mean", description="token_mean, seq_mean_token_mean or seq_sum_constant.")
    max_tokens_constant: int | None = Field(
        None, ge=1, description="Constant L of agg='seq_sum_constant' (default: the padded batch length)."
    )
    minibatch_size: int | None = Field(None, ge=1, description="Trajectories per optimiser step; None: all.")
    update_epochs: int = Field(1, ge=1, description="Passes over each batch (more reuse samples).")
    objective: Objective = Field("grpo", description="'grpo' (clipped policy gradient) or 'dpo' (pairs).")
    dpo_beta: float = Field(0.1, gt=0.0, description="DPO temperature beta on the log-ratio margin.")
    dpo_pairs: PairStrategy = Field("all", description="DPO pairs of a group: 'all' or 'best_vs_rest'.")
    dpo_min_margin: float = Field(0.0, ge=0.0, description="A DPO pair needs a reward gap larger than this.")
    dpo_max_pairs: int | None = Field(None, ge=1, description="Most DPO pairs per group; None: all.")
    allow_missing_logprobs: bool = Field(False, description="Recompute missing sampling logprobs (ratio 1).")
    seed: int = Field(0, description="Seed of the trainer's RNG (minibatch shuffling).")
    distributed: Literal["ddp", "fsdp"] = Field("ddp", description="HF backend strategy under torchrun.")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.max_tokens_constant is not None and self.agg != "seq_sum_constant":
            raise ValueError("max_tokens_constant: only used with agg='seq_sum_constant'")
        if self.lr_schedule != "constant" and self.decay_steps is None:
            raise ValueError(f"decay_steps: required by lr_schedule={self.lr_schedule!r}")
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate of the update that follows ``step`` completed trainer steps (warmup, then decay)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant" or self.decay_steps is None:
            return self.lr
        f = min((step - self.warmup_steps) / self.decay_steps, 1.0)
        m = self.lr_min_ratio
        if self.lr_schedule == "linear":
            return self.lr * (1.0 - (1.0 - m) * f)
        return self.lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * f)))

    @property
    def needs_reference(self) -> bool:
        """True when the backend must keep a frozen copy of the initial policy (KL or DPO)."""
        return self.kl_beta > 0.0 or self.objective == "dpo"
