"""What stands before and around every route: the API key, the request-size limit, request
counting (``Guard``), noticing a client that leaves (``DisconnectWatch``) and the error answers
(``install_error_handlers``), in OpenAI's error shape, or Anthropic's on its routes
(``ApiError.body_for``).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lean_qwenflash.server.metrics import Metrics
from lean_qwenflash.server.protocol import ApiError, error_param

log = logging.getLogger("lean_qwenflash.server")

# answered without an API key: liveness probes, and the dashboard's static files (its data, /v1/stats, needs the key)
OPEN_PATHS = {"/health", "/ui", "/ui/", "/ui/dashboard.js", "/ui/dashboard.css"}
# routes counted by name in the request metric (any other path is "other")
COUNTED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                  "/v1/models", "/health", "/metrics")


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """``err`` answering a request to ``path`` (Anthropic's error shape on its routes)."""
    return JSONResponse(err.body_for(path), status_code=err.status, headers=err.headers)


def key_matches(headers: dict, api_key: str) -> bool:
    """Whether the request's raw ``headers`` carry ``api_key``: OpenAI clients send
    "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY"."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    given = [auth[7:].strip() if auth[:7].lower() == "bearer " else "",
             headers.get(b"x-api-key", b"").decode("latin-1").strip()]
    return any(hmac.compare_digest(g.encode(), api_key.encode()) for g in given if g)


DISCONNECT_WATCH = "lqf.disconnect_watch"      # the scope key of a request's DisconnectWatch


class DisconnectWatch:
    """Notices the moment a request's client goes away, and tells whoever asked.

    Once ``Guard`` has read the body, this is the only reader of the server's ``receive``: a task
    waits on it (uvicorn answers ``http.disconnect`` as soon as the connection is lost, or when the
    response is complete) and then runs the callbacks given to ``on_disconnect`` (``job.cancel``:
    a waiting job leaves the engine's queue before it starts). The application's own ``receive``
    calls after the body wait for the same moment.
    """

    def __init__(self, receive):
        self._receive = receive
        self._callbacks: list[Callable[[], None]] = []
        self._task: Optional[asyncio.Task] = None
        self.gone = asyncio.Event()

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self.gone.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a disconnect callback failed")

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the client leaves (now, if it has)."""
        if self.gone.is_set():
            callback()
        elif callback not in self._callbacks:
            self._callbacks.append(callback)
            self._start()

    async def receive(self) -> dict:
        self._start()
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


def watch_disconnect(request, callback: Callable[[], None]) -> None:
    """Call ``callback()`` the moment ``request``'s client leaves (a request that did not pass
    through ``Guard`` has no watch: nothing happens, the caller's own checks remain)."""
    watch = request.scope.get(DISCONNECT_WATCH)
    if watch is not None:
        watch.on_disconnect(callback)


class Guard:
    """ASGI middleware: API key, request-size limit (413) and request counting, before any route runs.

    The body is read here (at most ``max_request_bytes`` + one chunk) and replayed to the app, so an
    oversized request is refused without being parsed.
    """

    def __init__(self, app, api_key: Optional[str], max_request_bytes: int, metrics: Metrics):
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in COUNTED_ROUTES else "other"
        status_seen = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
            await send(message)

        try:
            headers = dict(scope.get("headers") or [])
            if self.api_key and path not in OPEN_PATHS and not key_matches(headers, self.api_key):
                err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error_response(err, path)(scope, receive, counting_send)
            declared = headers.get(b"content-length")
            too_big = ApiError(413, f"request body larger than server.max_request_bytes={self.max_request_bytes}",
                               code="request_too_large")
            if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
                return await error_response(too_big, path)(scope, receive, counting_send)
            chunks, size = [], 0
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_request_bytes:
                        return await error_response(too_big, path)(scope, receive, counting_send)
                    if not message.get("more_body"):
                        break
            replayed = not chunks
            watch = scope[DISCONNECT_WATCH] = DisconnectWatch(receive)

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await watch.receive()

            try:
                await self.app(scope, replay, counting_send)
            except Exception:
                # A crash inside a handler: answer 500 here (counted as 500, the connection stays
                # usable) instead of letting it reach the server, which drops the connection.
                if "status" in status_seen:      # the response had started: nothing to repair
                    raise
                log.exception("request failed")
                err = ApiError(500, "internal server error (see the server log)", code="internal_error")
                await error_response(err, path)(scope, receive, counting_send)
            finally:
                watch.stop()
        finally:
            self.metrics.requests.labels(route, str(status_seen.get("status", 499))).inc()


def install_error_handlers(app: FastAPI) -> None:
    """Every error a route or FastAPI raises, answered in the API's error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return error_response(ApiError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                                .rstrip(": "), code="invalid_json"), request.url.path)
        param = error_param(tuple(first.get("loc", ())))
        msg = f"{param}: {first.get('msg')}" if param else f"request body: {first.get('msg')}"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(ApiError(400, msg, param, "invalid_value"), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code,
                                       type="invalid_request_error" if exc.status_code < 500 else "server_error"),
                              request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("request failed")
        return error_response(ApiError(500, "internal server error (see the server log)", code="internal_error"),
                              request.url.path)
