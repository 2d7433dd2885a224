"""What both APIs' routes share: the ``Service`` (tokenizer, engine, metrics, limits) that turns a
chat or completion request into an engine ``Job``, submits it, and runs it to its answer.

A route translates its request (the Anthropic one into a ``ChatCompletionRequest`` first), builds
the job with ``build_job`` (off the event loop), ``submit``s it, then either ``collect``s the whole
answer or ``stream``s it: the one driver of every streaming route, which the API shapes through
its callbacks. Both notice a client that went away and cancel its job.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Optional

from fastapi import Request

from lean_qwenflash.chat import TemplateError
from lean_qwenflash.chat.parse import TOOL_OPEN
from lean_qwenflash.generate import SamplingParams, Steering
from lean_qwenflash.generate.grammar import BannedTokens, GrammarError, GrammarHook, grammar_tokenizer
from lean_qwenflash.runtime import sampling_params
from lean_qwenflash.server.constrain import answer_grammar
from lean_qwenflash.server.engine import Engine, Job, QueueFull
from lean_qwenflash.server.metrics import Metrics
from lean_qwenflash.server.output import ChatOutput, TextOutput
from lean_qwenflash.server.protocol import (REASONING_BUDGETS, ApiError, ChatCompletionRequest, CompletionRequest,
                                            NamedToolChoice, invalid_text_param, stop_strings, template_messages)

RETRY_AFTER_S = 2               # the Retry-After of a 429 (queue full)


class ClientGone(Exception):
    """The client of a running job disconnected (the job is cancelled)."""


class Service:
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

    async def build_job(self, make_job: Callable[..., Job], req) -> Job:
        """``make_job(req, loop)`` (``chat_job`` / ``completion_job``) off the event loop: a long
        conversation takes seconds to render and tokenize, and /health and the other streams must
        not wait for it."""
        return await asyncio.to_thread(make_job, req, asyncio.get_running_loop())

    # -- job -> answer --------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        try:
            self.engine.submit(job)
        except QueueFull as e:
            self.metrics.rejected.inc()
            raise ApiError(429, f"server busy: {e}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def next_event(self, job: Job, request: Request):
        """The job's next event; raises ``ClientGone`` (and cancels the job) if the client left.
        The client is looked at every 0.2 s whether or not events are flowing: a non-streamed
        request writes nothing until the end, so only this notices that its client is gone."""
        while True:
            now = time.monotonic()
            if now - job.client_checked_s >= 0.2:
                job.client_checked_s = now
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone()
            try:
                return await asyncio.wait_for(job.events.get(), 0.2)
            except asyncio.TimeoutError:
                continue

    def finished(self, job: Job) -> None:
        self.metrics.latency.observe(time.perf_counter() - job.submitted_s)

    async def collect(self, job: Job, request: Request, on_deltas) -> Optional[dict]:
        """Run a non-streamed job to its end, handing each batch of deltas to ``on_deltas``; returns
        the final info, or None when the client went away (the job is cancelled either way)."""
        try:
            while True:
                kind, payload = await self.next_event(job, request)
                if kind == "delta":
                    on_deltas(payload)
                elif kind == "error":
                    raise ApiError(500, payload, code="generation_failed")
                else:
                    break
        except ClientGone:
            return None
        finally:
            job.cancel()
        self.finished(job)
        return payload

    async def stream(self, job: Job, request: Request, head: str, on_deltas, on_done,
                     on_error) -> AsyncIterator[str]:
        """A job's events as streamed text, for every streaming route: ``head`` first, then
        ``on_deltas(deltas)`` for each batch, and ``on_done(info)`` or ``on_error(message)`` at the end
        (each returns text; "" sends nothing). Ends quietly when the client leaves; the job is
        cancelled either way."""
        try:
            if head:
                yield head
            while True:
                kind, payload = await self.next_event(job, request)
                if kind == "delta":
                    out = on_deltas(payload)
                    if out:
                        yield out
                elif kind == "error":
                    yield on_error(payload)
                    return
                else:
                    yield on_done(payload)
                    self.finished(job)
                    return
        except ClientGone:
            return
        finally:
            job.cancel()
