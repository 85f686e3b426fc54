"""TrainConfig: every knob of a policy update, with defaults tuned for the embedded arithmetic policy (how they
were tuned: docs/guide.md, section 4)."""

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

    # optimiser
    lr: float = Field(
        6e-4, gt=0.0, description="Peak Adam learning rate (the schedule scales it; see lr_at)."
    )
    betas: tuple[Beta, Beta] = Field((0.9, 0.99), description="Adam (beta1, beta2), each in [0, 1).")
    adam_eps: float = Field(1e-8, gt=0.0, description="Adam denominator epsilon.")
    weight_decay: float = Field(
        0.0, ge=0.0, description="Decoupled weight decay on matrices (embeddings and weights, not biases)."
    )
    clip_norm: float | None = Field(
        1.0, ge=0.0, description="Global gradient-norm clip before the Adam update; None or 0 disables it."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine",
        description="Learning-rate schedule over trainer steps: constant, or linear/cosine decay from lr to "
        "lr * lr_min_ratio over decay_steps (after warmup_steps); see lr_at().",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    decay_steps: int | None = Field(
        2000,
        ge=1,
        description="Steps of the linear/cosine decay (required by those schedules; set it to the run length).",
    )
    lr_min_ratio: float = Field(
        0.05, ge=0.0, le=1.0, description="Final lr of a decaying schedule, as a fraction of lr."
    )
    # advantages
    advantage_mode: AdvantageMode = Field(
        "grpo", description="Group-relative advantage: grpo, batch_std, dr_grpo or rloo (see advantages.py)."
    )
    advantage_eps: float = Field(1e-4, ge=0.0, description="Added to the std in grpo / batch_std advantages.")
    drop_zero_std: bool = Field(
        True,
        description="DAPO dynamic filtering: drop groups whose rewards are all equal (no signal) before the "
        "update; they are still counted in frac_zero_std.",
    )
    negative_advantage_scale: float = Field(
        0.25,
        ge=0.0,
        description="Multiplier on negative advantages (1 = plain GRPO; < 1 weights reinforcing successes "
        "over penalising failures, which sharpens pass@1 faster; 0 = positive samples only).",
    )
    turn_credit: TurnCredit = Field(
        "final",
        description="Per-turn credit: final (the final reward's advantage on every turn), returns (each "
        "turn's discounted return against the group's episode returns) or turn_group (group-relative per "
        "turn index); see advantages.py. Per-turn rewards come from Trajectory.turn_rewards.",
    )
    turn_discount: float = Field(
        1.0, ge=0.0, le=1.0, description="Discount of later turns' rewards in per-turn returns."
    )
    on_token_drift: Literal["split", "raise"] = Field(
        "split",
        description="When a turn's recorded prompt does not extend the tokens before it (a chat template that "
        "is not append-only): train that turn as its own row with its exact prompt (split) or raise.",
    )
    # policy loss
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower ratio clip: rho >= 1 - clip_low.")
    clip_high: float = Field(
        0.28, ge=0.0, description="Upper ratio clip: rho <= 1 + clip_high (clip-higher when > clip_low)."
    )
    kl_beta: float = Field(
        0.0,
        ge=0.0,
        description="Coefficient of the k3 KL to the frozen initial policy; 0 keeps no reference copy.",
    )
    agg: AggMode = Field(
        "token_mean",
        description="Loss aggregation: token_mean (DAPO), seq_mean_token_mean (GRPO), seq_sum_constant "
        "(Dr. GRPO).",
    )
    max_tokens_constant: int | None = Field(
        None, ge=1, description="Constant L of agg='seq_sum_constant' (default: the padded batch length)."
    )
    # batching
    minibatch_size: int | None = Field(
        None, ge=1, description="Trajectories per optimiser step; None = the whole batch in one step."
    )
    update_epochs: int = Field(
        1,
        ge=1,
        description="Passes over each batch (1 = one on-policy update per step; more reuse the samples "
        "with the clipped importance ratio).",
    )
    # objective
    objective: Objective = Field(
        "grpo", description="'grpo' (clipped policy gradient) or 'dpo' (pairs from each group's ranking)."
    )
    dpo_beta: float = Field(0.1, gt=0.0, description="DPO temperature beta on the log-ratio margin.")
    dpo_pairs: PairStrategy = Field(
        "all", description="How a group's ranking becomes DPO pairs: 'all' or 'best_vs_rest'."
    )
    dpo_min_margin: float = Field(
        0.0, ge=0.0, description="A DPO pair needs a reward gap strictly larger than this."
    )
    dpo_max_pairs: int | None = Field(
        None, ge=1, description="At most this many DPO pairs per group (the clearest first); None = all."
    )
    # data
    allow_missing_logprobs: bool = Field(
        False,
        description="Train on Choices that carry no sampling-time logprobs by recomputing them (ratio 1); "
        "by default such trajectories are refused.",
    )
    seed: int = Field(0, description="Seed of the trainer's RNG (minibatch shuffling).")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="HF backend under torchrun: 'ddp' (a full model per rank) or 'fsdp' (the frozen base "
        "weights sharded over the ranks; sampling must run on vLLM). See docs/scaling.md.",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.max_tokens_constant is not None and self.agg != "seq_sum_constant":
            raise ValueError("max_tokens_constant: only used with agg='seq_sum_constant'")
        if self.lr_schedule != "constant" and self.decay_steps is None:
            raise ValueError(f"decay_steps: required by lr_schedule={self.lr_schedule!r}")
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate of the update that follows ``step`` completed trainer steps.

        Warmup: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``; then with ``k = step -
        warmup_steps`` and ``f = min(k / decay_steps, 1)``: constant ``lr``; linear ``lr * (1 - (1 - m) f)``;
        cosine ``lr * (m + (1 - m) (1 + cos(pi f)) / 2)``, where ``m = lr_min_ratio``.
        """
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
