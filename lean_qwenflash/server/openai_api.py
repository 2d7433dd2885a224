"""The OpenAI-compatible routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``)
and the server's own (``/health``, Prometheus ``/metrics``).

A request is checked, becomes a job through the ``Service`` (``chat_job`` / ``completion_job``),
and its deltas are shaped into OpenAI's answer: a whole ``chat.completion`` / ``text_completion``,
or its chunks streamed as server-sent events ending with ``data: [DONE]``. A request of ``n``
choices answers ``n`` (streamed chunks carry each one's ``index``); ``logprobs`` deltas become
OpenAI's logprobs objects (``chat_logprobs``, ``CompletionLogprobs``); a completions request with
``choices`` (our extension) answers the continuations ranked by log-likelihood (``scored_choices``).
"""
from __future__ import annotations

import codecs
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


# -- logprobs -------------------------------------------------------------------------------------

def token_text(raw: bytes) -> str:
    """A token's text as OpenAI writes it: its UTF-8, or "bytes:\\xe2\\x80" for a token that holds
    part of a character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tokenizer, entries) -> dict:
    """``TokenLogprob``s -> a chat choice's ``logprobs``: {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}], "refusal": None}."""
    def one(token_id, logprob):
        raw = tokenizer.token_bytes(token_id)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """``TokenLogprob``s -> a completion choice's ``logprobs`` ({tokens, token_logprobs,
    top_logprobs, text_offset}), piece by piece as a stream sends them. ``text_offset`` is where
    each token's text starts in the choice's ``text`` (characters; special tokens, which the text
    leaves out, add none)."""

    def __init__(self, tokenizer, special_ids):
        self.tokenizer, self.special_ids = tokenizer, special_ids
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0
        self.whole = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, entries) -> dict:
        """The logprobs object of ``entries`` (also added to ``whole``)."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            raw = self.tokenizer.token_bytes(e.token)
            part["tokens"].append(token_text(raw))
            part["token_logprobs"].append(e.logprob)
            part["top_logprobs"].append(None if e.top is None else
                                        {token_text(self.tokenizer.token_bytes(t)): lp for t, lp in e.top})
            part["text_offset"].append(self.chars)
            if e.token not in self.special_ids:
                self.chars += len(self.decoder.decode(raw))
        for key, values in part.items():
            self.whole[key].extend(values)
        return part


def _split(deltas):
    """A batch of deltas -> (the deltas of text, the logprob entries it carries)."""
    entries = [e for d in deltas if "logprobs" in d for e in d["logprobs"]]
    return [d for d in deltas if "logprobs" not in d and "scores" not in d], entries


def scored_choices(srv: Service, req: CompletionRequest, scores) -> list[dict]:
    """Choice mode's answer: the continuations best first (by total logprob, or ``rank_by`` mean),
    each with its scores (and, with ``logprobs``, its tokens' logprobs)."""
    key = (lambda s: s.mean) if req.rank_by == "mean" else (lambda s: s.total)
    out = []
    for rank, s in enumerate(sorted(scores, key=key, reverse=True)):
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs(srv.tokenizer, srv.special_ids).add(s.logprobs)
        out.append({"index": rank, "text": req.choices[s.index], "logprobs": lp, "finish_reason": "stop",
                    "choice_index": s.index, "total_logprob": s.total, "mean_logprob": s.mean,
                    "num_tokens": len(s.tokens)})
    return out


async def _respond(srv, req, request, make_job, id_prefix: str, kind: str, stream, fold, choices):
    """The body both routes share: submit the job, then stream it (``stream``'s chunks) or collect
    it whole (``fold(index, deltas)`` takes each batch of deltas; ``choices(info)`` is the answer's
    choices)."""
    job = await _submitted(srv, req, make_job)
    rid = id_prefix + uuid.uuid4().hex[:24]
    created = int(time.time())
    if req.stream:
        return event_stream(stream(srv, req, job, request, rid, created, _include_usage(req)))
    info = await srv.collect(job, request, fold, by_choice=True)
    if info is None:
        return Response(status_code=499)
    return {"id": rid, "object": kind, "created": created, "model": srv.model_name, "choices": choices(info),
            "usage": usage(info)}


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
        n = req.n or 1
        messages = [ChatMessage() for _ in range(n)]
        entries: list[list] = [[] for _ in range(n)]

        def fold(index, deltas):
            text, lp = _split(deltas)
            for d in text:
                messages[index].add(d)
            entries[index].extend(lp)

        def choices(info):
            return [{"index": i, "message": messages[i].to_dict(),
                     "logprobs": chat_logprobs(srv.tokenizer, entries[i]) if req.logprobs else None,
                     "finish_reason": finish_reason(info["choices"][i]["finish_reason"], messages[i])}
                    for i in range(n)]

        return await _respond(srv, req, request, srv.chat_job, "chatcmpl-", "chat.completion", _chat_stream,
                              fold, choices)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        n = req.n or 1
        texts: list[list] = [[] for _ in range(n)]
        logprobs = [CompletionLogprobs(srv.tokenizer, srv.special_ids) for _ in range(n)]
        scores = []

        def fold(index, deltas):
            text, lp = _split(deltas)
            texts[index].extend(d["text"] for d in text)
            logprobs[index].add(lp)
            scores.extend(s for d in deltas for s in d.get("scores", ()))

        def choices(info):
            if req.choices is not None:
                return scored_choices(srv, req, scores)
            return [{"index": i, "text": "".join(texts[i]),
                     "logprobs": logprobs[i].whole if req.logprobs is not None else None,
                     "finish_reason": finish_reason(info["choices"][i]["finish_reason"])} for i in range(n)]

        return await _respond(srv, req, request, srv.completion_job, "cmpl-", "text_completion", _completion_stream,
                              fold, choices)


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
    """An OpenAI stream: ``first``, the chunks ``on_deltas(index, deltas)`` makes, ``last_chunk(info)``
    (the finish reasons), the usage chunk when asked for, then [DONE]."""

    def on_done(info) -> str:
        out = last_chunk(info)
        if include_usage:
            out += sse({**head, "choices": [], "usage": usage(info)})
        return out + DONE

    return srv.stream(job, request, first, on_deltas, on_done, _stream_error, by_choice=True)


def _chat_stream(srv: Service, req: ChatCompletionRequest, job: Job, request: Request, rid: str, created: int,
                 include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}
    n = req.n or 1

    def chunk(index: int, delta: dict, reason=None, logprobs=None) -> str:
        return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": reason}]})

    messages = [ChatMessage() for _ in range(n)]

    def on_deltas(index, deltas) -> str:
        text, entries = _split(deltas)
        # the batch's logprobs go with its first chunk (or a chunk of their own)
        lp = chat_logprobs(srv.tokenizer, entries) if entries else None
        out = []
        for d in text:
            messages[index].add(d)
            for cd in chunk_deltas(d):
                out.append(chunk(index, cd, logprobs=lp))
                lp = None
        if lp is not None:
            out.append(chunk(index, {}, logprobs=lp))
        return "".join(out)

    def last_chunk(info) -> str:
        return "".join(chunk(i, {}, finish_reason(info["choices"][i]["finish_reason"], messages[i]))
                       for i in range(n))

    first = "".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(n))
    return _stream(srv, job, request, head, first, on_deltas, last_chunk, include_usage)


def _completion_stream(srv: Service, req: CompletionRequest, job: Job, request: Request, rid: str, created: int,
                       include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name}
    n = req.n or 1
    logprobs = [CompletionLogprobs(srv.tokenizer, srv.special_ids) for _ in range(n)]

    def chunk(index: int, text: str, reason=None, lp=None) -> str:
        return sse({**head, "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}]})

    def on_deltas(index, deltas) -> str:
        text, entries = _split(deltas)
        text = "".join(d["text"] for d in text)
        lp = logprobs[index].add(entries) if req.logprobs is not None and entries else None
        return chunk(index, text, lp=lp) if text or lp else ""

    def last_chunk(info) -> str:
        return "".join(chunk(i, "", finish_reason(info["choices"][i]["finish_reason"])) for i in range(n))

    return _stream(srv, job, request, head, "", on_deltas, last_chunk, include_usage)
