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
from palaestra.trainer.backend import Backend, TrainBatch
from palaestra.trainer.config import Objective, TrainConfig
from palaestra.trainer.grpo import GRPOTrainer, StepResult
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
from palaestra.trainer.tokenize import (
    MissingLogprobsError,
    PackedBatch,
    SequenceTooLongError,
    TokenizedTrajectory,
    pack,
    tokenize_batch,
    tokenize_trajectory,
)
from palaestra.trainer.validation import AccuracyResult, evaluate_accuracy, sample_group, validate


def __getattr__(name: str) -> object:
    # The experiment runner imports envs and judges; load it only when asked for.
    if name in ("Experiment", "ExperimentConfig", "load_config"):
        from palaestra.trainer import expconfig, experiment

        return getattr(experiment if name == "Experiment" else expconfig, name)
    raise AttributeError(f"module 'palaestra.trainer' has no attribute {name!r}")


__all__ = [
    "ADVANTAGE_MODES",
    "AGG_MODES",
    "STOP_REASONS",
    "AccuracyResult",
    "AdvantageMode",
    "AdvantageResult",
    "AggMode",
    "Backend",
    "DPOResult",
    "Experiment",
    "ExperimentConfig",
    "GRPOTrainer",
    "LossResult",
    "MissingLogprobsError",
    "NonFiniteOld",
    "Objective",
    "PackedBatch",
    "PairStrategy",
    "SequenceTooLongError",
    "StepResult",
    "StopDecision",
    "StopReason",
    "TokenizedTrajectory",
    "TrainBatch",
    "TrainConfig",
    "ValidationStopping",
    "batch_advantages",
    "dpo_loss",
    "evaluate_accuracy",
    "group_advantages",
    "kl_k3",
    "kl_k3_grad",
    "load_config",
    "pack",
    "policy_loss",
    "ranking_to_pairs",
    "sample_group",
    "tokenize_batch",
    "tokenize_trajectory",
    "validate",
]
