"""HTTP routes: OpenAI-compatible chat/completions, models, health and Prometheus metrics (the
Anthropic Messages API is in ``anthropic.py``, on the same engine).

``create_app(runtime, ...)`` builds the FastAPI app around an opened ``Runtime``; the engine
(worker thread + queue + prefix cache) starts with the app and stops at shutdown. The runtime
stays the caller's to close.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lean_qwenflash.chat import TemplateError
from lean_qwenflash.server.constrain import answer_grammar
from lean_qwenflash.chat.parse import TOOL_OPEN
from lean_qwenflash.generate import SamplingParams
from lean_qwenflash.generate.grammar import BannedTokens, GrammarError, GrammarHook, grammar_tokenizer
from lean_qwenflash.runtime import sampling_params
from lean_qwenflash.server.engine import Engine, Job, QueueFull, Steering
from lean_qwenflash.server.metrics import Metrics
from lean_qwenflash.server.output import ChatMessage, ChatOutput, TextOutput, chunk_deltas, finish_reason
from lean_qwenflash.server.protocol import (REASONING_BUDGETS, ApiError, ChatCompletionRequest, CompletionRequest,
                                            NamedToolChoice, check_unsupported, error_param, invalid_text_param,
                                            stop_strings,
                                            template_messages)

log = logging.getLogger("lean_qwenflash.server")

_OPEN_PATHS = {"/health"}      # answered without an API key (liveness probes)
_RETRY_AFTER_S = 2


class _Guard:
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
        route = path if path in ("/v1/chat/completions", "/v1/completions", "/v1/messages",
                                 "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics") else "other"
        status_seen = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
            await send(message)

        try:
            headers = dict(scope.get("headers") or [])
            if self.api_key and path not in _OPEN_PATHS:
                # OpenAI clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY".
                auth = headers.get(b"authorization", b"").decode("latin-1")
                given = [auth[7:].strip() if auth[:7].lower() == "bearer " else "",
                         headers.get(b"x-api-key", b"").decode("latin-1").strip()]
                if not any(hmac.compare_digest(g.encode(), self.api_key.encode()) for g in given if g):
                    err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    return await _error_response(err, path)(scope, receive, counting_send)
            declared = headers.get(b"content-length")
            too_big = ApiError(413, f"request body larger than server.max_request_bytes={self.max_request_bytes}",
                               code="request_too_large")
            if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
                return await _error_response(too_big, path)(scope, receive, counting_send)
            chunks, size = [], 0
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_request_bytes:
                        return await _error_response(too_big, path)(scope, receive, counting_send)
                    if not message.get("more_body"):
                        break
            replayed = not chunks

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()

            try:
                await self.app(scope, replay, counting_send)
            except Exception:
                # A crash inside a handler: answer 500 here (counted as 500, the connection stays
                # usable) instead of letting it reach the server, which drops the connection.
                if "status" in status_seen:      # the response had started: nothing to repair
                    raise
                log.exception("request failed")
                err = ApiError(500, "internal server error (see the server log)", code="internal_error")
                await _error_response(err, path)(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(route, str(status_seen.get("status", 499))).inc()


def _error_response(err: ApiError, path: str = "") -> JSONResponse:
    """``err`` answering a request to ``path`` (Anthropic's error shape on its routes)."""
    return JSONResponse(err.body_for(path), status_code=err.status, headers=err.headers)


def _usage(info: dict) -> dict:
    return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
            "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": info["cached_tokens"]},
            "completion_tokens_details": {"reasoning_tokens": info["reasoning_tokens"]}}


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


class _ClientGone(Exception):
    pass


