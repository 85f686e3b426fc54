"""Layer 2: environments (datasets, verifiers, multi-turn logic) and their rollout functions."""

from palaestra.envs.arithmetic import NaiveVerifier, StrictFinalVerifier
from palaestra.envs.registry import EnvSpec, get_env, load_callable, register_env
from palaestra.envs.rollouts import rollout_2048, single_turn_rollout
from palaestra.envs.verifier import Score, Verifier, VerifierReward, check_contract, get_verifier

__all__ = [
    "EnvSpec",
    "NaiveVerifier",
    "Score",
    "StrictFinalVerifier",
    "Verifier",
    "VerifierReward",
    "check_contract",
    "get_env",
    "get_verifier",
    "load_callable",
    "register_env",
    "rollout_2048",
    "single_turn_rollout",
]
