"""The OpenAI-compatible routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``)
and the server's own (``/health``, Prometheus ``/metrics``).

A request is checked, becomes a job through the ``Service`` (``chat_job`` / ``completion_job``),
and its deltas are shaped into OpenAI's answer: a whole ``chat.completion`` / ``text_completion``,
or its chunks streamed as server-sent events ending with ``data: [DONE]``.
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from lean_qwenflash.server.engine import Job
from lean_qwenflash.server.output import ChatMessage, chunk_deltas, finish_reason
from lean_qwenflash.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, check_unsupported
from lean_qwenflash.server.service import Service
from lean_qwenflash.server.sse import DONE, event_stream, sse


def usage(info: dict) -> dict:
    """A finished job's info -> OpenAI's ``usage``."""
    return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
            "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": info["cached_tokens"]},
            "completion_tokens_details": {"reasoning_tokens": info["reasoning_tokens"]}}


async def _respond(srv, req, request, make_job, id_prefix: str, kind: str, stream, fold, choice):
    """The body both routes share: submit the job, then stream it (``stream``'s chunks) or collect
    it whole (``fold`` takes each batch of deltas; ``choice(payload)`` is the answer's one choice)."""
    job = await _submitted(srv, req, make_job)
    rid = id_prefix + uuid.uuid4().hex[:24]
    created = int(time.time())
    if req.stream:
        return event_stream(stream(srv, job, request, rid, created, _include_usage(req)))
    payload = await srv.collect(job, request, fold)
    if payload is None:
        return Response(status_code=499)
    return {"id": rid, "object": kind, "created": created, "model": srv.model_name, "choices": [choice(payload)],
            "usage": usage(payload)}


def register(app: FastAPI, srv: Service) -> None:
    """Add the OpenAI API's routes and /health, /metrics to ``app`` (built around ``srv``)."""

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
        message = ChatMessage()
        return await _respond(srv, req, request, srv.chat_job, "chatcmpl-", "chat.completion", _chat_stream,
                              lambda deltas: [message.add(d) for d in deltas],
                              lambda payload: {"index": 0, "message": message.to_dict(), "logprobs": None,
                                               "finish_reason": finish_reason(payload["finish_reason"], message)})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        pieces = []
        return await _respond(srv, req, request, srv.completion_job, "cmpl-", "text_completion", _completion_stream,
                              lambda deltas: pieces.extend(d["text"] for d in deltas),
                              lambda payload: {"index": 0, "text": "".join(pieces), "logprobs": None,
                                               "finish_reason": finish_reason(payload["finish_reason"])})


async def _submitted(srv: Service, req, make_job) -> Job:
    """``req`` checked, made into a job by ``make_job`` (off the event loop) and submitted."""
    srv.check_text(req)
    srv.check_model(req.model)
    check_unsupported(req)
    job = await srv.build_job(make_job, req)
    srv.submit(job)
    return job


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _stream_error(message: str) -> str:
    return sse(ApiError(500, message, code="generation_failed").body()) + DONE


def _stream(srv: Service, job: Job, request: Request, head: dict, first: str, on_deltas, last_chunk,
            include_usage: bool) -> AsyncIterator[str]:
    """An OpenAI stream: ``first``, the chunks ``on_deltas`` makes, ``last_chunk(info)`` (the
    finish reason), the usage chunk when asked for, then [DONE]."""

    def on_done(info) -> str:
        out = last_chunk(info)
        if include_usage:
            out += sse({**head, "choices": [], "usage": usage(info)})
        return out + DONE

    return srv.stream(job, request, first, on_deltas, on_done, _stream_error)


def _chat_stream(srv: Service, job: Job, request: Request, rid: str, created: int,
                 include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}

    def chunk(delta: dict, reason=None) -> str:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]})

    message = ChatMessage()

    def on_deltas(deltas) -> str:
        out = []
        for d in deltas:
            message.add(d)
            out.extend(chunk(cd) for cd in chunk_deltas(d))
        return "".join(out)

    return _stream(srv, job, request, head, chunk({"role": "assistant", "content": ""}), on_deltas,
                   lambda info: chunk({}, finish_reason(info["finish_reason"], message)), include_usage)


def _completion_stream(srv: Service, job: Job, request: Request, rid: str, created: int,
                       include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name}

    def chunk(text: str, reason=None) -> str:
        return sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]})

    def on_deltas(deltas) -> str:
        text = "".join(d["text"] for d in deltas)
        return chunk(text) if text else ""

    return _stream(srv, job, request, head, "", on_deltas,
                   lambda info: chunk("", finish_reason(info["finish_reason"])), include_usage)