class _Server:
    """What the routes share: the runtime's tokenizer, the engine, metrics and limits."""

    def __init__(self, runtime, model_name: str, cfg):
        self.cfg = cfg
        self.tokenizer = runtime.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"the pack {runtime.store.path} has no tokenizer.json: the server needs one")
        self.model_name = model_name
        hf = runtime.store.config
        self.context_tokens = int(hf.get("max_position_embeddings")
                                  or self.tokenizer.config.get("model_max_length") or 32768)
        self.metrics = Metrics(runtime.provider)
        self.engine = Engine(runtime.model, cfg.generation.prefill_chunk_tokens, cfg.server.max_queue,
                             cfg.server.prefix_cache_bytes, self.metrics, cfg.server.max_active)
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)
        tok = self.tokenizer
        self.think_open_id = tok.token_to_id("<think>")
        self.think_close_id = tok.token_to_id("</think>")
        self.think_close_ids = tok.encode("\n</think>\n\n")
        self.tool_open_id = tok.token_to_id(TOOL_OPEN)
        self.vocab_size = self.engine.generator.vocab_size
        if self.tool_open_id is not None:
            grammar_tokenizer(tok, self.vocab_size)     # built once here (~1 s), not in a request
        self.created = int(time.time())

    # -- request -> job -------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} not found; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", "model", "model_not_found")

    def sampling(self, req) -> SamplingParams:
        try:
            return sampling_params(
                self.cfg.generation, temperature=req.temperature, top_p=req.top_p,
                top_k=None if req.top_k is None else max(req.top_k, 0),   # OpenAI-style -1 = off
                min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def check_text(self, req) -> None:
        """400 (not a crash) for text no tokenizer can encode, naming where it is."""
        where = invalid_text_param(req.model_dump(exclude_none=True))
        if where:
            raise ApiError(400, f"{where}: text contains a lone UTF-16 surrogate (e.g. \\ud800 without its pair); "
                                "send valid Unicode", where, "invalid_text")

    def max_new_tokens(self, prompt_len: int, requested: Optional[int], param: str) -> int:
        """Tokens to generate: what the request asks (or server.max_output_tokens, or up to the end
        of the context when neither is set), at most what fits after the prompt."""
        if prompt_len >= self.context_tokens:
            # The wording OpenAI and vLLM use: clients (litellm, so Aider...) match it to recognise
            # a context-window error.
            raise ApiError(400, f"This model's maximum context length is {self.context_tokens} tokens. However, you "
                                f"requested {prompt_len + (requested or 0)} tokens ({prompt_len} in the {param}, "
                                f"{requested or 0} in the completion). Please reduce the length of the {param} "
                                f"or completion. (The model's context is {self.context_tokens} tokens: "
                                "max_position_embeddings.)", param, "context_length_exceeded",
                           # Anthropic's wording, which Claude Code matches to compact the conversation
                           anthropic_message=f"prompt is too long: {prompt_len} tokens > "
                                             f"{self.context_tokens - 1} maximum")
        room = self.context_tokens - prompt_len
        # Asking for more than fits is answered with what fits (finish_reason "length").
        return min(requested or self.cfg.server.max_output_tokens or room, room)

    def chat_job(self, req: ChatCompletionRequest, loop=None) -> Job:
        """The job for a chat request: the template rendered, the prompt tokenized and the answer's
        grammar compiled (slow for a long conversation or many tools: the handlers run this in a
        worker thread, ``loop`` being theirs)."""
        tok = self.tokenizer
        choice = req.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        mode = "auto"
        if choice == "none":
            tools = []
        elif isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t["function"]["name"] == choice.function.name]
            mode = "named"
        elif choice == "required":
            mode = "required"
        effort = req.reasoning_effort or self.cfg.server.default_reasoning_effort
        budget = REASONING_BUDGETS[effort] if req.thinking_budget is None else req.thinking_budget
        thinking = effort != "none" if req.thinking_budget is None else req.thinking_budget > 0
        messages = template_messages(req)
        try:
            prompt = tok.chat_prompt(messages, tools=tools or None, thinking=thinking)
        except TemplateError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
        max_new = self.max_new_tokens(len(prompt.ids), req.max_completion_tokens or req.max_tokens, "messages")
        steering = None
        if self.think_close_id is not None:
            steering = Steering(self.think_open_id, self.think_close_id, self.think_close_ids,
                                budget if thinking else None, thinking)
        hooks = self.answer_hooks(req, tools, mode, steering)
        output = ChatOutput(tok, stop_strings(req), in_reasoning=thinking, parse_tools=bool(tools))
        return Job(prompt.ids, self.sampling(req), max_new, self.stop_ids, output, hooks, steering,
                   checkpoints=prompt.checkpoints, loop=loop)

    def answer_hooks(self, req: ChatCompletionRequest, tools: list, mode: str, steering) -> list:
        """The per-token hooks of a chat answer: its grammar (offered tools / response_format) or,
        with nothing to constrain, a ban on the tool-call token; then the thinking ``Steering``."""
        fmt = req.response_format.model_dump(exclude_none=True, by_alias=True) if req.response_format else None
        try:
            lark = answer_grammar(self.tokenizer, tools, mode, req.parallel_tool_calls, fmt)
            hooks = []
            if lark is not None:
                gate = (lambda: not steering.in_think) if steering is not None else None
                hooks.append(GrammarHook(self.tokenizer, self.vocab_size, lark, gate))
            elif self.tool_open_id is not None:
                hooks.append(BannedTokens([self.tool_open_id]))    # no tools offered: no tool calls
        except GrammarError as e:
            where = str(e).split(":", 1)[0]
            param = where.split(" ")[0] if where.startswith(("tools[", "response_format")) else None
            raise ApiError(400, str(e), param, "invalid_schema") from None
        return hooks + ([steering] if steering is not None else [])

    def completion_job(self, req: CompletionRequest, loop=None) -> Job:
        p = req.prompt
        if isinstance(p, list) and not p:
            raise ApiError(400, "prompt is empty", "prompt")
        if isinstance(p, list) and isinstance(p[0], int):
            bad = [t for t in p if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.tokenizer.vocab_size})",
                               "prompt")
            prompt = list(p)
        else:
            prompt = self.tokenizer.encode(p[0] if isinstance(p, list) else p)
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        max_new = self.max_new_tokens(len(prompt), req.max_tokens, "prompt")
        return Job(prompt, self.sampling(req), max_new, self.stop_ids, TextOutput(self.tokenizer, stop_strings(req)),
                   loop=loop)

    def submit(self, job: Job) -> None:
        try:
            self.engine.submit(job)
        except QueueFull as e:
            self.metrics.rejected.inc()
            raise ApiError(429, f"server busy: {e}; retry later", code="queue_full",
                           headers={"Retry-After": str(_RETRY_AFTER_S)}) from None

    async def next_event(self, job: Job, request: Request):
        """The job's next event; raises ``_ClientGone`` (and cancels the job) if the client left.
        The client is looked at every 0.2 s whether or not events are flowing: a non-streamed
        request writes nothing until the end, so only this notices that its client is gone."""
        while True:
            now = time.monotonic()
            if now - job.client_checked_s >= 0.2:
                job.client_checked_s = now
                if await request.is_disconnected():
                    job.cancel()
                    raise _ClientGone()
            try:
                return await asyncio.wait_for(job.events.get(), 0.2)
            except asyncio.TimeoutError:
                continue

    def finished(self, job: Job) -> None:
        self.metrics.latency.observe(time.perf_counter() - job.submitted_s)


