"""Layer 3: the Loop A/B measurement harness (eval, inspect, select, gate, validate-scorer) and pass@k."""

from palaestra.evals.passk import mean_pass_at_k, pass_at_k, pass_at_k_array

__all__ = ["mean_pass_at_k", "pass_at_k", "pass_at_k_array"]
