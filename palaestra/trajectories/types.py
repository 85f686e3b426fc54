"""Trajectory (messages and the policy's ``Choice`` objects, whose logprobs serve the trainer) and
TrajectoryGroup (the N attempts at one scenario whose rewards are compared): the records every loop passes."""

from __future__ import annotations

import time
import traceback as tb
import uuid
from collections.abc import Awaitable, Generator, Iterable, Iterator, Mapping
from typing import Any, Union

from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_serializer,
    field_validator,
    model_serializer,
)

Scalar = Union[str, int, float, bool, None]
MetricValue = Union[float, int, bool]
Message = dict[str, Any]
MessageOrChoice = Union[Message, Choice]


def field_of(obj: Any, *names: str) -> Any:
    """The first of ``names`` that ``obj`` has as a mapping key or an attribute, else None."""
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def choice_to_message(choice: Choice) -> Message:
    """The assistant message dict a ``Choice`` stands for (``content`` is ``""`` when None; tool calls kept)."""
    msg: Message = {"role": "assistant", "content": choice.message.content or ""}
    if choice.message.tool_calls:
        msg["tool_calls"] = [
            tc.model_dump(mode="json", exclude_none=True) for tc in choice.message.tool_calls
        ]
    return msg


class _Record(BaseModel):
    """Records compare equal when their JSON dumps are equal; they are mutable, so unhashable."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()  # type: ignore[attr-defined]


class Trajectory(_Record):
    """One rollout: messages and policy choices, reward, metrics, metadata and logs."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=False)

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, description="Unique id (random by default).")
    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    reward: float = 0.0
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, Scalar] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    policy_version: int | None = None
    # rewards per assistant turn (one per Choice, in order) earned besides the final ``reward``, for per-turn
    # credit (palaestra.trainer.advantages); omitted from the JSON form when None
    turn_rewards: list[float] | None = None
    _start: float = PrivateAttr(default_factory=time.monotonic)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("turn_rewards", 0) is None:  # older readers never see the new field when it is unused
            del out["turn_rewards"]
        return out

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _parse_items(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise ValueError("messages_and_choices must be a list")
        out: list[Any] = []
        for i, item in enumerate(value):
            if isinstance(item, Choice) or (isinstance(item, dict) and "role" in item):
                out.append(item)
            elif isinstance(item, dict) and "message" in item and "finish_reason" in item:
                out.append(Choice.model_validate(item))  # the JSON form of a Choice
            elif isinstance(item, dict):
                raise ValueError(f"item {i} is a dict without 'role' (neither a message nor a Choice)")
            elif isinstance(item, BaseModel) and hasattr(item, "role"):
                out.append(item.model_dump(mode="json", exclude_none=True))
            else:
                raise ValueError(f"item {i} must be a message dict or a Choice, got {type(item).__name__}")
        return out

    @field_serializer("messages_and_choices")
    def _dump_items(self, items: list[MessageOrChoice]) -> list[Any]:
        return [c.model_dump(mode="json") if isinstance(c, Choice) else c for c in items]

    def messages(self) -> list[Message]:
        """The chat as plain message dicts; each Choice becomes its assistant message."""
        return [choice_to_message(x) if isinstance(x, Choice) else x for x in self.messages_and_choices]

    def choices(self) -> list[Choice]:
        """The policy's Choice objects in order."""
        return [x for x in self.messages_and_choices if isinstance(x, Choice)]

    def last_assistant_text(self) -> str | None:
        """Content of the last assistant message, or None when there is none."""
        texts = self.assistant_texts()
        return texts[-1] if texts else None

    def assistant_texts(self) -> list[str]:
        """The text of each assistant message in order (a list of content parts joined; no text: ``""``)."""
        texts = []
        for msg in self.messages():
            if msg.get("role") == "assistant":
                content = msg.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                texts.append(content if isinstance(content, str) else "")
        return texts

    def log(self, message: str) -> None:
        """Append a line to this trajectory's logs."""
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Record the wall time since creation in ``metrics["duration"]`` (seconds); returns self."""
        self.metrics["duration"] = time.monotonic() - self._start
        return self


class ExceptionRecord(BaseModel):
    """A failed rollout: exception type, message and formatted traceback."""

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExceptionRecord:
        text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type=type(exc).__name__, message=str(exc), traceback=text)


class TrajectoryGroup(_Record):
    """N attempts at one scenario and the failed attempts' exceptions; rollouts given as awaitables are pending
    work that ``await group`` runs (under an enclosing gather's limits, if any)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[ExceptionRecord] = Field(default_factory=list)
    metadata: dict[str, Scalar] = Field(default_factory=dict)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    _pending: list[Awaitable[Any]] = PrivateAttr(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
        *,
        exceptions: Iterable[ExceptionRecord | BaseException] = (),
        metadata: dict[str, Scalar] | None = None,
        metrics: dict[str, MetricValue] | None = None,
        logs: list[str] | None = None,
    ) -> None:
        items = list(trajectories)  # finished trajectories, failures and rollouts still to run
        errors = [*exceptions, *(e for e in items if isinstance(e, BaseException))]
        super().__init__(
            trajectories=[
                t for t in items if not isinstance(t, BaseException) and not hasattr(t, "__await__")
            ],
            exceptions=[
                ExceptionRecord.from_exception(e) if isinstance(e, BaseException) else e for e in errors
            ],
            metadata=metadata or {},
            metrics=metrics or {},
            logs=logs or [],
        )
        self._pending = [a for a in items if hasattr(a, "__await__")]  # type: ignore[misc]

    @property
    def num_pending(self) -> int:
        """Rollouts not yet run (awaiting the group runs them)."""
        return len(self._pending)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        from palaestra.trajectories.gather import run_group

        return run_group(self).__await__()

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def rewards(self) -> list[float]:
        """Rewards of the trajectories, in order."""
        return [t.reward for t in self.trajectories]

    def log(self, message: str) -> None:
        """Append a line to the group's logs."""
        self.logs.append(message)
