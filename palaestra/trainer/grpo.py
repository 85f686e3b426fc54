"""``GRPOTrainer`` (one update on scored groups) lives with the loop that drives it, in
:mod:`palaestra.trainer.loop`; this module keeps the name importable."""

from palaestra.trainer.loop import GRPOTrainer, StepResult

__all__ = ["GRPOTrainer", "StepResult"]
