"""Layer 3: the Loop A/B measurement harness (eval, inspect, select, gate, validate-scorer) and pass@k."""

from palaestra.evals.evaluate import evaluate_completions, evaluate_model, select_best
from palaestra.evals.inputs import get_scorer, register_scorer, validate_scorer
from palaestra.evals.manifest import GateResult, gate, load_manifest, locked_room
from palaestra.evals.passk import mean_pass_at_k, pass_at_k, pass_at_k_array
from palaestra.evals.show import inspect_run
from palaestra.evals.taxonomy import CATEGORIES, OUTCOME_CATEGORY, category_of, classify

__all__ = [
    "CATEGORIES",
    "OUTCOME_CATEGORY",
    "GateResult",
    "category_of",
    "classify",
    "evaluate_completions",
    "evaluate_model",
    "gate",
    "get_scorer",
    "inspect_run",
    "load_manifest",
    "locked_room",
    "mean_pass_at_k",
    "pass_at_k",
    "pass_at_k_array",
    "register_scorer",
    "select_best",
    "validate_scorer",
]
