"""Test support shipped with palaestra, for tests, examples and benchmarks (production code never imports it).

``ScriptedServer`` is a real OpenAI-compatible HTTP server on 127.0.0.1 whose replies a script decides; tests,
examples and chaos runs use it in place of a paid endpoint, with the real ``openai`` client. It lives in
:mod:`palaestra.trajectories.scripted_server` (layer 1), where the simulated judges and the ``--simulated-http``
commands use it too.
"""

from palaestra.trajectories.scripted_server import Reply, ScriptedServer, completion_body

__all__ = ["Reply", "ScriptedServer", "completion_body"]