def create_app(runtime, cfg, model_name: Optional[str] = None) -> FastAPI:
    """The FastAPI app serving ``runtime`` (an opened ``Runtime``) with ``cfg`` (RuntimeConfig)."""
    from contextlib import asynccontextmanager

    name = model_name or cfg.server.model_name or "default"
    srv = _Server(runtime, name, cfg)

    @asynccontextmanager
    async def lifespan(app):
        yield
        srv.engine.close()

    app = FastAPI(title="lean-qwenflash", version="0.1", lifespan=lifespan,
                  description="OpenAI-compatible API of a lean-qwenflash model (experts streamed from SSD).")
    app.state.server = srv
    app.add_middleware(_Guard, api_key=cfg.server.api_key, max_request_bytes=cfg.server.max_request_bytes,
                       metrics=srv.metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return _error_response(ApiError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                                 .rstrip(": "), code="invalid_json"), request.url.path)
        param = error_param(tuple(first.get("loc", ())))
        msg = f"{param}: {first.get('msg')}" if param else f"request body: {first.get('msg')}"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return _error_response(ApiError(400, msg, param, "invalid_value"), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail), code=code,
                                        type="invalid_request_error" if exc.status_code < 500 else "server_error"),
                               request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("request failed")
        return _error_response(ApiError(500, "internal server error (see the server log)", code="internal_error"),
                               request.url.path)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": srv.model_name, "queue_depth": srv.engine.queue_depth,
                "generating": srv.engine.active_count}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": srv.model_name, "object": "model", "created": srv.created,
                                            "owned_by": "lean-qwenflash", "context_length": srv.context_tokens}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        srv.check_text(req)
        srv.check_model(req.model)
        check_unsupported(req)
        # Off the event loop: a long conversation takes seconds to render and tokenize, and
        # /health and the other streams must not wait for it.
        job = await asyncio.to_thread(srv.chat_job, req, asyncio.get_running_loop())
        srv.submit(job)
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_chat_stream(srv, job, request, rid, created, usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        message = ChatMessage()
        payload = await _collect(srv, job, request, lambda deltas: [message.add(d) for d in deltas])
        if payload is None:
            return Response(status_code=499)
        return {"id": rid, "object": "chat.completion", "created": created, "model": srv.model_name,
                "choices": [{"index": 0, "message": message.to_dict(), "logprobs": None,
                             "finish_reason": finish_reason(payload["finish_reason"], message)}],
                "usage": _usage(payload)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        srv.check_text(req)
        srv.check_model(req.model)
        check_unsupported(req)
        job = await asyncio.to_thread(srv.completion_job, req, asyncio.get_running_loop())
        srv.submit(job)
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_completion_stream(srv, job, request, rid, created, usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces = []
        payload = await _collect(srv, job, request, lambda deltas: pieces.extend(d["text"] for d in deltas))
        if payload is None:
            return Response(status_code=499)
        text = "".join(pieces)
        return {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish_reason(payload["finish_reason"])}],
                "usage": _usage(payload)}

    from lean_qwenflash.server import anthropic     # it imports this module: not at the top
    anthropic.register(app, srv)
    return app


async def _collect(srv: _Server, job: Job, request: Request, on_deltas) -> Optional[dict]:
    """Run a non-streamed job to its end, handing each batch of deltas to ``on_deltas``; returns
    the final info, or None when the client went away (the job is cancelled either way)."""
    try:
        while True:
            kind, payload = await srv.next_event(job, request)
            if kind == "delta":
                on_deltas(payload)
            elif kind == "error":
                raise ApiError(500, payload, code="generation_failed")
            else:
                break
    except _ClientGone:
        return None
    finally:
        job.cancel()
    srv.finished(job)
    return payload


_DONE = "data: [DONE]\n\n"


async def _stream_job(srv: _Server, job: Job, request: Request, head: str, on_deltas, on_done,
                      on_error) -> AsyncIterator[str]:
    """A job's events as streamed text, for every streaming route: ``head`` first, then
    ``on_deltas(deltas)`` for each batch, and ``on_done(info)`` or ``on_error(message)`` at the end
    (each returns text; "" sends nothing). Ends quietly when the client leaves; the job is
    cancelled either way."""
    try:
        if head:
            yield head
        while True:
            kind, payload = await srv.next_event(job, request)
            if kind == "delta":
                out = on_deltas(payload)
                if out:
                    yield out
            elif kind == "error":
                yield on_error(payload)
                return
            else:
                yield on_done(payload)
                srv.finished(job)
                return
    except _ClientGone:
        return
    finally:
        job.cancel()


def _openai_error(message: str) -> str:
    return _sse(ApiError(500, message, code="generation_failed").body()) + _DONE


def _chat_stream(srv: _Server, job: Job, request: Request, rid: str, created: int,
                 include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}

    def chunk(delta: dict, reason=None) -> str:
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]})

    message = ChatMessage()

    def on_deltas(deltas) -> str:
        out = []
        for d in deltas:
            message.add(d)
            out.extend(chunk(cd) for cd in chunk_deltas(d))
        return "".join(out)

    def on_done(info) -> str:
        out = chunk({}, finish_reason(info["finish_reason"], message))
        if include_usage:
            out += _sse({**head, "choices": [], "usage": _usage(info)})
        return out + _DONE

    return _stream_job(srv, job, request, chunk({"role": "assistant", "content": ""}), on_deltas, on_done,
                       _openai_error)


def _completion_stream(srv: _Server, job: Job, request: Request, rid: str, created: int,
                       include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name}

    def chunk(text: str, reason=None) -> str:
        return _sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]})

    def on_deltas(deltas) -> str:
        text = "".join(d["text"] for d in deltas)
        return chunk(text) if text else ""

    def on_done(info) -> str:
        out = chunk("", finish_reason(info["finish_reason"]))
        if include_usage:
            out += _sse({**head, "choices": [], "usage": _usage(info)})
        return out + _DONE

    return _stream_job(srv, job, request, "", on_deltas, on_done, _openai_error)
