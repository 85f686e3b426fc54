"""Test support shipped with palaestra (layer 1: imports no other palaestra package).

``ScriptedServer`` is a real OpenAI-compatible HTTP server on 127.0.0.1 whose replies a script decides; tests,
examples and chaos runs use it in place of a paid endpoint, with the real ``openai`` client.
"""

from palaestra.testing.openai_server import Reply, ScriptedServer, completion_body

__all__ = ["Reply", "ScriptedServer", "completion_body"]
