"""The reward-function and chat-model protocols, here in layer 1 so that verifiers, judges and models share them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from palaestra.trajectories.types import TrajectoryGroup

if TYPE_CHECKING:
    from openai import AsyncOpenAI


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a whole group at once; None drops the group (an unscored group is never given reward 0)."""

    async def score_group(
        self, group: TrajectoryGroup, example: Mapping[str, Any] | None = None
    ) -> TrajectoryGroup | None: ...


@runtime_checkable
class ChatModel(Protocol):
    """Anything rollouts can talk to: a served model name and an ``openai.AsyncOpenAI`` client bound to it."""

    name: str

    def openai_client(self) -> AsyncOpenAI: ...
