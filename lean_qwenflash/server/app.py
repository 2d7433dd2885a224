"""The FastAPI app: ``create_app(runtime, cfg)`` wires the pieces of the server together.

``middleware.py`` (API key, size limit, request counting, error answers), ``service.py`` (the
``Service`` every route shares: request -> engine job -> answer), ``openai_api.py`` (the OpenAI
routes, /health, /metrics) and ``anthropic.py`` (the Anthropic Messages API, on the same service).
The engine (worker thread + queue + prefix cache) starts with the app and stops at shutdown; the
runtime stays the caller's to close.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI

from lean_qwenflash.server.anthropic import register as register_anthropic
from lean_qwenflash.server.metrics import register_dashboard
from lean_qwenflash.server.middleware import Guard, install_error_handlers
from lean_qwenflash.server.openai_api import register as register_openai
from lean_qwenflash.server.service import Service


def create_app(runtime, cfg, model_name: Optional[str] = None) -> FastAPI:
    """The FastAPI app serving ``runtime`` (an opened ``Runtime``) with ``cfg`` (RuntimeConfig)."""
    name = model_name or cfg.server.model_name or "default"
    service = Service(runtime, name, cfg)

    @asynccontextmanager
    async def lifespan(app):
        yield
        service.engine.close()

    app = FastAPI(title="lean-qwenflash", version="0.1", lifespan=lifespan,
                  description="OpenAI-compatible API of a lean-qwenflash model (experts streamed from SSD).")
    app.state.server = service
    app.add_middleware(Guard, api_key=cfg.server.api_key, max_request_bytes=cfg.server.max_request_bytes,
                       metrics=service.metrics)
    install_error_handlers(app)
    register_openai(app, service)
    register_anthropic(app, service)
    register_dashboard(app, service)        # GET /v1/stats (JSON) and the live dashboard at /ui
    return app
