"""Layer 3: Loop C. Advantages and losses (pure functions), backends, the GRPO trainer, stopping, experiments."""

from palaestra.trainer.advantages import (
    ADVANTAGE_MODES,
    AdvantageMode,
    AdvantageResult,
    PairStrategy,
    batch_advantages,
    group_advantages,
    ranking_to_pairs,
)
from palaestra.trainer.losses import (
    AGG_MODES,
    AggMode,
    DPOResult,
    LossResult,
    NonFiniteOld,
    dpo_loss,
    kl_k3,
    kl_k3_grad,
    policy_loss,
)
from palaestra.trainer.stopping import STOP_REASONS, StopDecision, StopReason, ValidationStopping

__all__ = [
    "ADVANTAGE_MODES",
    "AGG_MODES",
    "STOP_REASONS",
    "AdvantageMode",
    "AdvantageResult",
    "AggMode",
    "DPOResult",
    "LossResult",
    "NonFiniteOld",
    "PairStrategy",
    "StopDecision",
    "StopReason",
    "ValidationStopping",
    "batch_advantages",
    "dpo_loss",
    "group_advantages",
    "kl_k3",
    "kl_k3_grad",
    "policy_loss",
    "ranking_to_pairs",
]
