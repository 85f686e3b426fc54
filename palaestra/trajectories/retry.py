"""``palaestra.retry``: retry a flaky sync or async rollout with exponential backoff (built on tenacity)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import tenacity
from tenacity import RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential, wait_none

F = TypeVar("F", bound=Callable[..., Any])


def retry(
    attempts: int = 3,
    *,
    delay: float = 0.25,
    backoff: float = 2.0,
    max_delay: float = 30.0,
    exceptions: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> Callable[[F], F]:
    """Try a sync or async function up to ``attempts`` times on ``exceptions``, waiting ``delay * backoff**k`` s
    (at most ``max_delay``), calling ``on_retry(exc, attempt_number)`` before each retry; re-raise the last one."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if on_retry is not None and exc is not None:
            on_retry(exc, state.attempt_number)

    return tenacity.retry(  # type: ignore[return-value]  # a coroutine function gets an async retry loop
        stop=stop_after_attempt(attempts),
        retry=retry_if_exception_type(exceptions),
        wait=wait_exponential(multiplier=delay, exp_base=backoff, max=max_delay)
        if delay > 0
        else wait_none(),
        before_sleep=before_sleep,
        reraise=True,
    )
