"""Re-export of the reward-function protocol (``palaestra.trajectories.reward.RewardFunction``)."""

from palaestra.trajectories.protocols import RewardFunction

__all__ = ["RewardFunction"]
