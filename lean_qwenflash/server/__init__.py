"""OpenAI-compatible HTTP server: ``python -m lean_qwenflash.server --config configs/X.yaml``.

``app`` (routes), ``protocol`` (request shapes, errors), ``engine`` (one generation at a time,
queue, prefix cache), ``output`` (tokens -> content / reasoning / tool-call deltas), ``metrics``.
"""
from lean_qwenflash.server.main import is_loopback, main, serve_config

__all__ = ["is_loopback", "main", "serve_config"]
