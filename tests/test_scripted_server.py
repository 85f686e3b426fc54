"""The scripted OpenAI-compatible test server (palaestra.testing.ScriptedServer): what it answers besides the
script's replies (the model list, unknown paths, a body that is not JSON), over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from palaestra.testing import ScriptedServer


def _fetch(url: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_unknown_paths_and_bad_bodies() -> None:
    with ScriptedServer(lambda request, n: "hello", model="m-1") as server:
        status, models = _fetch(server.base_url + "/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["m-1"]
        status, error = _fetch(server.base_url + "/embeddings")
        assert status == 404 and error["error"]["message"] == "not found"
        status, error = _fetch(server.base_url + "/embeddings", b'{"input": "x"}')
        assert status == 404 and error["error"]["message"] == "not found"
        status, error = _fetch(server.base_url + "/chat/completions", b"{not json")
        assert status == 400 and error["error"]["message"] == "body is not JSON"
        assert server.calls == 0  # none of these reached the script
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="m-1", input="x")
        reply = client.chat.completions.create(model="m-1", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "hello" and server.calls == 1
