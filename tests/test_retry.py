"""palaestra.retry: retries sync and async functions with backoff, only on the named exceptions."""

from __future__ import annotations

import pytest

import palaestra


async def test_async_retry_until_success() -> None:
    calls = []
    seen = []

    @palaestra.retry(attempts=3, delay=0.001, on_retry=lambda e, n: seen.append((type(e).__name__, n)))
    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "ok"

    assert await flaky() == "ok"
    assert len(calls) == 3
    assert seen == [("ConnectionError", 1), ("ConnectionError", 2)]


def test_sync_retry_reraises_last_error() -> None:
    calls = []

    @palaestra.retry(attempts=2, delay=0.001)
    def always() -> None:
        calls.append(1)
        raise ValueError(f"try {len(calls)}")

    with pytest.raises(ValueError, match="try 2"):
        always()


async def test_only_named_exceptions_are_retried() -> None:
    calls = []

    @palaestra.retry(attempts=5, delay=0.001, exceptions=(TimeoutError,))
    async def wrong_kind() -> None:
        calls.append(1)
        raise KeyError("no")

    with pytest.raises(KeyError):
        await wrong_kind()
    assert len(calls) == 1


@pytest.mark.parametrize("attempts", [0, -1])
def test_fewer_than_one_attempt_is_refused(attempts: int) -> None:
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        palaestra.retry(attempts=attempts)
