"""What both APIs' routes share: the ``Service`` (tokenizer, engine, metrics, limits) that turns a
chat or completion request into an engine ``Job``, submits it, and runs it to its answer.

A route translates its request (the Anthropic one into a ``ChatCompletionRequest`` first), builds
the job with ``build_job`` (off the event loop), ``submit``s it, then either ``collect``s the whole
answer or ``stream``s it: the one driver of every streaming route, which the API shapes through
its callbacks. Both notice a client that went away and cancel its job.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Callable, Optional

from fastapi import Request

from lean_qwenflash.chat import TemplateError
from lean_qwenflash.chat.parse import TOOL_OPEN
from lean_qwenflash.generate import SamplingParams, Steering
from lean_qwenflash.generate.generator import LogprobCapture, continuation_ids
from lean_qwenflash.generate.grammar import BannedTokens, GrammarError, GrammarHook, grammar_tokenizer
from lean_qwenflash.runtime import sampling_params
from lean_qwenflash.server.constrain import answer_grammar
from lean_qwenflash.server.engine import Engine, Job, QueueFull, engine_options
from lean_qwenflash.server.metrics import Metrics
from lean_qwenflash.server.middleware import watch_disconnect
from lean_qwenflash.server.output import ChatOutput, TextOutput
from lean_qwenflash.server.protocol import (REASONING_BUDGETS, ApiError, ChatCompletionRequest, CompletionRequest,
                                            NamedToolChoice, invalid_text_param, stop_strings, template_messages)

RETRY_AFTER_S = 2               # the Retry-After of a 429 (queue full)


def context_error(prompt_tokens: int, context_tokens: int, param: str, room: int = 1,
                  needs: str = "the completion needs at least 1 more") -> ApiError:
    """The 400 for a prompt the context cannot take, for both APIs (the one place its text is
    made). The server refuses a prompt that does not leave ``room`` tokens of the context free (1:
    the answer's first token; a longer asked-for answer is cut to what fits, never refused), so a
    prompt may have at most ``context_tokens - room`` tokens, and both wordings say so (``needs``
    says why)."""
    most = context_tokens - room
    why = f" ({needs})" if needs else ""
    # OpenAI's (and vLLM's) wording: clients (litellm, so Aider...) match "maximum context length"
    return ApiError(400, f"This model's maximum context length is {context_tokens} tokens. However, your {param} "
                         f"resulted in {prompt_tokens} tokens, and at most {most} fit{why}. Please reduce the "
                         f"length of the {param}.", param, "context_length_exceeded",
                    # Anthropic's wording, which Claude Code matches to compact the conversation
                    anthropic_message=f"prompt is too long: {prompt_tokens} tokens > {most} maximum (the model's "
                                      f"context is {context_tokens} tokens{'; ' + needs if needs else ''})")


class ChoiceEvents:
    """The events of one choice of a request, put into the request's queue tagged with the
    choice's index (what ``Job.events`` is for the jobs the service makes)."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self.queue, self.index = queue, index

    def put_nowait(self, item) -> None:
        self.queue.put_nowait((self.index,) + tuple(item))

    async def get(self):
        return await self.queue.get()


class LogprobOutput:
    """An output pipeline (``TextOutput`` / ``ChatOutput``) that also hands on log-probabilities:
    each batch of deltas is followed by ``{"logprobs": [TokenLogprob, ...]}`` for the tokens emitted
    since the last batch (so a streamed chunk carries the logprobs of the tokens whose text it
    carries; tokens still held back, e.g. half a character, go with the next). With ``echo`` the
    first batch is the prompt's text, then (with a ``capture``) its logprobs, the first None."""

    def __init__(self, inner, capture: Optional[LogprobCapture], echo: Optional[str] = None):
        self.inner, self.capture, self.echo = inner, capture, echo
        self.sent = 0

    @property
    def stopped(self) -> bool:
        return self.inner.stopped

    def push(self, token_id: int) -> list[dict]:
        return self._with_logprobs(self.inner.push(token_id), last=False)

    def finish(self) -> list[dict]:
        return self._with_logprobs(self.inner.finish(), last=True)

    def _with_logprobs(self, deltas: list[dict], last: bool) -> list[dict]:
        head = []
        if self.echo is not None:
            head = [{"text": self.echo}] if self.echo else []
            generation = self.capture.generation if self.capture is not None else None
            if generation is not None and generation.prompt_logprobs is not None:
                head.append({"logprobs": generation.prompt_logprobs})
            self.echo = None
        if self.capture is not None and (deltas or last) and len(self.capture.entries) > self.sent:
            deltas = deltas + [{"logprobs": self.capture.entries[self.sent:]}]
            self.sent = len(self.capture.entries)
        return head + deltas


class ScoreOutput:
    """The output of a choice-scoring job: nothing while it runs, then ``{"scores": [...]}``."""

    stopped = False

    def __init__(self, capture: LogprobCapture):
        self.capture = capture

    def push(self, token_id: int) -> list[dict]:
        return []

    def finish(self) -> list[dict]:
        generation = self.capture.generation
        return [{"scores": generation.scores}] if generation is not None and generation.scores is not None else []


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
        self.engine = Engine(runtime.model, runtime.prefill_chunk_tokens, cfg.server.max_queue,
                             cfg.server.prefix_cache_bytes, self.metrics, cfg.server.max_active,
                             **engine_options(runtime, cfg, self.context_tokens))
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)
        self.special_ids = frozenset(self.tokenizer.special_token_ids)     # (decoded text leaves them out)
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
            raise context_error(prompt_len, self.context_tokens, param)
        fit = self.engine.context_fit           # what fits in memory (engine.context_budget)
        if fit is not None and prompt_len >= fit:
            raise ApiError(400, f"the {param} is {prompt_len} tokens but only {fit} tokens of context fit in this "
                                f"server's memory ({self.engine.budget.describe()}); shorten the {param}, or give the "
                                "server more memory (smaller host_cache_bytes / server.prefix_cache_bytes, a "
                                "quantized kv_cache_dtype)", param, "context_memory_exceeded")
        room = min(self.context_tokens, fit or self.context_tokens) - prompt_len
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

        def one_choice():
            """(hooks, steering, output) of one choice: each has its own grammar and thinking state."""
            steering = None
            if self.think_close_id is not None:
                steering = Steering(self.think_open_id, self.think_close_id, self.think_close_ids,
                                    budget if thinking else None, thinking)
            hooks = self.answer_hooks(req, tools, mode, steering)
            output = ChatOutput(tok, stop_strings(req), in_reasoning=thinking, parse_tools=bool(tools))
            if req.logprobs:
                capture = LogprobCapture(req.top_logprobs or 0)
                hooks, output = hooks + [capture], LogprobOutput(output, capture)
            return hooks, steering, output

        return self.jobs(prompt.ids, self.sampling(req), max_new, req.n or 1, one_choice, loop,
                         checkpoints=prompt.checkpoints)

    def jobs(self, prompt_ids: list[int], params: SamplingParams, max_new: int, n: int, one_choice, loop,
             checkpoints=(), start_options: Optional[dict] = None) -> Job:
        """The job of a request of ``n`` choices, each from ``one_choice()`` (hooks, steering,
        output): the first is the job, the others its ``siblings`` (decoded from its prefill, their
        seeds the request's + 1, + 2, ...: a seeded request gives the same n answers every time).
        Every choice's events go into one queue, tagged with its index (``ChoiceEvents``)."""
        queue: asyncio.Queue = asyncio.Queue()
        choices = []
        for index in range(n):
            hooks, steering, output = one_choice()
            p = params if params.seed is None or index == 0 else dataclasses.replace(params, seed=params.seed + index)
            choices.append(Job(prompt_ids, p, max_new, self.stop_ids, output, hooks, steering,
                               checkpoints=checkpoints if index == 0 else (), loop=loop,
                               events=ChoiceEvents(queue, index),
                               start_options=dict(start_options or {}) if index == 0 else {}))
        for sibling in choices[1:]:
            sibling.cancelled = choices[0].cancelled        # one request: one cancellation
        choices[0].siblings = choices[1:]
        return choices[0]

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
        text = p if isinstance(p, str) else p[0] if isinstance(p[0], str) else None
        if req.choices is not None:
            return self.choices_job(req, prompt, text, loop)
        if req.max_tokens == 0:         # echo only (protocol.check_unsupported): the prompt's logprobs
            if len(prompt) > self.context_tokens:
                raise context_error(len(prompt), self.context_tokens, "prompt", room=0, needs="")
            max_new = 0
        else:
            max_new = self.max_new_tokens(len(prompt), req.max_tokens, "prompt")
        echo = None
        if req.echo:
            echo = text if text is not None else self.tokenizer.decode(prompt, skip_special_tokens=True)
        top = req.logprobs

        def one_choice():
            output = TextOutput(self.tokenizer, stop_strings(req))
            if top is None and echo is None:
                return [], None, output
            capture = LogprobCapture(top) if top is not None else None
            return ([capture] if capture else []), None, LogprobOutput(output, capture, echo)

        # echo with logprobs: the whole prompt is computed (no prefix reuse) and its logprobs kept
        options = {"prompt_logprobs": top} if echo is not None and top is not None else {}
        return self.jobs(prompt, self.sampling(req), max_new, req.n or 1, one_choice, loop, start_options=options)

    def choices_job(self, req: CompletionRequest, prompt: list[int], text: Optional[str], loop) -> Job:
        """Choice mode (our extension): score ``req.choices`` after the prompt, from one prefill."""
        conts = [continuation_ids(self.tokenizer.encode, prompt, text, c) for c in req.choices]
        for i, ids in enumerate(conts):
            if not ids:
                raise ApiError(400, f"choices[{i}] is empty: every choice needs at least one token", f"choices[{i}]")
        longest = max(len(c) for c in conts)
        if len(prompt) + longest > self.context_tokens:
            raise context_error(len(prompt), self.context_tokens, "prompt", room=longest,
                                needs=f"the longest choice has {longest} tokens")
        capture = LogprobCapture()
        return Job(prompt, self.sampling(req), 0, self.stop_ids, ScoreOutput(capture), [capture],
                   loop=loop, events=ChoiceEvents(asyncio.Queue(), 0),
                   start_options={"continuations": conts, "score_top": req.logprobs or 0})

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

    async def next_event(self, job: Job, request: Request) -> tuple:
        """The job's next event, (index of the choice, kind, payload); raises ``ClientGone`` (and
        cancels the job) if the client left. The client is looked at every 0.2 s whether or not
        events are flowing: a non-streamed request writes nothing until the end, so only this
        notices that its client is gone. (And ``Guard``'s watch cancels the job the moment the
        client leaves: a job still queued then never starts.)"""
        watch_disconnect(request, job.cancel)
        while True:
            now = time.monotonic()
            if now - job.client_checked_s >= 0.2:
                job.client_checked_s = now
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone()
            try:
                item = await asyncio.wait_for(job.events.get(), 0.2)
            except asyncio.TimeoutError:
                continue
            return item if len(item) == 3 else (0,) + tuple(item)

    def finished(self, job: Job) -> None:
        self.metrics.latency.observe(time.perf_counter() - job.submitted_s)

    async def events(self, job: Job, request: Request):
        """(index, "delta", deltas) events of every choice, then one (None, "done", info) once all
        are done (``info``: the first choice's, completion and reasoning tokens summed over the
        choices, and ``info["choices"]``: each one's) or one (index, "error", message)."""
        infos: dict = {}
        count = 1 + len(job.siblings)
        while True:
            index, kind, payload = await self.next_event(job, request)
            if kind == "done":
                infos[index] = payload
                if len(infos) == count:
                    break
            else:
                yield index, kind, payload
                if kind == "error":
                    return
        choices = [infos[i] for i in range(count)]
        info = dict(choices[0], choices=choices)
        for key in ("completion_tokens", "reasoning_tokens"):
            if all(key in c for c in choices):
                info[key] = sum(c[key] for c in choices)
        yield None, "done", info

    async def collect(self, job: Job, request: Request, on_deltas, by_choice: bool = False) -> Optional[dict]:
        """Run a non-streamed job to its end, handing each batch of deltas to ``on_deltas`` (with
        ``by_choice``: ``on_deltas(index, deltas)``); returns the final info (see ``events``), or
        None when the client went away (the job is cancelled either way)."""
        try:
            async for index, kind, payload in self.events(job, request):
                if kind == "delta":
                    on_deltas(index, payload) if by_choice else on_deltas(payload)
                elif kind == "error":
                    raise ApiError(500, payload, code="generation_failed")
                else:
                    info = payload
        except ClientGone:
            return None
        finally:
            job.cancel()
        self.finished(job)
        return info

    async def stream(self, job: Job, request: Request, head: str, on_deltas, on_done,
                     on_error, by_choice: bool = False) -> AsyncIterator[str]:
        """A job's events as streamed text, for every streaming route: ``head`` first, then
        ``on_deltas(deltas)`` for each batch (``by_choice``: ``on_deltas(index, deltas)``), and
        ``on_done(info)`` or ``on_error(message)`` at the end (each returns text; "" sends nothing).
        Ends quietly when the client leaves; the job is cancelled either way."""
        try:
            if head:
                yield head
            async for index, kind, payload in self.events(job, request):
                if kind == "delta":
                    out = on_deltas(index, payload) if by_choice else on_deltas(payload)
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
