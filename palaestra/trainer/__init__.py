"""Layer 3: Loop C (advantages, losses, backends, the GRPO trainer, stopping, experiments); the names below
load lazily from their modules, so importing one trainer module stays light."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES: dict[str, str] = {  # module: the names it exports here
    "advantages": "ADVANTAGE_MODES AdvantageMode AdvantageResult PairStrategy batch_advantages group_advantages "
    "ranking_to_pairs",
    "backend": "Backend TrainBatch",
    "config": "Objective TrainConfig",
    "loop": "GRPOTrainer StepResult",
    "losses": "AGG_MODES AggMode DPOResult LossResult NonFiniteOld dpo_loss kl_k3 kl_k3_grad policy_loss",
    "stopping": "STOP_REASONS StopDecision StopReason ValidationStopping",
    "tokenize": "MissingLogprobsError PackedBatch SequenceTooLongError TokenizedTrajectory pack tokenize_batch "
    "tokenize_trajectory",
    "validation": "AccuracyResult evaluate_accuracy sample_group validate",
    "experiment": "Experiment",
    "expconfig": "ExperimentConfig load_config",
}
_EXPORTS = {name: module for module, names in _NAMES.items() for name in names.split()}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names, typed for checkers and editors
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
    from palaestra.trainer.expconfig import ExperimentConfig, load_config
    from palaestra.trainer.experiment import Experiment
    from palaestra.trainer.loop import GRPOTrainer, StepResult
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"palaestra.trainer.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
