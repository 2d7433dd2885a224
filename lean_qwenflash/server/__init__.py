"""OpenAI-compatible HTTP server: ``python -m lean_qwenflash.server --config configs/X.yaml``.

``app`` (``create_app``: the pieces wired together), ``middleware`` (API key, size limit, error
answers), ``service`` (request -> engine job -> answer, shared by both APIs), ``openai_api`` and
``anthropic`` (each API's translation and routes), ``sse`` (event-stream encoding), ``protocol``
(request shapes, errors), ``engine`` (the worker thread interleaving generations, queue, prefix
cache), ``output`` (tokens -> content / reasoning / tool-call deltas), ``metrics``, ``http``
(uvicorn config, request-read deadlines).
"""
from lean_qwenflash.server.main import is_loopback, main, serve_config

__all__ = ["is_loopback", "main", "serve_config"]
