"""Test support for tests, examples and benchmarks (production code never imports it): ``ScriptedServer``, a real
OpenAI-compatible HTTP server on 127.0.0.1 whose replies a script decides (defined in layer 1, in
:mod:`palaestra.trajectories.scripted_server`, where the simulated judges use it too).
"""

from palaestra.trajectories.scripted_server import Reply, ScriptedServer, completion_body

__all__ = ["Reply", "ScriptedServer", "completion_body"]
