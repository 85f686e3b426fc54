"""Models as endpoints for rollouts in other processes (palaestra.trainer.endpoints), without Ray: a
RemoteModel is used as it is, a model with nothing to serve is refused, and the worker side keeps a bounded
set of connections (the in-process executor runs the worker side here)."""

from __future__ import annotations

from typing import Any

import pytest

from palaestra.models.remote import RemoteModel
from palaestra.trainer.endpoints import ModelEndpoint, endpoint_of, remote_rollout, serve_model
from palaestra.trajectories.executors import InProcessExecutor


async def _which_model(model: Any, tag: str) -> tuple[Any, str]:
    """A rollout that only reports the model it was handed."""
    return model, tag


def test_a_remote_model_is_its_own_endpoint() -> None:
    remote = RemoteModel(
        "judge-7b", ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"], api_key_env="PALAESTRA_TEST_KEY_ENV"
    )
    endpoint, stop = endpoint_of(remote)
    assert endpoint == ModelEndpoint(
        "judge-7b", ("http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"), api_key_env="PALAESTRA_TEST_KEY_ENV"
    )
    stop()  # nothing was started for it
    with serve_model(remote) as served:
        assert served == endpoint


def test_a_model_without_an_app_is_refused() -> None:
    class Scripted:
        name = "scripted"

    with pytest.raises(TypeError, match="Scripted has no app\\(\\) to serve and is not a RemoteModel"):
        endpoint_of(Scripted())


async def test_remote_rollout_needs_an_endpoint() -> None:
    run = remote_rollout(_which_model, InProcessExecutor())
    with pytest.raises(TypeError, match="remote rollouts take a ModelEndpoint, got RemoteModel"):
        run(RemoteModel("m", "http://127.0.0.1:9/v1", api_key="k"), "x")
    endpoint = ModelEndpoint("m", ("http://127.0.0.1:9/v1",))
    model, tag = await run(endpoint, "x")
    assert isinstance(model, RemoteModel) and model.name == "m" and tag == "x"
    fixed = remote_rollout(_which_model, InProcessExecutor(), endpoint)  # the caller's model is ignored
    again, _ = await fixed(object(), "y")
    assert again is model  # one connection per endpoint in a worker


async def test_a_worker_keeps_at_most_eight_connections() -> None:
    run = remote_rollout(_which_model, InProcessExecutor())
    endpoints = [ModelEndpoint(f"policy-{k}", (f"http://127.0.0.1:{9000 + k}/v1",)) for k in range(9)]
    first, _ = await run(endpoints[0], "a")
    for k in range(1, 9):
        model, _ = await run(endpoints[k], "a")
        assert model.name == f"policy-{k}"
    latest, _ = await run(endpoints[8], "b")
    reconnected, _ = await run(endpoints[0], "b")  # the oldest was closed when the ninth came
    assert latest is model and reconnected is not first and reconnected.name == "policy-0"
